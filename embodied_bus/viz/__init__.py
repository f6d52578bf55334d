"""Pictures: fusion timelines (matplotlib, headless)."""

from embodied_bus.viz.timeline import added_latency_series, load_frame_summaries, plot_timeline

__all__ = ["added_latency_series", "load_frame_summaries", "plot_timeline"]

"""Pictures: fusion timelines (matplotlib, headless)."""

from embodied_bus.viz.timeline import load_frame_summaries, plot_timeline

__all__ = ["load_frame_summaries", "plot_timeline"]

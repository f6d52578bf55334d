"""Pictures: fusion timelines (matplotlib, headless) and the live view for Foxglove."""

from embodied_bus.viz.live import DEFAULT_VIEW_PORT, LiveView, ViewOptions
from embodied_bus.viz.timeline import added_latency_series, load_frame_summaries, plot_timeline

__all__ = [
    "DEFAULT_VIEW_PORT",
    "LiveView",
    "ViewOptions",
    "added_latency_series",
    "load_frame_summaries",
    "plot_timeline",
]

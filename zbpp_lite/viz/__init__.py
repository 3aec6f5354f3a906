"""Layer 5, presentation: Plotly figures (returned, never displayed), the ipywidgets explorer, slider
figures, text grids and Chrome-trace export of any Timeline, planned or measured.

May import: :mod:`zbpp_lite.schedules` and :mod:`zbpp_lite.analysis` (never JAX itself).
"""

from .figures import (
    bubble_sweep,
    bubble_sweep_figure,
    compare_figure,
    dependency_figure,
    layer_dependency_figure,
    postvalidation_figure,
    schedules_figure,
    timeline_figure,
)
from .memory import measured_memory_figure, memory_figure
from .states import applicable_options, plan_timeline
from .static import microbatch_slider_figure, schedule_slider_figure, slider_figure
from .style import KIND_STYLE
from .text import text_grid
from .trace import to_chrome_trace, write_chrome_trace

from .widgets import Explorer, ExplorerSettings, ExplorerState, enable_colab_widgets, explore_state, explorer


__all__ = [
    "KIND_STYLE",
    "applicable_options",
    "bubble_sweep",
    "bubble_sweep_figure",
    "compare_figure",
    "dependency_figure",
    "layer_dependency_figure",
    "measured_memory_figure",
    "memory_figure",
    "microbatch_slider_figure",
    "plan_timeline",
    "postvalidation_figure",
    "schedule_slider_figure",
    "schedules_figure",
    "slider_figure",
    "text_grid",
    "timeline_figure",
    "to_chrome_trace",
    "write_chrome_trace",
    "Explorer",
    "ExplorerSettings",
    "ExplorerState",
    "enable_colab_widgets",
    "explore_state",
    "explorer",
]

"""The schedule explorer: pick a schedule, move sliders, see the timeline and memory redraw.

:func:`explore_state` computes (build -> simulate, errors caught as messages); :class:`Explorer` wires
ipywidgets controls to it and updates two Plotly ``FigureWidget`` s in place (Plotly 6+ needs ``anywidget``;
Colab needs :func:`enable_colab_widgets`, which the explorer calls). Sliders apply per the builder's
signature (``options_of``): "stages per rank" for ``stages_per_rank`` builders, costs and memory limit
for those taking ``costs`` / ``memory_limit`` (arXiv 2401.10241 section 3.2); the limit is always drawn.
"T_F&B" sets DualPipeV's overlapped-pair time (``Costs.fb``; 0: no overlap).
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field, fields
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from ..schedules.builders import SCHEDULES, options_of
from ..schedules.costs import Costs
from ..schedules.timeline import Timeline
from .figures import figure_title, timeline_figure, timeline_layout, timeline_traces
from .memory import memory_figure, memory_layout, memory_traces
from .states import plan_timeline

try:  # Google Colab only: its custom widget manager, which FigureWidget needs there
    from google.colab import output as _colab_output  # type: ignore[import-not-found]
except ImportError:
    _colab_output = None


def enable_colab_widgets() -> bool:
    """On Google Colab, turn on the custom widget manager Plotly's FigureWidget needs; True there, else
    False (nothing done)."""
    if _colab_output is None:
        return False
    _colab_output.enable_custom_widget_manager()
    return True


def _slider(default: Any, label: str, lo: Any, hi: Any, step: Any, tip: str) -> Any:
    """A settings field and its slider: (label, min, max, step, tooltip) in the field's metadata; an integer
    step makes an IntSlider; a text max is taken from the explorer's arguments."""
    return field(default=default, metadata={"slider": (label, lo, hi, step, tip)})


@dataclass(frozen=True)
class ExplorerSettings:
    """One set of explorer settings, the sliders' values (their tooltips say what each is); the costs in
    their time unit, the memory limit per rank in M_B; ``memory_limit`` or ``fb`` <= 0 or None: none."""

    schedule: str = "zb-h1"
    num_ranks: int = _slider(4, "ranks p", 1, "max_ranks", 1, "pipeline ranks (devices)")
    num_microbatches: int = _slider(8, "microbatches m", 1, "max_microbatches", 1, "microbatches per step")
    stages_per_rank: int | None = _slider(2, "stages per rank v", 1, 4, 1,
                                          "model chunks per rank (for schedules that take stages_per_rank)")
    f: float = _slider(1.0, "T_F", 0.1, 3.0, 0.1, "forward time of one stage")
    b: float = _slider(1.0, "T_B", 0.1, 3.0, 0.1, "input-gradient backward time")
    w: float = _slider(1.0, "T_W", 0.1, 3.0, 0.1, "weight-gradient backward time")
    comm: float = _slider(0.0, "T_comm", 0.0, 2.0, 0.05, "transfer time between ranks")
    memory_limit: float | None = _slider(0.0, "memory limit (M_B)", 0.0, "4 max_microbatches", 1.0,
                                         "per-rank activation memory limit in units of M_B; 0 = none")
    fb: float | None = _slider(0.0, "T_F&B (0: no overlap)", 0.0, 9.0, 0.1,
                               "time of an overlapped F&B pair (DualPipeV); 0 = T_F + T_B + T_W, no overlap")


@dataclass(frozen=True)
class ExplorerState:
    """The outcome of one set of explorer settings: the schedule's ``name``, the simulated ``timeline`` and
    the ``costs`` built from the sliders (both None when refused), the per-rank ``memory_limit`` in M_B (or
    None) and the refusal's message, ``error`` (no traceback; None when accepted)."""

    name: str
    timeline: Timeline | None
    costs: Costs | None
    memory_limit: float | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def figure(self) -> go.Figure | None:
        """The timeline figure, or None if the settings were refused."""
        return None if self.timeline is None else timeline_figure(self.timeline, self.name)

    def memory_figure(self) -> go.Figure | None:
        """The memory figure with the limit drawn, or None if the settings were refused."""
        if self.timeline is None:
            return None
        return memory_figure(self.timeline, self.costs, self.memory_limit, title=self.name)


def explore_state(settings: ExplorerSettings) -> ExplorerState:
    """Build and simulate ``settings`` into an :class:`ExplorerState`; never raises for refused settings or
    bad costs (the ValueError's message, ScheduleError included, goes to ``error``)."""
    x = settings
    limit = float(x.memory_limit) if x.memory_limit is not None and x.memory_limit > 0 else None
    try:
        costs = Costs(f=x.f, b=x.b, w=x.w, comm=x.comm, fb=x.fb if x.fb is not None and x.fb > 0 else None)
        timeline = plan_timeline(
            x.schedule, x.num_ranks, x.num_microbatches, stages_per_rank=x.stages_per_rank, costs=costs,
            memory_limit=limit,
        )
    except ValueError as exc:
        return ExplorerState(x.schedule, None, None, limit, str(exc) or type(exc).__name__)
    return ExplorerState(x.schedule, timeline, costs, limit)


def _wide() -> dict[str, Any]:
    return {"style": {"description_width": "150px"}, "layout": widgets.Layout(width="360px")}


class Explorer(widgets.VBox):
    """Schedule picker and sliders over a live timeline and memory plot (an ipywidgets VBox).

    ``Explorer(schedule, *, max_ranks, max_microbatches, show_memory, **settings)``, ``settings`` the other
    :class:`ExplorerSettings` fields; display it as a cell's last expression.

    Attributes:
        controls: name -> widget (``schedule``, ``num_ranks``, ``num_microbatches``, ``stages_per_rank``,
            ``f``, ``b``, ``w``, ``comm``, ``fb``, ``memory_limit``).
        figure: the timeline ``go.FigureWidget`` (5 bar traces: F, B, W, BW, idle).
        memory: the memory ``go.FigureWidget`` (a line per rank), or None with show_memory=False.
        message: HTML widget with the summary or the refusal.
        state: the last :class:`ExplorerState`.
        last_redraw_ms: wall time of the last redraw, ms.

    Raises:
        ValueError: an unknown initial schedule name (the message lists the valid ones).
        TypeError: a setting that is not an :class:`ExplorerSettings` field.
    """

    def __init__(
        self,
        schedule: str = "zb-h1",
        *,
        max_ranks: int = 8,
        max_microbatches: int = 32,
        show_memory: bool = True,
        **settings: Any,
    ):
        enable_colab_widgets()  # FigureWidget needs Colab's custom widget manager; no-op elsewhere
        names = list(SCHEDULES)
        if schedule not in names:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of: {', '.join(names)}")
        x = ExplorerSettings(schedule, **settings)
        tops = {"max_ranks": max_ranks, "max_microbatches": max_microbatches,
                "4 max_microbatches": 4.0 * max_microbatches}
        self.controls: dict[str, widgets.Widget] = {
            "schedule": widgets.Dropdown(options=names, value=schedule, description="schedule", **_wide())}
        for key in fields(ExplorerSettings)[1:]:
            label, lo, hi, step, tip = key.metadata["slider"]
            kind = widgets.IntSlider if isinstance(step, int) else widgets.FloatSlider
            self.controls[key.name] = kind(value=getattr(x, key.name), min=lo, max=tops.get(hi, hi),
                                           step=step, description=label, tooltip=tip, continuous_update=False,
                                           **_wide())
        self.message = widgets.HTML(layout=widgets.Layout(min_height="24px"))
        self.state: ExplorerState | None = None
        self.last_redraw_ms = float("nan")
        t0 = time.perf_counter()
        first = self._compute()
        start = first.timeline or explore_state(ExplorerSettings("gpipe", 1, 1, None)).timeline
        assert start is not None
        self.figure = go.FigureWidget(timeline_figure(start, first.name))
        self.memory = go.FigureWidget(memory_figure(start)) if show_memory else None
        left = ("schedule", "num_ranks", "num_microbatches", "stages_per_rank", "memory_limit")
        columns = [[c for k, c in self.controls.items() if (k in left) == side] for side in (True, False)]
        panels = [widgets.HBox([widgets.VBox(column) for column in columns]), self.message, self.figure]
        super().__init__(panels + ([self.memory] if self.memory is not None else []))
        self._show(first, t0)
        for control in self.controls.values():
            control.observe(self._on_change, names="value")

    # ------------------------------------------------------------------ callbacks

    def _compute(self) -> ExplorerState:
        c = self.controls  # plan_timeline gives each builder only the options it takes
        c["stages_per_rank"].disabled = "stages_per_rank" not in options_of(c["schedule"].value)
        return explore_state(ExplorerSettings(**{key: control.value for key, control in c.items()}))

    def _on_change(self, _change: Any = None) -> None:
        self.redraw()

    def redraw(self) -> ExplorerState:
        """Recompute from the controls, update the figures in place, return the new state; errors show in
        ``message`` (plots emptied), never escape."""
        t0 = time.perf_counter()
        try:
            state = self._compute()
        except Exception as exc:  # noqa: BLE001 - shown to the reader instead of a traceback
            error = f"{type(exc).__name__}: {exc}"
            state = ExplorerState(self.controls["schedule"].value, None, None, None, error)
        try:
            self._show(state, t0)
        except Exception as exc:  # noqa: BLE001
            self.message.value = _error_html(state.name, f"{type(exc).__name__}: {exc}")
        return state

    def _show(self, state: ExplorerState, t0: float) -> None:
        self.state, t, name = state, state.timeline, state.name
        if t is None:
            self.message.value = _error_html(name, state.error or "")
            refused = {"title": {"text": f"{name}: no schedule for these settings"}}
            empty = {"base": [], "x": [], "y": [], "text": [], "customdata": [], "showlegend": False}
            _refill(self.figure, [empty] * len(self.figure.data), refused)
            if self.memory is not None:
                _refill(self.memory, [{"x": [], "y": []}] * len(self.memory.data), refused)
        else:
            _refill(self.figure, timeline_traces(t), timeline_layout(t, name))
            if self.memory is not None:
                layout = memory_layout(t, state.memory_limit, name)
                _refill(self.memory, memory_traces(t, state.costs), layout)
            self.message.value = _summary_html(state)
        self.last_redraw_ms = (time.perf_counter() - t0) * 1e3


def _refill(fig: go.FigureWidget, traces: list[dict[str, Any]], layout: dict[str, Any]) -> None:
    """Update ``fig`` in place to ``traces`` (surplus traces dropped, missing ones added) and ``layout``."""
    with fig.batch_update():
        if len(fig.data) > len(traces):
            fig.data = fig.data[: len(traces)]
        for trace, new in zip(fig.data, traces):
            trace.update({k: v for k, v in new.items() if k != "type"})
        for key in ("shapes", "annotations"):  # update() merges lists element-wise: an old line would stay
            if key in layout:
                fig.layout[key] = layout.pop(key)
        fig.layout.update(layout)
    if len(traces) > len(fig.data):
        fig.add_traces([go.Scatter(new) for new in traces[len(fig.data):]])


def _error_html(name: str, error: str) -> str:
    return (
        f'<div class="zbpp-error" style="color:#B00020"><b>{html.escape(name)}</b> refuses these settings: '
        f"{html.escape(error)}</div>"
    )


def _summary_html(state: ExplorerState) -> str:
    t = state.timeline
    assert t is not None
    peaks = ", ".join(f"{x:g}" for x in t.peak_memory)
    text = f"<b>{html.escape(figure_title(t, state.name))}</b>; peak memory per rank [{peaks}] M_B"
    if state.memory_limit is not None:
        over = [r for r, x in enumerate(t.peak_memory) if x > state.memory_limit + 1e-9]
        if over:
            text += f' <span style="color:#B00020">(over the limit on rank(s) {over})</span>'
    return f'<div class="zbpp-summary">{text}</div>'


def explorer(**settings: Any) -> Explorer:
    """An :class:`Explorer` (an ipywidgets container) with initial ``settings`` (its arguments)."""
    return Explorer(**settings)

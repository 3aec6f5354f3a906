"""zbpp_lite: learn, see and run zero-bubble pipeline parallelism.

Re-exports the schedule layer (pure Python, no JAX); the JAX executor and model are in
:mod:`zbpp_lite.runtime.executor` and :mod:`zbpp_lite.training.model`. Sources: Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR 2024 (arXiv 2401.10241); "Pipeline Parallelism with Controllable Memory",
NeurIPS 2024 (arXiv 2405.15362).
"""

from .schedules.builders import SCHEDULES, build_schedule
from .schedules.costs import Costs
from .schedules.ir import KINDS, Action, Overlap, Schedule, deps, looped_placement, v_placement
from .schedules.program import Program, Recv, Send, lower
from .schedules.simulate import simulate
from .schedules.timeline import Event, Timeline
from .schedules.validate import ScheduleError, format_grid, validate

__version__ = "0.1.0"

__all__ = [
    "KINDS",
    "SCHEDULES",
    "Action",
    "Costs",
    "Event",
    "Overlap",
    "Program",
    "Recv",
    "Schedule",
    "ScheduleError",
    "Send",
    "Timeline",
    "build_schedule",
    "deps",
    "format_grid",
    "looped_placement",
    "lower",
    "simulate",
    "v_placement",
    "validate",
]

"""One registry of schedule builders by name: ``SCHEDULES`` and ``build_schedule``.

Any registered name + ``"+fuse"`` (``"zb-h1+fuse"``) builds that schedule, then runs
:func:`zbpp_lite.schedules.fuse.fuse_adjacent` on it."""

from __future__ import annotations

import functools
import inspect
from dataclasses import replace
from typing import Any, Callable

from ..costs import Costs
from ..fuse import FUSE_SUFFIX, fuse_adjacent
from ..ir import Schedule
from ..memory import MemoryPlan
from ._common import as_size

Builder = Callable[..., Schedule]

SCHEDULES: dict[str, Builder] = {}
"""Registered builders: name -> ``(num_ranks, num_microbatches, **options) -> Schedule``."""


def register(name: str, builder: Builder) -> Builder:
    """Add ``builder`` under ``name`` (lower case, dashes). Raises ValueError on a duplicate."""
    if name in SCHEDULES:
        raise ValueError(f"schedule {name!r} is already registered")
    SCHEDULES[name] = builder
    return builder


def options_of(name: str) -> dict[str, Any]:
    """A builder's keyword options beyond (num_ranks, num_microbatches), with defaults (``Parameter.empty``:
    required)."""
    params = list(inspect.signature(lookup(name)).parameters.values())[2:]
    return {p.name: p.default for p in params}


def lookup(name: str) -> Builder:
    """The builder registered as ``name`` (``NAME+fuse``: NAME's, fused after); ValueError listing names."""
    key = name.strip().lower().replace("_", "-")
    base = key.removesuffix(FUSE_SUFFIX)
    if base not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)} "
                         f"(each also as NAME{FUSE_SUFFIX})")
    if base == key:
        return SCHEDULES[key]
    build = SCHEDULES[base]
    return functools.wraps(build)(lambda *args, **options: fuse_adjacent(build(*args, **options)))


def build_schedule(name: str, num_ranks: int, num_microbatches: int, **options: Any) -> Schedule:
    """Build the schedule registered as ``name`` for p = ``num_ranks``, m = ``num_microbatches``.

    ``options`` go to the builder (``stages_per_rank``, ``costs``, ``memory_limit``, ...); sizes may be
    any integer type (e.g. NumPy int64), passed on as Python ints. Raises ValueError: an unknown name
    (listing the valid ones), an option the builder does not take, a size that is not an integer >= 1, or
    sizes the builder cannot support (its message says what works).

    A builder that plans from ``costs`` returns a schedule whose ``memory_plan``
    (:class:`~zbpp_lite.schedules.memory.MemoryPlan`) holds the M_B, M_W it planned with (the defaults'
    7/16 M_B unless ``costs`` says otherwise) and, where it planned under one, the memory limit."""
    builder = lookup(name)
    num_ranks = as_size(name, "num_ranks", num_ranks)
    num_microbatches = as_size(name, "num_microbatches", num_microbatches)
    if "stages_per_rank" in options:
        options["stages_per_rank"] = as_size(name, "stages_per_rank", options["stages_per_rank"])
    accepted = options_of(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"schedule {name!r} takes no option(s) {unknown}; it accepts: {', '.join(accepted) or 'none'}"
        )
    schedule = builder(num_ranks, num_microbatches, **options)
    if "costs" not in accepted or schedule.memory_plan is not None:
        return schedule
    plan = MemoryPlan.of(options.get("costs") or Costs(), schedule.num_stages)
    return replace(schedule, memory_plan=plan)

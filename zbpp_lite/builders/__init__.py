"""Schedule builders, one small module per family, all registered by name."""

from .gpipe import gpipe
from .interleaved import interleaved_1f1b, looped_bfs
from .one_f_one_b import one_f_one_b
from .registry import SCHEDULES, build_schedule, lookup, options_of, register
from .zero_bubble_h import zb_h1, zb_h2

register("gpipe", gpipe)
register("1f1b", one_f_one_b)
register("interleaved-1f1b", interleaved_1f1b)
register("looped-bfs", looped_bfs)
register("zb-h1", zb_h1)
register("zb-h2", zb_h2)

__all__ = ["SCHEDULES", "build_schedule", "lookup", "options_of", "register"]

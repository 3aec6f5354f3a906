"""Schedule builders, one small module per family, all registered by name."""

from .auto import zb_1p, zb_2p, zb_auto
from .dualpipe_v import dualpipe_v
from .gpipe import gpipe
from .interleaved import interleaved_1f1b, looped_bfs
from .one_f_one_b import one_f_one_b
from .registry import SCHEDULES, build_schedule, lookup, options_of, register
from .v_family import v_half, v_min
from .zero_bubble_h import zb_h1, zb_h2
from .zero_bubble_v import zb_v

register("gpipe", gpipe)
register("1f1b", one_f_one_b)
register("interleaved-1f1b", interleaved_1f1b)
register("looped-bfs", looped_bfs)
register("zb-h1", zb_h1)
register("zb-h2", zb_h2)
register("zb-auto", zb_auto)
register("zb-1p", zb_1p)
register("zb-2p", zb_2p)
register("zb-v", zb_v)
register("v-half", v_half)
register("v-min", v_min)
register("dualpipe-v", dualpipe_v)

__all__ = ["SCHEDULES", "build_schedule", "lookup", "options_of", "register"]

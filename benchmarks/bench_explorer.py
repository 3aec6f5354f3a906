"""Explorer redraw time: how long one slider move takes in the kernel, for p <= 8 and m <= 32.

Drives the ipywidgets explorer headless (no browser), moving one control at a time through a
grid of (schedule, p, m), and times ``Explorer.redraw`` (build -> simulate -> in-place update of
the two FigureWidgets) and, separately, the pure ``explore_state`` (build -> simulate only).
Target from issue 5: every redraw within 200 ms for p <= 8 and m <= 32.

    python benchmarks/bench_explorer.py [--schedules zb-h1,1f1b] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import zbpp_lite as zb
from zbpp_lite.schedules.builders import options_of
from zbpp_lite.viz.widgets import Explorer, ExplorerSettings, explore_state

TARGET_MS = 200.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", default=",".join(zb.SCHEDULES), help="comma-separated names (default: all)")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--microbatches", default="4,8,16,32")
    ap.add_argument("--repeats", type=int, default=3, help="timed redraws per setting")
    args = ap.parse_args()
    names = [n for n in args.schedules.split(",") if n]
    ranks = [int(x) for x in args.ranks.split(",")]
    mbs = [int(x) for x in args.microbatches.split(",")]

    ex = Explorer(names[0], max_ranks=max(ranks), max_microbatches=max(mbs))
    c = ex.controls
    print(f"explorer redraw (kernel side), p in {ranks}, m in {mbs}, {args.repeats} repeats; target {TARGET_MS:.0f} ms")
    print(f"{'schedule':<18}{'settings':>9}{'state med':>11}{'redraw med':>12}{'redraw max':>12}{'worst (p, m)':>14}")
    all_redraws = []
    for name in names:
        c["schedule"].value = name
        v = 2 if "stages_per_rank" in options_of(name) else None
        state_ms, redraw_ms, worst = [], [], (0.0, None)
        refused = 0
        for p in ranks:
            for m in mbs:
                t0 = time.perf_counter()
                state = explore_state(ExplorerSettings(name, p, m, v, 1.0, 1.0, 1.0, 0.0, None))
                state_ms.append((time.perf_counter() - t0) * 1e3)
                refused += not state.ok
                c["num_ranks"].value, c["num_microbatches"].value = p, m  # each set redraws once
                for i in range(args.repeats):
                    c["f"].value = 1.0 + 0.1 * ((i % 2) + 1)  # a real change: one redraw
                    redraw_ms.append(ex.last_redraw_ms)
                    if ex.last_redraw_ms > worst[0]:
                        worst = (ex.last_redraw_ms, (p, m))
                c["f"].value = 1.0
        all_redraws += redraw_ms
        print(
            f"{name:<18}{len(state_ms) - refused:>4}/{len(state_ms):<4}{statistics.median(state_ms):>10.1f} "
            f"{statistics.median(redraw_ms):>11.1f} {max(redraw_ms):>11.1f} {str(worst[1]):>13}"
        )
    print(
        f"all: median {statistics.median(all_redraws):.1f} ms, max {max(all_redraws):.1f} ms over {len(all_redraws)} "
        f"redraws; {'within' if max(all_redraws) <= TARGET_MS else 'OVER'} the {TARGET_MS:.0f} ms target"
    )


if __name__ == "__main__":
    main()

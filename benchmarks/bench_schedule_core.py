"""How fast the pure-Python schedule layers are: build, validate and simulate large schedules.

Target (issue 2): zb-h1 with p = 32, m = 256 well under a second in all.
Run: python benchmarks/bench_schedule_core.py
"""

from __future__ import annotations

import statistics
import time

import zbpp_lite as zb


def timed(fn, repeat=5):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times), min(times)


def main() -> None:
    costs = zb.Costs(f=18.522, b=18.086, w=9.337, comm=0.601)
    print(f"{'schedule':<18} {'p':>3} {'m':>4} {'actions':>8} {'build ms':>9} {'validate ms':>12} {'simulate ms':>12} {'total ms':>9}")
    for name, p, m, kw in [("zb-h1", 32, 256, {}), ("zb-h2", 32, 256, {}), ("1f1b", 32, 256, {}),
                           ("interleaved-1f1b", 32, 256, {"stages_per_rank": 2})]:
        s, t_build, _ = timed(lambda: zb.build_schedule(name, p, m, **kw))
        _, t_val, _ = timed(lambda: zb.validate(s))
        _, t_sim, _ = timed(lambda: zb.simulate(s, costs, check=False))
        total = t_build + t_val + t_sim
        print(f"{name:<18} {p:>3} {m:>4} {len(s):>8} {t_build*1e3:>9.1f} {t_val*1e3:>12.1f} {t_sim*1e3:>12.1f} {total*1e3:>9.1f}")
    print("(medians of 5; total = build + validate + simulate; target for zb-h1 p=32 m=256: < 1000 ms)")


if __name__ == "__main__":
    main()

"""Write simulate_golden.json: what zbpp_lite.simulate gave, before it timed the lowered program, on the
planner golden cases (generate_planner_golden.py's, simulated under their own costs, T_comm included) and on
a grid of every registered builder, sizes and costs, so that simulating the program is shown to change
nothing: per case the makespan, the per-rank peak memory and busy time, and the SHA-256 of every event
(rank, action, start, end, floats written exactly).

The file in the repository was written by commit 8fde833 (the simulator walking the compute-only
schedule). Run: PYTHONPATH=<tree> python tests/artifacts/generate_simulate_golden.py OUT.json
"""

import hashlib
import pathlib
import sys

import zbpp_lite as zb
from zbpp_lite.schedules import strict_json

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import generate_planner_golden as planner  # noqa: E402

GRID_COSTS = {  # T_comm and T_F&B included: the transfers the program writes out are what is timed
    "unit": {},
    "uneven": {"f": 3.0, "b": 2.0, "w": 1.0, "comm": 0.5},
    "paper": {"f": 14.407, "b": 14.380, "w": 9.676, "comm": 1.610, "fb": 20.0},
}
GRID_SIZES = [(p, m) for p in (1, 2, 3, 4) for m in (p, 2 * p, 3 * p)]
PLANNER_CASES = [case for case in planner.CASES if case[1] * case[2] <= 200]
"""The planner golden cases small enough to build in a fast test (p * m at most 200)."""


def record(timeline: zb.Timeline) -> dict:
    lines = "\n".join(f"{e.rank},{e.action},{e.start!r},{e.end!r}" for e in timeline.events)
    return {"makespan": timeline.makespan, "peak_memory": list(timeline.peak_memory),
            "busy": list(timeline.busy), "events": hashlib.sha256(lines.encode()).hexdigest()}


def cases():
    """(key, schedule, costs) of every case, builds that refuse a size left out."""
    for case in PLANNER_CASES:
        yield planner.key(*case), planner.build(*case), zb.Costs(**planner.COSTS[case[3]])
    for name in sorted(zb.SCHEDULES):
        for p, m in GRID_SIZES:
            try:
                schedule = zb.build_schedule(name, p, m)
            except ValueError:
                continue
            for label, costs in GRID_COSTS.items():
                yield f"{name} p={p} m={m} costs={label}", schedule, zb.Costs(**costs)


if __name__ == "__main__":
    strict_json.write(sys.argv[1], {key: record(zb.simulate(s, costs)) for key, s, costs in cases()})

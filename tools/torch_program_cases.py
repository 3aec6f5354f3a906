"""Write every registered schedule, lowered to its program, as PyTorch's compute+comms CSV, and the cases
file ``../shared/peers/torch_check_schedules.py`` reads, so that PyTorch's own deadlock check
(``_simulate_comms_compute``) runs over them with a Python that has torch:

    PYTHONPATH=. python tools/torch_program_cases.py OUT_DIR [--ranks 2 4 8] [--bad]
    TORCH_PYTHON ../shared/peers/torch_check_schedules.py OUT_DIR/cases.json

Sizes: p in ``--ranks``, m = 2p and 3p (a builder refusing a size is listed and skipped). ``--bad`` adds
one 1F1B program per p with a receive out of order (:func:`receive_moved_early`), which both PyTorch's
check and :func:`zbpp_lite.validate` must refuse.
"""

from __future__ import annotations

import argparse
import pathlib

import zbpp_lite as zb
from zbpp_lite.schedules import strict_json
from zbpp_lite.schedules.ir import Action
from zbpp_lite.schedules.program import Program, Recv, lower


def receive_moved_early(program: Program) -> Program:
    """``program`` with rank 0's receive of microbatch 1's input gradient moved before its forward of
    microbatch 1: that receive waits for a send the sender makes only after it got that forward's
    activation, which rank 0 sends after the receive: a deadlock, after some steps have run."""
    row = list(program.instructions[0])
    recv = next(i for i, x in enumerate(row) if isinstance(x, Recv) and x.key[0] == "B" and x.key[2] == 1)
    moved = row.pop(recv)
    row.insert(next(i for i, x in enumerate(row) if isinstance(x, Action) and x.microbatch == 1), moved)
    return Program((tuple(row), *program.instructions[1:]), program.placement, program.num_microbatches,
        program.name)


def write_cases(out: pathlib.Path, ranks: list[int], bad: bool = False) -> pathlib.Path:
    """Write the programs (module docstring) as CSV files under ``out`` and the cases file; its path."""
    out.mkdir(parents=True, exist_ok=True)
    cases = []

    def add(name: str, program: Program) -> None:
        path = out / f"{name}.csv"
        program.to_csv(path)
        cases.append({"name": name, "path": str(path), "num_ranks": program.num_ranks,
            "num_microbatches": program.num_microbatches, "placement": list(program.placement)})

    for p in ranks:
        for m in (2 * p, 3 * p):
            for name in sorted(zb.SCHEDULES):
                try:
                    schedule = zb.build_schedule(name, p, m)
                except ValueError as e:
                    print(f"skipped {name} p={p} m={m}: {str(e).splitlines()[0]}")
                    continue
                add(f"{name}_p{p}_m{m}", lower(zb.validate(schedule)))
        if bad:
            add(f"bad-1f1b_p{p}", receive_moved_early(lower(zb.build_schedule("1f1b", p, 2 * p))))
    strict_json.write(out / "cases.json", cases)
    print(f"wrote {len(cases)} programs and {out / 'cases.json'}")
    return out / "cases.json"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--bad", action="store_true", help="add a program with a receive out of order per p")
    args = parser.parse_args()
    write_cases(args.out, args.ranks, args.bad)

"""Post-validation vs a synchronous optimizer step, zb-h2 at p = 2 with clipping on, measured.

The executor runs the training loop itself (``PipelineExecutor.run_steps``): each rank goes on
to its next step as soon as its own share is done, and AdamW with the global-norm clip and the
NaN check runs inside the rank threads (``zbpp_lite.training.postval.optimizer.StageOptimizer``) three ways:
``plain`` (no guard: the floor), ``synchronous`` (every rank waits for every rank's norm before
stepping) and ``post-validation`` (speculative step on the partial norm, validated and rolled
back before the next step's first action). ``max_norm`` is set so that clipping triggers on
some steps (rollbacks counted; each costs a rollback and a redone step). The figure is the
loop's period: per run the median time between the starts of consecutive timed steps (each
step's first action; with ``--procs`` the slower rank's), then the median over the runs, per
policy; the policies take turns, several rounds, to spread any drift of the machine over all
three, and the ratio post-validation / synchronous is also given per round (runs next to each
other in time), with how many rounds it is below 1. The synchronisation itself shows best in
each rank's idle time between steps (its last action of a step to its first of the next: the
optimizer step and any wait for other ranks), which the speed of the actions, drifting from run
to run on a shared machine, does not enter.

Two set-ups:
- default: one process, 2 simulated CPU devices, ranks as threads. The devices share XLA's
  thread pool, so a rank that waits lends its core to the other: the synchronisation bubble
  costs less than a core's idle time and the ratio is noisy;
- ``--procs``: PyTorch's set-up, one process per rank pinned to its own core, values between
  ranks (activations, gradients and the optimizer's norms) through pipes
  (:mod:`zbpp_lite.runtime.processes`): a rank that waits leaves its core idle, as on real
  hardware.

The machine load (cores other programs used) is printed beside the figures; quote only runs on
an otherwise idle machine.

Run: python benchmarks/bench_postval.py [--procs] [--steps 12 --rounds 3]   (PyTorch job size, ~2-3 min)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench_vs_torch import busy_cpu_seconds
from zbpp_lite.runtime.processes import RankProcesses, connect, disconnect


def _cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) the processes ``pids`` have used so far (Linux /proc), seconds."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def _job(args):
    """Schedule, model and batches of the job (JAX imported by the caller's set-up)."""
    import zbpp_lite as zb
    from zbpp_lite.training.data import load_digits
    from zbpp_lite.training.model import ModelConfig, build_parts
    from zbpp_lite.runtime.stages import StagedModel

    schedule = zb.build_schedule(args.schedule, 2, args.microbatches)
    model = StagedModel(build_parts(ModelConfig(d=args.d, heads=4, blocks=args.blocks)), schedule.num_stages)
    data = load_digits(0.0, 0)
    return schedule, model, [data.batch(k, args.batch) for k in range(args.steps)]


def _summary(results, optimizer) -> dict:
    """What the parent needs of one run on one side: step starts (s), reports, events."""
    return {
        "starts": [r.start for r in results],
        "norms": [r.global_norm for r in optimizer.reports],
        "rolled_back": [list(r.rolled_back) for r in optimizer.reports],
        "redone": [len(r.discarded) for r in results],
        "events": [[(e.rank, str(e.action), e.start, e.end) for e in r.timeline.events] for r in results],
    }


def rank_process(rank: int, peers: dict, control, config: dict) -> None:
    """One rank of the ``--procs`` set-up (pinned by :class:`RankProcesses` before this runs):
    runs every policy the parent names on its own rank."""
    import argparse

    from zbpp_lite.runtime.devices import ensure_devices

    args = argparse.Namespace(**config)

    device = ensure_devices(1)[0]
    from zbpp_lite.runtime.executor import PipelineExecutor
    from zbpp_lite.training.postval.optimizer import StageOptimizer
    from zbpp_lite.training.postval.rollback import AdamWConfig

    schedule, model, batches = _job(args)
    executor = connect(peers, lambda transport: PipelineExecutor(model, schedule, [device], ranks=[rank], transport=transport))
    while (command := control.recv()) is not None:
        policy, max_norm = command
        optimizer = StageOptimizer(executor, model.params, AdamWConfig(), policy, max_norm)  # compiles here
        control.send("ready")
        control.recv()  # both ranks ready: go
        results = executor.run_steps(model.params, batches, optimizer)
        control.send(_summary(results, optimizer))
    disconnect(peers)


class Processes:
    """The ``--procs`` side: two pinned rank processes, one run per call."""

    def __init__(self, args):
        self.ranks = RankProcesses(f"{os.path.abspath(__file__)}:rank_process", 2, vars(args), pin=True)
        self.procs, self.controls = self.ranks.procs, self.ranks.controls

    def run(self, policy: str, max_norm: float | None) -> list[dict]:
        for control in self.controls:
            control.send((policy, max_norm))
        for control in self.controls:
            if control.recv() != "ready":
                raise RuntimeError("a rank process did not get ready")
        for control in self.controls:
            control.send("go")
        return [control.recv() for control in self.controls]

    def cpu_seconds(self) -> float:
        return _cpu_seconds([os.getpid(), *(p.pid for p in self.procs)])

    def close(self) -> None:
        self.ranks.close()


class Threads:
    """The default side: one process, 2 simulated devices, ranks as threads."""

    def __init__(self, args):
        from zbpp_lite.runtime.devices import ensure_devices

        devices = ensure_devices(2)
        from zbpp_lite.runtime.executor import PipelineExecutor

        self.schedule, self.model, self.batches = _job(args)
        self.executor = PipelineExecutor(self.model, self.schedule, devices[:2])

    def run(self, policy: str, max_norm: float | None) -> list[dict]:
        from zbpp_lite.training.postval.optimizer import guarded_run
        from zbpp_lite.training.postval.rollback import AdamWConfig

        results, optimizer = guarded_run(self.executor, self.model.params, self.batches, policy, max_norm, AdamWConfig())
        return [_summary(results, optimizer)]

    def cpu_seconds(self) -> float:
        return _cpu_seconds([os.getpid()])

    def close(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", default="zb-h2")
    ap.add_argument("--procs", action="store_true", help="one process per rank, each pinned to its own core")
    ap.add_argument("--steps", type=int, default=12, help="steps per run (the first 2 are not timed)")
    ap.add_argument("--rounds", type=int, default=3, help="runs per policy, taking turns")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--clip-quantile", type=float, default=0.9, help="max_norm: this quantile of an unclipped run's norms")
    args = ap.parse_args()
    if args.steps < 4:
        ap.error("--steps must be at least 4 (2 untimed, then at least 2 timed step starts)")
    import zbpp_lite as zb
    from zbpp_lite.analysis.profiling.timelines import measured_costs
    from zbpp_lite.training.postval.optimizer import POLICIES
    from zbpp_lite.schedules.ir import Action
    from zbpp_lite.schedules.timeline import Event, Timeline

    side = Processes(args) if args.procs else Threads(args)
    try:
        # max_norm: the chosen quantile of the norms of an unclipped run, so clipping triggers now
        # and then, as in stable training (the case post-validation is for; --clip-quantile 0.5
        # makes half the steps roll back). This run also compiles everything.
        norms = sorted(side.run("synchronous", 1e30)[0]["norms"])
        max_norm = norms[min(len(norms) - 1, int(args.clip_quantile * len(norms)))]
        periods: dict[str, list[float]] = {p: [] for p in POLICIES}
        rollbacks = {p: 0 for p in POLICIES}
        redone = {p: 0 for p in POLICIES}
        gaps: dict[str, dict[int, list[float]]] = {p: {} for p in POLICIES}
        timelines = []
        busy0, own0, t0 = busy_cpu_seconds(), side.cpu_seconds(), time.monotonic()
        for _ in range(args.rounds):
            for policy in POLICIES:
                print(f"  {policy} ...", file=sys.stderr, flush=True)
                ranks = side.run(policy, None if policy == "plain" else max_norm)
                # the loop's period: median time between consecutive timed step starts, the slower rank's
                periods[policy].append(max(statistics.median(b - a for a, b in zip(r["starts"][2:], r["starts"][3:])) for r in ranks))
                rollbacks[policy] += sum(bool(rb) for rb in ranks[0]["rolled_back"][2:])
                redone[policy] += sum(sum(r["redone"][2:]) for r in ranks)
                for r in ranks:  # per rank: idle time between its last action of a step and its first of the next
                    for k in range(2, args.steps - 1):
                        for q in {e[0] for e in r["events"][k]}:
                            end = r["starts"][k] + max(e[3] for e in r["events"][k] if e[0] == q)
                            begin = r["starts"][k + 1] + min(e[2] for e in r["events"][k + 1] if e[0] == q)
                            gaps[policy].setdefault(q, []).append(begin - end)
                for k in range(2, args.steps):
                    events = [Event(rank, Action.from_str(a), s, e) for r in ranks for rank, a, s, e in r["events"][k]]
                    timelines.append(Timeline.from_events(events, 2, source="measured"))
        wall = time.monotonic() - t0
        other = None if busy0 is None else max(0.0, busy_cpu_seconds() - busy0 - (side.cpu_seconds() - own0)) / wall
    finally:
        side.close()
    median = {p: statistics.median(v) for p, v in periods.items()}
    schedule = zb.build_schedule(args.schedule, 2, args.microbatches)
    costs = measured_costs(timelines[len(timelines) // 2], schedule.num_stages)
    predicted = zb.simulate(schedule, costs)
    timed = args.rounds * (args.steps - 2)
    setup = "one pinned process per rank" if args.procs else "one process, 2 simulated devices (ranks as threads)"
    print(f"{args.schedule}, p=2, m={args.microbatches}, d={args.d}, {args.blocks} blocks, batch {args.batch}; {setup}; "
          f"{args.rounds} runs x {args.steps - 2} timed steps per policy, max_norm {max_norm:.3g} "
          f"(the {args.clip_quantile:g} quantile of an unclipped run's norms)")
    print(f"machine load: other programs used {'?' if other is None else f'{other:.2f}'} cores during the runs"
          + ("  ** busy: repeat on an idle machine **" if other is not None and other > 0.1 else ""))
    for p in POLICIES:
        extra = (f"   rolled back on {rollbacks[p]} of {timed} timed steps, {redone[p]} speculative F's redone"
                 if p == "post-validation" else "")
        runs = ", ".join(f"{v * 1e3:.1f}" for v in periods[p])
        print(f"  {p:<16} step period {median[p] * 1e3:8.2f} ms  (runs: {runs}){extra}")
        boundary = ", ".join(f"rank {q} {statistics.median(v) * 1e3:.2f} ms" for q, v in sorted(gaps[p].items()))
        print(f"  {'':<16} between steps (median idle from a rank's last action to its next first one): {boundary}")
    paired = [pv / sync for pv, sync in zip(periods["post-validation"], periods["synchronous"])]  # neighbours in time
    print(f"post-validation / synchronous: {median['post-validation'] / median['synchronous']:.3f} (medians); "
          f"per round {statistics.median(paired):.3f} (median of {len(paired)} paired rounds, "
          f"{sum(r < 1 for r in paired)} of them below 1; range {min(paired):.3f}-{max(paired):.3f})")
    print(f"synchronous - plain: {(median['synchronous'] - median['plain']) * 1e3:.2f} ms; "
          f"post-validation - plain: {(median['post-validation'] - median['plain']) * 1e3:.2f} ms")
    print(f"simulator, these costs: makespan {predicted.makespan * 1e3:.2f} ms, synchronisation bubble "
          f"{predicted.sync_bubble * 1e3:.2f} ms (the last rank's lag the synchronous step makes every rank wait for)")


if __name__ == "__main__":
    main()

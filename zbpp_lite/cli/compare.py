"""``python -m zbpp_lite compare``: run every schedule live and write one HTML report.

Every registered schedule trains the same model on the same batches for a few steps on the same
devices; the report has one table (loss, gradient check, measured and simulated makespan and
bubble rate) and, per schedule, the planned timeline (the simulator with that run's measured mean
action costs) above the measured one, and the activation bytes each rank held beside the plan's. Schedules whose builders need options are given them from
what is known (``stages_per_rank`` 2; ``costs`` the mean measured action costs of the runs so far;
``memory_limit`` p activation units, 1F1B's peak); a schedule that cannot be built or run is
listed with the reason, never left out silently.

``--platform gpu`` (or ``tpu``) with fewer such devices than ranks, but at least one: every
schedule is first simulated from per-stage costs timed on one accelerator (printed as PROFILED),
then the real runs go on simulated CPU devices (printed as REAL; the HTML report shows these).
"""

from __future__ import annotations

import argparse
import html
import inspect
import json
import sys

from . import CliError
from .train import add_model_arguments, add_platform_argument, check_model_arguments, setup_platform


def add_parser(subparsers, help_text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser("compare", help=help_text, description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", "-p", type=int, default=2, help="pipeline ranks = devices (default 2)")
    p.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches per step (default 8)")
    p.add_argument("--steps", type=int, default=4, help="training steps per schedule (default 4)")
    p.add_argument("--schedules", default="", help="comma-separated names (default: every registered schedule)")
    add_model_arguments(p)
    p.add_argument("--out", default="compare.html", help="HTML report path (default compare.html)")
    p.add_argument("--json", metavar="PATH", help="also write the figures of every run as JSON")
    add_platform_argument(p)
    return p


def _required(name: str) -> list[str]:
    """The options a builder cannot do without."""
    from ..schedules.builders import options_of

    return [key for key, default in options_of(name).items() if default is inspect.Parameter.empty]


def _options(name: str, ranks: int, costs) -> tuple[dict, str | None]:
    """Values for a builder's required options, or the reason they cannot be given."""
    known = {"stages_per_rank": 2, "memory_limit": float(ranks), "costs": costs}
    missing = [key for key in _required(name) if known.get(key) is None]
    if missing:
        return {}, f"needs option(s) {missing} that compare cannot supply"
    return {key: known[key] for key in _required(name)}, None


def _mean_costs(results: list):
    """Scalar mean action costs over the runs so far (seconds), for builders that plan with costs."""
    import numpy as np

    import zbpp_lite as zb

    split = [r.costs for r in results if any(w > 0 for w in r.costs.w)]
    if not split:
        return None
    return zb.Costs(
        f=float(np.mean([v for c in split for v in c.f])),
        b=float(np.mean([v for c in split for v in c.b])),
        w=float(np.mean([v for c in split for v in c.w])),
    )


def _profile_all(device, names: list[str], args, blocks: int) -> list[dict]:
    """Every schedule simulated from per-stage costs timed on ``device`` (printed as PROFILED);
    planners that need costs get the mean profiled ones. One JSON-ready dict per schedule."""
    import numpy as np

    import zbpp_lite as zb

    from .train import cost_table, profile_json, profile_pipelines

    print(f"PROFILED on {device}: per-stage costs timed on this one device; every pipeline below is simulated from them "
          f"({args.ranks} ranks, no transfer cost; nothing ran on {args.ranks} devices)", flush=True)
    by_shape: dict = {}
    profiled, shown = [], set()
    for name in sorted(names, key=lambda n: "costs" in _required(n)):
        mean = None
        if by_shape:
            every = list(by_shape.values())
            mean = zb.Costs(*(float(np.mean([v for c in every for v in getattr(c, k)])) for k in "fbw"))
        options, reason = _options(name, args.ranks, mean)
        try:
            if reason:
                raise ValueError(reason)
            schedule = zb.build_schedule(name, args.ranks, args.microbatches, **options)
            if blocks < schedule.num_stages:
                raise ValueError(f"{blocks} blocks cannot fill {schedule.num_stages} stages")
        except ValueError as e:
            print(f"PROFILED {name:18s} not simulated: {str(e).strip().splitlines()[0]}")
            continue
        (_, costs, timeline), = profile_pipelines(device, [schedule], args, blocks, by_shape)
        if schedule.num_stages not in shown:  # each stage count's cost table once
            shown.add(schedule.num_stages)
            print("\n".join(cost_table(costs, schedule.num_stages)))
        print(f"PROFILED {name:18s} S={schedule.num_stages:<2d} simulated makespan {timeline.makespan * 1e3:7.3f} ms  "
              f"bubble rate {timeline.bubble_rate:.3f}", flush=True)
        profiled.append({"schedule": name, "stages": schedule.num_stages, **profile_json(device, costs, timeline)})
    return profiled


def run(args) -> int:
    import zbpp_lite as zb

    names = [n.strip() for n in args.schedules.split(",") if n.strip()] or list(zb.SCHEDULES)
    unknown = [n for n in names if n not in zb.SCHEDULES]
    if unknown:
        raise CliError(f"unknown schedule(s) {unknown}; choose from: {', '.join(zb.SCHEDULES)}")
    m = args.microbatches
    check_model_arguments(args, m)
    blocks = args.blocks if args.blocks is not None else max(4, 2 * args.ranks)
    if blocks < 2 * args.ranks:
        print(f"note: --blocks {blocks} < {2 * args.ranks}: schedules with 2 stages per rank will be refused")
    devices, accelerator = setup_platform(args.ranks, args.platform)
    profiled = _profile_all(accelerator, names, args, blocks) if accelerator is not None else []
    if args.platform is not None:
        kind = "simulated CPU" if devices[0].platform == "cpu" else devices[0].platform.upper()
        print(f"REAL runs on {args.ranks} {kind} devices", flush=True)

    from ..training.data import load_digits
    from ..training.model import ModelConfig
    from ..training.train import RunConfig, train

    data = load_digits(args.holdout, args.seed)
    results, notes = [], {}
    for name in sorted(names, key=lambda n: "costs" in _required(n)):  # planners needing costs run last
        options, reason = _options(name, args.ranks, _mean_costs(results))
        if reason:
            notes[name] = reason
            print(f"{name:18s} skipped: {reason}")
            continue
        try:
            schedule = zb.build_schedule(name, args.ranks, m, **options)
            if blocks < schedule.num_stages:
                raise ValueError(f"{blocks} blocks cannot fill {schedule.num_stages} stages (use --blocks {schedule.num_stages})")
        except ValueError as e:
            notes[name] = str(e).strip().splitlines()[0]
            print(f"{name:18s} not run: {notes[name]}")
            continue
        r = train(schedule, steps=args.steps, model=ModelConfig(d=args.d, heads=args.heads, blocks=blocks, seed=args.seed),
                  run=RunConfig(batch=args.batch, lr=args.lr, seed=args.seed, holdout=args.holdout, progress=sys.stderr.isatty()),
                  devices=devices, data=data)
        results.append(r)
        print(
            f"{name:18s} S={schedule.num_stages:<2d} loss {r.losses[0]:.4f} -> {r.losses[-1]:.4f}  grad err {r.grad_max_rel_error:.1e}  "
            f"makespan {r.measured.makespan * 1e3:7.2f} ms (sim {r.simulated.makespan * 1e3:7.2f})  "
            f"bubble {r.measured.bubble_rate:.3f} (sim {r.simulated.bubble_rate:.3f})",
            flush=True,
        )
        memory = r.measured.measured_memory
        if memory is not None:
            print(f"{'':18s} activation memory peak per rank (bytes): measured {list(memory.peak_bytes)}  "
                  f"planned {[int(b) for b in r.measured.planned_peak_bytes]}", flush=True)
    with open(args.out, "w") as f:
        f.write(html_report(results, notes, args, blocks))
    print(f"wrote {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            data = {"runs": [{k: v for k, v in r.to_json().items() if k != "trace"} for r in results], "not_run": notes}
            if accelerator is not None:
                data["profiled"] = profiled
            json.dump(data, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def html_report(results: list, notes: dict, args, blocks: int) -> str:
    """One self-contained page: the table, then planned above measured per schedule."""
    from ..viz import compare_figure, measured_memory_figure

    rows = []
    for r in results:
        s, meas, sim = r.schedule, r.measured, r.simulated
        rows.append(
            "<tr>" + "".join(f"<td>{c}</td>" for c in (
                html.escape(s.name), s.num_stages, f"{r.losses[0]:.4f}", f"{r.losses[-1]:.4f}", f"{r.grad_max_rel_error:.1e}",
                f"{meas.makespan * 1e3:.2f}", f"{sim.makespan * 1e3:.2f}", f"{meas.makespan / sim.makespan:.3f}",
                f"{meas.bubble_rate:.3f}", f"{sim.bubble_rate:.3f}", f"{r.test_accuracy:.3f}",
            )) + "</tr>"
        )
    rows += [f"<tr><td>{html.escape(n)}</td><td colspan='10'>not run: {html.escape(why)}</td></tr>" for n, why in notes.items()]
    figures = []
    for i, r in enumerate(results):
        fig = compare_figure(r.simulated, r.measured, title=f"{r.schedule.name}: planned (simulated, measured costs) vs measured")
        figures.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
        if r.measured.measured_memory is not None:
            figures.append(measured_memory_figure(r.measured, title=r.schedule.name).to_html(full_html=False, include_plotlyjs=False))
    memory_rows = [
        f"<tr><td>{html.escape(r.schedule.name)}</td><td>{r.measured.measured_memory.peak_bytes}</td>"
        f"<td>{tuple(int(b) for b in r.measured.planned_peak_bytes)}</td><td>{tuple(round(u, 3) for u in r.measured.measured_memory.peak_units([r.schedule.stages_of(k)[0] for k in range(r.schedule.num_ranks)]))}</td></tr>"
        for r in results if r.measured.measured_memory is not None
    ]
    head = ["schedule", "stages", "loss first", "loss last", "grad rel. error", "measured makespan (ms)",
            "simulated makespan (ms)", "measured / simulated", "measured bubble rate", "simulated bubble rate", "test accuracy"]
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>zbpp_lite compare: p={args.ranks}, m={args.microbatches}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}</style>
</head><body>
<h1>Every schedule, live: p = {args.ranks} ranks, m = {args.microbatches} microbatches</h1>
<p>Digits Transformer d={args.d}, heads={args.heads}, blocks={blocks}, batch {args.batch}, {args.steps} steps per schedule.
Measured: the step with the median makespan (after the first). Planned: the simulator with that step's mean measured action
costs. Gradient error: first step against the unpartitioned model, relative to each gradient's largest entry.</p>
<table><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>
{chr(10).join(rows)}
</table>
<h2>Activation memory per rank</h2>
<p>Measured: the bytes each rank's actions kept for the schedule (F's residuals and W's operands, B's output gradients),
counted from the arrays' shapes and dtypes. Planned: the plan's memory model with the measured M_B and M_W of every stage,
in bytes and in units of M_B.</p>
<table><tr><th>schedule</th><th>measured peak (bytes)</th><th>planned peak (bytes)</th><th>measured peak (units of the rank's first stage's M_B)</th></tr>
{chr(10).join(memory_rows)}
</table>
{chr(10).join(figures)}
</body></html>
"""

"""The ``compare`` report: what the runs measured, ranked, explained in a paragraph, drawn; and
``train --html``'s page of one run (:func:`run_page`), drawn with the same figures.

All in milliseconds. Step times and bubble rates are medians over the timed steps (the first, compiling,
is left out); the plan is the simulator with the measured mean action costs of the median step.
Speed-ups are against the faster of the two single-device references, which is named. Paired ratios
(:func:`against`) compare step k with step k: the schedules took turns, so the machine's drift cancels.
"""

from __future__ import annotations

import html
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..analysis.noise import paired_gain
from ..analysis.profiling.timelines import timed_median, timed_steps
from ..schedules.timeline import Event, Timeline
from ..viz import compare_figure, measured_memory_figure
from ..viz.summary import SummaryRow, learning_figure, summary_figure


def held_out_words(result) -> str:
    """E.g. ``a test accuracy of 0.912 on the held-out digits``, or for the GPT ``a validation loss of
    2.10 nats/byte, 35% below the unigram baseline 3.24``."""
    unigram = result.config.get("unigram_nats")
    if unigram is None:
        return f"a test accuracy of {result.test_accuracy:.3f} on the held-out digits"
    side = "below" if result.test_loss <= unigram else "above"
    gap = abs(1 - result.test_loss / unigram)
    return (f"a validation loss of {result.test_loss:.3f} nats/byte, {gap:.0%} {side} the unigram baseline "
            f"{unigram:.3f}")


def _median_step_ms(r) -> float:
    return timed_median(r.step_seconds) * 1e3


def _median_bubble(r) -> float:
    return timed_median([t.bubble_rate for t in r.timelines])


def against(r, base):
    """``r``'s steps over ``base``'s, paired (:func:`~zbpp_lite.analysis.noise.paired_gain`), or None."""
    before, after = timed_steps(base.step_seconds), timed_steps(r.step_seconds)
    if not before or len(before) != len(after):
        return None
    return paired_gain(before, after)


@dataclass
class Comparison:
    """What ``compare`` ran and measured (see :mod:`zbpp_lite.cli.compare`)."""

    results: list
    notes: dict
    references: dict  # name -> median step seconds
    learned: Any  # TrainResult of the long run, or None
    args: Any
    blocks: int
    mode: str  # "processes" or "threads"
    stage_costs: dict = field(default_factory=dict)  # num_stages -> Costs timed on one device
    written: str | None = None  # what the learned GPT writes (:func:`zbpp_lite.cli.train.written_lines`)

    @property
    def ranked(self) -> list:
        return sorted(self.results, key=_median_step_ms)

    @property
    def reference(self) -> tuple[str, float]:
        """(name, ms) of the faster single-device reference."""
        name = min(self.references, key=self.references.get)
        return name, self.references[name] * 1e3

    def by_name(self, name: str):
        return next((r for r in self.results if r.schedule.name == name), None)

    def loss_spread(self) -> float:
        """The largest difference between two schedules' losses at the same step."""
        steps = min(len(r.losses) for r in self.results)
        at = [[r.losses[k] for r in self.results] for k in range(steps)]
        return max((max(v) - min(v) for v in at), default=0.0)

    def to_json(self) -> dict:
        ref_name, ref_ms = self.reference
        runs = []
        for r in self.ranked:
            data = {k: v for k, v in r.to_json().items() if k != "trace"}
            data.update({"median_step_ms": _median_step_ms(r), "median_bubble_rate": _median_bubble(r),
                         "speedup": ref_ms / _median_step_ms(r)})
            gain = against(r, self.by_name("1f1b")) if self.by_name("1f1b") is not None else None
            if gain is not None:  # step k over 1f1b's step k: median ratio and its interval
                data["vs_1f1b"] = {k: getattr(gain, k) for k in ("ratio", "low", "high", "coverage")}
            runs.append(data)
        out = {"mode": self.mode, "runs": runs, "not_run": self.notes,
               "references_ms": {n: s * 1e3 for n, s in self.references.items()},
               "reference": ref_name, "loss_spread": self.loss_spread()}
        bound = busy_bound(self)
        if bound is not None:  # the busiest 1f1b rank against the one-rank executor: see busy_bound
            out["busy_bound"] = dict(zip(("busy_ms", "ratio", "bound"), bound))
        split, live = _split_cost(self), split_in_pipeline(self)
        if split is not None or live is not None:  # (T_B + T_W) / T_BW: stages alone, and in the pipelines
            out["split_price"] = {"stages_alone": split,
                                  "in_pipeline": live and {"schedule": live[0], "ratio": live[1]}}
        if self.stage_costs:  # what the planners planned with: each stage timed alone, in ms
            out["stage_costs_ms"] = {str(n): {k: [float(v) * 1e3 for v in np.atleast_1d(getattr(c, k))]
                                              for k in ("f", "b", "w", "bw") if getattr(c, k) is not None}
                                     for n, c in self.stage_costs.items()}
        if fusions(self):  # each fused run beside its plain one: see fusions
            out["fusion"] = fusions(self)
        if self.learned is not None:
            out["learned"] = {"schedule": self.learned.schedule.name, "steps": len(self.learned.losses),
                              "losses": self.learned.losses, "test_accuracy": self.learned.test_accuracy,
                              "test_loss": self.learned.test_loss,
                              "validation": [{"step": k, "loss": v} for k, v in self.learned.validation],
                              "written": self.written}
        return out


def split_in_pipeline(c) -> tuple[str, float] | None:
    """``(name, ratio)``: zb-h2's (else zb-h1's) measured T_B + T_W over 1f1b's T_BW, mean over stages
    (the split's cost in the pipeline, beside :func:`_split_cost`); None without the pair."""
    base = c.by_name("1f1b")
    for name in ("zb-h2", "zb-h1"):
        r = c.by_name(name)
        if base is not None and r is not None and r.schedule.num_stages == base.schedule.num_stages:
            return name, _split_ratio(r.costs, base.costs)
    return None


def _split_ratio(split, fused) -> float:
    """``split``'s T_B + T_W over ``fused``'s T_BW, the mean over stages."""
    return statistics.mean((b + w) / bw for b, w, bw in zip(split.b, split.w, fused.bw))


def busy_bound(c) -> tuple[float, float, float] | None:
    """``(busy_ms, ratio, bound)``: 1f1b's busiest rank's median compute per step (ms); its ratio to a
    p-th of the one-rank reference's step (above 1: work beyond its share, e.g. per-action dispatch and
    sends); and the reference's step over it, the most a bubble-free pipeline could gain. None without
    1f1b or the reference, or in threads."""
    base = c.by_name("1f1b")
    executor = next((ms for n, ms in c.references.items() if "executor" in n), None)
    if base is None or executor is None or c.mode != "processes" or len(base.timelines) < 2:
        return None
    busy = timed_median([max(t.busy) for t in base.timelines]) * 1e3
    p = base.schedule.num_ranks
    return busy, busy / (executor * 1e3 / p), executor * 1e3 / busy


def auto_split_sentence(auto) -> str:
    """How many of zb-auto's backwards its plan ``auto`` (a Schedule, or None: "") split into B and W."""
    if auto is None:
        return ""
    kinds = [a.kind for _, a in auto]
    split, fused = kinds.count("B"), kinds.count("BW")
    return (f" zb-auto, planned with the measured T_BW, fuses a backward back into BW wherever that does not "
            f"lengthen its simulated step: it split {split} of its {split + fused} backwards.")


def _split_cost(c) -> float | None:
    """``(T_B + T_W) / T_BW`` of the profiled stages (each timed alone), or None without a fused cost."""
    for costs in c.stage_costs.values():
        if costs.bw is not None:
            return _split_ratio(costs, costs)
    return None


def fusions(c) -> list[dict]:
    """One dict (ms) per ``NAME+fuse`` run whose NAME ran too: ``fused`` of ``backwards`` run as BW on
    ``stages``; mean T_BW (``bw_ms``) vs the plain T_B + T_W (``b_w_ms``); median steps (``step_ms``,
    ``plain_step_ms``); paired ratio ``vs_plain`` (:func:`against`, or None); plans with each run's
    measured costs (``plan_ms``, ``plain_plan_ms``)."""
    out = []
    for r in c.results:
        name = r.schedule.name
        plain = c.by_name(name.removesuffix("+fuse")) if name.endswith("+fuse") else None
        if plain is None:
            continue
        fused_at = [a.stage for _, a in r.schedule if a.kind == "BW"]
        before = [a.stage for _, a in plain.schedule if a.kind == "BW"]
        stages = sorted(set(fused_at) - set(before))
        mean_ms = lambda values: statistics.mean(values) * 1e3 if stages else None  # noqa: E731
        gain = against(r, plain)
        out.append({"schedule": name, "plain": plain.schedule.name, "fused": len(fused_at) - len(before),
                    "stages": stages, "backwards": sum(a.kind == "B" for _, a in plain.schedule),
                    "bw_ms": mean_ms([r.costs.bw[s] for s in stages]),
                    "b_w_ms": mean_ms([plain.costs.b[s] + plain.costs.w[s] for s in stages]),
                    "step_ms": _median_step_ms(r), "plain_step_ms": _median_step_ms(plain),
                    "vs_plain": gain and {"ratio": gain.ratio, "low": gain.low, "high": gain.high},
                    "plan_ms": r.simulated.makespan * 1e3, "plain_plan_ms": plain.simulated.makespan * 1e3})
    return out


def fusion_lines(c) -> list[str]:
    """A sentence per :func:`fusions` entry: what was fused, its cost, the step's gain or loss."""
    lines = []
    for f in fusions(c):
        where = f"stage(s) {', '.join(map(str, f['stages']))}, whose input gradient goes to no other rank"
        cost = (f"; there one BW took {f['bw_ms']:.2f} ms against B + W {f['b_w_ms']:.2f} ms in {f['plain']} "
                f"({f['bw_ms'] / f['b_w_ms']:.2f}x)") if f["stages"] else ""
        g = f["vs_plain"]
        paired = ""
        if g is not None:
            verdict = ("a real gain" if g["high"] < 1 else "a real loss" if g["low"] > 1
                       else "within the noise")
            paired = f" (step by step {g['ratio']:.3f} [{g['low']:.3f}, {g['high']:.3f}]: {verdict})"
        lines.append(f"Fusion: {f['schedule']} ran {f['fused']} of {f['plain']}'s {f['backwards']} split "
                     f"backwards as one BW ({where}){cost}. A step took {f['step_ms']:.1f} ms against "
                     f"{f['plain_step_ms']:.1f} ms{paired}; the plans with each run's measured costs: "
                     f"{f['plan_ms']:.1f} against {f['plain_plan_ms']:.1f} ms.")
    return lines


def lead(best, base) -> str:
    """How the summary names ``best``, the run with the lowest median step: "was fastest" unless its
    steps, paired with ``base``'s (1f1b's), give a ratio interval not wholly below 1: then the ratio, its
    interval and that the gain is within the noise (or that it was slower step by step)."""
    g = against(best, base) if base is not None and base is not best else None
    if g is None or g.high < 1:
        return f"{best.schedule.name} was fastest"
    verdict = "no gain beyond the noise" if g.low <= 1 else "slower step by step"
    return (f"{best.schedule.name} had the lowest median step, taking {g.ratio:.3f} [{g.low:.3f}, "
            f"{g.high:.3f}] of 1f1b's time step by step ({verdict})")


def summary_text(c: Comparison) -> str:
    """A short paragraph generated from the numbers: which schedule won, by how much, and why."""
    ranked = c.ranked
    best, ref_name, ref_ms = ranked[0], *c.reference
    base = c.by_name("1f1b")
    lines = []
    best_ms = _median_step_ms(best)
    speedup, p_best = ref_ms / best_ms, best.schedule.num_ranks
    bound = busy_bound(c)
    why = "see why below" if bound is not None else \
        "the reference did the same work more slowly than the ranks"
    limit = (f"more than the {p_best}x that p = {p_best} ranks give for the same work: {why}"
             if speedup > p_best else f"p = {p_best} ranks allow at most {p_best}x")
    lines.append(f"{lead(best, base)}: {best_ms:.1f} ms a step (median of "
                 f"{len(best.step_seconds) - 1} timed steps), {speedup:.2f}x the faster single-device "
                 f"reference ({ref_name}, {ref_ms:.1f} ms; {limit}).")
    if base is not None and base is not best:
        base_ms, saved = _median_step_ms(base), _median_bubble(base) - _median_bubble(best)
        lines.append(f"Against 1f1b ({base_ms:.1f} ms, bubble rate {_median_bubble(base):.3f}) it took "
                     f"{best_ms / base_ms:.3f} of the time with a bubble rate of "
                     f"{_median_bubble(best):.3f}: {saved * 100:+.1f} points of idle time saved.")
    if base is not None:
        paired = [(r, g) for r in ranked if r is not base and (g := against(r, base)) is not None]
        if paired:
            lines.append("Step by step against 1f1b (the schedules took turns, so step k of each met the "
                         f"same machine; median ratio and its {paired[0][1].coverage:.0%} interval): "
                         + ", ".join(f"{r.schedule.name} {g.ratio:.3f} [{g.low:.3f}, {g.high:.3f}]"
                                     for r, g in paired[:6])
                         + (", ..." if len(paired) > 6 else "")
                         + ". An interval wholly below 1 is a real gain.")
    split = _split_cost(c)
    if split is not None:
        zb = [r for r in ranked if r.schedule.name in ("zb-h1", "zb-h2")]
        tail = (" ZB-H1 and ZB-H2 split every backward and pay that on every microbatch: "
                + ", ".join(f"{r.schedule.name} {_median_step_ms(r):.1f} ms" for r in zb) + ".") if zb else ""
        auto = c.by_name("zb-auto")
        lines.append(f"Splitting the backward into B and W costs {split:.2f}x the fused backward here "
                     "(T_B + T_W against T_BW, each stage timed alone)."
                     f"{auto_split_sentence(auto and auto.schedule)}{tail}")
    live = split_in_pipeline(c)
    if live is not None:
        lines.append(f"In the pipelines of this run, {live[0]}'s B + W took {live[1]:.2f}x 1f1b's fused "
                     "backward per microbatch (mean action times of their measured steps): the split's "
                     "price as the schedules paid it.")
    lines += fusion_lines(c)
    if bound is not None:
        lines.append(_why_not_p(bound, base.schedule.num_ranks, speedup > p_best))
    ratios = [r.measured.makespan / r.simulated.makespan for r in ranked]
    lines.append(f"Measured makespans are {min(ratios):.2f}-{max(ratios):.2f}x the plan's for the same "
                 "action costs (the rest is transfers and the start of each step).")
    lines.append("Every schedule computed the same losses (largest difference at one step "
                 f"{c.loss_spread():.1e}).")
    if c.learned is not None:
        losses = c.learned.losses
        lines.append(f"{c.learned.schedule.name}, trained for {len(losses)} steps, reached "
                     f"{held_out_words(c.learned)} (loss {losses[0]:.3f} -> {losses[-1]:.3f}).")
    if c.mode == "threads":
        lines.append("The ranks ran as threads sharing cores: a waiting rank lent its core to the others, "
                     "so bubbles cost less here than on real devices.")
    return "\n".join(lines)


def _why_not_p(bound: tuple[float, float, float], p: int, above_p: bool) -> str:
    """Why the winner is not (``above_p``: is more than) p times the one-rank reference."""
    busy, ratio, most = bound
    share = "half" if p == 2 else f"1/{p} of"
    did = (f"1f1b's busiest rank computed {busy:.1f} ms a step, {ratio:.2f}x {share} the one-rank "
           "executor's step")
    idle = "idle time: the bubbles, and each step's start and optimizer update"
    if above_p and ratio < 1:  # the reference did the same work more slowly than the ranks
        return (f"Why more than {p}x: {did} (stepped in the same turns): the one device did the same work "
                "more slowly than the ranks. A likely cause: it holds every microbatch's activations of "
                "the whole model at once (GPipe's order), where a rank holds its own stages' share, so its "
                "arrays leave the caches; the pipelines' gain over it is then more than their bubbles and "
                "ranks alone explain.")
    if most < p:
        return (f"Why not {p}x: {did} (stepped in the same turns), so a pipeline with no bubble at all would "
                f"reach at most {most:.2f}x here; the rest of the gap to {p}x is {idle}.")
    # the ranks did no more than their share: only idle time stands between the pipeline and px
    return (f"Why not {p}x: {did} (stepped in the same turns): no more than its share of the work, so what "
            f"stands between the pipelines and {p}x is {idle}.")


def _in_ms(timeline):
    events = [Event(e.rank, e.action, e.start * 1e3, e.end * 1e3) for e in timeline.events]
    return Timeline.from_events(events, timeline.num_ranks, source=timeline.source)


def _memory_section(c: Comparison) -> str:
    """Measured activation bytes per rank beside the plan's, per schedule (where recorded)."""
    runs = [r for r in c.ranked if r.measured.measured_memory is not None]
    if not runs:
        return ""
    rows = "".join(f"<tr><td>{html.escape(r.schedule.name)}</td>"
                   f"<td>{', '.join(str(b) for b in r.measured.measured_memory.peak_bytes)}</td>"
                   f"<td>{', '.join(str(int(b)) for b in r.measured.planned_peak_bytes)}</td></tr>"
                   for r in runs)
    figures = "".join(measured_memory_figure(r.measured, title=r.schedule.name, time_unit="ms")
                      .to_html(full_html=False, include_plotlyjs=False) for r in runs)
    return ("<h2>Activation memory per rank</h2><p>Measured: the bytes each rank's actions kept for the "
            "schedule (F's residuals and W's operands, B's output gradients), counted from the arrays' "
            "shapes and dtypes. Planned: the plan's memory model with the measured M_B and M_W of every "
            "stage.</p>"
            "<table><tr><th>schedule</th><th>measured peak per rank (bytes)</th><th>planned peak per rank "
            f"(bytes)</th></tr>{rows}</table>{figures}")


def learning_section(result, written: str | None = None) -> str:
    """HTML: ``result``'s loss over the steps (:func:`~zbpp_lite.viz.summary.learning_figure`, where it
    recorded held-out points; Plotly's script not included) and ``written``, the text the model wrote."""
    out = ""
    if result.validation:
        unigram = result.config.get("unigram_nats")
        fig = learning_figure(result.losses, result.validation, unigram,
                              title=f"{result.schedule.name}: the loss over {len(result.losses)} steps")
        out += fig.to_html(full_html=False, include_plotlyjs=False)
    if written:
        out += f"<pre>{html.escape(written)}</pre>"
    return out


def run_page(result, text: str, written: str | None = None) -> str:
    """``train --html``: one self-contained page of one run, its report ``text``, its median step planned
    over measured, and (:func:`learning_section`) its loss over the steps and what the model wrote."""
    name = result.schedule.name or "custom"
    fig = compare_figure(_in_ms(result.simulated), _in_ms(result.measured), time_unit="ms",
                         title=f"{name}: planned (simulator, measured costs) vs measured")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>zbpp_lite train: {html.escape(name)}</title></head>
<body style="font-family:sans-serif;margin:2em;max-width:1200px">
<h1>{html.escape(name)}, trained live</h1><pre>{html.escape(text)}</pre>
{fig.to_html(full_html=False, include_plotlyjs=True)}
{learning_section(result, written)}
</body></html>
"""


def html_report(c: Comparison) -> str:
    """One self-contained page: summary figure and paragraph, table, planned over measured per schedule."""
    args = c.args
    ref_name, ref_ms = c.reference
    rows = [SummaryRow(r.schedule.name, _median_step_ms(r), r.simulated.makespan * 1e3, _median_bubble(r),
                       r.simulated.bubble_rate) for r in c.ranked]
    summary = summary_figure(rows, reference=(ref_name, ref_ms),
                             title=f"p = {args.ranks} ranks, m = {args.microbatches} microbatches: "
                                   "fastest at the top")
    parts = [summary.to_html(full_html=False, include_plotlyjs=True)]
    head = ["schedule", "stages", "step (ms)", "speed-up", "makespan (ms)", "planned (ms)",
            "measured / planned", "bubble rate", "planned bubble rate", "loss first", "loss last",
            "grad rel. error"]
    table = []
    for r in c.ranked:
        step = _median_step_ms(r)
        cells = (html.escape(r.schedule.name), r.schedule.num_stages, f"{step:.2f}", f"{ref_ms / step:.2f}",
                 f"{r.measured.makespan * 1e3:.2f}", f"{r.simulated.makespan * 1e3:.2f}",
                 f"{r.measured.makespan / r.simulated.makespan:.3f}", f"{_median_bubble(r):.3f}",
                 f"{r.simulated.bubble_rate:.3f}", f"{r.losses[0]:.4f}", f"{r.losses[-1]:.4f}",
                 "-" if r.grad_max_rel_error is None else f"{r.grad_max_rel_error:.1e}")
        table.append("<tr>" + "".join(f"<td>{v}</td>" for v in cells) + "</tr>")
    table += [f"<tr><td>{html.escape(n)}</td><td colspan='{len(head) - 1}'>not run: "
              f"{html.escape(why)}</td></tr>" for n, why in c.notes.items()]
    refs = "".join(f"<li>{html.escape(n)}: {s * 1e3:.1f} "
                   f"ms{' (the reference)' if n == ref_name else ''}</li>" for n, s in c.references.items())
    for r in c.ranked:
        fig = compare_figure(_in_ms(r.simulated), _in_ms(r.measured), time_unit="ms",
                             title=f"{r.schedule.name}: planned (simulator, measured costs) vs measured")
        parts.append(fig.to_html(full_html=False, include_plotlyjs=False))
    memory = _memory_section(c)
    paragraph = "".join(f"<p>{html.escape(line)}</p>" for line in summary_text(c).splitlines())
    mode = ("one process per rank, each pinned to its own core, schedules taking turns step by step"
            if c.mode == "processes" else "ranks as threads of one process, sharing cores")
    learned = ""
    if c.learned is not None:
        learned = (f"<h2>Does it learn?</h2><p>{html.escape(c.learned.schedule.name)} trained from the "
                   f"start for {len(c.learned.losses)} steps: {held_out_words(c.learned)}. The comparison "
                   f"above runs only {args.steps} steps per schedule, too few to learn: it reports no "
                   "held-out figure.</p>" + learning_section(c.learned, c.written))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>zbpp_lite compare: p={args.ranks}, m={args.microbatches}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}</style>
</head><body>
<h1>Every schedule, live: p = {args.ranks} ranks, m = {args.microbatches} microbatches</h1>
{parts[0]}
{paragraph}
<p>{"GPT (bytes of Python source)" if getattr(args, "model", "digits") == "gpt" else "Digits Transformer"}
d={args.d}, heads={args.heads}, blocks={c.blocks}, batch {args.batch};
{args.steps} steps per schedule ({mode}). Step time: median over the steps after the first (which
compiles). Planned: the simulator with the measured mean action costs of the schedule's median
step. Gradient error: the first step against the unpartitioned model. All times in ms.</p>
<p>Single-device references, each on one core:</p><ul>{refs}</ul>
<table><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>
{chr(10).join(table)}
</table>
{learned}
{memory}
<h2>Timelines, planned above measured</h2>
<p>Colours: F forward, B input gradient, W weight gradient, BW fused backward, grey hatched idle.</p>
{chr(10).join(parts[1:])}
</body></html>
"""

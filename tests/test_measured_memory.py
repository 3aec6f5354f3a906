"""Measured activation memory: the bytes each rank really keeps equal the plan's peak, to the
byte, for every schedule; a leaked residual is caught; ZB-H2 holds (2p-1)/p of 1F1B's peak on
rank 0 (Qi et al., arXiv 2401.10241, sections 2.1 and 3.1, table 1)."""

from __future__ import annotations

import inspect
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zbpp_lite as zb
from zbpp_lite.analysis.profiling.device import stage_memory_bytes
from zbpp_lite.runtime.executor import PipelineExecutor, PlanMemoryWarning
from zbpp_lite.runtime.memory import MemoryRecorder, nbytes
from zbpp_lite.runtime.stages import StagedModel
from zbpp_lite.runtime.step import Compute
from zbpp_lite.schedules.builders import options_of
from zbpp_lite.schedules.memory import MeasuredMemory, add_curves
from zbpp_lite.training.data import load_digit_tokens
from zbpp_lite.training.model import ModelConfig, build_parts

DEVICES = jax.devices()
X, Y = load_digit_tokens()
MB = 2  # samples per microbatch
_models: dict[int, StagedModel] = {}


def _model(num_stages: int) -> StagedModel:
    """d=16, 2 heads, max(4, S) blocks: the executor grid's model (its compiled stages are shared)."""
    if num_stages not in _models:
        _models[num_stages] = StagedModel(build_parts(ModelConfig(d=16, heads=2, blocks=max(4, num_stages))), num_stages)
    return _models[num_stages]


def _build(name: str, p: int, m: int) -> zb.Schedule:
    options = {}
    for key, default in options_of(name).items():
        if default is inspect.Parameter.empty:
            options[key] = {"costs": zb.Costs(), "memory_limit": 2.0 * p}[key]
    try:
        return zb.build_schedule(name, p, m, **options)
    except ValueError as e:
        pytest.skip(f"{name} refuses p={p}, m={m}: {str(e).splitlines()[0]}")


def _run(schedule: zb.Schedule, executor_class=PipelineExecutor):
    model, m = _model(schedule.num_stages), schedule.num_microbatches
    executor = executor_class(model, schedule, DEVICES[: schedule.num_ranks])
    return executor.run(model.params, X[: MB * m], Y[: MB * m]).timeline


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("name", list(zb.SCHEDULES))
def test_measured_peak_bytes_equal_the_simulators_peak_on_every_rank(name, p):
    schedule = _build(name, p, 2 * p)
    timeline = _run(schedule)
    memory = timeline.measured_memory
    assert isinstance(memory, MeasuredMemory)
    assert all(b > 0 for b in memory.mem_b) and all(0 < w < b for w, b in zip(memory.mem_w, memory.mem_b))
    # the simulator, with M_B and M_W in measured bytes per stage, predicts every rank's peak to the byte
    planned = zb.simulate(schedule, memory.costs()).peak_memory
    assert memory.peak_bytes == tuple(int(b) for b in planned) and all(b == int(b) for b in planned)
    assert timeline.planned_peak_bytes == planned and timeline.peak_memory_bytes == memory.peak_bytes
    # in units of one stage-microbatch's activations (M_B of the rank's first stage), M_W / M_B from the measurement
    units = [memory.mem_b[schedule.stages_of(r)[0]] for r in range(p)]
    counts = zb.simulate(schedule, zb.Costs(mem_b=[Fraction(b, units[schedule.placement[s]]) for s, b in enumerate(memory.mem_b)],
                                            mem_w=[Fraction(w, units[schedule.placement[s]]) for s, w in enumerate(memory.mem_w)])).peak_memory
    for r in range(p):
        assert memory.peak_bytes[r] / units[r] == pytest.approx(counts[r], rel=1e-12)
    # everything kept is released by the step's end; everything received is consumed
    assert all(c[-1][1] == 0 for c in memory.held) and all(c[-1][1] == 0 for c in memory.received)
    ranks_that_receive = {schedule.placement[s] for s in range(1, schedule.num_stages)} | {schedule.placement[s] for s in range(schedule.num_stages - 1)}
    for r in range(p):
        sends_to_self = all(schedule.placement[s] == r for s in range(schedule.num_stages))
        assert (memory.peak_received_bytes[r] > 0) == (r in ranks_that_receive and not sends_to_self)
        assert memory.peak_bytes[r] <= memory.peak_total_bytes[r] <= memory.peak_bytes[r] + memory.peak_received_bytes[r]


class _LeakyCompute(Compute):
    """Drops one free: the backward (B or BW) of (stage 0, microbatch 0) leaves F's residuals
    counted as held, as an executor that kept them alive after their B would hold them."""

    def _leaky(self, backward, step, a, dy):
        if (a.stage, a.microbatch) != (0, 0):
            return backward(step, a, dy)
        free = step.memory.free
        step.memory.free = lambda rank, key: None if key == ("res", 0, 0) else free(rank, key)  # other ranks free too
        try:
            return backward(step, a, dy)
        finally:
            del step.memory.free

    def backward_input(self, step, a, dy=None):
        return self._leaky(super().backward_input, step, a, dy)

    def backward_fused(self, step, a, dy=None):
        return self._leaky(super().backward_fused, step, a, dy)


class _LeakyExecutor(PipelineExecutor):
    """An executor with :class:`_LeakyCompute`'s handlers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compute = _LeakyCompute(self.model, self.schedule.placement)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_a_residual_kept_after_its_b_fails_the_check(name):
    schedule = zb.build_schedule(name, 2, 4)
    memory = _run(schedule, _LeakyExecutor).measured_memory
    planned = zb.simulate(schedule, memory.costs()).peak_memory
    assert memory.peak_bytes[1] == planned[1]
    leaked = memory.held[0][-1][1]  # still held at the step's end: stage 0's residuals of microbatch 0
    assert 0 < leaked < memory.mem_b[0]
    assert memory.peak_bytes[0] > planned[0]  # the check fails on rank 0
    if name == "1f1b":  # F(0, 2) after BW(0, 0) takes rank 0 back to its peak, with the leak on top
        assert memory.peak_bytes[0] == planned[0] + leaked


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zb_h2_holds_2p_minus_1_over_p_of_1f1b_peak_on_rank_0(p):
    h2 = _run(zb.build_schedule("zb-h2", p, 2 * p)).measured_memory
    one = _run(zb.build_schedule("1f1b", p, 2 * p)).measured_memory
    assert Fraction(h2.peak_bytes[0], one.peak_bytes[0]) == Fraction(2 * p - 1, p)
    assert one.peak_bytes[0] == p * one.mem_b[0]  # 1F1B: p microbatches' activations on rank 0


@pytest.mark.parametrize("name", ["zb-h1", "zb-v"])
def test_the_shapes_give_the_measured_m_b_and_m_w_before_any_step(name):
    # what train and compare plan with (issue 31): the recorder's per-stage bytes, known before a step
    # runs (schedules that split B and W: a fused BW keeps no output gradients for a W)
    schedule = _build(name, 2, 4)
    memory = _run(schedule).measured_memory
    assert stage_memory_bytes(_model(schedule.num_stages), X[:MB], Y[:MB]) == (memory.mem_b, memory.mem_w)


def test_f_outputs_are_fresh_buffers_so_summing_leaves_counts_each_once():
    model = _model(2)
    shapes = model.stage_inputs(X[:MB])
    split = model.split_stage(1, shapes[1], Y[:MB])
    params = tuple(jax.tree_util.tree_leaves(model.stage_params(model.params, 1)))
    x = jax.device_put(np.zeros(shapes[1].shape, shapes[1].dtype))
    _, res, kept = split.flat.forward(params, x, Y[:MB], None)
    pointers = [a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves((res, kept))]
    assert len(set(pointers)) == len(pointers) and x.unsafe_buffer_pointer() not in pointers
    assert nbytes((res, kept)) == sum(np.asarray(a).nbytes for a in jax.tree_util.tree_leaves((res, kept)))


def test_the_recorder_counts_keeps_frees_and_arrivals_at_the_right_times():
    rec = MemoryRecorder(num_ranks=1, num_stages=1)
    a, g, x = np.zeros((4, 8), np.float32), np.zeros(3, np.float16), np.zeros(5, np.int32)
    rec.receive(0, ("F", -1, 0), x, 0.5)  # 20 bytes arrive
    rec.free(0, ("F", -1, 0))
    rec.keep(0, ("res", 0, 0), (a, a))  # 256 bytes
    rec.keep(0, ("kept", 0, 0), [a])  # 128 bytes
    rec.settle(0, 1.0)
    rec.free(0, ("res", 0, 0))
    rec.keep(0, ("grads", 0, 0), {"g": g})  # 6 bytes
    rec.settle(0, 2.0)
    rec.free(0, ("kept", 0, 0))
    rec.free(0, ("grads", 0, 0))
    rec.settle(0, 3.0)
    m = rec.result(shift=0.25)
    assert m.held == (((0.0, 0), (0.75, 384), (1.75, 134), (2.75, 0)),)
    assert m.received == (((0.0, 0), (0.25, 20), (0.75, 0)),)
    assert (m.mem_b, m.mem_w, m.peak_bytes, m.peak_total_bytes) == ((384,), (134,), (384,), (384,))
    assert add_curves(((0.0, 0), (1.0, 5)), ((0.0, 1), (0.5, 2), (1.0, 0))) == ((0.0, 1), (0.5, 2), (1.0, 5))


def test_a_measured_m_w_above_m_b_is_simulated_and_refused_by_the_planners_in_one_line():
    # under jax.checkpoint B recomputes W's operands: B allocates M_W - M_B, which a planner cannot hold
    costs = MeasuredMemory(((0.0, 0),), ((0.0, 0),), (10, 20), (5, 30)).costs()
    assert zb.simulate(zb.build_schedule("zb-h1", 2, 2), costs).peak_memory == (20.0, 60.0)  # rank 1: F +20, B +10, F +20, B +10
    with pytest.raises(ValueError, match=r"zb-2p: M_W exceeds M_B on stage\(s\) \[1\] \(M_B \[20.0\], M_W "
                                         r"\[30.0\]\): the planner has B free memory; give mem_b = max"):
        zb.build_schedule("zb-2p", 2, 4, costs=costs)


def test_recording_can_be_turned_off():
    schedule = zb.build_schedule("1f1b", 2, 2)
    model = _model(2)
    result = PipelineExecutor(model, schedule, DEVICES[:2], record_memory=False).run(model.params, X[: MB * 2], Y[: MB * 2])
    assert result.timeline.measured_memory is None and result.timeline.peak_memory_bytes is None


def test_the_figure_draws_measured_and_planned_per_rank_and_refuses_a_plan():
    from zbpp_lite.viz import measured_memory_figure

    schedule = zb.build_schedule("zb-h1", 2, 4)
    timeline = _run(schedule)
    fig = measured_memory_figure(timeline, title="zb-h1")
    assert len(fig.data) == 3 * 2
    for r in range(2):
        measured, planned, with_received = fig.data[3 * r : 3 * r + 3]
        assert max(measured.y) == timeline.peak_memory_bytes[r] == max(planned.y) == timeline.planned_peak_bytes[r]
        assert max(with_received.y) == timeline.measured_memory.peak_total_bytes[r]
        assert "measured / planned 1" in fig.layout.annotations[r].text
    with pytest.raises(ValueError, match="no measured memory"):
        measured_memory_figure(zb.simulate(schedule))


def test_train_plans_zb_v_with_the_jobs_memory_so_its_measured_peak_keeps_the_promise(tmp_path, capsys):
    # issue 31: planned with M_W = 0, zb-v at p = 2, m = 16 held 584,408 bytes on rank 0 against a
    # promise of about 103 KB (p whole-rank M_B): every W waited for the tail
    import json

    from zbpp_lite.cli import main

    path = tmp_path / "run.json"
    argv = ["train", "--threads", "--schedule", "zb-v", "--microbatches", "16", "--d", "8", "--heads", "1",
            "--steps", "1", "--batch", "32", "--json", str(path), "--no-progress"]
    assert main(argv) == 0
    memory = json.loads(path.read_text())["memory"]
    mem_b, p = memory["mem_b_bytes"], 2
    assert all(memory["peak_bytes"][r] <= p * (mem_b[r] + mem_b[2 * p - 1 - r]) for r in range(p))
    assert memory["peak_bytes"] == memory["planned_peak_bytes"]
    assert "planned with this job's activation memory per stage" in capsys.readouterr().out


def test_train_json_and_compare_report_carry_the_measured_memory(tmp_path, capsys, untimed_children):
    import json

    from zbpp_lite.cli import main

    path = tmp_path / "run.json"
    argv = ["train", "--schedule", "zb-h2", "--ranks", "2", "--microbatches", "4", "--steps", "2", "--d", "16",
            "--heads", "2", "--blocks", "4", "--batch", "8", "--json", str(path), "--no-progress",
            "--ranks-as", "threads"]  # (the processes path is test_turns'; threads spawn nothing)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "activation memory per rank" in out and "measured / planned 1.0000" in out
    memory = json.loads(path.read_text())["memory"]
    assert memory["peak_bytes"] == memory["planned_peak_bytes"] and memory["peak_units"][0] == 2 * 2 - 1
    assert len(memory["mem_b_bytes"]) == 2 and memory["device_peak_bytes"] == [None, None]  # CPU: no memory_stats
    assert memory["held"][0][0] == [0.0, 0] and memory["held"][0][-1][1] == 0
    out_html = tmp_path / "compare.html"
    argv = ["compare", "--ranks", "2", "--microbatches", "2", "--schedules", "1f1b,zb-h1", "--steps", "2", "--d", "16",
            "--heads", "2", "--blocks", "4", "--batch", "4", "--learn-steps", "0", "--out", str(out_html), "--ranks-as", "threads"]
    assert main(argv) == 0
    assert "activation memory peak per rank (bytes): measured" in capsys.readouterr().out
    page = out_html.read_text()
    assert "Activation memory per rank" in page and page.count("measured beside the plan") == 2


def test_the_executor_warns_in_one_line_when_the_models_m_w_breaks_the_schedules_memory_plan():
    # zb-2p planned with M_W = 7/16 M_B at p = 2, m = 8 promises 4 M_B per rank; this model's M_W is
    # about 0.7 of its M_B: the executor says so before the step, and the measured peak bears it out
    schedule = zb.build_schedule("zb-2p", 2, 8)
    with pytest.warns(PlanMemoryWarning, match=r"planned with M_W = 0\.4375 M_B to hold at most 4 M_B"):
        memory = _run(schedule).measured_memory
    assert max(memory.peak_units([0, 1])) > 4
    planned = zb.build_schedule("zb-2p", 2, 8, costs=memory.costs())
    assert planned.memory_plan.overrun(planned, memory.costs()) is None


def _ffn(p, x):
    return x + jnp.tanh(x @ p["up"]) @ p["down"]


def _linear(p, x):
    return x @ p["w"]


def _ffn_model(remat: bool) -> StagedModel:
    """[linear, ffn, ffn, linear] on d = 16 (ffn 64 wide), two stages; the ffn under jax.checkpoint or not."""
    k = jax.random.split(jax.random.key(0), 6)
    block = jax.checkpoint(_ffn) if remat else _ffn
    parts = [(_linear, {"w": 0.3 * jax.random.normal(k[0], (16, 16))})]
    parts += [(block, {"up": 0.3 * jax.random.normal(k[i], (16, 64)), "down": 0.3 * jax.random.normal(k[i + 1], (64, 16))})
              for i in (1, 3)]
    parts += [(_linear, {"w": 0.3 * jax.random.normal(k[5], (16, 16))})]
    return StagedModel(parts, 2, loss_fn=lambda y, t: jnp.mean((y - t) ** 2))


def test_under_jax_checkpoint_w_keeps_what_b_recomputed_and_the_plan_counts_it_to_the_byte():
    """F keeps the checkpoints' inputs only (M_B 1,024 and 1,536 B against 5,120 and 5,632 without), but
    W's operands and output gradients wait from B to W as without (M_W 6,144 B, above M_B): 1F1B's fused
    backward keeps the saving, a schedule that postpones W does not (ZB-H1's rank 1 holds what it holds
    without checkpoints). The simulator with the measured M_B, M_W (B allocating M_W - M_B) predicts
    every peak to the byte; a planner refuses such costs in one line."""
    x, y = jax.random.normal(jax.random.key(1), (32, 16)), jnp.ones((32, 16))
    model = _ffn_model(remat=True)
    timeline = PipelineExecutor(model, zb.build_schedule("zb-h1", 2, 4), DEVICES[:2]).run(model.params, x, y).timeline
    memory = timeline.measured_memory
    assert (memory.mem_b, memory.mem_w) == stage_memory_bytes(model, x[:8], y[:8]) == ((1024, 1536), (6144, 6144))
    assert memory.peak_bytes == timeline.planned_peak_bytes == (7168, 12288)
    mem_b, mem_w = stage_memory_bytes(_ffn_model(remat=False), x[:8], y[:8])
    plain = zb.Costs(mem_b=mem_b, mem_w=mem_w)
    peaks = {(remat, name): zb.simulate(zb.build_schedule(name, 2, 4), costs).peak_memory
             for remat, costs in ((True, memory.costs()), (False, plain)) for name in ("1f1b", "zb-h1")}
    assert peaks[True, "1f1b"] == (2048, 1536) and peaks[False, "1f1b"][0] >= 4 * 2048
    assert peaks[True, "zb-h1"][1] == peaks[False, "zb-h1"][1] == 2 * 6144  # two W's wait on rank 1
    with pytest.warns(PlanMemoryWarning, match=r"M_W / M_B per stage 6, 4 it holds 16 M_B"):
        PipelineExecutor(model, zb.build_schedule("zb-2p", 2, 4), DEVICES[:2]).run(model.params, x, y)
    with pytest.raises(ValueError, match=r"zb-2p: M_W exceeds M_B on stage\(s\) \[0, 1\]"):
        zb.build_schedule("zb-2p", 2, 4, costs=memory.costs())

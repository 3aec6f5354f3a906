"""The optimizer step inside the rank threads (zbpp_lite.training.postval.optimizer): the synchronous guard equals
postval's reference step, post-validation equals it within the rollback bound, run by the executor
itself with no barrier between steps (paper section 4)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zbpp_lite as zb
from zbpp_lite.training.data import load_digits
from zbpp_lite.runtime.executor import PipelineExecutor
from zbpp_lite.training.model import ModelConfig, build_parts
from zbpp_lite.runtime.stages import StagedModel
from zbpp_lite.training.postval.optimizer import StageOptimizer, guarded_run, synchronous_step
from zbpp_lite.training.reference import adamw_step
from zbpp_lite.training.postval.rollback import AdamWConfig

CFG = AdamWConfig(learning_rate=1e-2, eps=1e-3)
# eps 1e-3, not 1e-8: the attention key bias's exact gradient is 0 (softmax ignores a shift of all
# scores), so its computed gradient is float32 noise, which Adam with a tiny eps turns into
# lr-sized steps of either sign; two runs whose parameters differ by one rounding would then differ
# there by ~lr. With eps 1e-3 such entries barely move and the comparison sees the real steps.
STEPS, SPIKE_STEP, NAN_STEP = 5, 1, 3


def _max_rel(a, b) -> float:
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max() / max(np.abs(np.asarray(y)).max(), 1e-30))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True))


def _setup(name):
    schedule = zb.build_schedule(name, 2, 4)
    model = StagedModel(build_parts(ModelConfig(d=16, heads=2, blocks=4)), schedule.num_stages)
    executor = PipelineExecutor(model, schedule, jax.devices()[:2])
    data = load_digits(0.2, 0)
    batches = [data.batch(k, 32) for k in range(STEPS)]
    return schedule, model, executor, batches


def _faults(schedule, spike, delay=0.0):
    """A gradient spike on every stage at SPIKE_STEP, a NaN on a stage of the last rank at
    NAN_STEP; ``delay`` seconds of sleep in the last rank's optimizer step then, so that its full
    reduction surely comes after rank 0 has begun the next step (speculative F's to redo)."""
    bad = schedule.stages_of(1)[0]  # a stage of the last rank: rank 0 steps before it is known

    def inject(k, stage, grads):
        if delay and stage == bad and k in (SPIKE_STEP, NAN_STEP):
            time.sleep(delay)
        if k == SPIKE_STEP:
            return tuple(spike * g for g in grads)
        if k == NAN_STEP and stage == bad:
            return tuple(g.at[(0,) * g.ndim].set(jnp.nan) for g in grads)
        return grads

    return inject


def reference_grads(schedule, model, executor, batches, inject, max_norm):
    """postval.synchronous_step on gradients from single executor steps: the host-side reference."""
    S = schedule.num_stages
    params = [tuple(jax.tree_util.tree_leaves(model.stage_params(model.params, s))) for s in range(S)]
    states = [CFG.optimizer().init(p) for p in params]
    reports = []
    for k, (x, y) in enumerate(batches):
        full = model.join_stage_params([jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(model.stage_params(model.params, s)), list(p))
                                        for s, p in enumerate(params)])
        grads = executor.run(full, x, y).grads
        grads = [jax.device_put(tuple(inject(k, s, tuple(jax.tree_util.tree_leaves(model.stage_params(grads, s))))), jax.devices()[0])
                 for s in range(S)]
        params = [jax.device_put(p, jax.devices()[0]) for p in params]
        states = [jax.device_put(st, jax.devices()[0]) for st in states]
        params, states, report = synchronous_step(params, states, grads, CFG, max_norm)
        reports.append(report)
    return params, states, reports


# spike 100: 1e-3, not 2e-4. The rollback's error grows as k^2 (k = norm / max_norm, ~3.3 and ~33),
# so (100 / 10)^2 times spike 10's 1e-5; measured 1.07e-4 (spike 10: 1.04e-6), a rounding draw
# amplified per entry, which another CPU's rounding may double. Steps left unclipped end 0.88 of
# the parameters' scale away (measured); a missed redo is a step of ~lr = 1e-2.
@pytest.mark.parametrize("name, spike, pv_tolerance", [("zb-h2", 10.0, 1e-5), ("zb-v", 10.0, 1e-5), ("zb-h2", 100.0, 1e-3)])
def test_guarded_steps_in_the_rank_threads_equal_the_reference(name, spike, pv_tolerance):
    schedule, model, executor, batches = _setup(name)
    first = executor.run(model.params, *batches[0]).grads
    # three times the first step's norm: ordinary steps are not clipped
    max_norm = 3.0 * float(np.sqrt(sum(float(jnp.sum(jnp.square(v))) for v in jax.tree_util.tree_leaves(first))))
    inject = _faults(schedule, spike, delay=0.2)
    ref_params, ref_states, ref_reports = reference_grads(schedule, model, executor, batches, inject, max_norm)
    assert [r.clipped for r in ref_reports] == [False, True, False, False, False]
    assert [r.finite for r in ref_reports] == [True, True, True, False, True]
    # synchronous: 1e-5 of each leaf's largest entry, not 1e-6. The rank threads sum the global norm
    # from per-rank partial sums and step AdamW in their own programs, the reference in another
    # order, so each of the 5 steps may round every parameter differently by a few ulps (2^-23 of
    # the leaf's scale each: ~5e-7 a step, ~2.4e-6 over 5), plus gradient differences that follow;
    # measured 1.07e-6 on a loaded 2-core x86, over 1e-6. A real fault (a missed clip, a step
    # applied with a NaN, wrong gradients) moves parameters by ~lr = 1e-2 of their scale.
    runs = (("synchronous", 1e-5, False), ("post-validation", pv_tolerance, False),
            ("post-validation", pv_tolerance, True))
    for policy, tolerance, speculative in runs:
        results, opt = guarded_run(executor, model.params, batches, policy, max_norm, CFG, inject, speculative)
        got = opt.params()
        assert _max_rel([got[s] for s in range(schedule.num_stages)], ref_params) < tolerance, policy
        assert [r.clipped for r in opt.reports] == [r.clipped for r in ref_reports], policy
        assert [r.finite for r in opt.reports] == [r.finite for r in ref_reports], policy
        # the skipped step (NaN) is not counted: 4 of 5 steps taken on every stage, both ways
        counts = [int(opt._states[s][0].count) for s in range(schedule.num_stages)]
        assert counts == [int(st[0].count) for st in ref_states] == [STEPS - 1] * schedule.num_stages, policy
        norms = [r.global_norm for r in opt.reports]
        for ours, ref in zip(norms, [r.global_norm for r in ref_reports]):
            assert ours == pytest.approx(ref, rel=1e-5) or (np.isnan(ours) and np.isnan(ref))
        # every step's loss is the model's at that step's parameters: the first equals the reference's
        assert results[0].loss == pytest.approx(executor.run(model.params, *batches[0]).loss, rel=1e-6)
        if policy == "post-validation":
            rolled = [r.rolled_back for r in opt.reports]
            assert rolled == [[], [0, 1], [], [0], []]  # the spike: both wrong; the NaN on rank 1: rank 0 only
            partial = opt.reports[0].partial_norms
            assert partial[0] < partial[1] == pytest.approx(opt.reports[0].global_norm)
            # speculatively, the step after a rollback ran its warm-up twice: the F's redone are
            # the discarded ones, and every step's timeline still holds each action exactly once
            redone = [sorted({e.rank for e in r.discarded}) for r in results]
            if speculative:  # rank 0 began the steps after the faults before the verdict came (the delay)
                assert [r == [0] for r in redone] == [k - 1 in (SPIKE_STEP, NAN_STEP) for k in range(STEPS)], redone
                assert all(e.action.kind == "F" for r in results for e in r.discarded)
            else:
                assert not any(redone)
            for r in results:
                assert sorted(map(str, (e.action for e in r.timeline.events))) == sorted(map(str, (a for acts in schedule.actions for a in acts)))


@pytest.mark.parametrize("policy", ["synchronous", "post-validation"])
def test_one_executor_per_rank_trains_as_one_executor_for_all(policy):
    """PyTorch's set-up, one process per rank (here two single-rank executors in two threads, values
    through processes.connect's transport as a pipe carries them: arrays as NumPy, the optimizer's
    floats as they are): several steps in one run_steps call, the guard's messages between the ranks
    included, give the all-ranks executor's parameters and reports."""
    from test_byo_model import run_one_process_per_rank

    schedule, model, executor, batches = _setup("zb-h2")
    first = executor.run(model.params, *batches[0]).grads
    max_norm = 3.0 * float(np.sqrt(sum(float(jnp.sum(jnp.square(v))) for v in jax.tree_util.tree_leaves(first))))
    inject = _faults(schedule, 10.0, delay=0.2)
    whole_results, whole = guarded_run(executor, model.params, batches, policy, max_norm, CFG, inject)

    def run(executor):
        optimizer = StageOptimizer(executor, model.params, CFG, policy, max_norm, inject)
        results = executor.run_steps(model.params, batches, optimizer)
        after = (optimizer.params(), list(optimizer.reports))
        # a second call continues the step numbering on both sides (no message meets the wrong step)
        return results, after, executor.run_steps(model.params, batches[:2], optimizer)

    both = run_one_process_per_rank(model, schedule, run)
    results, again = {r: v[0] for r, v in both.items()}, {r: v[2] for r, v in both.items()}
    params, reports = {r: v[1][0] for r, v in both.items()}, {r: v[1][1] for r, v in both.items()}
    for s in range(schedule.num_stages):
        r = schedule.placement[s]
        assert _max_rel(params[r][s], whole.params()[s]) < 1e-5, (policy, s)
    last = schedule.placement[-1]
    assert [res.loss for res in results[last]] == pytest.approx([res.loss for res in whole_results], rel=1e-5)
    for r in range(2):  # each process reports its own ranks: the same global norms and verdicts
        assert [rep.clipped for rep in reports[r]] == [rep.clipped for rep in whole.reports]
        assert [rep.finite for rep in reports[r]] == [rep.finite for rep in whole.reports]
        if policy == "post-validation":
            assert [rep.rolled_back for rep in reports[r]] == [[q for q in rep.rolled_back if q == r] for rep in whole.reports]
    if policy == "post-validation":  # rank 0 redid its speculative warm-up after each rollback
        assert [bool(r.discarded) for r in results[0]] == [k - 1 in (SPIKE_STEP, NAN_STEP) for k in range(STEPS)]
    assert sorted(again) == [0, 1] and all(len(v) == 2 for v in again.values())


def test_plain_steps_equal_optax_adamw_step_by_step():
    schedule, model, executor, batches = _setup("zb-h2")
    results, opt = guarded_run(executor, model.params, batches[:3], "plain", config=CFG)
    S = schedule.num_stages
    params = [tuple(jax.tree_util.tree_leaves(model.stage_params(model.params, s))) for s in range(S)]
    states = [CFG.optimizer().init(p) for p in params]
    tree = [jax.tree_util.tree_structure(model.stage_params(model.params, s)) for s in range(S)]
    for k, (x, y) in enumerate(batches[:3]):
        full = model.join_stage_params([jax.tree_util.tree_unflatten(tree[s], list(params[s])) for s in range(S)])
        step = executor.run(full, x, y)
        assert results[k].loss == pytest.approx(step.loss, rel=1e-6)
        for s in range(S):
            g = jax.device_put(tuple(jax.tree_util.tree_leaves(model.stage_params(step.grads, s))), jax.devices()[0])
            params[s], states[s] = adamw_step(jax.device_put(params[s], jax.devices()[0]), states[s], g, CFG)
    # 1e-5, not 1e-6: the in-thread AdamW and adamw_step are two programs, which may round each
    # parameter a few ulps differently (2^-23 of the leaf's scale each) in each of the 3 steps
    # (5.1e-7 measured); a wrong step moves parameters by ~lr = 1e-2 of their scale
    assert _max_rel([opt.params()[s] for s in range(S)], params) < 1e-5
    assert opt.reports == []
    # no barrier between steps: each step starts after the previous one's first action
    assert all(b.start > a.start for a, b in zip(results, results[1:]))


def test_bad_policies_are_refused():
    _, model, executor, _ = _setup("zb-h2")
    with pytest.raises(ValueError, match="policy must be one of plain, synchronous, post-validation"):
        StageOptimizer(executor, model.params, policy="sgd")
    with pytest.raises(ValueError, match="give max_norm, a number > 0, got None"):
        StageOptimizer(executor, model.params, policy="post-validation")
    with pytest.raises(ValueError, match="give max_norm > 0, got -1.0"):
        StageOptimizer(executor, model.params, policy="synchronous", max_norm=-1)
    with pytest.raises(ValueError, match="a number > 0, got '1.0x'"):
        StageOptimizer(executor, model.params, policy="synchronous", max_norm="1.0x")
    with pytest.raises(ValueError, match="one pytree per model module"):
        StageOptimizer(executor, [], policy="synchronous", max_norm=1.0)
    with pytest.raises(ValueError, match="b2 must be in \\(0, 1\\)"):
        AdamWConfig(b2=0.0)
    with pytest.raises(ValueError, match="max_norm needs a guarded policy"):
        StageOptimizer(executor, model.params, max_norm=1.0)
    with pytest.raises(ValueError, match="at least one"):
        executor.run_steps(model.params, [])


def test_train_with_a_guard_runs_both_policies_to_the_same_model(monkeypatch):
    import dataclasses

    from zbpp_lite.training.postval import rollback
    from zbpp_lite.training.train import TrainOptions, train

    # AdamW's eps raised to CFG's 1e-3 for both guarded runs (see CFG's comment): with eps 1e-8 the
    # attention key bias, whose exact gradient is 0, takes lr-sized steps whose sign is float32 noise,
    # so the two policies' parameters differed there by 1.35e-3 of the leaf on an AMD EPYC and by less
    # elsewhere: a comparison that measured the CPU's rounding, not the policies.
    @dataclasses.dataclass(frozen=True)
    class _RaisedEps(rollback.AdamWConfig):
        eps: float = CFG.eps

    monkeypatch.setattr(rollback, "AdamWConfig", _RaisedEps)

    from zbpp_lite.training.model import ModelConfig
    from zbpp_lite.training.train import RunConfig

    common = dict(ranks=2, microbatches=4, steps=4, model=ModelConfig(d=16, heads=2, blocks=4),
                  options=TrainOptions(devices=jax.devices()[:2]))
    plain = train("zb-h2", run=RunConfig(batch=32, lr=1e-2), **common)
    sync = train("zb-h2", run=RunConfig(batch=32, lr=1e-2, max_grad_norm=0.5), **common)
    pv = train("zb-h2", run=RunConfig(batch=32, lr=1e-2, max_grad_norm=0.5, post_validation=True), **common)
    reports = sync.config["guard_reports"]
    assert all(r["clipped"] for r in reports) and plain.losses[0] == pytest.approx(sync.losses[0], rel=1e-6)
    assert sync.grad_max_rel_error < 1e-4 and pv.grad_max_rel_error < 1e-4
    # every step clipped: post-validation rolled back every rank every step, and still lands on the synchronous model
    assert [r["rolled_back"] for r in pv.config["guard_reports"]] == [[0, 1]] * 4
    np.testing.assert_allclose(pv.losses, sync.losses, rtol=1e-4)
    assert _max_rel(pv.params, sync.params) < 1e-4
    assert not np.allclose(plain.losses[-1], sync.losses[-1], rtol=1e-6)  # clipping changed the training
    with pytest.raises(ValueError, match="give max_grad_norm too"):
        RunConfig(batch=32, lr=1e-2, post_validation=True)


def test_train_command_reports_the_guard(capsys):
    from zbpp_lite.cli import main

    tiny = ["--ranks", "2", "--microbatches", "4", "--steps", "3", "--d", "16", "--heads", "2", "--blocks", "4", "--batch", "32",
            "--ranks-as", "threads"]  # (a clipped run in processes: test_turns)
    assert main(["train", "--schedule", "zb-h2", *tiny, "--max-grad-norm", "0.5", "--post-validation", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "optimizer step in the rank threads, post-validation, max_grad_norm 0.5: 3 of 3 steps clipped, 0 skipped, 3 rolled back" in out
    assert main(["train", "--schedule", "zb-h2", *tiny, "--post-validation"]) == 2
    assert "--post-validation validates a clipped step: give --max-grad-norm N too" in capsys.readouterr().err


def test_a_heavily_clipped_redo_stays_finite_and_equals_the_synchronous_run():
    """max_norm far below every norm: each speculative step is undone and redone with gradients
    scaled down ~1e6 times; the recovered second moment must not go negative (NaN in sqrt)."""
    _, model, executor, batches = _setup("zb-h2")
    runs = {p: guarded_run(executor, model.params, batches[:3], p, 1e-6, CFG) for p in ("synchronous", "post-validation")}
    losses = {p: [r.loss for r in results] for p, (results, _) in runs.items()}
    assert np.all(np.isfinite(losses["post-validation"])) and all(r.finite for r in runs["post-validation"][1].reports)
    np.testing.assert_allclose(losses["post-validation"], losses["synchronous"], rtol=1e-4)
    assert [r.rolled_back for r in runs["post-validation"][1].reports] == [[0, 1]] * 3


def test_reports_cover_the_latest_run_only():
    _, model, executor, batches = _setup("zb-h2")
    opt = StageOptimizer(executor, model.params, CFG, "synchronous", 1e9)
    executor.run_steps(model.params, batches[:3], opt)
    assert len(opt.reports) == 3 and opt.reports[0].global_norm > 0
    executor.run_steps(model.params, batches[3:4], opt)
    assert len(opt.reports) == 1 and opt.reports[0].global_norm > 0


def test_guard_flags_are_checked_before_jax_work(capsys):
    from zbpp_lite.cli import main

    tiny = ["--ranks", "2", "--microbatches", "4", "--steps", "1", "--d", "16", "--heads", "2", "--blocks", "4", "--batch", "16"]
    for flags, message in ((["--max-grad-norm", "nan"], "--max-grad-norm must be a number > 0, got nan"),
                           (["--max-grad-norm", "0"], "--max-grad-norm must be a number > 0, got 0.0"),
                           (["--spmd", "--max-grad-norm", "1"], "--spmd trains plain AdamW")):
        assert main(["train", "--schedule", "zb-h2", *tiny, *flags]) == 2
        err = capsys.readouterr()
        assert message in err.err and "zb-h2: 2 ranks" not in err.out  # refused before the run's header


def test_a_clipped_run_takes_the_one_train_step_once_a_step(monkeypatch):
    """train with max_grad_norm runs train_step once a step with the clipped AdamW (the run's update in
    the rank threads), so the held-out loss is taken between steps as in a plain run (before: one
    run_steps call over every batch, held-out loss at the start and the end only)."""
    from zbpp_lite.training import train as training
    from zbpp_lite.training.model import ModelConfig, RunConfig

    calls, real = [], training.train_step

    def counted(executor, optimizer, *args):
        calls.append(type(optimizer).__name__)
        return real(executor, optimizer, *args)

    monkeypatch.setattr(training, "train_step", counted)
    run = RunConfig(batch=32, lr=1e-2, max_grad_norm=0.5, eval_every=1, check_grads=False)
    result = training.train("zb-h2", 2, 4, 3, model=ModelConfig(d=16, heads=2, blocks=4), run=run,
                            options=training.TrainOptions(devices=jax.devices()[:2]))
    assert calls == ["ClippedAdamW"] * 3 and len(result.config["guard_reports"]) == 3
    assert [k for k, _ in result.validation] == [0, 1, 2, 3]
    assert len({v for _, v in result.validation}) == 4  # the parameters moved between the points

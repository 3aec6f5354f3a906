"""The compiled SPMD executor: the unpartitioned model's loss and gradients for 1f1b, zb-h1,
zb-h2 and zb-v in one process (simulated devices), its static tables, and the #40823 guard."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import zbpp_lite as zb
from zbpp_lite.training.data import load_digit_tokens
from zbpp_lite.training.model import ModelConfig, build_parts
from zbpp_lite.runtime.stages import StagedModel
from zbpp_lite.runtime.spmd import KIND_CODE, SpmdExecutor, tick_tables
from zbpp_lite.training.reference import max_relative_error

X, Y = load_digit_tokens()
P, M, MB = 2, 4, 2


def _setup(name: str):
    schedule = zb.build_schedule(name, P, M)
    model = StagedModel(build_parts(ModelConfig(d=16, heads=2, blocks=4)), schedule.num_stages)
    x, y = X[: M * MB], Y[: M * MB]
    return schedule, model, x, y


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zb-v"])
def test_spmd_matches_unpartitioned_model(name):
    schedule, model, x, y = _setup(name)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(model.loss))(model.params, x, y)
    result = SpmdExecutor(model, schedule, jax.devices()[:P]).run(model.params, x, y)
    assert abs(result.loss - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert max_relative_error(result.grads, ref_grads) <= 1e-5


def test_tables_follow_the_lockstep_ticks():
    schedule = zb.build_schedule("zb-v", P, M)
    t = tick_tables(schedule)
    ticks = zb.simulate(schedule, lockstep=True)  # noqa: F841 - the lockstep timing exists for this table
    from zbpp_lite.schedules.simulate import lockstep_ticks

    rows = lockstep_ticks(schedule)
    assert t.num_ticks == len(rows)
    for tick, row in enumerate(rows):
        for r, step in enumerate(row):
            if step is None:
                assert t.kind[r, tick] == 0
            else:
                a = schedule.actions[r][step]
                assert (t.kind[r, tick], schedule.stages_of(r)[t.chunk[r, tick]], t.microbatch[r, tick]) == (KIND_CODE[a.kind], a.stage, a.microbatch)
    # V placement: stage 1 -> 2 is the turn on rank 1, a local ("self") hand-over
    assert t.recv["self"][0][1].any() and not t.recv["self"][0][0].any()


def test_unsupported_placement_is_refused():
    s = zb.Schedule.from_rows([["0F0", "0B0"], ["1F0", "2F0", "2B0", "1B0"]])  # rank 1 holds 2 stages, rank 0 one
    with pytest.raises(ValueError, match="same number"):
        tick_tables(s)


def test_overlapped_pairs_are_refused_in_one_line_and_their_split_form_is_taken():
    s = zb.build_schedule("dualpipe-v", P, M)
    with pytest.raises(ValueError, match=r"^the SPMD executor runs one action per rank per tick and has no overlapped F&B pair; run schedule.split_pairs\(\)[^\n]*$"):
        tick_tables(s)
    t = tick_tables(s.split_pairs())
    assert (t.kind != 0).sum() == len(s)


def _branch_collectives(jaxpr) -> list[str]:
    """Collective primitives inside any cond / switch branch of a jaxpr (recursively)."""
    found = []

    def walk(jp, in_branch):
        for eqn in jp.eqns:
            name = eqn.primitive.name
            if in_branch and name.startswith(("psum", "ppermute", "all_gather", "all_to_all", "pmax", "pmin")):
                found.append(name)
            for param in eqn.params.values():
                subs = param if isinstance(param, (tuple, list)) else (param,)
                for sub in subs:
                    inner = getattr(sub, "jaxpr", None)
                    if inner is not None and hasattr(inner, "eqns"):
                        walk(inner, in_branch or name == "cond")
                    elif hasattr(sub, "eqns"):
                        walk(sub, in_branch or name == "cond")

    walk(jaxpr.jaxpr, False)
    return found


def test_replicated_inputs_are_made_varying_before_the_switch():
    """JAX #40823: without lax.pcast(..., to="varying") the replicated embedding / head parameters
    enter the per-rank switch invariant, and their gradients' transpose puts a psum inside a
    branch only some ranks take: wrong gradients, or (XLA:CPU) a rendezvous that never completes.
    With the cast no collective is left inside any branch."""
    schedule, model, x, y = _setup("zb-h1")
    programs = {}
    for vary in (True, False):
        ex = SpmdExecutor(model, schedule, jax.devices()[:P], vary_replicated=vary)
        args = ex.inputs(model.params, x, y)
        program, _ = ex._program(args[-2].shape[1:], args[-1].shape[1:])
        programs[vary] = _branch_collectives(jax.make_jaxpr(program)(*args))
    assert programs[True] == []
    assert programs[False], "without the cast a collective must appear inside a branch (else #40823 is fixed upstream)"


def test_train_command_runs_the_spmd_executor(capsys):
    from zbpp_lite.cli import main

    tiny = ["--ranks", "2", "--microbatches", "4", "--steps", "2", "--d", "16", "--heads", "2", "--blocks", "4", "--batch", "16"]
    assert main(["train", "--schedule", "zb-h1", *tiny, "--spmd"]) == 0
    out = capsys.readouterr().out
    error = float(out.split("max relative error ")[1].split(",")[0])
    assert error < 1e-5 and "SPMD: median step" in out and "lockstep ticks" in out

"""Lesson 10's claims (``notebooks/10_spmd_v.md``): those its cells state in words only, and three of
"Toward a model of your own" as its cell prints them (``bench.model_claims``).

"Keeping the pullback": inside a ``shard_map`` program, a treedef traced once, buffers sized by
``jax.eval_shape`` and F's inputs cast to varying keep each microbatch's pullback in a row, and B
rebuilt from that row gives ``jax.vjp``'s dx, with no collective inside a branch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from zbpp_lite import course as ex
from zbpp_lite.course import bench
from zbpp_lite.runtime.spmd import shard_map, to_varying as vary

p, m, samples, d = (ex.V_CASE[k] for k in ("ranks", "microbatches", "microbatch_size", "width"))


def _stage(A, c):
    """Lesson 9's stage, two tanh layers, with a probe added where each layer's bias is."""
    return lambda x, e: jnp.tanh(jnp.tanh(x @ A[0] + c[0] + e[0]) @ A[1] + c[1] + e[1])


def test_a_pullback_kept_in_rows_inside_the_program_gives_jax_vjps_dx_with_no_collective_in_a_branch():
    def keep_then_pull(A, c, X, dY):             # one rank: F on every microbatch, then B on every one
        F = _stage(A[0], c[0])
        X, e = vary(X), vary(jnp.zeros((2, samples, d)))
        treedef = jax.tree.structure(jax.vjp(F, X[0], e)[1])
        shapes = jax.eval_shape(lambda x: jax.tree.leaves(jax.vjp(F, x, e)[1]), X[0])
        bufs = vary([jnp.zeros((m, *s.shape), s.dtype) for s in shapes])

        def tick(bufs, t):
            def forward(bufs):
                leaves = jax.tree.leaves(jax.vjp(F, X[t], e)[1])
                return [b.at[t].set(a) for b, a in zip(bufs, leaves)], jnp.zeros_like(X[0])

            def backward(bufs):
                pullback = jax.tree.unflatten(treedef, [b[t - m] for b in bufs])
                return bufs, pullback(vary(dY[t - m]))[0]
            return lax.cond(t < m, forward, backward, bufs)
        return lax.scan(tick, bufs, jnp.arange(2 * m))[1][m:][None]

    mesh = Mesh(np.array(jax.devices()[:p]), ("rank",))
    keys = jax.random.split(jax.random.key(0), 4)
    As, cs = jax.random.normal(keys[0], (p, 2, d, d)) / d ** 0.5, jax.random.normal(keys[1], (p, 2, d)) / 4
    X, dY = jax.random.normal(keys[2], (m, samples, d)), jax.random.normal(keys[3], (m, samples, d))
    keeping = jax.jit(shard_map(keep_then_pull, mesh=mesh, in_specs=(P("rank"), P("rank"), P(), P()),
                                out_specs=P("rank")))
    assert bench.collectives_in_branches(jax.make_jaxpr(keeping)(As, cs, X, dY).jaxpr) == []
    zero = jnp.zeros((2, samples, d))
    want = jnp.stack([jnp.stack([jax.vjp(_stage(As[r], cs[r]), X[j], zero)[1](dY[j])[0] for j in range(m)])
                      for r in range(p)])
    np.testing.assert_allclose(keeping(As, cs, X, dY), want, atol=1e-5)


def test_the_model_claims_hold_as_lesson_10_prints_them():
    """bench.model_claims, which lesson 10's cell prints (its tied-weight cell runs in the lesson, on both
    JAX legs): the package's dropout keys repeat for the same step, part and microbatch and differ
    otherwise; nnx.split / nnx.merge rebuild a module; two pipeline copies over a "data" axis, each weight
    cast to varying there, average to the whole batch's gradient with one pmean, and without the cast get
    twice it."""
    claims = bench.model_claims(jax.devices()[:4])
    assert set(claims) == {"dropout", "nnx", "data", "data uncast"}
    assert claims["dropout"] == [True] * 4 and claims["nnx"] < 1e-6
    assert claims["data"] < 1e-5 and abs(claims["data uncast"] - 2) < 1e-4


def test_the_tick_table_written_in_the_lesson_is_what_the_package_prints():
    """Lesson 10 writes ZB-V's tick 14 into its source (read on GitHub, no cell has run): the same lines as
    ``ex.tick_messages(vz, 14, reads=False)`` prints."""
    import zbpp_lite as zb
    from pathlib import Path

    source = (Path(__file__).parent.parent / "notebooks" / "10_spmd_v.md").read_text(encoding="utf-8")
    written = source.split("```text\n")[1].split("```")[0].rstrip("\n").splitlines()
    assert written == ex.tick_messages(zb.build_schedule("zb-v", p, m), 14, reads=False).splitlines()


def test_zb_v_in_lockstep_takes_6m_plus_p_minus_1_ticks_rank_r_idling_r_at_the_start_and_p_1_r_at_the_end():
    """Each action one tick, ZB-V (m >= 2p - 1) takes 6m + p - 1 ticks: a rank runs 6m actions (two chunks,
    an F, a B and a W each per microbatch), the last rank starts p - 1 ticks late and then has one every
    tick (the count lesson 10's tables run over)."""
    import zbpp_lite as zb
    from zbpp_lite.schedules.simulate import lockstep_ticks

    for ranks, micro in ((2, 3), (3, 5), (4, 7), (4, 8), (5, 12)):
        ticks = lockstep_ticks(zb.build_schedule("zb-v", ranks, micro))
        idle = [[t for t, row in enumerate(ticks) if row[r] is None] for r in range(ranks)]
        assert len(ticks) == 6 * micro + ranks - 1
        assert all(i == [*range(r), *range(len(ticks) - ranks + 1 + r, len(ticks))] for r, i in enumerate(idle))

"""Lesson 10's claims that its cells state in words only (``notebooks/10_spmd_v.md``).

"Keeping the pullback": inside a ``shard_map`` program, a treedef traced once, buffers sized by
``jax.eval_shape`` and F's inputs cast to varying keep each microbatch's pullback in a row, and B
rebuilt from that row gives ``jax.vjp``'s dx, with no collective inside a branch. "Toward a model of
your own": a tied weight passed whole, cast to varying, each rank taking its own use's gradient and one
psum adding them, gives ``jax.grad``'s gradient of both uses; the package's dropout keys, folded from the
step's key, the microbatch and the part, repeat for the same three and differ otherwise; ``nnx.split`` /
``nnx.merge`` carry a module's arrays and rebuild it; two pipeline copies over a ``"data"`` axis, each
weight cast to varying over it, average their gradients with one ``lax.pmean`` to the whole batch's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from zbpp_lite import course as ex
from zbpp_lite.course import bench
from zbpp_lite.runtime.spmd import shard_map, to_varying as vary
from zbpp_lite.runtime.stages import dropout_keys

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


def test_a_tied_weight_cast_to_varying_and_summed_by_one_psum_gets_both_uses_gradient():
    def tied_uses(E, x, y):                      # rank 0 embeds with E, rank p - 1 scores with E.T
        r = lax.axis_index("rank")

        def loss(E):
            embed = jnp.where(r == 0, jnp.sum(jnp.tanh(x @ E)), 0.0)
            head = jnp.where(r == p - 1, jnp.sum((y @ E.T) ** 2), 0.0)
            return embed + head
        return lax.psum(jax.grad(loss)(vary(E)), "rank")   # each rank's own use, summed once

    mesh = Mesh(np.array(jax.devices()[:p]), ("rank",))
    E, x, y = (jax.random.normal(k, (d if i == 0 else samples, d)) / 16
               for i, k in enumerate(jax.random.split(jax.random.key(2), 3)))
    tied = jax.jit(shard_map(tied_uses, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P()))(E, x, y)
    whole = jax.grad(lambda E: jnp.sum(jnp.tanh(x @ E)) + jnp.sum((y @ E.T) ** 2))(E)
    np.testing.assert_allclose(tied, whole, rtol=1e-5, atol=1e-5)
    untied = jax.jit(shard_map(lambda E, x, y: jax.grad(lambda E: jnp.sum(jnp.tanh(x @ E)))(vary(E))[None],
                               mesh=mesh, in_specs=(P(), P(), P()), out_specs=P("rank")))(E, x, y)
    assert not np.allclose(untied[0], whole, atol=1e-3)     # one use alone is not the tied gradient


def test_two_pipeline_copies_over_a_data_axis_average_their_gradients_with_one_pmean():
    dp, p, m, n, d = 2, 2, 2, 4, 8                       # 2 copies of a 2-rank pipeline, 2 microbatches each
    k = jax.random.split(jax.random.key(5), 3)
    As = jax.random.normal(k[0], (p, d, d)) / d**0.5     # stage s: tanh(x @ As[s])
    X, Y = (jax.random.normal(key, (dp, m, n, d)) for key in k[1:])   # each copy's microbatches

    def step(cast):  # cast: what a weight passed whole over "data" gets before its gradient
        def per_device(A, X, Y):                         # this rank's stage; this copy's microbatches
            A = cast(A[0])
            X, Y, rank = X[0], Y[0], lax.axis_index("rank")

            def copy_loss(A):                            # lesson 9's forward_all, the loss on the last rank
                def tick(x_in, t):
                    y = jnp.tanh(jnp.where(rank == 0, X[jnp.clip(t, 0, m - 1)], x_in) @ A)
                    y = jnp.where((t >= rank) & (t - rank < m), y, 0.0)
                    return lax.ppermute(y, "rank", [(0, 1)]), y
                start = vary(vary(jnp.zeros((n, d)), "rank"), "data")
                _, ys = lax.scan(tick, start, jnp.arange(m + p - 1))
                return lax.psum(jnp.where(rank == p - 1, jnp.mean((ys[p - 1:] - Y) ** 2), 0.0), "rank")
            return lax.pmean(jax.grad(copy_loss)(A), "data")[None]   # the copies' gradients, averaged
        mesh = Mesh(np.array(jax.devices()[:dp * p]).reshape(dp, p), ("data", "rank"))
        return jax.jit(shard_map(per_device, mesh, (P("rank"), P("data"), P("data")), P("rank")))(As, X, Y)

    def whole(As):                                       # one device, the whole batch
        h = X.reshape(-1, n, d)
        for A in As:
            h = jnp.tanh(h @ A)
        return jnp.mean((h - Y.reshape(-1, n, d)) ** 2)
    reference = jax.grad(whole)(As)
    np.testing.assert_allclose(step(lambda A: vary(A, "data")), reference, rtol=1e-5, atol=1e-6)
    # passed whole over "data", the weight's gradient is summed over the copies before the pmean: 2x
    np.testing.assert_allclose(step(lambda A: A), dp * reference, rtol=1e-5, atol=1e-6)


def test_dropout_keys_repeat_for_the_same_step_stage_and_microbatch_and_differ_otherwise():
    """The package's keys (runtime.stages.dropout_keys: the step's key folded with microbatch j, then with
    the part, as StagedModel.apply_part draws), which lesson 10's fold_in recipe describes."""
    def mask(step, part, j):
        key = jax.random.fold_in(dropout_keys(7, step, m)[j], part)
        return jax.random.bernoulli(key, 0.9, (samples, d))
    assert (mask(0, 1, 3) == mask(0, 1, 3)).all()                          # F and its rerun agree
    for other in (mask(0, 1, 4), mask(0, 2, 3), mask(1, 1, 3)):           # another microbatch, part, step
        assert (mask(0, 1, 3) != other).any()


def test_nnx_split_and_merge_carry_a_modules_arrays_and_rebuild_it():
    layer = nnx.Linear(d, d, rngs=nnx.Rngs(0))
    structure, state = nnx.split(layer)
    assert {a.shape for a in jax.tree.leaves(state)} == {(d,), (d, d)}   # the bias and the weight ("kernel")
    x = jax.random.normal(jax.random.key(1), (samples, d))
    np.testing.assert_allclose(nnx.merge(structure, state)(x), layer(x), rtol=1e-6)


def test_the_tick_table_written_in_the_lesson_is_what_the_package_prints():
    """Lesson 10 writes ZB-V's tick 14 into its source (read on GitHub, no cell has run): the same lines as
    ``ex.tick_messages(vz, 14, reads=False)`` prints."""
    import zbpp_lite as zb
    from pathlib import Path

    source = (Path(__file__).parent.parent / "notebooks" / "10_spmd_v.md").read_text(encoding="utf-8")
    written = source.split("```text\n")[1].split("```")[0].rstrip("\n").splitlines()
    assert written == ex.tick_messages(zb.build_schedule("zb-v", p, m), 14, reads=False).splitlines()

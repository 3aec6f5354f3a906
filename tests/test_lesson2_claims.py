"""Lesson 2's claims over many cases (the lesson shows one each): a W that recomputes B's chain costs L - 1
more products (XLA's counts, L = 1 to 5); fusion starts no action later, fuses rank 0 only, and gives ZB-H1
exactly one saving where T_W <= T_F; a fused schedule's makespan over 1F1B's never falls as the split's
price rises. Source: arXiv 2401.10241 section 2 (B, W), section 3 (ZB-H1, ZB-H2)."""

from __future__ import annotations

import itertools

import pytest

import zbpp_lite as zb

COSTS = ((1, 1, 1), (1.2, 1.5, 0.8), (1, 0.5, 1.5))
"""(T_F, T_B, T_W): equal, T_W <= T_F, and T_W > T_F."""


def _stack_flops(layers: int, n: int = 16, d: int = 32) -> dict[str, float]:
    """XLA's flop counts for ``layers`` linear layers of width d on n tokens, in 2nd^2 products."""
    import jax
    import jax.numpy as jnp

    from zbpp_lite.runtime.split import compiled_flops

    ws = [jax.random.normal(jax.random.PRNGKey(k), (d, d)) for k in range(layers)]
    acts = [jnp.ones((n, d))]
    for w in ws[:-1]:
        acts.append(acts[-1] @ w)                 # the layer inputs F keeps

    def grads_out(g):                             # B's chain: every layer's output gradient
        out = [g]
        for w in ws[:0:-1]:
            out.insert(0, out[0] @ w.T)
        return out

    def forward(x):
        for w in ws:
            x = x @ w
        return x

    def w_kept(dys):
        return [a.T @ dy for a, dy in zip(acts, dys)]

    g, unit = jnp.ones((n, d)), 2 * n * d ** 2
    return {"F": compiled_flops(forward, acts[0]) / unit,
            "B": compiled_flops(lambda g: grads_out(g)[0] @ ws[0].T, g) / unit,
            "W kept": compiled_flops(w_kept, grads_out(g)) / unit,
            "W recomputing": compiled_flops(lambda g: w_kept(grads_out(g)), g) / unit}


@pytest.mark.parametrize("layers", range(1, 6))
def test_a_recomputing_w_costs_l_minus_1_more_products(layers):
    expected = {"F": layers, "B": layers, "W kept": layers, "W recomputing": 2 * layers - 1}
    assert _stack_flops(layers) == expected


def _starts(timeline):                            # action -> its start; a fused BW stands for its B
    return {(e.action.stage, e.action.microbatch, "B" if e.action.kind == "BW" else e.action.kind): e.start
            for e in timeline.events}


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_fusion_starts_nothing_later_fuses_rank_0_only_and_zb_h1_gains_one_saving(name):
    long_w = set()                                # savings gained where T_W > T_F
    for (f, b, w), frac, p, m in itertools.product(COSTS, (0.55, 0.7, 0.85, 1.0), range(2, 6), (1, 2, 3, 5, 8, 12)):
        c = zb.Costs(f=f, b=b, w=w, bw=frac * (b + w))
        plain, fused = (zb.simulate(zb.build_schedule(n, p, m), c) for n in (name, name + "+fuse"))
        before, after = _starts(plain), _starts(fused)
        assert all(t <= before[k] + 1e-9 for k, t in after.items()), (p, m, c)
        kinds = [{e.action.kind for e in fused.rank_events(r)} for r in range(p)]
        assert kinds[0] == {"F", "BW"} and all("BW" not in k for k in kinds[1:]), (p, m)
        if name == "zb-h1" and frac < 1:
            gained = (plain.makespan - fused.makespan) / (b + w - c.bw)
            if w <= f:
                assert abs(gained - 1) < 1e-9, (p, m, c)
            else:
                long_w.add(round(gained, 3))
    if name == "zb-h1":
        assert min(long_w) < 1 < max(long_w)      # with T_W > T_F the gain is not one saving


@pytest.mark.parametrize("name", ["zb-h1+fuse", "zb-h2+fuse"])
def test_a_fused_schedule_over_1f1b_never_falls_as_the_price_rises(name):
    measured = zb.Costs(f=[1.0, 1.1], b=[1.0, 1.2], w=[0.8, 0.9], bw=[1.5, 1.8])
    pairs = [tuple(zb.simulate(zb.build_schedule(n, 2, 8), measured.with_split_price(1 + k / 100)).makespan
                   for n in (name, "1f1b")) for k in range(31)]
    assert len({base for _, base in pairs}) == 1            # 1F1B runs fused backwards only
    ratios = [ms / base for ms, base in pairs]
    assert ratios == sorted(ratios) and ratios[0] < 1


def test_exercise_2_3s_reveal_gives_xlas_counts_at_the_checks_ratio():
    from zbpp_lite import course as ex

    text = ex.REVEALS["2.3"](None)
    assert "B 36864 flops, F 102400 flops, ratio 0.360" in text and 36864 / 102400 == (64 * 16 + 16 * 8) / (
        32 * 64 + 64 * 16 + 16 * 8)                        # the check's ratio at the reveal's widths

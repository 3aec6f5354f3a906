"""The fusion pass (issue 32): a B right before its own W runs as one BW where no other rank waits
for the B; ``NAME+fuse`` builds it for any registered schedule."""

from __future__ import annotations

import random

import pytest

import zbpp_lite as zb
from zbpp_lite.schedules.fuse import fuse_adjacent, split_fused
from zbpp_lite.schedules.ir import Schedule

GRID = [(1, 3), (2, 2), (2, 8), (3, 6), (4, 4), (4, 12), (5, 10)]


def _built(name: str, p: int, m: int):
    try:
        return zb.build_schedule(name, p, m), zb.build_schedule(name + "+fuse", p, m)
    except ValueError as e:  # a size the builder cannot support: refused alike, fused or not
        with pytest.raises(ValueError, match="."):
            zb.build_schedule(name, p, m)
        assert len(str(e)) > 20
        return None


def _starts(timeline) -> dict:
    """Start times by (stage, microbatch, kind), a fused BW standing for its B."""
    return {(e.action.stage, e.action.microbatch, "B" if e.action.kind == "BW" else e.action.kind): e.start
            for e in timeline.events}


@pytest.mark.parametrize("name", list(zb.SCHEDULES))
def test_every_fused_builder_validates_and_is_never_slower_when_bw_is_cheaper(name):
    rng = random.Random(32)
    for p, m in GRID:
        pair = _built(name, p, m)
        if pair is None:
            continue
        plain, fused = pair
        zb.validate(fused)
        assert fused.name == plain.name + "+fuse" and fused.placement == plain.placement
        bws = [sum(a.kind == "BW" for _, a in s) for s in (plain, fused)]
        assert len(fused) == len(plain) - (bws[1] - bws[0])  # each fusion: two actions become one
        for _ in range(4):
            f, b, w = (rng.uniform(0.2, 2.0) for _ in range(3))
            costs = zb.Costs(f=f, b=b, w=w, bw=rng.uniform(0.5, 1.0) * (b + w), comm=rng.choice([0.0, 0.3]))
            before, after = zb.simulate(plain, costs), zb.simulate(fused, costs)
            assert after.makespan <= before.makespan + 1e-9
            assert all(a <= b + 1e-9 for a, b in zip(after.peak_memory, before.peak_memory))
            starts = _starts(before)  # every event of every rank starts no later (a BW as its B)
            assert all(start <= starts[k] + 1e-9 for k, start in _starts(after).items())
        assert fuse_adjacent(fused).actions == fused.actions  # nothing left to fuse
        zb.simulate(fused, lockstep=True)  # runs as one SPMD program too (there a longer tick may cost)


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("m", [2, 4, 8, 9])
def test_at_p2_every_b_on_rank_0_is_fused(name, m):
    plain, fused = zb.build_schedule(name, 2, m), zb.build_schedule(name + "+fuse", 2, m)
    assert {a.kind for a in fused.rank_actions(0)} == {"F", "BW"}
    assert [a.microbatch for a in fused.rank_actions(0) if a.kind == "BW"] == [
        a.microbatch for a in plain.rank_actions(0) if a.kind == "B"]
    assert fused.actions[1] == plain.actions[1]  # rank 1's B sends to rank 0: left split
    # with a fused BW cheaper than B + W, rank 0 saves T_B + T_W - T_BW per microbatch of work
    costs = zb.Costs(f=1.0, b=1.0, w=1.0, bw=1.6)
    assert zb.simulate(fused, costs).busy[0] == pytest.approx(m * (1.0 + 1.6))


def test_the_rule_on_literal_actions():
    # rank 1's B(1, 0) is needed by rank 0's B(0, 0): kept; rank 0's B(0, 0) sends nothing: fused;
    # rank 0's B(0, 1) is not right before its own W: kept
    rank_1 = ["1F0", "1I0", "1W0", "1F1", "1I1", "1W1"]
    s = Schedule.from_rows([["0F0", "0F1", "0I1", "0I0", "0W0", "0W1"], rank_1], name="x")
    fused = fuse_adjacent(s)
    assert fused.to_rows() == [["0F0", "0F1", "0I1", "0B0", "0W1"], rank_1]
    assert fused.name == "x+fuse" and fuse_adjacent(Schedule.from_rows([["0F0", "0I0", "0W0"]])).name == ""
    # V placement: stage 2's gradient goes to stage 1 on the same rank, so B(2, 0) fuses there
    v = Schedule.from_rows([["0F0", "3F0", "3I0", "3W0", "0I0", "0W0"],
                            ["1F0", "2F0", "2I0", "2W0", "1I0", "1W0"]])
    assert fuse_adjacent(v).to_rows() == [["0F0", "3F0", "3I0", "3W0", "0B0"],
                                          ["1F0", "2F0", "2B0", "1I0", "1W0"]]
    zb.validate(fuse_adjacent(v))


def test_fused_names_take_the_builders_options():
    costs = zb.Costs(f=1.0, b=1.0, w=1.0, bw=1.5)
    s = zb.build_schedule("zb-auto+fuse", 2, 4, costs=costs, memory_limit=2.0)
    assert s.name == "zb-auto+fuse" and max(zb.simulate(s, costs).peak_memory) <= 2.0
    assert zb.build_schedule("ZB_H1+fuse", 2, 2).name == "zb-h1+fuse"
    assert zb.build_schedule("interleaved-1f1b+fuse", 2, 4, stages_per_rank=2).num_stages == 4


@pytest.mark.parametrize("name", ["zb-h3+fuse", "zb-h1+fuse+fuse", "zb-h1+fused", "+fuse"])
def test_bad_fused_names_are_refused_listing_the_valid_ones(name):
    with pytest.raises(ValueError) as e:
        zb.build_schedule(name, 2, 4)
    text = str(e.value)
    assert "\n" not in text and f"unknown schedule {name!r}" in text
    assert "zb-h1" in text and "NAME+fuse" in text
    with pytest.raises(ValueError, match="takes no option"):
        zb.build_schedule("zb-h1+fuse", 2, 4, costs=zb.Costs())


def test_plan_command_accepts_fused_names(capsys):
    from zbpp_lite.cli import main

    assert main(["plan", "-s", "zb-h1+fuse", "-p", "2", "-m", "4"]) == 0
    assert "zb-h1+fuse" in capsys.readouterr().out
    assert main(["plan", "-s", "zb-h3+fuse"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown schedule 'zb-h3+fuse'" in err[0]


def test_with_split_price_sets_each_stages_price_and_keeps_the_rest():
    c = zb.Costs(f=(1.0, 2.0), b=(2.0, 1.0), w=(1.0, 1.0), bw=(2.0, 1.5), comm=0.25, mem_b=3.0)
    priced = c.with_split_price(1.2)
    for s in range(2):
        assert (priced.b[s] + priced.w[s]) / priced.bw[s] == pytest.approx(1.2, rel=1e-12)
        assert priced.b[s] / priced.w[s] == pytest.approx(c.b[s] / c.w[s], rel=1e-12)  # scaled alike
    assert (priced.f, priced.bw, priced.comm, priced.mem_b, priced.mem_w) == (c.f, c.bw, c.comm, c.mem_b, c.mem_w)
    assert zb.Costs(b=1.0, w=1.0, bw=1.6).with_split_price(1.0) == zb.Costs(b=0.8, w=0.8, bw=1.6)  # scalars stay scalars


@pytest.mark.parametrize("costs, price, message", [
    (zb.Costs(), 1.1, "needs the fused backward's time"),
    (zb.Costs(bw=1.5), float("nan"), "price must be a finite number > 0"),
    (zb.Costs(bw=1.5), 0.0, "price must be a finite number > 0"),
    (zb.Costs(b=(1.0, 1.0), w=(1.0, 1.0, 1.0), bw=1.5), 1.1, "different numbers of stages"),
    (zb.Costs(b=0.0, w=0.0, bw=1.0), 1.1, "no split to price"),
])
def test_with_split_price_refuses_what_it_cannot_price(costs, price, message):
    with pytest.raises(ValueError, match=message):
        costs.with_split_price(price)


@pytest.mark.parametrize("name", ["zb-h1+fuse", "zb-h2+fuse"])
def test_a_dearer_split_never_shortens_the_step_and_a_free_one_beats_1f1b(name):
    # 1f1b runs fused backwards only: the price leaves it alone, and every action of the split
    # schedule lasts no shorter at a higher price, so its step against 1f1b's can only grow
    measured = zb.Costs(f=6.65, b=6.44, w=3.87, bw=8.92)  # the peer job's stage 0 on XLA:CPU, ms (issue 32)
    ratios = []
    for price in (1.0, 1.04, 1.08, 1.157, 1.3):
        c = measured.with_split_price(price)
        ratios.append(zb.simulate(zb.build_schedule(name, 2, 8), c).makespan
                      / zb.simulate(zb.build_schedule("1f1b", 2, 8), c).makespan)
    assert ratios == sorted(ratios) and ratios[0] < 0.96 and ratios[-1] > 1.0


@pytest.mark.parametrize("p, m", [(2, 2), (3, 6), (4, 4), (4, 8), (5, 10)])
def test_the_split_alone_saves_one_w_a_rank_on_1f1b_chain_of_backwards(p, m):
    """1F1B's order with each BW run as B then W: the previous rank gets B's output T_W sooner, so with
    T_BW = T_B + T_W the step is (p - 1) T_W shorter (arXiv 2401.10241 section 2)."""
    fused = zb.build_schedule("1f1b", p, m)
    split = zb.validate(split_fused(fused))
    assert split.name == "1f1b+split" and split.placement == fused.placement
    for a_row, b_row in zip(fused.actions, split.actions):
        assert [str(a) for a in b_row] == [s for a in a_row for s in (
            (f"{a.stage}I{a.microbatch}", f"{a.stage}W{a.microbatch}") if a.kind == "BW" else (str(a),))]
    costs = zb.Costs(f=1.0, b=1.0, w=0.5)
    assert zb.simulate(split, costs).makespan == zb.simulate(fused, costs).makespan - (p - 1) * 0.5
    assert fuse_adjacent(split).actions[0] == fused.actions[0]     # stage 0's B feeds no rank: fused back

"""Lesson 2's exercise checks (the backward split): one function per exercise, which says right or not yet
with a hint (:class:`zbpp_lite.course.checks.Verdict`)."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence


from .checks import Verdict, _function_check, _with_fresh


MLP_TOKENS, MLP_WIDTHS = 16, (32, 64, 32)
"""The two-layer MLP of notebook 02: 16 tokens, x (16, 32) @ weight1 (32, 64), then (16, 64) @ weight2
(64, 32)."""


FIRST_STAGE_WIDTHS = (32, 64, 16, 8)
"""Exercise 2.3's reveal: three layers ``z_l = a_l @ weight_l`` of these widths (2.1's convention)."""


def _matmul(rows: int, inner: int, cols: int) -> int:
    return 2 * rows * inner * cols  # one multiply and one add per term


WIDTH_LISTS = ((32, 64, 32), (8, 16, 4, 2), (3, 5, 7, 11, 13), (1, 1), (64, 256, 64, 256, 64, 16))
"""The widths lists exercises 2.1 and 2.2 try: one to five layers of uneven widths."""
MLP_RATIO = (32 + 64 + 64 + 32) / (32 + 64 + 64)
"""M_W / M_B of the lesson's two-layer GELU MLP: W reads x, a, dh, dy (192 floats a token), F keeps x, h, a
(160: GELU's derivative needs its input h)."""


def _layer_products(n: int, widths: Sequence[int]) -> list[int]:
    """Flops of each layer's weight-gradient product x_l.T @ dz_l, (d_l, n) @ (n, d_{l+1})."""
    return [_matmul(a, n, b) for a, b in itertools.pairwise(widths)]


def _widths_check(exercise: str, fn: Any, expected: Callable[[int, Sequence[int]], int], what: str,
                  hint: str) -> Verdict:
    points = [(n, list(w)) for n, w in itertools.product((16, 5), WIDTH_LISTS)]
    return _function_check(exercise, fn, points, lambda n, w: expected(n, tuple(w)), what, hint)


def mw_over_mb(fn: Any) -> Verdict:
    """Exercise 2.1: ``ratio(widths)``, M_W / M_B for ``len(widths) - 1`` layers ``z_l = a_l @ weight_l``
    (``widths[l]``: layer l's input width, ``widths[-1]``: the output width) with tanh between layers
    (``a_{l+1} = tanh(z_l)``, as lessons 8 to 10's), none after the last. F keeps only what B and W need
    (tanh's derivative, 1 - tanh(z)^2, reads its output: the next layer's input, kept anyway), B every output
    gradient; M_B is what F keeps, M_W what is held from B's end until W has run. Per token, so n cancels.
    Checked on :data:`WIDTH_LISTS`; the lesson's GELU MLP copied (keeping each z_l, its ratio, or its arrays
    counted alike at every depth) and M_W taken as M_B alone get their own messages. The derivation: the
    lesson's Solutions."""

    def held(w):  # F: a_0 .. a_{L-1}; W: a_l (w[l]) and dz_l (w[l+1]) for every layer
        return (sum(w[:-1]) + sum(w[1:])) / sum(w[:-1])

    points = [(list(w),) for w in WIDTH_LISTS]
    hint = ("list the arrays F keeps (which does B still need, which W?) and the arrays W reads: its "
            "operands a_l and dz_l; which of W's were never part of M_B?")
    copied = [(lambda w: MLP_RATIO, f"{MLP_RATIO} is the lesson's two-layer GELU MLP, [32, 64, 32]: other "
                                    "widths, depths and activations give other ratios."),
              (lambda w: (sum(w[:-1]) + sum(w[1:])) / (sum(w[:-1]) + sum(w[1:-1])),
               "that keeps each z_l (or tanh's output) besides the layer inputs, as the lesson's GELU MLP "
               "keeps h: tanh's derivative reads its output, which is the next layer's input, kept once."),
              (lambda w: (w[0] + 2 * w[1] + w[-1]) / (w[0] + 2 * w[1]),
               "that counts the two-layer GELU MLP's arrays (x, a, dh, dy against x, h, a) at every depth: "
               "a stack of L layers keeps L layer inputs, and B hands W L output gradients."),
              (lambda w: 1.0, "that is M_W as what F kept alone: W reads all of it, and B's output "
                              "gradients besides.")]
    return _function_check("2.1", fn, points, lambda w: held(tuple(w)), "ratio(widths)", hint, known=copied)


def w_flops_without_kept_gradients(fn: Any) -> Verdict:
    """Exercise 2.2: ``w_flops_recompute(n, widths)``, W's matmul flops on 2.1's stack when B keeps the
    output gradients of the even layers (0, 2, ...) only, so W rebuilds each odd layer's from the one
    after it (activation derivative not counted); (r, k) @ (k, c) counts 2 r k c."""

    def recompute(n, w):
        layers = len(w) - 1
        back = [_matmul(n, w[k + 2], w[k + 1]) for k in range(1, layers - 1, 2)]  # dz_{l+1} @ weight_{l+1}.T
        return sum(_layer_products(n, w)) + sum(back)

    return _widths_check("2.2", fn, recompute, "w_flops_recompute(n, widths)",
                         "which output gradients does W now lack, and from which kept array is each "
                         "cheapest to rebuild? Price each rebuild as B would, and ask for every layer "
                         "where its output gradient comes from at the edge of the stage.")


def first_stage_b_ratio(fn: Any) -> Verdict:
    """Exercise 2.3: ``first_stage_ratio(widths)``, on the *first* stage (no dx needed) B's matmul flops over
    F's for ``len(widths) - 1`` layers ``z_l = a_l @ weight_l`` without tanh (2.1's convention; the tokens
    cancel). Checked on :data:`FIRST_STAGE_WIDTHS` (the reveal's), :data:`WIDTH_LISTS` past one layer and
    three lists drawn afresh, the package out of bounds; a middle stage's ratio, and one that counts every
    layer's products as equal, get their own messages. The derivation: the lesson's Solutions."""
    def ratio(w):
        products = [a * b for a, b in itertools.pairwise(w)]
        return sum(products[1:]) / sum(products)

    hint = ("ask who reads each of B's products: W, or the previous stage. On the first stage one of "
            "those readers is missing; which products served only it, and how large are they beside the "
            "others?")
    known = [(lambda w: 1.0,
              "1 is a middle stage's B, a product per layer as F has: the first stage skips one."),
             (lambda w: (len(w) - 2) / (len(w) - 1),
              "(layers - 1)/layers counts the products as equal: they are not, and the one skipped is not "
              "the smallest.")]
    fixed = [(list(w),) for w in (FIRST_STAGE_WIDTHS, *WIDTH_LISTS) if len(w) > 2]

    def draw(rng):   # two to five layers of widths 1 to 128
        return ([rng.randint(1, 128) for _ in range(rng.randint(3, 6))],)

    return _function_check("2.3", fn, _with_fresh(fixed, draw, 3), lambda w: ratio(w),
                           "first_stage_ratio(widths)", hint, known=known)


EXERCISES: dict[str, Callable[[Any], Verdict]] = {
    "2.1": mw_over_mb, "2.2": w_flops_without_kept_gradients, "2.3": first_stage_b_ratio
}
"""Lesson 2's exercises by id -> check."""

def _reveal_first_stage() -> str:
    """Exercise 2.3's reveal: XLA's matmul flop counts (:func:`~zbpp_lite.runtime.split.compiled_flops`) of
    F and of the first stage's B on :data:`FIRST_STAGE_WIDTHS`, ``MLP_TOKENS`` tokens, and their ratio."""
    import jax.numpy as jnp

    from ..runtime.split import compiled_flops

    weights = [jnp.ones((a, b)) for a, b in itertools.pairwise(FIRST_STAGE_WIDTHS)]

    def forward(ws, a):
        for w in ws:
            a = a @ w
        return a

    def first_b(ws, dz):                          # each layer's output gradient, from the last one down
        grads = [dz]
        for w in ws[:0:-1]:
            grads.insert(0, grads[0] @ w.T)
        return grads

    f = compiled_flops(forward, weights, jnp.ones((MLP_TOKENS, FIRST_STAGE_WIDTHS[0])))
    b = compiled_flops(first_b, weights, jnp.ones((MLP_TOKENS, FIRST_STAGE_WIDTHS[-1])))
    return f"XLA: B {b:.0f} flops, F {f:.0f} flops, ratio {b / f:.3f}"


REVEALS: dict[str, Callable[[Any], Any]] = {"2.3": lambda answer: _reveal_first_stage()}
"""Predict-first exercise id -> the simulation its reveal cell draws."""

__all__ = [
    "MLP_TOKENS", "FIRST_STAGE_WIDTHS", "WIDTH_LISTS", "MLP_RATIO", "mw_over_mb",
    "w_flops_without_kept_gradients", "first_stage_b_ratio", "EXERCISES", "REVEALS"
]

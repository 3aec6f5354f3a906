"""Lesson 2's exercise checks (the backward split): one function per exercise, which says right or not yet
with a hint (:class:`zbpp_lite.course.checks.Verdict`)."""

from __future__ import annotations

import itertools
from typing import Any, Callable


from .checks import Verdict, _function_check, _function_missing, _shown, _unanswered, _with_fresh


MLP_TOKENS, MLP_WIDTHS = 16, (32, 64, 32)
"""The two-layer MLP of notebook 02: 16 tokens, x (16, 32) @ weight1 (32, 64), then (16, 64) @ weight2
(64, 32)."""


FIRST_STAGE_WIDTHS = (32, 64, 16, 8)
"""Exercise 2.3's reveal: three layers ``z_l = a_l @ weight_l`` of these widths (2.1's convention)."""


WIDTH_LISTS = ((32, 64, 32), (8, 16, 4, 2), (3, 5, 7, 11, 13), (1, 1), (64, 256, 64, 256, 64, 16))
"""The widths lists exercises 2.1 and 2.3 try: one to five layers of uneven widths."""
MLP_RATIO = (32 + 64 + 64 + 32) / (32 + 64 + 64)
"""M_W / M_B of the lesson's two-layer GELU MLP: W reads x, a, dh, dy (192 floats a token), F keeps x, h, a
(160: GELU's derivative needs its input h)."""


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


TIED_SHAPES = ((16, 32, 64), (5, 3, 7))
"""Exercise 2.2's cases (tokens n, width d, hidden width k): x (n, d), weight (d, k), h = tanh(x @ weight)
(n, k), y = h @ weight.T and dy (n, d)."""


def _tied_case(n: int, d: int, k: int, seed: int = 2) -> tuple:
    """``x, weight, h, dy`` for exercise 2.2 and ``jax.vjp``'s ``(dx, d_weight)`` (float32)."""
    import jax
    import jax.numpy as jnp

    kx, kw, ky = jax.random.split(jax.random.PRNGKey(seed), 3)
    x, dy = jax.random.normal(kx, (n, d)), jax.random.normal(ky, (n, d))
    weight = jax.random.normal(kw, (d, k)) / jnp.sqrt(d)
    h = jnp.tanh(x @ weight)
    _, pullback = jax.vjp(lambda x, w: jnp.tanh(x @ w) @ w.T, x, weight)
    return x, weight, h, dy, pullback(dy)


def tied_split(pair: Any) -> Verdict:
    """Exercise 2.2: B and W by hand for a stage that uses one weight twice, ``y = tanh(x @ weight) @
    weight.T`` (a tied pair, as a tied embedding and head are: Press and Wolf, EACL 2017). ``pair`` is
    ``(tied_b, tied_w)``: ``tied_b(weight, h, dy) -> (dx, handover)`` and ``tied_w(x, h, handover) ->
    d_weight``, with ``h = tanh(x @ weight)`` kept by F; shapes in :data:`TIED_SHAPES`. Right when, at each
    shape, dx and d_weight equal ``jax.vjp``'s within 1e-5 (relative to the largest entry, float32), B and
    W each run at most two matrix products (B: dh and dx, the weight's gradient being W's work; W: nothing
    of B's again), and neither calls JAX's differentiation. W giving one use's gradient alone, or a
    gradient of the transposed shape, gets its own message."""
    import jax
    import jax.numpy as jnp

    from . import bench

    hint = ("a weight used twice gets the sum of its two uses' gradients. Which of them needs dy itself, "
            "and so what must B hand W besides dz?")
    if _unanswered(pair):
        return Verdict("2.2", False, "no answer yet: write tied_b and tied_w, and pass (tied_b, tied_w).")
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        return Verdict("2.2", False, f"expected the pair (tied_b, tied_w), got {_shown(pair)}.", hint,
                       attempt=False)
    tied_b, tied_w = pair
    for name, fn in (("tied_b", tied_b), ("tied_w", tied_w)):
        missing = _function_missing("2.2", fn, hint, name=f"{name}'s body")
        if missing is not None:
            return missing
    refused = (jax.grad, jax.vjp, jax.value_and_grad, jax.linearize, jax.linear_transpose)
    rel = lambda got, ref: float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))  # noqa: E731
    for n, d, k in TIED_SHAPES:
        x, weight, h, dy, (dx_ref, dw_ref) = _tied_case(n, d, k)
        where = f"with x ({n}, {d}) and weight ({d}, {k})"
        program, out, why = bench._traced_run(tied_b, (weight, h, dy), 2, refused)
        if why is not None:
            return _tied_refusal("tied_b", why, where, "(dx, handover)", hint)
        dx, handover = out
        if getattr(dx, "shape", None) != (n, d):
            return Verdict("2.2", False, f"{where} tied_b's dx has shape {getattr(dx, 'shape', None)}; x's "
                           f"is {(n, d)}.", hint)
        products = bench._products(program.jaxpr)
        if products > 2:
            return Verdict("2.2", False, f"{where} tied_b runs {products} matrix products; the previous "
                           "stage waits for two (dh, then dx): the weight's gradient is W's work.", hint)
        if rel(dx, dx_ref) > 1e-5:
            return Verdict("2.2", False, f"{where} tied_b's dx differs from jax.vjp's by "
                           f"{rel(dx, dx_ref):.2g} (relative).", hint)
        program, out, why = bench._traced_run(lambda *a: (tied_w(*a),), (x, h, handover), 1, refused)
        if why is not None:
            return _tied_refusal("tied_w", why, where, "d_weight", hint)
        dw, products = out[0], bench._products(program.jaxpr)
        if products > 2:
            return Verdict("2.2", False, f"{where} tied_w runs {products} matrix products: it redoes B's "
                           "work. Hand W what B made instead.", hint)
        if getattr(dw, "shape", None) != (d, k):
            return Verdict("2.2", False, f"{where} tied_w returned shape {getattr(dw, 'shape', None)}; the "
                           f"weight's is {(d, k)}: the second use, y = h @ weight.T, takes its gradient "
                           "transposed.", hint)
        dz = (dy @ weight) * (1 - h ** 2)
        for part, said in ((x.T @ dz, "the first use's gradient alone, x.T @ dz"),
                           (dy.T @ h, "the second use's gradient alone, dy.T @ h")):
            if rel(dw, part) < 1e-5:
                return Verdict("2.2", False, f"{where} tied_w gives {said}: the weight is used twice.", hint)
        if rel(dw, dw_ref) > 1e-5:
            return Verdict("2.2", False, f"{where} tied_w's d_weight differs from jax.vjp's by "
                           f"{rel(dw, dw_ref):.2g} (relative).", hint)
        if (n, d, k) == TIED_SHAPES[0]:
            floats = sum(int(jnp.size(a)) for a in jax.tree_util.tree_leaves(handover)) // n
    return Verdict("2.2", True, f"dx and d_weight equal jax.vjp's at both shapes, and B runs two products. "
                   f"B hands W {floats} floats a token at d = {TIED_SHAPES[0][1]}, k = {TIED_SHAPES[0][2]}; "
                   "W also reads x and h, kept by F.")


def _tied_refusal(name: str, why: Any, where: str, returns: str, hint: str) -> Verdict:
    """Exercise 2.2's verdict for a B or W that could not be read (:func:`bench._traced_run`'s ``why``)."""
    if why is ...:
        return Verdict("2.2", False, f"no answer yet: {name} returned None; replace its ... .",
                       attempt=False)
    if why.get("copied"):
        return Verdict("2.2", False, f"{name} calls jax.{why['copied']}: write the products yourself.", hint)
    if why.get("shape"):
        return Verdict("2.2", False, f"{where} {name} returned a {why['shape']}; expected {returns}.", hint)
    return Verdict("2.2", False, f"{where} {name} raised {why['error']}", hint)


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
    "2.1": mw_over_mb, "2.2": tied_split, "2.3": first_stage_b_ratio
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
    "MLP_TOKENS", "FIRST_STAGE_WIDTHS", "WIDTH_LISTS", "MLP_RATIO", "mw_over_mb", "TIED_SHAPES",
    "tied_split", "first_stage_b_ratio", "EXERCISES", "REVEALS"
]

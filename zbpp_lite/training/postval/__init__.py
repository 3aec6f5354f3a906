"""The optimizer step and post-validation (Qi et al., arXiv 2401.10241, section 4).

- :mod:`.rollback`: ``AdamWConfig`` and the exact in-place rollback of an AdamW step;
- :mod:`.optimizer`: ``StageOptimizer``, AdamW inside the rank threads (plain, synchronous, post-validated),
  and its host-side reference, ``synchronous_step``.

May import: the layers below :mod:`zbpp_lite.training`.
"""

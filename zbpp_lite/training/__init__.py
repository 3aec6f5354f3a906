"""Layer 4, training: the job the pipeline trains, and the loops that train it.

- :mod:`.data`: scikit-learn's digits as 8 row tokens, batches, a held-out split;
- :mod:`.model`: the digits Transformer (Flax NNX), the job of the course and the benchmarks, and
  ``ModelConfig`` / ``RunConfig``;
- :mod:`.reference`: the one single-device reference: the unpartitioned model's loss and
  gradients, evaluation, AdamW, the whole-batch step and the one-rank schedule every speed-up is
  measured against;
- :mod:`.train`: ``train``, any schedule on N devices, measured and checked against the reference;
- :mod:`.spmd`: training with the compiled SPMD executor;
- :mod:`.postval`: the optimizer step inside the rank threads, with post-validation and rollback;
- :mod:`.adapt`: measure, attribute, rebalance and re-plan, then train (the adaptive loop).

May import: :mod:`zbpp_lite.schedules`, :mod:`zbpp_lite.runtime`, :mod:`zbpp_lite.analysis`.
"""

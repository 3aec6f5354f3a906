"""Layer 4, training: the job the pipeline trains, and the loops that train it.

- :mod:`.data`: scikit-learn's digits as 8 row tokens, batches, a held-out split;
- :mod:`.model`: the digits Transformer (Flax NNX), ``ModelConfig`` / ``RunConfig``;
- :mod:`.reference`: the single-device reference: loss and gradients, evaluation, AdamW, baselines;
- :mod:`.train`: ``train``, any schedule on N devices, measured and checked against the reference;
- :mod:`.spmd`: training with the compiled SPMD executor;
- :mod:`.postval`: the optimizer step inside the rank threads, with post-validation and rollback;
- :mod:`.adapt`: measure, attribute, rebalance and re-plan, then train (the adaptive loop).

May import: :mod:`zbpp_lite.schedules`, :mod:`zbpp_lite.runtime`, :mod:`zbpp_lite.analysis`.
"""

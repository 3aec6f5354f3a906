"""Layer 4, training: the job the pipeline trains, and the loops that train it.

- :mod:`.data`: scikit-learn's digits as 8 row tokens, batches, a held-out split; the GPT's bytes of
  Python's standard library source, split by file (``load_data`` picks the model's);
- :mod:`.model`: the digits Transformer and the GPT (Flax NNX), ``ModelConfig`` / ``GPTConfig`` /
  ``RunConfig``;
- :mod:`.reference`: the single-device reference: loss and gradients, evaluation, AdamW, baselines;
- :mod:`.train`: ``train``, any schedule on N devices, measured and checked against the reference;
- :mod:`.spmd`: training with the compiled SPMD executor;
- :mod:`.postval`: the optimizer step inside the rank threads, with post-validation and rollback;
- :mod:`.adapt`: measure, attribute, rebalance and re-plan, then train (the adaptive loop).

May import: :mod:`zbpp_lite.schedules`, :mod:`zbpp_lite.runtime`, :mod:`zbpp_lite.analysis`.
"""

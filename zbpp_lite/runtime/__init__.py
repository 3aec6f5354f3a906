"""Layer 2, runtime: a schedule run for real on JAX devices.

- :mod:`.devices`: simulated CPU devices, accelerators, enough-device checks;
- :mod:`.split`: the backward split, a stage's F, B, W and fused BW as jitted functions;
- :mod:`.stages`: ``StagedModel``, any list of NNX modules and a loss cut into stages;
- :mod:`.executor`: ``PipelineExecutor``, one thread a rank, measuring a ``Timeline``; ``run_schedule``;
- :mod:`.transport`: ``Transfer``, ``OptimizerMessage``, ``Inbox``, the ``Transport`` protocol, ``Threads``;
- :mod:`.step`: a step's state and result; the optimizer the rank threads step (``RankUpdate``);
- :mod:`.processes`: one pinned process per rank, shared-memory rings and sockets (``Rings``);
- :mod:`.distributed` / :mod:`.cluster`: JAX's distributed runtime across hosts (``process_executor``);
- :mod:`.wire`: JSON and raw NumPy bytes across processes (never pickles);
- :mod:`.spmd`: a schedule compiled into one ``shard_map`` program (lockstep).

May import: :mod:`zbpp_lite.schedules`, JAX, Flax, Optax, NumPy; nothing above.
"""

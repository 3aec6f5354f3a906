"""Layer 2, runtime: a schedule run for real on JAX devices.

- :mod:`.devices`: simulated CPU devices, accelerators, and the checks that there are enough;
- :mod:`.split`: the backward split, a stage's F, B, W and fused BW as jitted functions;
- :mod:`.stages`: ``StagedModel``, any list of NNX modules and a loss cut into stages;
- :mod:`.executor`: ``PipelineExecutor``, the one rank loop: any schedule on several devices,
  one thread a rank, measuring a ``Timeline`` of the simulator's type; ``run_schedule``;
- :mod:`.transport`: what ranks send each other (``Transfer``, ``OptimizerMessage``: named
  records, JSON on the wire), the ``Inbox`` a rank's inputs wait in, and the transports;
- :mod:`.processes`: one pinned process per rank, joined by shared-memory rings and pipes (the
  ``Carrier`` transport's other end);
- :mod:`.distributed`: JAX's distributed runtime and the transport across hosts
  (``process_executor``);
- :mod:`.cluster`: joining a run on several hosts (addresses, cluster detection, the runtime's
  fatal errors in one line);
- :mod:`.wire`: what crosses a process boundary, as JSON and raw NumPy bytes (never pickles);
- :mod:`.spmd`: a schedule compiled into one ``shard_map`` program (lockstep).

May import: :mod:`zbpp_lite.schedules`, JAX, Flax, Optax, NumPy; nothing above.
"""

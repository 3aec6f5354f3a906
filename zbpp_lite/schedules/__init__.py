"""Layer 1, schedules: what a pipeline does and how long it takes, in pure Python.

- :mod:`.strict_json`: the one JSON writer (NaN and infinity written as null, and listed);
- :mod:`.ir`: ``Action``, ``Overlap``, ``Schedule``, placements, dependencies, PyTorch's text and CSV forms;
- :mod:`.program`: ``lower`` a schedule to a ``Program``, per rank its compute, ``Send`` and ``Recv``;
- :mod:`.costs`: ``Costs`` (T_F, T_B, T_W, T_BW, T_F&B, T_comm, M_B, M_W), per stage;
- :mod:`.memory`: ``MeasuredMemory``, the activation bytes each rank held in a measured step;
- :mod:`.timeline`: ``Timeline`` and ``Event``, planned or measured;
- :mod:`.validate`: completeness, order and deadlock freedom, of a schedule or a program;
- :mod:`.simulate`: event-driven timing of the lowered program (and lockstep) under costs;
- :mod:`.fuse`: a B right before its own W run as one BW (``NAME+fuse``);
- :mod:`.formulas`: the papers' closed forms the simulator is checked against;
- :mod:`.builders`: one module per schedule family and the registry (on top: they plan by simulating).

May import nothing of zbpp_lite outside this package, and never JAX (a test checks both).
"""

"""Profiling: where the measured costs come from.

- :mod:`.timelines`: costs read off measured timelines (pure Python), T_comm from the waits;
- :mod:`.parts`: each model part's F, B, W timed on a device (for the rebalancer);
- :mod:`.device`: each stage's F, B, W (and BW) timed on one accelerator (the 1-chip path).

May import: :mod:`zbpp_lite.schedules`, :mod:`zbpp_lite.runtime`, :mod:`zbpp_lite.analysis`.
"""

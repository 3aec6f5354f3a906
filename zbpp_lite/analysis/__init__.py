"""Layer 3, analysis: what a measured run says, and what to change.

- :mod:`.profiling`: costs from measured timelines, and model parts and stages timed on a device;
- :mod:`.attribute`: every idle gap of a timeline attributed to a cause and a stage;
- :mod:`.rebalance`: moving layers between stages from measured per-part costs;
- :mod:`.replan`: re-planning the automatic scheduler from measured costs, online drift checks.

May import: :mod:`zbpp_lite.schedules` and :mod:`zbpp_lite.runtime`; never training, viz or cli.
"""

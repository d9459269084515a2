"""Layout: WHERE things run. The pipeline's shape and its rules, as data and arithmetic.

- :mod:`.topology`: the world as a ``pp x dp`` grid, neighbours, process groups.
- :mod:`.partition`: ordered layers cut into ``pp * vpp`` chunks.
- :mod:`.placement`: which layers and tied groups each rank holds (from the schedule's placement).
- :mod:`.rules`: every validity rule of a shape, each with its message and fix.
- :mod:`.recompute_spec`: what a ``recompute=`` / ``activation_budget=`` setting means.
- :mod:`.plan`: :class:`~lightning_pp.layout.plan.PipelinePlan`, the one frozen object that
  holds the defaults and applies the rules (the strategy, every CLI command and the planner
  build one).

May import: :mod:`lightning_pp.schedules` only. The rules and the plan import nothing heavier
than the schedules at import time (``lightning-pp plan`` starts without torch); the partition
and the topology use torch when called.
"""

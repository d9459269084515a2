"""Where this rank sits in the job, learnt in phases: one small object the collaborators share.

A Lightning run learns its pipeline's shape in steps: the settings at ``Strategy.__init__``
(:attr:`RankLayout.plan`), the world at launch, the grid and its process groups once the default
group exists (:attr:`topology`, :attr:`groups`), the layers inside ``configure_model``
(:meth:`with_layers` sets the plan's split and :attr:`placement`). The strategy owns one
``RankLayout`` and hands it to whoever needs the shape (the stage builders, the steps, the model
summary) instead of handing them the strategy.

Example::

    layout = RankLayout(PipelinePlan.build(pp=2, microbatches=4).with_world(4))
    layout.topology = PipelineTopology.from_world(4, rank=3, pp=2)
    layout.with_layers(6)
    layout.local_layers()      # [3, 4, 5]: pp_rank 1 holds the second stage
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .placement import LayerPlacement
from .plan import PipelinePlan
from .topology import PipelineTopology, ProcessGroups

__all__ = ["RankLayout"]


@dataclass
class RankLayout:
    """The plan, the grid and the placement of one rank (see the module docstring). Fields are
    ``None`` until the run has learnt them; the accessors say which step is missing."""

    plan: PipelinePlan | None = None
    topology: PipelineTopology | None = None
    groups: ProcessGroups | None = None
    placement: LayerPlacement | None = None

    def with_layers(
        self,
        num_layers: int,
        *,
        layer_params: Sequence[int] | None = None,
        layer_costs: Sequence[float] | None = None,
    ) -> PipelinePlan:
        """The module has ``num_layers`` pipeline layers: cut them (the plan's rules) and place
        them (the schedule's placement); returns the refined plan."""
        plan = self.need_plan().with_layers(
            num_layers, layer_params=layer_params, layer_costs=layer_costs
        )
        assert plan.layer_ranges is not None
        self.plan = plan
        self.placement = LayerPlacement(plan.schedule, plan.layer_ranges)
        return plan

    def local_layers(self) -> list[int]:
        """The layer indices this rank holds, in local chunk order."""
        topo = self.need_topology()
        return [i for r in self.need_plan().stage_layers(topo.pp_rank) for i in r]

    def need_plan(self) -> PipelinePlan:
        if self.plan is None:
            raise RuntimeError("the pipeline plan is not built yet (PipelineStrategy.__init__)")
        return self.plan

    def need_topology(self) -> PipelineTopology:
        if self.topology is None:
            raise RuntimeError(
                "the process group must exist before the pipeline's grid is known "
                "(Strategy.setup_environment)"
            )
        return self.topology

    def need_groups(self) -> ProcessGroups:
        if self.groups is None:
            raise RuntimeError("the pipeline's process groups are not built yet")
        return self.groups

    def need_placement(self) -> LayerPlacement:
        if self.placement is None:
            raise RuntimeError("the layers are not placed yet: configure_model has not run")
        return self.placement

"""Which layers each pipeline rank holds, and which ranks share a tied weight: pure arithmetic.

The schedule owns placement (``Schedule.stage``/``locate``/``stages_of``: loop placement for
gpipe, 1f1b and interleaved, V placement for zbv); the partition owns the layer ranges of each
virtual stage. :class:`LayerPlacement` combines the two and answers the strategy's questions
without a process group, so it is unit-tested on its own (``tests/test_placement.py``).

Example:
    >>> from lightning_pp.schedules import build_schedule
    >>> place = LayerPlacement(build_schedule("interleaved", pp=4, microbatches=4, vpp=2),
    ...                        [range(2 * s, 2 * s + 2) for s in range(8)])
    >>> place.chunk_ranges(0)               # rank 0 holds stages 0 and 4
    [range(0, 2), range(8, 10)]
    >>> place.rank_of_layer(9), place.output_rank
    (0, 3)
    >>> place.tied_ranks([0, 15])           # embedding on rank 0, head on rank 3; rank 0 owns it
    ([0, 3], 0)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..schedules import Schedule

__all__ = ["LayerPlacement", "layer_of", "split_layer_name"]


class LayerPlacement:
    """The layer ranges of every virtual stage, placed on ranks by the schedule.

    Args:
        schedule: the schedule the pipeline runs (only its shape and placement are read).
        layer_ranges: one contiguous range of layer indices per virtual stage, in stage order
            (``pp * vpp`` of them, e.g. from
            :func:`~lightning_pp.layout.partition.partition_layers`).
    """

    def __init__(self, schedule: Schedule, layer_ranges: Sequence[range]) -> None:
        if len(layer_ranges) != schedule.num_stages:
            raise ValueError(
                f"got {len(layer_ranges)} layer ranges for pp({schedule.pp}) * "
                f"vpp({schedule.vpp}) = {schedule.num_stages} virtual stages"
            )
        self.schedule = schedule
        self.layer_ranges: tuple[range, ...] = tuple(layer_ranges)
        self._stage_of_layer = {i: s for s, r in enumerate(self.layer_ranges) for i in r}

    @property
    def pp(self) -> int:
        return self.schedule.pp

    @property
    def vpp(self) -> int:
        return self.schedule.vpp

    @property
    def num_layers(self) -> int:
        return self.layer_ranges[-1].stop

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.pp:
            raise ValueError(f"pipeline rank {rank} must lie in [0, pp({self.pp}))")

    # -- rank -> layers -------------------------------------------------------------------
    def chunk_ranges(self, rank: int) -> list[range]:
        """The layer ranges ``rank`` holds, one per local chunk, in local chunk order."""
        self._check_rank(rank)
        return [self.layer_ranges[s] for s in self.schedule.stages_of(rank)]

    def local_indices(self, rank: int) -> list[int]:
        """Every layer index ``rank`` holds, in local chunk order."""
        return [i for r in self.chunk_ranges(rank) for i in r]

    # -- layer -> rank --------------------------------------------------------------------
    def stage_of_layer(self, layer: int) -> int:
        try:
            return self._stage_of_layer[layer]
        except KeyError:
            raise ValueError(
                f"layer {layer} is outside the model's {self.num_layers} layers"
            ) from None

    def rank_of_layer(self, layer: int) -> int:
        """The pipeline rank holding ``layer``."""
        return self.schedule.locate(self.stage_of_layer(layer))[0]

    @property
    def output_rank(self) -> int:
        """The pipeline rank holding the last virtual stage (where outputs and losses are)."""
        return self.schedule.locate(self.schedule.num_stages - 1)[0]

    def tied_ranks(self, layers: Iterable[int]) -> tuple[list[int], int]:
        """Pipeline ranks holding a copy of a tied weight used by ``layers``, and its owner.

        ``layers`` lists the layer index of each member, the group's first (canonical) member
        first: its rank owns the weight (initialises it; counts it once in the global norm).
        Returns ``(sorted pipeline ranks, owner pipeline rank)``.
        """
        layers = list(layers)
        ranks = sorted({self.rank_of_layer(i) for i in layers})
        return ranks, self.rank_of_layer(layers[0])

    # -- text and records -----------------------------------------------------------------
    def layout(self) -> dict[str, Any]:
        """The shape facts a sharded checkpoint records (see :mod:`lightning_pp.checkpoint`)."""
        return {
            "pp": self.pp,
            "vpp": self.vpp,
            "num_layers": self.num_layers,
            "layer_ranges": [[r.start, r.stop] for r in self.layer_ranges],
        }

    def describe(self) -> list[str]:
        """One line per rank: its chunks, their virtual stages and layers.

        >>> from lightning_pp.schedules import build_schedule
        >>> LayerPlacement(build_schedule("1f1b", 2, 2), [range(0, 3), range(3, 5)]).describe()
        ['rank 0: chunk 0 = stage 0, layers 0-2', 'rank 1: chunk 0 = stage 1, layers 3-4']
        """
        lines = []
        for rank in range(self.pp):
            parts = [
                f"chunk {c} = stage {s}, layers {_span(self.layer_ranges[s])}"
                for c, s in enumerate(self.schedule.stages_of(rank))
            ]
            lines.append(f"rank {rank}: " + "; ".join(parts))
        return lines


def _span(r: range) -> str:
    return f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start)


def split_layer_name(name: str) -> tuple[int, str]:
    """``"5.head.weight"`` -> ``(5, "head.weight")``: a name relative to a layer list split into
    the layer index and the rest; a name without a leading index is an error."""
    head, _, rest = name.partition(".")
    if not head.isdigit() or not rest:
        raise ValueError(
            f"tied parameter name {name!r} must start with a layer index, e.g. '0.wte.weight'"
        )
    return int(head), rest


def layer_of(name: str) -> int:
    """The layer index a parameter name relative to :class:`PipelineLayers` starts with.

    >>> layer_of("5.head.weight")
    5
    """
    return split_layer_name(name)[0]

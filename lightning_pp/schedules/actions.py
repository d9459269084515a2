"""The schedule's data model: what a rank computes, in which order.

A schedule is plain data so that three consumers can share one source of truth: the engine
executes it, the simulator predicts its timeline, and the renderers draw it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from enum import Enum


class Op(str, Enum):
    """Kind of compute step.

    * ``F``: forward of one microbatch through one chunk;
    * ``B``: the fused backward (input gradient and weight gradients in one pass);
    * ``I``: the input-gradient half of a split backward: the gradient the previous stage waits
      for, and nothing else;
    * ``W``: the weight-gradient half of an earlier ``I`` of the same microbatch and chunk on the
      same rank. Nothing waits for it, which is why zero-bubble schedules use W's to fill bubbles.

    A forward is paired with exactly one ``B``, or with one ``I`` and one ``W``.
    """

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the paper's name for the input-gradient pass
    W = "W"

    @property
    def is_backward(self) -> bool:
        """``B`` or ``I``: the step that consumes the next stage's gradient and sends its own."""
        return self in (Op.B, Op.I)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Action:
    """One compute step of one rank: ``op`` on microbatch ``mb`` through local chunk ``chunk``.

    ``chunk`` is the rank-local chunk index; the virtual stage it runs is given by the
    schedule's placement (:meth:`Schedule.stage`).

    Example:
        >>> str(Action(Op.F, 3))
        'F3'
        >>> Action(Op.B, 5, 1).short(show_chunk=True)
        'B5.1'
    """

    op: Op
    mb: int
    chunk: int = 0

    def short(self, show_chunk: bool = False) -> str:
        """Printable form used in grids and error messages: ``F3`` or, with chunks, ``F3.1``."""
        base = f"{str(self.op)}{self.mb}"  # str(): a malformed op still prints in errors
        return f"{base}.{self.chunk}" if show_chunk else base

    def describe(self) -> str:
        """Long form for error messages, e.g. ``B mb=5 chunk=1``."""
        return f"{str(self.op)} mb={self.mb} chunk={self.chunk}"

    def __str__(self) -> str:
        return self.short(show_chunk=self.chunk != 0)

    def to_dict(self) -> dict:
        return {"op": self.op.value, "mb": self.mb, "chunk": self.chunk}


@dataclass(frozen=True)
class Schedule:
    """One ordered action list per pipeline rank, plus the shape it was built for.

    Example:
        >>> from lightning_pp.schedules import build_schedule
        >>> s = build_schedule("1f1b", pp=2, microbatches=3)
        >>> [str(a) for a in s.ranks[1]]
        ['F0', 'B0', 'F1', 'B1', 'F2', 'B2']
    """

    name: str
    pp: int
    vpp: int
    microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    group_size: int | None = None
    meta: dict = field(default_factory=dict, compare=False)
    #: how virtual stages map onto (rank, chunk): ``"loop"`` (``chunk * pp + rank``: gpipe,
    #: 1f1b, interleaved) or ``"v"`` (rank ``r`` holds stages ``r`` and ``2 * pp - 1 - r``, in
    #: that chunk order; needs ``vpp == 2``). The ONLY statement of placement in the project:
    #: partition, engine, strategy, checkpoints and callbacks ask the schedule.
    placement: str = "loop"

    def __post_init__(self) -> None:
        if self.placement not in ("loop", "v"):
            raise ValueError(f"placement must be 'loop' or 'v', got {self.placement!r}")
        if self.placement == "v" and self.vpp != 2:
            raise ValueError(f"V placement holds exactly 2 chunks per rank, got vpp={self.vpp}")

    @property
    def num_stages(self) -> int:
        """Number of virtual stages, ``pp * vpp``."""
        return self.pp * self.vpp

    def stage(self, rank: int, chunk: int) -> int:
        """Virtual stage run by local ``chunk`` of ``rank``.

        Loop placement: ``chunk * pp + rank``. V placement: chunk 0 is stage ``rank`` and chunk
        1 is stage ``2 * pp - 1 - rank`` (the pipeline goes down the ranks and back up).

        Example:
            >>> from lightning_pp.schedules import build_schedule
            >>> build_schedule("interleaved", pp=4, vpp=2, microbatches=8).stage(0, 1)
            4
        """
        if self.placement == "v" and chunk == 1:
            return 2 * self.pp - 1 - rank
        return chunk * self.pp + rank

    def locate(self, stage: int) -> tuple[int, int]:
        """Inverse of :meth:`stage`: the ``(rank, chunk)`` holding virtual stage ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} out of range for {self.num_stages} virtual stages")
        if self.placement == "v" and stage >= self.pp:
            return 2 * self.pp - 1 - stage, 1
        return stage % self.pp, stage // self.pp

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages ``rank`` holds, in local chunk order."""
        return tuple(self.stage(rank, c) for c in range(self.vpp))

    @property
    def interleaved(self) -> bool:
        return self.vpp > 1

    def forward_only(self) -> Schedule:
        """The same order with backward steps removed: the evaluation schedule."""
        return Schedule(
            name=f"{self.name}-forward",
            pp=self.pp,
            vpp=self.vpp,
            microbatches=self.microbatches,
            ranks=tuple(tuple(a for a in r if a.op is Op.F) for r in self.ranks),
            group_size=self.group_size,
            placement=self.placement,
        )

    @functools.cached_property
    def split_backward(self) -> bool:
        """Whether any rank runs split backwards (``I`` / ``W`` steps). Cached: the engine asks
        at every forward, and the answer is a scan of the whole order."""
        return any(a.op in (Op.I, Op.W) for r in self.ranks for a in r)

    def to_dict(self) -> dict:
        return {
            "schedule": self.name,
            "pp": self.pp,
            "vpp": self.vpp,
            "microbatches": self.microbatches,
            "placement": self.placement,
            "ranks": [[a.to_dict() for a in r] for r in self.ranks],
        }

    def to_json(self, **extra) -> str:
        d = self.to_dict()
        d.update(extra)
        return json.dumps(d)

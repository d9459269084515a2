"""Where each data-parallel rank's shard of a gradient bucket lies (ZeRO-1/2 layout, no
communication here).

Every parameter is cut along its first dim into ``dp`` pieces by ``torch.chunk``'s rule (each
piece ``ceil(rows / dp)`` rows, the last ones shorter or empty), which is how a ``DTensor`` with
``Shard(0)`` over the data-parallel mesh dim holds it and how FSDP2 shards. A bucket's flat
buffer is laid out rank by rank::

    [ rank 0: p0 rows 0..c0 | p1 rows 0..c1 | ... ][ rank 1: p0 rows c0..2c0 | ... ] ...

each piece padded to its full ``c`` rows, so ``reduce_scatter_single`` over the bucket hands
rank ``d`` exactly its rows of every parameter, contiguous, and ``all_gather_single``
brings the updated rows back. Because the pieces are the ``Shard(0)`` pieces, the optimizer state
of a shard is a DTensor's local tensor: checkpoints store it by the parameter's own name and
shape, for any later ``dp``. Padding: ``c * dp - rows`` rows per parameter (none when ``dp``
divides ``rows``).

A tensor-parallel parameter (a ``DTensor``) is cut by the same rule, on its local shard: the
data-parallel replicas of one tp rank share that shard, so its rows are what they split
(Megatron's distributed optimizer under tp does the same: each tp rank's optimizer holds
1/dp of its own shard). Every tensor a member reads or writes (gradients, parameter data) is
taken by its local part.

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(5, 3))
    >>> b = torch.nn.Parameter(torch.zeros(4))
    >>> layout = BucketLayout.build([w, b], dp=2, dp_rank=1)
    >>> [(m.rows, m.chunk_rows, m.lo, m.hi) for m in layout.members]
    [(5, 3, 3, 5), (4, 2, 2, 4)]
    >>> (layout.shard_numel, layout.numel)     # 3 rows x 3 + 2 = 11 per rank, 2 ranks
    (11, 22)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .dtensor_state import local_part

__all__ = ["BucketLayout", "ShardMember"]


@dataclass(frozen=True)
class ShardMember:
    """One parameter of a bucket: its rows, the rows of every rank's piece, and this rank's."""

    param: nn.Parameter
    shape: tuple[int, ...]  # the parameter's local shape (its tp shard's; the whole otherwise)
    rows: int  # first-dim size (1 for a scalar)
    row_numel: int  # elements per row
    chunk_rows: int  # ceil(rows / dp): every rank's slot in the flat buffer
    lo: int  # this rank's rows [lo, hi) (empty when lo == hi)
    hi: int
    offset: int  # start of this member's slot inside one rank's block

    @property
    def slot_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    @property
    def local_numel(self) -> int:
        return (self.hi - self.lo) * self.row_numel

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.hi - self.lo, *self.shape[1:])

    def rows_view(self, tensor: Tensor) -> Tensor:
        """``tensor`` (shaped as the parameter; a ``DTensor``: its local part) as
        ``(rows, row_numel)``."""
        return local_part(tensor).reshape(self.rows, self.row_numel)

    def local_piece(self, tensor: Tensor) -> Tensor:
        """This rank's rows of ``tensor`` (shaped as the parameter), a view when it can be."""
        return self.rows_view(tensor)[self.lo : self.hi].view(self.local_shape)


@dataclass(frozen=True)
class BucketLayout:
    """The rank-by-rank flat layout of one gradient bucket (see the module docstring)."""

    members: tuple[ShardMember, ...]
    dp: int
    dp_rank: int
    shard_numel: int  # one rank's block

    @property
    def numel(self) -> int:
        """The whole flat buffer: ``dp`` blocks."""
        return self.shard_numel * self.dp

    @property
    def padding_numel(self) -> int:
        """Elements of the flat buffer that belong to no parameter."""
        return self.numel - sum(m.rows * m.row_numel for m in self.members)

    @classmethod
    def build(cls, params: Sequence[nn.Parameter], dp: int, dp_rank: int) -> BucketLayout:
        members, offset = [], 0
        for p in params:
            shape = tuple(local_part(p).shape)
            rows = shape[0] if shape else 1
            row_numel = math.prod(shape) // rows if rows else 0
            chunk = math.ceil(rows / dp)
            lo, hi = min(dp_rank * chunk, rows), min((dp_rank + 1) * chunk, rows)
            members.append(ShardMember(p, shape, rows, row_numel, chunk, lo, hi, offset))
            offset += chunk * row_numel
        return cls(tuple(members), dp, dp_rank, offset)

    def pack(self, tensors: Sequence[Tensor | None], divide_by: int = 1) -> Tensor:
        """The flat buffer of ``tensors`` (one per member, shaped as its parameter; ``None``:
        zeros) divided by ``divide_by``, laid out rank by rank, padding zeroed: the
        reduce-scatter's input. Each rank's rows are written straight into their slot (one
        pass over the data, the division included; only padding rows are zero-filled)."""
        ref = self.members[0].param
        flat = torch.empty(self.numel, dtype=ref.dtype, device=ref.device)
        blocks = flat.view(self.dp, self.shard_numel)
        for m, t in zip(self.members, tensors):
            slots = blocks[:, m.offset : m.offset + m.slot_numel].view(
                self.dp, m.chunk_rows, m.row_numel
            )
            if t is None:
                slots.zero_()
                continue
            rows = m.rows_view(t)
            for d in range(self.dp):
                lo = min(d * m.chunk_rows, m.rows)
                n = min(lo + m.chunk_rows, m.rows) - lo
                if n and divide_by != 1:
                    torch.div(rows[lo : lo + n], divide_by, out=slots[d, :n])
                elif n:
                    slots[d, :n].copy_(rows[lo : lo + n])
                if n < m.chunk_rows:
                    slots[d, n:].zero_()
        return flat

    def pack_local(self, pieces: Sequence[Tensor | None]) -> Tensor:
        """This rank's block from its pieces (``local_shape`` each, ``None`` for an empty one):
        the all-gather's input."""
        ref = self.members[0].param
        block = torch.zeros(self.shard_numel, dtype=ref.dtype, device=ref.device)
        for m, t in zip(self.members, pieces):
            if t is not None and m.local_numel:
                block[m.offset : m.offset + m.local_numel].copy_(t.reshape(-1))
        return block

    def local_view(self, block: Tensor, member: ShardMember) -> Tensor:
        """``member``'s rows inside this rank's ``block`` (a view)."""
        return block[member.offset : member.offset + member.local_numel].view(member.local_shape)

    def unpack_full(self, flat: Tensor, member: ShardMember) -> Tensor:
        """``member``'s whole tensor from the gathered flat buffer (padding dropped)."""
        blocks = flat.view(self.dp, self.shard_numel)
        slots = blocks[:, member.offset : member.offset + member.slot_numel]
        return slots.reshape(self.dp * member.chunk_rows, member.row_numel)[: member.rows]

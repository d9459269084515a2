"""What travels between pipeline neighbours, and the bookkeeping of one transfer.

- :class:`Message` (a send) and :class:`RecvRequest` (a receive): kind (activation or
  gradient), peer, virtual stage, microbatch, and the tensors or their :data:`Spec`;
- :class:`PendingSend` / :class:`SendQueue`: sends in flight, waited for before their buffers
  are reused; :class:`PendingRecv`: a posted receive, its header and its buffers;
- the header's dtype codes and the landing mark that tells a gloo receive has arrived.

The communicator that posts them is :class:`~lightning_pp.runtime.p2p.P2PCommunicator`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import Work

from .failure import FailureMonitor

__all__ = [
    "ACT",
    "GRAD",
    "Message",
    "PendingRecv",
    "PendingSend",
    "RecvRequest",
    "SendQueue",
    "Spec",
    "format_specs",
    "specs_of",
]

ACT, GRAD = 0, 1
_KIND = {ACT: "activation", GRAD: "gradient"}


_MAGIC = 0x5050  # first header word: catches a data message read as a header


_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


Spec = tuple[tuple[int, ...], torch.dtype]


# gloo offers no completion test for a receive before wait() (is_completed() stays False until
# then), but it writes a message straight into the posted buffer, in order. An 8-byte pattern
# in the buffer's last bytes therefore shows when the message has landed: the wait then returns
# at once and can run on the calling thread, without the failure monitor's helper-thread
# hand-off (0.2-0.4 ms per receive on a loaded 2-core machine). A message that itself ends in
# the pattern (2^-64 for random bytes) only takes the slow path: correctness never rests on it.
_LANDING_MARK = torch.tensor(list(b"\x9d\x1fLPPmk\xc3"), dtype=torch.uint8)


def _arm(buffer: torch.Tensor) -> torch.Tensor | None:
    """Write the landing mark into ``buffer``'s last 8 bytes; return that byte view."""
    if not buffer.is_contiguous():
        return None
    tail = buffer.view(-1).view(torch.uint8)[-8:]
    if tail.numel() < 8:
        return None
    tail.copy_(_LANDING_MARK)
    return tail


def _landed(marks: Sequence[torch.Tensor | None]) -> bool:
    """True if every marked buffer's mark was overwritten (its message has arrived)."""
    return bool(marks) and all(m is not None and not torch.equal(m, _LANDING_MARK) for m in marks)


def format_specs(specs: Sequence[Spec]) -> str:
    """``[(4, 16) float32, (4,) int64]`` style text of a tensor list for error messages."""
    return "[" + ", ".join(f"{tuple(s)} {str(d).replace('torch.', '')}" for s, d in specs) + "]"


def specs_of(tensors: Sequence[torch.Tensor]) -> list[Spec]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


@dataclass
class Message:
    """One outgoing activation or gradient. ``stage`` is the RECEIVING virtual stage."""

    kind: int
    peer: int
    stage: int
    mb: int
    tensors: tuple[torch.Tensor, ...]
    is_tuple: bool = True


@dataclass
class RecvRequest:
    """One expected incoming message. ``specs`` is required for gradients (known shapes).
    ``chunk``: the receiving local chunk, named in hang and abort messages."""

    kind: int
    peer: int
    stage: int
    mb: int
    specs: list[Spec] | None = None
    chunk: int | None = None


@dataclass
class PendingSend:
    """Posted sends; holds the send buffers alive until the works complete."""

    works: list[Work]
    buffers: list[torch.Tensor]
    monitor: FailureMonitor | None = None
    peers: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    @classmethod
    def combine(cls, sends: Sequence[PendingSend]) -> PendingSend:
        """One pending send for several: waiting for them costs one monitored wait, not one
        each (the end-of-step wait of a whole step's sends)."""
        monitor = next((s.monitor for s in sends if s.monitor is not None), None)
        return cls(
            [w for s in sends for w in s.works],
            [b for s in sends for b in s.buffers],
            monitor,
            [p for s in sends for p in s.peers],
        )

    def wait(self) -> None:
        if self.monitor is not None:
            peers = sorted(set(self.peers))
            self.monitor.wait(
                self.works, f"waiting for its sends to rank(s) {peers} to complete", peer=None
            )
        else:
            for w in self.works:
                w.wait()
        self.works, self.buffers = [], []


class SendQueue:
    """One step's sends not yet known to be complete, oldest first, and the bytes they hold.

    Example::

        sends = SendQueue()
        sends.add(pending_send)
        sends.reap()   # drop the completed ones at the head
        sends.wait()   # end of step: wait for all of them
    """

    def __init__(self) -> None:
        self._queue: deque[PendingSend] = deque()
        self.nbytes = 0  # a running total: re-summing per action would be O(n^2) per step

    def add(self, sent: PendingSend) -> None:
        if sent.works:
            self._queue.append(sent)
            self.nbytes += sent.nbytes

    def reap(self) -> None:
        """Forget the sends known complete (they complete in order: NCCL; gloo: at wait)."""
        while self._queue and self._queue[0].done():
            self.nbytes -= self._queue.popleft().nbytes

    def wait(self) -> None:
        if self._queue:
            PendingSend.combine(self._queue).wait()


@dataclass
class PendingRecv:
    """A posted receive. :meth:`P2PCommunicator.receive` waits for it; ``tensors`` then holds
    what arrived. An activation whose shape is not agreed yet holds its ``header`` receive
    until then (its data receive goes out once the header is in)."""

    request: RecvRequest
    header: torch.Tensor | None = None
    header_works: list[Work] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    works: list[Work] = field(default_factory=list)
    is_tuple: bool = True
    waited: float = 0.0
    header_mark: torch.Tensor | None = None
    marks: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.buffers)

    @property
    def specs(self) -> list[Spec]:
        return specs_of(self.buffers)

    def describe(self, header: bool = False) -> str:
        """``waiting for activation of mb=5 chunk=1 (stage 5) from rank 1`` (hang/abort text)."""
        req = self.request
        chunk = f" chunk={req.chunk}" if req.chunk is not None else ""
        what = f"{_KIND[req.kind]} of mb={req.mb}{chunk} (stage {req.stage})"
        if header:
            what = f"the shape header of the {what}"
        return f"waiting for {what} from rank {req.peer}"


class _Op(NamedTuple):
    """One point-to-point operation to post: a send (``send``) or a receive of ``tensor``
    to/from global rank ``peer``."""

    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int


class _OpBatch:
    """One batch of posts being built (:meth:`P2PCommunicator._post`): its ops and, per op,
    the list its work goes to (a :class:`PendingSend`'s, or a receive's header or data works)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.ops: list[_Op] = []
        self._sinks: list[list[Work]] = []

    def add(self, send: bool, tensor: torch.Tensor, peer: int, tag: int, sink: list[Work]) -> None:
        self.ops.append(_Op(send, tensor, peer, tag))
        self._sinks.append(sink)

    def assign(self, works: list[Work]) -> None:
        if len(works) == len(self.ops):
            for sink, work in zip(self._sinks, works):
                sink.append(work)
        else:  # coalesced backends (NCCL) return one work for the whole batch
            for sink in self._sinks:
                sink += works

"""Point-to-point traffic between pipeline neighbours.

One :class:`P2PCommunicator` per rank. Every compute step hands it the messages the step
produced and the receives of upcoming steps (at least the NEXT one; the engine's
``recv_lookahead``); all of them go out in ONE ``dist.batch_isend_irecv`` call (Megatron's
``send_forward_recv_backward`` pairing), so two neighbours that send to each other at the same
time never deadlock on ordering.

Messages carry an activation (a tensor or a tuple of tensors) forward, or the gradients of an
activation's floating-point tensors backward.

Shape agreement (activations only; a gradient has the shape of the output it belongs to, which
the receiver stashed):

- default (``static_shapes=False``): each activation is preceded by a small int64 header
  (tuple-ness, number of tensors, dtype and shape of each, microbatch). The sender posts header
  and data together; the receiver posts the header receive in the paired batch and, once the
  header has arrived, allocates buffers and receives the data. Shapes may change freely between
  microbatches and batches (variable sequence length, uneven last microbatch). Cost: one extra
  tiny message and one latency before the data receive is posted.
- ``static_shapes=True``: the header is exchanged only the FIRST time a (stage, microbatch) pair
  is seen; afterwards both sides reuse the agreed shapes, the receiver posts its data receive
  directly in the paired batch, and the SENDER checks every later activation against the agreed
  shapes and raises (naming both ranks, the microbatch and both shapes) if they changed.

Tags separate channels on gloo: ``tag = ((stage * 2 + kind) * 2 + is_header)`` where ``stage``
is the receiving virtual stage. NCCL ignores tags and matches messages between a pair of ranks
in posting order; that holds here because each side posts a channel's messages in schedule
order and, on NCCL, the receiver has at most one message per channel outstanding (it posts the
receives of the next step only). A message whose peer is this very rank (pp=1 with several
chunks) is handed over in-process.

Example (on every rank of an initialized pipeline group)::

    comm = P2PCommunicator(topo, groups.pp_group, device=torch.device("cpu"))
    sends, recvs = comm.exchange(
        [Message(ACT, topo.next_rank, stage=1, mb=0, tensors=(h,), is_tuple=False)],
        [RecvRequest(GRAD, topo.next_rank, stage=0, mb=0, specs=[(h.shape, h.dtype)])],
    )
    (grad,) = recvs[0].wait()
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .failure import FailureMonitor
from .topology import PipelineTopology

__all__ = [
    "ACT",
    "GRAD",
    "Message",
    "P2PCommunicator",
    "PendingRecv",
    "PendingSend",
    "RecvRequest",
    "Spec",
    "format_specs",
]

ACT, GRAD = 0, 1
_KIND = {ACT: "activation", GRAD: "gradient"}
_MAGIC = 0x5050  # first header word: catches a data message read as a header
# Seconds the set-up rendezvous may wait before the watchdog calls it a hang (at least; a larger
# watchdog_timeout wins).
SETUP_RENDEZVOUS_TIMEOUT = 120.0
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
    """One expected incoming message. ``specs`` is required for gradients (known shapes)."""

    kind: int
    peer: int
    stage: int
    mb: int
    specs: list[Spec] | None = None


@dataclass
class PendingSend:
    """Posted sends; holds the send buffers alive until the works complete."""

    works: list[Any]
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


@dataclass
class PendingRecv:
    """A posted receive; :meth:`wait` returns the tensors (blocking until they arrived)."""

    request: RecvRequest
    comm: P2PCommunicator
    header: torch.Tensor | None = None
    header_works: list[Any] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    works: list[Any] = field(default_factory=list)
    is_tuple: bool = True
    local: tuple[torch.Tensor, ...] | None = None
    waited: float = 0.0
    header_mark: torch.Tensor | None = None
    marks: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def specs(self) -> list[Spec]:
        return specs_of(self.buffers)

    def describe(self, header: bool = False) -> str:
        """``waiting for activation of mb=5 chunk=1 from rank 1`` (for hang/abort messages)."""
        req = self.request
        pp = self.comm.topology.pp
        what = f"{_KIND[req.kind]} of mb={req.mb} chunk={req.stage // pp} (stage {req.stage})"
        if header:
            what = f"the shape header of the {what}"
        return f"waiting for {what} from rank {req.peer}"

    def wait(self) -> tuple[torch.Tensor, ...]:
        t0 = time.perf_counter()
        try:
            if self.local is not None:
                return self.local
            if self.header is not None:
                self.comm._wait(self.header_works, self, True)
                self.comm._on_header(self)
            self.comm._wait(self.works, self, False)
            return tuple(self.buffers)
        finally:
            self.waited += time.perf_counter() - t0


class P2PCommunicator:
    """Paired, batched isend/irecv between pipeline neighbours of one pp group.

    Args:
        topology: this rank's place in the grid.
        group: the pp process group (``ProcessGroups.pp_group``); ``None`` only when pp == 1.
        device: where receive buffers are allocated (the CUDA device under NCCL).
        static_shapes: agree activation shapes once per (stage, microbatch), then skip headers.
        header_len: int64 words per header (bounds tensors per activation and their ranks).
        monitor: abort channel and hang watchdog for every blocking wait (``None``: plain
            blocking waits, as torch does them).
    """

    def __init__(
        self,
        topology: PipelineTopology,
        group: Any,
        *,
        device: torch.device | str = "cpu",
        static_shapes: bool = False,
        header_len: int = 64,
        monitor: FailureMonitor | None = None,
    ) -> None:
        self.topology = topology
        self.monitor = monitor
        self.group = group
        self.device = torch.device(device)
        self.static_shapes = static_shapes
        self.header_len = header_len
        # Landing marks only help where a monitor would otherwise hand the wait to a thread.
        self._mark_landing = (
            monitor is not None and not monitor.poll_works and self.device.type == "cpu"
        )
        self._agreed: dict[tuple[int, int], tuple[bool, list[Spec]]] = {}
        # Activation receives of each stage still waiting for their header: their data receive
        # is posted only when the header arrives, so no later data receive of that stage may be
        # posted before then (one channel's receives must be posted in message order).
        self._awaiting_header: dict[int, int] = {}
        self._local: dict[tuple[int, int, int], deque] = {}
        if topology.pp > 1:
            if group is None:
                raise ValueError(f"pp={topology.pp} needs a pp process group, got None")
            # NCCL requires the first batched P2P call on a group to involve every member; a
            # collective first makes communicator creation collective and deterministic.
            probe = torch.zeros(1, device=self.device)
            work = dist.all_reduce(probe, group=group, async_op=True)
            # Ranks reach this point seconds apart (model building, data loading, a previous
            # job's teardown): a short step watchdog must not fire here, only a real hang.
            self._wait(
                [work],
                "waiting for the other pipeline ranks to build their engine",
                min_timeout=SETUP_RENDEZVOUS_TIMEOUT,
            )

    def _wait(
        self, works: Sequence[Any], what: Any, header: bool = False, min_timeout: float = 0.0
    ) -> None:
        """Block on ``works`` through the monitor (abortable, watched) when there is one."""
        if not works:
            return
        if self.monitor is None:
            for w in works:
                w.wait()
            return
        if isinstance(what, PendingRecv):
            pending, peer = what, what.request.peer
            marks = [pending.header_mark] if header else pending.marks
            self.monitor.wait(
                works,
                lambda: pending.describe(header),
                peer=peer,
                landed=(lambda: _landed(marks)) if self._mark_landing else None,
            )
        else:
            self.monitor.wait(works, what, min_timeout=min_timeout)

    # -- tags and headers ------------------------------------------------------------------
    @staticmethod
    def tag(kind: int, stage: int, header: bool) -> int:
        return ((stage * 2 + kind) * 2) + int(header)

    def _encode(self, msg: Message) -> torch.Tensor:
        words = [_MAGIC, msg.mb, int(msg.is_tuple), len(msg.tensors)]
        for t in msg.tensors:
            if t.dtype not in _DTYPE_CODE:
                raise TypeError(f"cannot send dtype {t.dtype}; supported: {_DTYPES}")
            words += [_DTYPE_CODE[t.dtype], t.dim(), *t.shape]
        if len(words) > self.header_len:
            raise ValueError(
                f"activation header needs {len(words)} words > header_len={self.header_len} "
                f"({len(msg.tensors)} tensors {format_specs(specs_of(msg.tensors))}); "
                f"raise header_len on every rank"
            )
        words += [0] * (self.header_len - len(words))
        return torch.tensor(words, dtype=torch.int64, device=self.device)

    def _decode(self, header: torch.Tensor, req: RecvRequest) -> tuple[bool, list[Spec]]:
        words = header.tolist()
        if words[0] != _MAGIC:
            raise RuntimeError(
                f"rank {self.topology.rank}: corrupt activation header from rank {req.peer} for "
                f"stage {req.stage} mb={req.mb} (first word {words[0]}, expected {_MAGIC}): the "
                f"two ranks are running different schedules or message sequences"
            )
        if words[1] != req.mb:
            raise RuntimeError(
                f"rank {self.topology.rank}: expected the activation of mb={req.mb} for stage "
                f"{req.stage} from rank {req.peer} but received mb={words[1]}: the two ranks run "
                f"inconsistent schedules"
            )
        is_tuple, n, pos, specs = bool(words[2]), words[3], 4, []
        for _ in range(n):
            code, ndim = words[pos], words[pos + 1]
            specs.append((tuple(words[pos + 2 : pos + 2 + ndim]), _DTYPES[code]))
            pos += 2 + ndim
        return is_tuple, specs

    def can_post_early(self, req: RecvRequest) -> bool:
        """Whether ``req`` may be posted now, ahead of receives still waiting for a header."""
        if req.kind != ACT or not self._awaiting_header.get(req.stage):
            return True
        # Only another header receive is safe: it goes to the header channel, in order.
        return not (self.static_shapes and (req.stage, req.mb) in self._agreed)

    def _recv_buffers(
        self, specs: Sequence[Spec]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Fresh receive buffers for ``specs``, and their landing marks (if marking)."""
        buffers = [torch.empty(s, dtype=d, device=self.device) for s, d in specs]
        return buffers, [_arm(b) for b in buffers] if self._mark_landing else []

    def _on_header(self, pending: PendingRecv) -> None:
        req = pending.request
        self._awaiting_header[req.stage] -= 1
        is_tuple, specs = self._decode(pending.header, req)  # type: ignore[arg-type]
        if self.static_shapes:
            self._agreed[(req.stage, req.mb)] = (is_tuple, specs)
        pending.is_tuple = is_tuple
        pending.header = None
        pending.buffers, pending.marks = self._recv_buffers(specs)
        ops = [
            dist.P2POp(dist.irecv, b, req.peer, self.group, self.tag(req.kind, req.stage, False))
            for b in pending.buffers
        ]
        pending.works = self._post(ops, pending.describe())

    def _post(self, ops: list[dist.P2POp], what: str) -> list[Any]:
        """``batch_isend_irecv``; a failure caused by a peer that already aborted says so."""
        if not ops:
            return []
        try:
            return list(dist.batch_isend_irecv(ops))
        except Exception:
            if self.monitor is not None:  # e.g. "connection closed by peer" after its failure
                self.monitor.raise_if_aborted(what)
            raise

    # -- the one entry point ----------------------------------------------------------------
    def exchange(
        self, sends: Sequence[Message], recvs: Sequence[RecvRequest]
    ) -> tuple[PendingSend, list[PendingRecv]]:
        """Post ``sends`` and ``recvs`` together in one ``batch_isend_irecv``.

        Returns the pending sends (wait or poll before reusing their buffers; they keep them
        alive) and one :class:`PendingRecv` per request, in order. Nothing here blocks.
        """
        me = self.topology.rank
        ops: list[dist.P2POp] = []
        owners: list[PendingRecv | None] = []  # per op: the receive it belongs to (None: send)
        is_header: list[bool] = []
        send_buffers: list[torch.Tensor] = []

        for msg in sends:
            tensors = tuple(t.detach().contiguous() for t in msg.tensors)
            if msg.peer == me:  # pp == 1: the next stage is a local chunk
                key = (msg.kind, msg.stage, msg.mb)
                self._local.setdefault(key, deque()).append((msg.is_tuple, tensors))
                continue
            need_header = msg.kind == ACT
            if msg.kind == ACT and self.static_shapes:
                agreed = self._agreed.get((msg.stage, msg.mb))
                if agreed is not None:
                    self._check_static(msg, agreed, tensors)
                    need_header = False
                else:
                    self._agreed[(msg.stage, msg.mb)] = (msg.is_tuple, specs_of(tensors))
            if need_header:
                header = self._encode(msg)
                send_buffers.append(header)
                ops.append(
                    dist.P2POp(
                        dist.isend,
                        header,
                        msg.peer,
                        self.group,
                        self.tag(msg.kind, msg.stage, True),
                    )
                )
                owners.append(None)
                is_header.append(True)
            for t in tensors:
                send_buffers.append(t)
                ops.append(
                    dist.P2POp(
                        dist.isend, t, msg.peer, self.group, self.tag(msg.kind, msg.stage, False)
                    )
                )
                owners.append(None)
                is_header.append(False)

        pendings: list[PendingRecv] = []
        for req in recvs:
            p = PendingRecv(req, self)
            pendings.append(p)
            if req.peer == me:
                q = self._local.get((req.kind, req.stage, req.mb))
                if not q:
                    raise RuntimeError(
                        f"rank {me}: local {_KIND[req.kind]} for stage {req.stage} mb={req.mb} "
                        f"was never produced (schedule runs a consumer before its producer)"
                    )
                is_tuple, tensors = q.popleft()
                p.local, p.is_tuple, p.buffers = tensors, is_tuple, list(tensors)
                continue
            specs = req.specs
            if req.kind == ACT:
                agreed = self._agreed.get((req.stage, req.mb)) if self.static_shapes else None
                if agreed is None:
                    self._awaiting_header[req.stage] = self._awaiting_header.get(req.stage, 0) + 1
                    p.header = torch.empty(self.header_len, dtype=torch.int64, device=self.device)
                    if self._mark_landing:
                        p.header_mark = _arm(p.header)
                    ops.append(
                        dist.P2POp(
                            dist.irecv,
                            p.header,
                            req.peer,
                            self.group,
                            self.tag(req.kind, req.stage, True),
                        )
                    )
                    owners.append(p)
                    is_header.append(True)
                    continue
                p.is_tuple, specs = agreed
            if specs is None:
                raise ValueError(f"receive of a {_KIND[req.kind]} needs specs (shapes and dtypes)")
            p.buffers, p.marks = self._recv_buffers(specs)
            for b in p.buffers:
                ops.append(
                    dist.P2POp(
                        dist.irecv, b, req.peer, self.group, self.tag(req.kind, req.stage, False)
                    )
                )
                owners.append(p)
                is_header.append(False)

        works: list[Any] = self._post(ops, "posting sends/receives")
        if len(works) == len(ops):
            per_op = [[w] for w in works]
        else:  # coalesced backends (NCCL) return one work for the whole batch
            per_op = [works for _ in ops]
        send_works: list[Any] = []
        for owner, hdr, ws in zip(owners, is_header, per_op):
            if owner is None:
                send_works += ws
            elif hdr:
                owner.header_works += ws
            else:
                owner.works += ws
        peers = [m.peer for m in sends if m.peer != me]
        return PendingSend(send_works, send_buffers, self.monitor, peers), pendings

    def _check_static(self, msg: Message, agreed: tuple[bool, list[Spec]], tensors) -> None:
        is_tuple, specs = agreed
        got = specs_of(tensors)
        if got != specs or is_tuple != msg.is_tuple:
            dst = self.topology.global_rank(msg.stage % self.topology.pp)
            raise ValueError(
                f"static_shapes: rank {self.topology.rank} -> rank {dst} activation for stage "
                f"{msg.stage} mb={msg.mb} changed from the agreed {format_specs(specs)} to "
                f"{format_specs(got)}; use static_shapes=False for varying shapes"
            )

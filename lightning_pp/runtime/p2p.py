"""Point-to-point traffic between pipeline neighbours.

One :class:`P2PCommunicator` per rank. Every compute step hands it the messages the step
produced and the receives of upcoming steps (at least the NEXT one; the engine's
``recv_lookahead``). Nothing it posts blocks, so two neighbours that send to each other at the
same time never deadlock on ordering. On gloo (asynchronous sends, matched by tag) the sends go
out first, each straight on the process group, then the receives; under NCCL's rules everything
goes out in the schedule's global message order in batched ``dist.batch_isend_irecv`` calls
(Megatron's ``send_forward_recv_backward`` pairing).

The engine talks to it through a per-step :class:`ReceiveWindow`: "send these messages, and post
the receives of the next k actions" (:meth:`ReceiveWindow.exchange`), then "give me what action i
received" (:meth:`ReceiveWindow.wait`). What an action receives is the engine's knowledge; when a
receive may go out (the header protocol below) is the communicator's alone.

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

Each receiving stage's activations form one channel, received in order: header, then data.
While a header is outstanding its data receive is not posted yet, so no later DATA receive of
that channel may go out ahead of it (:meth:`P2PCommunicator.may_post_ahead`); a later header
receive may, since headers have their own tag.

Tags separate channels on gloo: ``tag = ((stage * 2 + kind) * 2 + is_header)`` where ``stage``
is the receiving virtual stage. NCCL ignores tags, matches a pair's messages in posting order and
runs a rank's operations on one stream; there the window posts in the schedule's global message
order instead (:mod:`lightning_pp.p2p_order`, :meth:`P2PCommunicator.exchange_ordered`: a header
is waited for before anything later in that order is posted). ``LIGHTNING_PP_EMULATE_NCCL=1``
runs gloo under NCCL's rules for tests (:mod:`lightning_pp.nccl_emulation`). A message whose
peer is this very rank (pp=1 with several chunks) is handed over in-process.

Example (on every rank of an initialized pipeline group)::

    comm = P2PCommunicator(topo, groups.pp_group, device=torch.device("cpu"))
    sends, recvs = comm.exchange(
        [Message(ACT, topo.next_rank, stage=1, mb=0, tensors=(h,), is_tuple=False)],
        [RecvRequest(GRAD, topo.next_rank, stage=0, mb=0, specs=[(h.shape, h.dtype)])],
    )
    (grad,) = comm.receive(recvs[0])
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import Work

from .failure import FailureMonitor
from .nccl_emulation import EmulatedStream, emulation_enabled
from .p2p_order import RankOrder
from .topology import PipelineTopology

__all__ = [
    "ACT",
    "GRAD",
    "Message",
    "P2PCommunicator",
    "PendingRecv",
    "PendingSend",
    "ReceiveWindow",
    "RecvRequest",
    "SendQueue",
    "Spec",
    "format_specs",
    "p2p_backend",
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


def p2p_backend(group: dist.ProcessGroup | None) -> str:
    """The backend whose rules the pipeline traffic on ``group`` follows: ``"nccl"`` under the
    NCCL emulation (:mod:`lightning_pp.nccl_emulation`), else the group's backend (``"gloo"``
    without a process group). The engine picks its defaults (receive lookahead, how the monitor
    waits) from it."""
    if emulation_enabled():
        return "nccl"
    try:
        return str(dist.get_backend(group))
    except Exception:  # no process group (single-rank unit tests)
        return "gloo"


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
        emulate_nccl: run the traffic under NCCL's matching, coalescing and stream rules on
            gloo (a test harness: :mod:`lightning_pp.nccl_emulation`); ``None``: the
            ``LIGHTNING_PP_EMULATE_NCCL`` environment variable decides.
    """

    def __init__(
        self,
        topology: PipelineTopology,
        group: dist.ProcessGroup | None,
        *,
        device: torch.device | str = "cpu",
        static_shapes: bool = False,
        header_len: int = 64,
        monitor: FailureMonitor | None = None,
        emulate_nccl: bool | None = None,
    ) -> None:
        self.topology = topology
        self.monitor = monitor
        self.group = group
        self.device = torch.device(device)
        self.static_shapes = static_shapes
        self.header_len = header_len
        self._agreed: dict[tuple[int, int], tuple[bool, list[Spec]]] = {}
        # Per receiving stage, the activation receives still waiting for their header (the
        # channel's queue: their data receives are posted as the headers arrive).
        self._awaiting_header: dict[int, int] = {}
        self._local: dict[tuple[int, int, int], deque[tuple[bool, tuple[torch.Tensor, ...]]]] = {}
        emulate = emulation_enabled() if emulate_nccl is None else emulate_nccl
        self.backend = "nccl" if emulate else p2p_backend(group)
        self._stream: EmulatedStream | None = None
        if emulate and topology.pp > 1:
            self._stream = EmulatedStream(group, rank=topology.rank, describe=self.describe_tag)
        # Landing marks only help where a monitor would otherwise hand the wait to a thread.
        # Not under the emulation: a landed message does not complete its coalesced batch.
        self._mark_landing = (
            monitor is not None
            and not monitor.poll_works
            and self.device.type == "cpu"
            and self._stream is None
        )
        # Global rank -> rank in the pp group, for posting straight on the group (gloo only:
        # NCCL coalesces a batch, and only batch_isend_irecv groups it; see _post_direct).
        self._group_rank: dict[int, int] | None = None
        if (
            topology.pp > 1
            and group is not None
            and self._stream is None
            and self.backend == "gloo"
            and type(group) is dist.ProcessGroup
        ):
            self._group_rank = {
                r: dist.get_group_rank(group, r) for r in dist.get_process_group_ranks(group)
            }
        if topology.pp > 1:
            if group is None:
                raise ValueError(f"pp={topology.pp} needs a pp process group, got None")
            # NCCL requires the first batched P2P call on a group to involve every member; a
            # collective first makes communicator creation collective and deterministic.
            probe = torch.zeros(1, device=self.device)
            work = self._collective(lambda: dist.all_reduce(probe, group=group, async_op=True))
            assert work is not None  # async_op=True always returns a work
            # Ranks reach this point seconds apart (model building, data loading, a previous
            # job's teardown): a short step watchdog must not fire here, only a real hang.
            self._wait(
                [work],
                "waiting for the other pipeline ranks to build their engine",
                min_timeout=SETUP_RENDEZVOUS_TIMEOUT,
            )

    @property
    def ordered_posting(self) -> bool:
        """Post in the schedule's global message order (:mod:`lightning_pp.p2p_order`): what
        NCCL's one stream per rank needs (gloo matches by tag and needs no order)."""
        return self.backend == "nccl" and self.topology.pp > 1

    @property
    def emulating_nccl(self) -> bool:
        """True when the traffic runs under the NCCL emulation."""
        return self._stream is not None

    def _collective(self, start: Callable[[], Work | None]) -> Work | None:
        """Start a collective on the pp group (on the emulated stream, behind earlier batches,
        as NCCL runs it on the same stream as the group's point-to-point batches)."""
        if self._stream is not None:
            return self._stream.collective(start)  # type: ignore[return-value]
        return start()

    # -- blocking ----------------------------------------------------------------------------
    def _wait(self, works: Sequence[Work], what: str, min_timeout: float = 0.0) -> None:
        """Block on ``works`` through the monitor (abortable, watched) when there is one."""
        if not works:
            return
        if self.monitor is None:
            for w in works:
                w.wait()
            return
        self.monitor.wait(works, what, min_timeout=min_timeout)

    def _wait_recv(self, pending: PendingRecv, header: bool) -> None:
        works = pending.header_works if header else pending.works
        if not works:
            return
        if self.monitor is None:
            for w in works:
                w.wait()
            return
        marks = [pending.header_mark] if header else pending.marks
        self.monitor.wait(
            works,
            lambda: pending.describe(header),
            peer=pending.request.peer,
            landed=(lambda: _landed(marks)) if self._mark_landing else None,
        )

    def receive(self, pending: PendingRecv) -> tuple[torch.Tensor, ...]:
        """Block until ``pending`` has arrived (an activation still waiting for its header: the
        header, then the data) and return its tensors; the time blocked adds to ``waited``."""
        t0 = time.perf_counter()
        try:
            if pending.header is not None:
                self._wait_recv(pending, header=True)
                self._post_data(pending)
            self._wait_recv(pending, header=False)
            return pending.tensors
        finally:
            pending.waited += time.perf_counter() - t0

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """Broadcast ``tensor`` from global rank ``src`` over the pp group, in place (watched
        like every other wait; ``what`` describes it in hang and abort messages)."""
        work = self._collective(
            lambda: dist.broadcast(tensor, src=src, group=self.group, async_op=True)
        )
        self._wait([work] if work is not None else [], what)

    # -- tags and headers ------------------------------------------------------------------
    @staticmethod
    def tag(kind: int, stage: int, header: bool) -> int:
        return ((stage * 2 + kind) * 2) + int(header)

    @staticmethod
    def describe_tag(tag: int) -> str:
        """What a message with ``tag`` carries: ``the activation header for stage 3``."""
        header, kind, stage = tag % 2, (tag // 2) % 2, tag // 4
        return f"the {_KIND[kind]}{' header' if header else ''} for stage {stage}"

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
        is_tuple, n, pos = bool(words[2]), words[3], 4
        specs: list[Spec] = []
        for _ in range(n):
            code, ndim = words[pos], words[pos + 1]
            specs.append((tuple(words[pos + 2 : pos + 2 + ndim]), _DTYPES[code]))
            pos += 2 + ndim
        return is_tuple, specs

    def may_post_ahead(self, req: RecvRequest) -> bool:
        """Whether ``req`` may be posted now, ahead of its channel's receives still waiting for
        a header: only another header receive may (it goes to the header channel, in order).
        An in-process hand-over (the turn of a V placement) exists only once it was produced."""
        if req.peer == self.topology.rank:
            return bool(self._local.get((req.kind, req.stage, req.mb)))
        if req.kind != ACT or not self._awaiting_header.get(req.stage):
            return True
        return not (self.static_shapes and (req.stage, req.mb) in self._agreed)

    def _recv_buffers(
        self, specs: Sequence[Spec]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Fresh receive buffers for ``specs``, and their landing marks (if marking)."""
        buffers = [torch.empty(s, dtype=d, device=self.device) for s, d in specs]
        return buffers, [_arm(b) for b in buffers] if self._mark_landing else []

    def _post_data(self, pending: PendingRecv) -> None:
        """``pending``'s header has arrived: size its buffers and post its data receive."""
        req = pending.request
        assert pending.header is not None
        self._awaiting_header[req.stage] -= 1
        is_tuple, specs = self._decode(pending.header, req)
        if self.static_shapes:
            self._agreed[(req.stage, req.mb)] = (is_tuple, specs)
        pending.is_tuple = is_tuple
        pending.header = None
        pending.buffers, pending.marks = self._recv_buffers(specs)
        tag = self.tag(req.kind, req.stage, False)
        ops = [_Op(False, b, req.peer, tag) for b in pending.buffers]
        pending.works = self._post(ops, pending.describe())

    def _post(self, ops: list[_Op], what: str) -> list[Work]:
        """Post ``ops`` as one batch (``batch_isend_irecv``, or straight on a gloo group); a
        failure caused by a peer that already aborted says so."""
        if not ops:
            return []
        if self._stream is not None:
            return [self._stream.batch(self._p2p_ops(ops))]  # type: ignore[list-item]
        try:
            if self._group_rank is not None:
                return self._post_direct(ops)
            return list(dist.batch_isend_irecv(self._p2p_ops(ops)))
        except Exception as e:
            if self.monitor is not None:  # e.g. "connection closed by peer" after its failure
                self.monitor.explain_failure(what, e)  # or a peer that vanished: name it
            raise

    def _p2p_ops(self, ops: list[_Op]) -> list[dist.P2POp]:
        return [
            dist.P2POp(dist.isend if o.send else dist.irecv, o.tensor, o.peer, self.group, o.tag)
            for o in ops
        ]

    def _post_direct(self, ops: list[_Op]) -> list[Work]:
        """gloo: each op straight on the process group. gloo does not coalesce a batch (torch's
        ``batch_isend_irecv`` loops over ``isend``/``irecv`` for it), and that Python path
        (op-list checks, group lookups and rank translation per op) costs about 25 us per op:
        posting a send and a receive together took 106 us that way against 54 us here (2 ranks
        on a 2-core machine, ``python benchmarks/profile_overhead.py --pingpong``), and a
        pipeline action posts one to four."""
        group, ranks = self.group, self._group_rank
        assert group is not None and ranks is not None
        return [
            group.send([op.tensor], ranks[op.peer], op.tag)
            if op.send
            else group.recv([op.tensor], ranks[op.peer], op.tag)
            for op in ops
        ]

    # -- posting -----------------------------------------------------------------------------
    def exchange(
        self, sends: Sequence[Message], recvs: Sequence[RecvRequest]
    ) -> tuple[PendingSend, list[PendingRecv]]:
        """Post ``sends``, then ``recvs``, as one batch (:meth:`_post`: ``batch_isend_irecv``,
        or each op straight on a gloo group).

        Returns the pending sends (wait or poll before reusing their buffers; they keep them
        alive) and one :class:`PendingRecv` per request, in order. Nothing here blocks.
        """
        me = self.topology.rank
        batch = _OpBatch(self.group)
        sent = PendingSend([], [], self.monitor, [m.peer for m in sends if m.peer != me])
        for msg in sends:
            self._add_send(batch, msg, sent)
        pendings = [self._add_recv(batch, req) for req in recvs]
        batch.assign(self._post(batch.ops, "posting sends/receives"))
        return sent, pendings

    def exchange_ordered(
        self, sends: Sequence[Message], recvs: Sequence[RecvRequest]
    ) -> tuple[PendingSend, list[PendingRecv]]:
        """:meth:`exchange` for ordered posting: ``recvs`` come in the global message order, and
        an activation whose shape is not agreed yet gets its data receive posted before
        anything later in that order, so this waits for its header here (a batch of its own;
        the wait is added to the receive's ``waited``)."""
        me = self.topology.rank
        batch = _OpBatch(self.group)
        sent = PendingSend([], [], self.monitor, [m.peer for m in sends if m.peer != me])
        for msg in sends:
            self._add_send(batch, msg, sent)
        pendings = []
        for req in recvs:
            pending = self._add_recv(batch, req)
            pendings.append(pending)
            if pending.header is not None:
                batch.assign(self._post(batch.ops, "posting sends/receives"))
                batch = _OpBatch(self.group)
                t0 = time.perf_counter()
                self._wait_recv(pending, header=True)
                self._post_data(pending)
                pending.waited += time.perf_counter() - t0
        batch.assign(self._post(batch.ops, "posting sends/receives"))
        return sent, pendings

    def _add_send(self, batch: _OpBatch, msg: Message, sent: PendingSend) -> None:
        tensors = tuple(t.detach().contiguous() for t in msg.tensors)
        if msg.peer == self.topology.rank:  # a local chunk's stage (pp == 1, a V's turn)
            key = (msg.kind, msg.stage, msg.mb)
            self._local.setdefault(key, deque()).append((msg.is_tuple, tensors))
            return
        if self._header_needed(msg, tensors):
            header = self._encode(msg)
            sent.buffers.append(header)
            batch.add(True, header, msg.peer, self.tag(msg.kind, msg.stage, True), sent.works)
        tag = self.tag(msg.kind, msg.stage, False)
        for t in tensors:
            sent.buffers.append(t)
            batch.add(True, t, msg.peer, tag, sent.works)

    def _header_needed(self, msg: Message, tensors: tuple[torch.Tensor, ...]) -> bool:
        """Activations carry a header, except under static shapes once agreed (then checked)."""
        if msg.kind != ACT:
            return False
        if not self.static_shapes:
            return True
        agreed = self._agreed.get((msg.stage, msg.mb))
        if agreed is None:
            self._agreed[(msg.stage, msg.mb)] = (msg.is_tuple, specs_of(tensors))
            return True
        self._check_static(msg, agreed, tensors)
        return False

    def _add_recv(self, batch: _OpBatch, req: RecvRequest) -> PendingRecv:
        pending = PendingRecv(req)
        if req.peer == self.topology.rank:
            queue = self._local.get((req.kind, req.stage, req.mb))
            if not queue:
                raise RuntimeError(
                    f"rank {req.peer}: local {_KIND[req.kind]} for stage {req.stage} mb={req.mb} "
                    f"was never produced (schedule runs a consumer before its producer)"
                )
            pending.is_tuple, tensors = queue.popleft()
            pending.buffers = list(tensors)  # no works: receive() returns them at once
            return pending
        specs = req.specs
        if req.kind == ACT:
            agreed = self._agreed.get((req.stage, req.mb)) if self.static_shapes else None
            if agreed is None:  # the header first; receive() posts the data once it is in
                self._awaiting_header[req.stage] = self._awaiting_header.get(req.stage, 0) + 1
                pending.header = torch.empty(self.header_len, dtype=torch.int64, device=self.device)
                if self._mark_landing:
                    pending.header_mark = _arm(pending.header)
                tag = self.tag(req.kind, req.stage, True)
                batch.add(False, pending.header, req.peer, tag, pending.header_works)
                return pending
            pending.is_tuple, specs = agreed
        if specs is None:
            raise ValueError(f"receive of a {_KIND[req.kind]} needs specs (shapes and dtypes)")
        pending.buffers, pending.marks = self._recv_buffers(specs)
        tag = self.tag(req.kind, req.stage, False)
        for b in pending.buffers:
            batch.add(False, b, req.peer, tag, pending.works)
        return pending

    def _check_static(
        self, msg: Message, agreed: tuple[bool, list[Spec]], tensors: Sequence[torch.Tensor]
    ) -> None:
        is_tuple, specs = agreed
        got = specs_of(tensors)
        if got != specs or is_tuple != msg.is_tuple:
            raise ValueError(
                f"static_shapes: rank {self.topology.rank} -> rank {msg.peer} activation for "
                f"stage {msg.stage} mb={msg.mb} changed from the agreed {format_specs(specs)} to "
                f"{format_specs(got)}; use static_shapes=False for varying shapes"
            )

    def receive_window(
        self, count: int, lookahead: int, needs: Needs, order: RankOrder | None = None
    ) -> ReceiveWindow:
        """A :class:`ReceiveWindow` over ``count`` actions (one step of one rank); ``order``:
        post in that global message order instead of ``lookahead`` actions ahead."""
        return ReceiveWindow(self, count, lookahead, needs, order)


Needs = Callable[[int, bool], "list[RecvRequest] | None"]
"""``needs(index, ahead)``: the receives action ``index`` needs; ``ahead`` says it is a later
action than the next one, and ``None`` then means its receives cannot be stated yet (a gradient
whose forward has not run has no shape)."""


class ReceiveWindow:
    """One step's receives, posted ahead in action order.

    After action ``i`` the engine calls :meth:`exchange` with that action's messages: they go out
    together with the receives of actions ``i+1 .. i+lookahead`` not posted yet. The next
    action's receives always go out; later ones while ``needs`` can state them and the channel
    allows (:meth:`P2PCommunicator.may_post_ahead`), stopping at the first that cannot (a
    channel's receives must be posted in order). :meth:`wait` then hands over what an action
    received.

    Example (one rank's step)::

        window = comm.receive_window(len(actions), 8, needs)
        window.exchange([], after=-1)            # before the first action
        for i, action in enumerate(actions):
            received, waited = window.wait(i)
            sent = window.exchange(compute(action, received), after=i)
    """

    def __init__(
        self,
        comm: P2PCommunicator,
        count: int,
        lookahead: int,
        needs: Needs,
        order: RankOrder | None = None,
    ) -> None:
        self.comm = comm
        self.count = count
        self.lookahead = lookahead
        self.order = order
        self._needs = needs
        self._posted: dict[int, list[PendingRecv]] = {}
        self.posted_after: dict[int, int] = {}  # action index -> index it was posted after
        self._upto = -1  # the last action whose receives were posted
        self._taken: set[int] = set()  # ordered posting: actions whose receives were posted
        self.current: list[PendingRecv] = []  # the receives taken by the last wait()

    def exchange(self, sends: Sequence[Message], *, after: int) -> PendingSend:
        """Post ``sends`` (of action ``after``; ``-1`` before the first), then the receives of
        the actions up to ``after + lookahead`` not posted yet."""
        if self.order is not None:
            return self._exchange_ordered(sends, after)
        # The sends go out first, on their own: a neighbour may be blocked waiting for them, and
        # stating the lookahead receives (and allocating their buffers) would delay its wake-up.
        # gloo matches by tag, so a separate batch changes nothing else (NCCL posts in order,
        # above).
        sent = self.comm.exchange(sends, [])[0]
        reqs: list[RecvRequest] = []
        counts: list[tuple[int, int]] = []
        j, last = self._upto + 1, min(after + self.lookahead, self.count - 1)
        while j <= last:
            ahead = j > after + 1
            needs = self._needs(j, ahead)
            if needs is None or (ahead and not all(map(self.comm.may_post_ahead, needs))):
                break
            reqs += needs
            counts.append((j, len(needs)))
            j += 1
        _, pendings = self.comm.exchange([], reqs)
        k = 0
        for index, n in counts:
            self._posted[index] = pendings[k : k + n]
            k += n
            if n:
                self.posted_after[index] = after
        self._upto = j - 1
        return sent

    def _exchange_ordered(self, sends: Sequence[Message], after: int) -> PendingSend:
        """Ordered posting (NCCL): with ``sends`` go the receives of every later action whose
        message comes before this rank's next send in the global order, in that order (and the
        next action's, e.g. an in-process hand-over)."""
        order = self.order
        assert order is not None
        bound = order.next_send(after)
        chosen = []
        for j in range(max(after + 1, 0), self.count):
            if j in self._taken:
                continue
            number = order.recv[j]
            if j == after + 1 or (number is not None and (bound is None or number < bound)):
                chosen.append((-1 if number is None else number, j))
        chosen.sort()
        reqs: list[RecvRequest] = []
        counts: list[tuple[int, int]] = []
        for _, j in chosen:
            needs = self._needs(j, j > after + 1)
            if needs is None:
                raise RuntimeError(
                    f"rank {self.comm.topology.rank}: ordered posting: the receive of action "
                    f"{j} is due after action {after} but its shape is not known yet"
                )
            reqs += needs
            counts.append((j, len(needs)))
        sent, pendings = self.comm.exchange_ordered(sends, reqs)
        k = 0
        for index, n in counts:
            self._posted[index] = pendings[k : k + n]
            self._taken.add(index)
            k += n
            if n:
                self.posted_after[index] = after
        return sent

    def outstanding(self) -> list[PendingRecv]:
        """Every receive posted and not yet consumed (a failed step's leftovers)."""
        return self.current + [p for posted in self._posted.values() for p in posted]

    def wait(self, index: int) -> tuple[list[PendingRecv], float]:
        """Block until every receive of action ``index`` has arrived; returns them (``tensors``
        holds the data) and the seconds spent blocked."""
        pending = self.current = self._posted.pop(index)
        for p in pending:
            self.comm.receive(p)
        return pending, sum(p.waited for p in pending)

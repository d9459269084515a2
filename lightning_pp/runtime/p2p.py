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
order instead (:mod:`lightning_pp.runtime.p2p_order`, :meth:`P2PCommunicator.exchange_ordered`: a
header
is waited for before anything later in that order is posted). ``LIGHTNING_PP_EMULATE_NCCL=1``
runs gloo under NCCL's rules for tests (:mod:`lightning_pp.runtime.nccl_emulation`). A message whose
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

import torch
import torch.distributed as dist
from torch.distributed import Work

from ..layout.topology import PipelineTopology
from .failure import FailureMonitor
from .nccl_emulation import EmulatedStream, emulation_enabled
from .p2p_order import RankOrder
from .p2p_wire import (
    _DTYPE_CODE,
    _DTYPES,
    _KIND,
    _MAGIC,
    ACT,
    Message,
    PendingRecv,
    PendingSend,
    RecvRequest,
    Spec,
    _arm,
    _landed,
    _Op,
    _OpBatch,
    format_specs,
    specs_of,
)
from .receive_window import Needs, ReceiveWindow

__all__ = ["P2PCommunicator", "p2p_backend"]

# Seconds the set-up rendezvous may wait before the watchdog calls it a hang (at least; a larger
# watchdog_timeout wins).
SETUP_RENDEZVOUS_TIMEOUT = 120.0


def p2p_backend(group: dist.ProcessGroup | None) -> str:
    """The backend whose rules the pipeline traffic on ``group`` follows: ``"nccl"`` under the
    NCCL emulation (:mod:`lightning_pp.runtime.nccl_emulation`), else the group's backend
    (``"gloo"``
    without a process group). The engine picks its defaults (receive lookahead, how the monitor
    waits) from it."""
    if emulation_enabled():
        return "nccl"
    try:
        return str(dist.get_backend(group))
    except Exception:  # no process group (single-rank unit tests)
        return "gloo"


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
            gloo (a test harness: :mod:`lightning_pp.runtime.nccl_emulation`); ``None``: the
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
        """Post in the schedule's global message order (:mod:`lightning_pp.runtime.p2p_order`): what
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
        if not sends and not recvs:
            # About 40 % of a step's calls post nothing (a W's sends, a window already posted
            # ahead): no batch to set up. zb-auto-2p, p=4, m=8 on the virtual device: 0.2-0.4
            # ms less CPU per rank and step (one A/B run in one process group).
            return PendingSend([], []), []
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

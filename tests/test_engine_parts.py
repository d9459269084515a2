"""The engine's collaborators on their own: placement, the stash's running totals, the recorder,
and the gather of what it recorded. Single process, no torch.distributed."""

from __future__ import annotations

import pytest
import torch

from lightning_pp.callbacks.gather import _pack, _unpack
from lightning_pp.layout.topology import PipelineTopology
from lightning_pp.runtime.engine_step import ChunkPlace, Stash, _Entry, place_chunks
from lightning_pp.runtime.p2p_wire import ACT, PendingRecv, PendingSend, RecvRequest
from lightning_pp.runtime.receive_window import ReceiveWindow
from lightning_pp.runtime.records import StepRecorder
from lightning_pp.schedules import Action, Op, Schedule, build_schedule

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


def _rescanned_bytes(stash: Stash) -> int:
    """What the step record counted before the totals were kept incrementally: the unique
    (data pointer, elements, dtype) of every stashed input and output, summed at once."""
    seen, total = set(), 0
    for q in stash.queues:
        for e in q:
            for t in (*e.inputs, *e.outputs):
                key = (t.data_ptr(), t.numel(), t.dtype)
                if key not in seen:
                    seen.add(key)
                    total += t.numel() * t.element_size()
    return total


def test_stash_totals_match_a_rescan_through_release_and_shared_tensors():
    stash = Stash(chunks=2)
    w = torch.randn(8, 8, requires_grad=True)
    shared = torch.randn(4, 8)  # one input held by two entries (counted once)
    checks = []
    for mb in range(3):
        x = shared if mb < 2 else torch.randn(4, 8)
        y = x @ w
        stash.push(0, _Entry(mb, (x,), (y, y), [0, 1], [], saved_keys={mb: 10 * (mb + 1)}))
        checks.append((stash.nbytes, _rescanned_bytes(stash)))
        stash.release_outputs(0)  # y (listed twice) now holds a 1-element storage
        checks.append((stash.nbytes, _rescanned_bytes(stash)))
        # the next chunk receives y's data as its input (pp=1 style hand-over: an alias)
        stash.push(1, _Entry(mb, (x.detach(),), (), [], [], saved_keys={mb: 1}))
        checks.append((stash.nbytes, _rescanned_bytes(stash)))
    assert stash.inflight == 6 and stash.saved_bytes == 10 + 20 + 30 + 3
    for chunk in (1, 0, 1, 0, 1, 0):
        stash.pop(chunk)
        checks.append((stash.nbytes, _rescanned_bytes(stash)))
    assert all(got == want for got, want in checks), checks
    assert (stash.inflight, stash.nbytes, stash.saved_bytes) == (0, 0, 0)


def test_place_chunks_follows_the_schedules_placement():
    loop = build_schedule("interleaved", pp=4, vpp=2, microbatches=8)
    topo = PipelineTopology.from_world(8, 2, pp=4)  # dp=2: pp_rank 1
    assert place_chunks(loop, topo) == [
        ChunkPlace(stage=1, first=False, last=False, prev_rank=0, next_rank=4),
        ChunkPlace(stage=5, first=False, last=False, prev_rank=0, next_rank=4),
    ]
    # V placement: rank r holds stages r and 2p-1-r; the pipeline turns on the last rank
    ranks = tuple(tuple(loop.ranks[r]) for r in range(4))
    v = Schedule(name="v", pp=4, vpp=2, microbatches=8, ranks=ranks, placement="v")
    last = PipelineTopology.from_world(4, 3, pp=4)
    assert place_chunks(v, last) == [
        ChunkPlace(stage=3, first=False, last=False, prev_rank=2, next_rank=3),
        ChunkPlace(stage=4, first=False, last=False, prev_rank=3, next_rank=2),
    ]
    first = place_chunks(v, PipelineTopology.from_world(4, 0, pp=4))
    assert first[0].first and first[1].last and first[1].prev_rank == 1


def test_recorded_events_survive_the_gather():
    s = build_schedule("1f1b", pp=2, microbatches=2)
    rec = StepRecorder(1, 1, s, t0=0.0)
    for i, a in enumerate(s.ranks[1]):
        rec.add(
            a,
            start=float(i),
            comm_wait=0.1,
            compute_end=i + 0.5,
            sent=a.op is Op.B,
            recv_posted_after=i - 1 if a.op is Op.F else None,
            stash_bytes=100 * i,
            saved_bytes=10 * i,
            inflight=i % 2,
            send_bytes=7,
            layers=0.25 * i,
        )
    record = rec.finish()
    assert record.peak_stash_bytes == 300 and record.peak_inflight == 1
    assert [e.recv_posted_after for e in record.events] == [-1, None, 1, None]
    assert record.events[1].send_time == 1.5 and record.events[0].send_time is None
    assert [e.layers for e in record.events] == [0.0, 0.25, 0.5, 0.75]
    assert _unpack(_pack(record), s) == record
    assert Action(Op.F, 0) == record.events[0].action


class _Channel:
    """A channel in one process: records what is posted, and (like the communicator) refuses
    to post an in-process hand-over ahead before it was produced."""

    def __init__(self, rank: int) -> None:
        self.topology = PipelineTopology(world_size=4, pp=4, dp=1, rank=rank)
        self.produced: set[tuple[int, int]] = set()  # (stage, mb) handed over in-process
        self.posted: list[tuple[int, int, int]] = []  # (peer, stage, mb) in posting order

    def exchange(self, sends, recvs):
        for r in recvs:
            if r.peer == self.topology.rank:
                assert (r.stage, r.mb) in self.produced, f"local {r} posted before produced"
            self.posted.append((r.peer, r.stage, r.mb))
        return PendingSend([], []), [PendingRecv(r) for r in recvs]

    def exchange_ordered(self, sends, recvs):
        raise AssertionError("not under NCCL's rules here")

    def may_post_ahead(self, req: RecvRequest) -> bool:
        return req.peer != self.topology.rank or (req.stage, req.mb) in self.produced

    def receive(self, pending: PendingRecv) -> tuple:
        return ()


def test_the_receive_window_posts_past_a_turn_not_handed_over_yet():
    """The turn of a V (rank 3 of pp=4: its stage 3 hands stage 4 its output in-process): the
    window posts the remote receives behind a hand-over not produced yet, and takes the hand-over
    when its action runs. It stopped at it, so every remote receive after a turn was posted one
    action ahead instead of ``lookahead`` (measured: 17 of rank 3's 32 under zb-auto-2p)."""
    rank = 3
    acts = [("remote", 3, 0), ("local", 4, 0), ("remote", 3, 1), ("local", 4, 1), ("remote", 3, 2)]

    def needs(index: int, ahead: bool) -> list[RecvRequest]:
        where, stage, mb = acts[index]
        peer = rank if where == "local" else 2
        return [RecvRequest(ACT, peer, stage, mb)]

    channel = _Channel(rank)
    window = ReceiveWindow(channel, len(acts), 8, needs)
    window.exchange([], after=-1)
    # every remote receive went out before the first action ran; no hand-over did
    assert channel.posted == [(2, 3, 0), (2, 3, 1), (2, 3, 2)]
    for i, (_, stage, mb) in enumerate(acts):
        got, _ = window.wait(i)
        assert [(p.request.stage, p.request.mb) for p in got] == [(stage, mb)]
        if i + 1 < len(acts) and acts[i + 1][0] == "local":
            channel.produced.add(acts[i + 1][1:])  # this action's output, handed over
        window.exchange([], after=i)
    assert channel.posted[3:] == [(rank, 4, 0), (rank, 4, 1)]
    assert window.outstanding() == window.current  # nothing posted is left unconsumed

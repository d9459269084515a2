"""The engine's collaborators on their own: placement, the stash's running totals, the recorder,
and the gather of what it recorded. Single process, no torch.distributed."""

from __future__ import annotations

import pytest
import torch

from lightning_pp.callbacks.gather import _pack, _unpack
from lightning_pp.layout.topology import PipelineTopology
from lightning_pp.runtime.engine_step import ChunkPlace, Stash, _Entry, place_chunks
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

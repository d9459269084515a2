"""Failures must be loud and named: mismatched neighbours, changed static shapes, bad orders."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import DistributedFailure, run_distributed
from engine_models import (
    HID,
    IN,
    OUT,
    grad_errors,
    make_chunks,
    mlp_batch,
    mlp_layers,
    mse_loss,
    run_reference,
)
from torch import nn

from lightning_pp.layout.partition import PipelineChunk
from lightning_pp.layout.topology import PipelineTopology, build_process_groups
from lightning_pp.runtime.engine import PipelineEngine, PipelineStepError
from lightning_pp.schedules import Action, Op, Schedule, build_schedule

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

WORLD = 6  # pp=2, dp=3: pipelines {0, 3}, {1, 4}, {2, 5}, one broken in a different way each


def _broken_worker(rank, world_size):
    topo = PipelineTopology.from_world(world_size, rank, pp=2)
    groups = build_process_groups(topo)
    schedule = build_schedule("1f1b", pp=2, microbatches=2)
    kind = ["shape", "dtype", "static"][topo.dp_rank]
    torch.manual_seed(0)
    if topo.pp_rank == 0:
        out_dim = 8 if kind == "shape" else 16
        layer = nn.Linear(IN, out_dim)
        if kind == "dtype":
            layer = layer.double()
        chunk = PipelineChunk([layer], [0])
    else:
        chunk = PipelineChunk([nn.Linear(16, 3)], [1])
    engine = PipelineEngine(
        [chunk],
        schedule,
        topo,
        groups,
        loss_fn=mse_loss("mean"),
        input_fn=(lambda mb: mb[0].double()) if kind == "dtype" else None,
        static_shapes=kind == "static",
        # three pipelines break independently here; the job-wide abort channel would stop the
        # slower ones with PipelineAborted before their own error (tests/test_faults.py covers it)
        abort_on_failure=False,
    )
    engine.train_step(mlp_batch(0, 8))
    engine.train_step(mlp_batch(1, 6))  # static: the batch size changed after agreement
    return "finished"


def test_mismatched_neighbours_name_both_ranks_mb_and_shapes():
    with pytest.raises(DistributedFailure) as info:
        run_distributed(_broken_worker, WORLD, timeout=120, pg_timeout=60, grace=4)
    f = info.value.failures
    # receivers of pipeline 0 (shape) and 1 (dtype), sender of pipeline 2 (static shapes)
    shape, dtype, static = f[3], f[4], f[2]
    assert "PipelineStepError: rank 3 (pp_rank 1): F mb=0 chunk=0" in shape
    assert "received from rank 0 (stage 0) for mb=0" in shape
    assert "[(4, 8) float32]" in shape  # what arrived: 8 features where 16 are expected
    assert "rank 4 (pp_rank 1): F mb=0 chunk=0" in dtype
    assert "received from rank 1 (stage 0) for mb=0" in dtype and "float64" in dtype
    assert "rank 2 (pp_rank 0): F mb=0 chunk=0" in static
    assert "rank 2 -> rank 5" in static and "mb=0" in static
    assert "agreed [(4, 16) float32] to [(3, 16) float32]" in static
    assert "> rank 0:" in static  # the schedule grid marks the failing rank's row
    # the partners block on the failed rank; the harness ends them instead of hanging
    assert set(f) == set(range(WORLD))


# ---- single-process (pp=1) checks: no process group needed ------------------------------------


def _pp1_engine(schedule, layers, **kw):
    topo = PipelineTopology(world_size=1, pp=1, dp=1, rank=0)
    chunks = make_chunks(layers, 1, schedule.vpp, 0)
    return chunks, PipelineEngine(chunks, schedule, topo, None, loss_fn=mse_loss("mean"), **kw)


def test_misordered_backward_is_named_not_silent():
    bad = Schedule(
        "bad",
        pp=1,
        vpp=1,
        microbatches=2,
        ranks=((Action(Op.F, 0), Action(Op.F, 1), Action(Op.B, 1), Action(Op.B, 0)),),
    )
    _, engine = _pp1_engine(bad, mlp_layers(0))
    with pytest.raises(PipelineStepError) as info:
        engine.train_step(mlp_batch(0, 4))
    msg = str(info.value)
    assert msg.startswith("rank 0 (pp_rank 0): B mb=1 chunk=0:")
    assert "oldest stashed forward of chunk 0 is mb=0" in msg
    assert "[B1]" in msg


@pytest.mark.parametrize("release", [True, False])
def test_pp1_with_two_local_chunks_matches_reference(release):
    layers = mlp_layers(3)
    ref = copy.deepcopy(layers)
    chunks, engine = _pp1_engine(
        build_schedule("gpipe", pp=1, microbatches=3, vpp=2), layers, release_outputs=release
    )
    batch = mlp_batch(5, 7)
    res = engine.train_step(batch)
    ref_loss = run_reference(ref, batch, mse_loss("mean"))
    assert abs(res.loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    assert max(grad_errors(chunks, ref).values()) <= 1e-6


def test_gradients_accumulate_across_steps():
    layers = mlp_layers(4)
    chunks, engine = _pp1_engine(build_schedule("gpipe", pp=1, microbatches=2), layers)
    batch = mlp_batch(0, 4)
    engine.train_step(batch)
    once = [p.grad.clone() for c in chunks for p in c.parameters()]
    engine.train_step(batch)
    twice = [p.grad for c in chunks for p in c.parameters()]
    for a, b in zip(once, twice):
        torch.testing.assert_close(b, 2 * a)


def test_constructor_rejects_wrong_chunk_count_and_reduction():
    layers = mlp_layers(0)
    topo = PipelineTopology(world_size=1, pp=1, dp=1, rank=0)
    sched = build_schedule("gpipe", pp=1, microbatches=2, vpp=2)
    with pytest.raises(ValueError, match="got 1 chunks but the schedule has vpp=2"):
        PipelineEngine(make_chunks(layers, 1, 1, 0), sched, topo, None, loss_fn=mse_loss("mean"))
    with pytest.raises(ValueError, match="loss_reduction"):
        PipelineEngine(
            make_chunks(layers, 1, 2, 0),
            sched,
            topo,
            None,
            loss_fn=mse_loss("mean"),
            loss_reduction="avg",
        )


def test_batch_smaller_than_microbatches():
    _, engine = _pp1_engine(build_schedule("gpipe", pp=1, microbatches=4), mlp_layers(0))
    with pytest.raises(
        ValueError, match="batch size 3 is smaller than the number of microbatches 4"
    ):
        engine.train_step(mlp_batch(0, 3))


def test_recv_lookahead_is_validated_and_resolved():
    from types import SimpleNamespace

    import lightning_pp.runtime.engine as engine_mod

    sched = build_schedule("gpipe", pp=1, microbatches=2)
    with pytest.raises(ValueError, match="recv_lookahead must be a positive integer, got 0"):
        _pp1_engine(sched, mlp_layers(0), recv_lookahead=0)
    # pp=1: every message is in-process and exists only once sent: no lookahead possible
    _, eng = _pp1_engine(sched, mlp_layers(0), recv_lookahead=5)
    assert eng.recv_lookahead == 1
    # pp>1: NCCL runs just in time (one stream per rank), gloo looks ahead; explicit wins
    resolve = engine_mod.PipelineEngine._resolve_lookahead
    fake = SimpleNamespace(pp=2)
    for backend, want in (("nccl", 1), ("gloo", engine_mod.GLOO_RECV_LOOKAHEAD)):
        assert resolve(fake, None, backend) == want
        assert resolve(fake, 3, backend) == 3


class _Fork(nn.Module):
    """Sends ``h`` on and also feeds it to a Linear of its own chunk, which saves ``h`` for
    its backward: the output release must not swap ``h``'s storage."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(IN, HID), nn.Linear(HID, HID)

    def forward(self, x):
        h = self.a(x)
        return h, self.b(h)


class _Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(HID, OUT)

    def forward(self, pair):
        h, z = pair
        return self.c(torch.tanh(h) * z)


@pytest.mark.parametrize("schedule", ["gpipe", "zbv"])
def test_output_also_read_inside_its_chunk_is_not_released(schedule):
    """A chunk output that a layer of the same chunk also saved (here a Linear reading it):
    releasing it made the fused backward fail inside the engine's mm, and a graph-free W raise.
    The release now skips it; every other output is still released, and the gradients match
    the unpipelined reference."""
    torch.manual_seed(3)
    layers = [_Fork(), _Join()]
    ref = copy.deepcopy(layers)
    sched = build_schedule(schedule, pp=1, microbatches=3, vpp=2)
    chunks, engine = _pp1_engine(sched, layers, release_outputs=True)
    seen = []
    chunks[0].register_forward_hook(lambda m, a, out: seen.append(out))
    batch = mlp_batch(2, 6)
    res = engine.train_step(batch)
    ref_loss = run_reference(ref, batch, mse_loss("mean"))
    assert abs(res.loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    assert max(grad_errors(chunks, ref).values()) <= 1e-6
    assert len(seen) == 3
    for h, z in seen:
        assert h.numel() > 1  # read by chunk 0's own Linear: kept
        assert z.numel() == 1  # saved by nobody: released as before

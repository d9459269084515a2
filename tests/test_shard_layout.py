"""The distributed optimizer's row layout and the sharding settings' rules (no processes).

The layout must hand each data-parallel rank exactly ``torch.chunk``'s rows of every parameter
(what a ``DTensor`` with ``Shard(0)`` holds), pad only to whole rows, and lose nothing between
pack and unpack; the rules must refuse impossible settings before anything starts.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn

from lightning_pp import PipelineStrategy
from lightning_pp.layout.plan import PipelinePlan
from lightning_pp.layout.rules import PreflightError
from lightning_pp.runtime.shard_layout import BucketLayout

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

SHAPES = [(5, 3), (4,), (7, 2, 2), (1, 6), ()]


def _params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_each_rank_gets_torch_chunks_rows(dp):
    params = _params()
    for rank in range(dp):
        layout = BucketLayout.build(params, dp, rank)
        for m, p in zip(layout.members, params):
            rows = p.reshape(p.shape[0] if p.dim() else 1, -1)
            chunks = torch.chunk(rows, dp) if rows.shape[0] else ()
            want = chunks[rank] if rank < len(chunks) else rows[:0]
            assert torch.equal(m.local_piece(p.data).reshape(-1, rows.shape[1]), want)


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_reduce_scatter_layout_sums_rows_and_gathers_back(dp):
    """What ``reduce_scatter_single`` would give each rank (its block of the summed flat
    buffers) is its rows of the summed gradients; the blocks gathered rebuild every tensor."""
    params = _params()
    grads = [[torch.randn(p.shape) for p in params] for _ in range(dp)]
    layouts = [BucketLayout.build(params, dp, r) for r in range(dp)]
    flat = sum(layouts[0].pack(g) for g in grads)  # identical layout on every rank
    blocks = flat.view(dp, -1)
    total = [sum(g[i] for g in grads) for i in range(len(params))]
    for r, layout in enumerate(layouts):
        for m, t in zip(layout.members, total):
            assert torch.allclose(layout.local_view(blocks[r], m), m.local_piece(t))
    gathered = torch.cat(
        [
            layouts[r].pack_local([m.local_piece(t) for m, t in zip(layouts[r].members, total)])
            for r in range(dp)
        ]
    )
    for m, t in zip(layouts[0].members, total):
        assert torch.equal(layouts[0].unpack_full(gathered, m).reshape(t.shape), t)


def test_padding_is_whole_rows_only():
    params = _params()
    layout = BucketLayout.build(params, 2, 0)
    want = sum(
        (math.ceil((s[0] if s else 1) / 2) * 2 - (s[0] if s else 1)) * math.prod(s[1:])
        for s in SHAPES
    )
    assert layout.padding_numel == want == 3 + 4 + 0 + 6 + 1  # (5,3) (7,2,2) (1,6) ()
    assert layout.numel == sum(p.numel() for p in params) + want


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"zero": 3}, "ZeRO-3, sharded parameters, is fsdp=True"),
        ({"zero": True}, "zero must be 0 (no sharding), 1"),
        ({"fsdp": "yes"}, "fsdp must be True or False"),
        ({"zero": 1, "fsdp": True}, "fsdp=True with zero=1: FSDP2 already shards"),
    ],
)
def test_strategy_refuses_impossible_sharding_at_construction(kw, needle):
    with pytest.raises(PreflightError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        PipelineStrategy(pp=2, **kw)


def test_zero_without_replicas_is_refused_by_the_trainer_before_any_process_starts():
    with pytest.raises(PreflightError, match=r"zero=1 shards over .* but dp=1"):
        L.Trainer(accelerator="cpu", devices=2, strategy=PipelineStrategy(pp=2, zero=1))


def test_the_plan_says_what_is_sharded():
    lines = PipelinePlan.build(pp=2, world_size=8, zero=2).describe()
    assert lines[-1] == (
        "data-parallel sharding: zero=2: optimizer state, master weights and gradients over dp=4"
    )
    assert not any("sharding" in x for x in PipelinePlan.build(pp=2, world_size=8).describe())

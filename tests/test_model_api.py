"""The model-author API without processes: PipelineLayers, PipelineMixin, GPT, grad helpers."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

import lightning_pp
from lightning_pp.models import GPT
from lightning_pp.runtime.grad_sync import DeferredGradSync, global_grad_norm
from lightning_pp.strategy.model import PipelineLayers, select_layers
from lightning_pp.strategy.pipeline_strategy import PipelineStrategy

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

KW = dict(vocab_size=16, n_layer=3, n_head=2, n_embd=8, block_size=4, seed=3)


def _gpt(indices=None) -> GPT:
    model = GPT(**KW)
    if indices is None:
        model.configure_model()
    else:
        with select_layers(indices):
            model.configure_model()
    return model


def test_names_keyed_by_original_index_and_only_selected_built():
    model = _gpt([1, 4])
    assert model.layers.built_indices == [1, 4]
    assert model.layers.num_layers == 5
    names = {n.split(".")[1] for n, _ in model.named_parameters()}
    assert names == {"1", "4"}
    with pytest.raises(IndexError, match="layer 0 is not held"):
        model.layers[0]


def test_layer_init_independent_of_which_layers_are_built():
    full = _gpt()
    for indices in ([2], [0, 3], [3, 4]):
        part = _gpt(indices)
        for i in indices:
            for (n, a), (_, b) in zip(
                part.layers[i].named_parameters(), full.layers[i].named_parameters()
            ):
                if i == 4 and n == "head.weight":
                    continue  # tied: initialised by layer 0 (the strategy broadcasts it)
                assert torch.equal(a, b), (i, n)


def test_tied_in_plain_mode_and_locally():
    full = _gpt()
    assert full.layers[0].wte.weight is full.layers[4].head.weight
    both = _gpt([0, 4])
    assert both.layers[0].wte.weight is both.layers[4].head.weight
    assert torch.equal(both.layers[0].wte.weight, full.layers[0].wte.weight)
    # counted once, as in the unpipelined model
    assert sum(p.numel() for p in full.parameters()) == sum(full.layers.layer_param_counts()) - (
        KW["vocab_size"] * KW["n_embd"]
    )


def test_bad_tied_names_are_rejected():
    with pytest.raises(ValueError, match="names layer 5"):
        PipelineLayers([nn.Identity] * 2, tied=[("0.weight", "5.weight")])
    with pytest.raises(ValueError, match="start with a layer index"):
        PipelineLayers([nn.Identity] * 2, tied=[("weight", "1.weight")])


def test_seed_changes_init():
    a = PipelineLayers([lambda: nn.Linear(3, 3)] * 2, seed=0)
    b = PipelineLayers([lambda: nn.Linear(3, 3)] * 2, seed=1)
    assert not torch.equal(a[0].weight, b[0].weight)
    assert not torch.equal(a[0].weight, a[1].weight)


def test_plain_trainer_trains_gpt():
    torch.manual_seed(0)
    x = torch.randint(0, 16, (8, 4))
    data = torch.utils.data.DataLoader(list(zip(x, x.roll(-1, 1))), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
    )
    trainer.fit(GPT(**KW), data, data)
    assert {"train_loss", "val_loss", "val_acc"} <= set(trainer.callback_metrics)


def test_strategy_registered_and_defaults():
    assert lightning_pp.PipelineStrategy is PipelineStrategy
    from lightning.pytorch.strategies import StrategyRegistry

    assert "pipeline" in StrategyRegistry and "pipeline_spawn" in StrategyRegistry
    assert PipelineStrategy(pp=2).schedule_name == "1f1b"
    assert PipelineStrategy(pp=2, vpp=2).schedule_name == "interleaved"


def test_bad_strategy_arguments_fail_before_launch():
    with pytest.raises(ValueError, match="microbatches"):
        PipelineStrategy(pp=4, vpp=2, microbatches=2)  # interleaved needs m >= pp
    with pytest.raises(ValueError, match="does not divide the world size 3"):
        L.Trainer(accelerator="cpu", devices=3, strategy=PipelineStrategy(pp=2), logger=False)


def test_global_grad_norm_matches_torch_single_process():
    params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p)
    ours = global_grad_norm(params, group=None)
    ref = torch.nn.utils.get_total_norm([p.grad for p in params])
    assert torch.allclose(ours, ref, rtol=1e-6)
    skipped = global_grad_norm(params, group=None, skip={id(params[1])})
    assert torch.allclose(skipped, params[0].grad.norm(), rtol=1e-6)


def test_grad_sync_buckets_and_shared_params():
    shared = nn.Parameter(torch.zeros(10))
    a, b = nn.Parameter(torch.zeros(300)), nn.Parameter(torch.zeros(300))
    sync = DeferredGradSync(
        [[a, shared], [b, shared]], group=None, dp_size=2, bucket_cap_mb=1000 * 4 / 2**20
    )
    # the shared parameter is reduced once, with chunk 0 (whose backward ends last)
    assert [[len(bk) for bk in c] for c in sync.chunk_buckets] == [[2], [1]]
    small = DeferredGradSync([[a, b]], group=None, dp_size=2, bucket_cap_mb=400 * 4 / 2**20)
    assert small.num_buckets == 2

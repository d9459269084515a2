"""Single-process tests of the checkpoint format helpers (no process group, no Trainer)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from v1_writer import save_sharded_checkpoint

from lightning_pp.checkpoint.sharded import (
    CheckpointError,
    adapt_scheduler_state,
    load_model_shard,
    load_optimizer_shard,
    optimizer_state_by_name,
    read_index,
    tied_canonical_names,
)
from lightning_pp.strategy.model import PipelineLayers

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


class Tiny(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.layers = PipelineLayers(
            [lambda: nn.Embedding(5, 4), lambda: nn.Linear(4, 4), lambda: nn.Linear(4, 5)],
            seed=seed,
            tied=[("0.weight", "2.weight")],
        )


def _adam(module: nn.Module, split: str) -> torch.optim.Optimizer:
    params = list(module.parameters())
    decay = {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1}
    no_decay = {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}
    groups = {
        "decay_first": [decay, no_decay],
        "no_decay_first": [no_decay, decay],  # same groups, other positions
        "one_group": [{"params": params, "weight_decay": 0.5}],
    }[split]
    return torch.optim.AdamW(groups, lr=1e-2)


def _train(module: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    for _ in range(steps):
        opt.zero_grad()
        module.layers(torch.tensor([[0, 1, 2, 3]])).square().mean().backward()
        opt.step()


def test_round_trip_by_name_into_differently_grouped_optimizer(tmp_path):
    src = Tiny(seed=0)
    opt = _adam(src, "decay_first")
    _train(src, opt)
    canonical = tied_canonical_names(src, src.layers)
    assert canonical == {"layers.0.weight": "layers.0.weight", "layers.2.weight": "layers.0.weight"}
    ckpt = {
        "state_dict": src.state_dict(),
        "optimizer_states": [optimizer_state_by_name(opt, src, canonical)],
        "global_step": 3,
    }
    path = save_sharded_checkpoint(
        ckpt, tmp_path / "a.ckpt", tag="pp0", canonical=canonical, layout={"pp": 1}
    )
    index = read_index(path)
    assert index["model_files"]["model.pp0.pt"] == sorted(
        k for k in src.state_dict() if k != "layers.2.weight"
    )

    dst = Tiny(seed=1)  # different initial weights
    dst_opt = _adam(dst, "no_decay_first")  # positions differ from the source's
    load_model_shard(path, dst, canonical)
    load_optimizer_shard(path, [dst_opt], dst, canonical)
    for (n, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), n
    assert dst.layers[0].weight is dst.layers[2].weight  # still tied after loading
    src_names = {id(p): n for n, p in src.named_parameters()}
    dst_params = dict(dst.named_parameters())
    for p, st in opt.state.items():
        other = dst_opt.state[dst_params[src_names[id(p)]]]
        for key in st:
            assert torch.equal(st[key], other[key]), (src_names[id(p)], key)
    assert [g["weight_decay"] for g in dst_opt.param_groups] == [0.0, 0.1]

    # the loaded pair continues exactly like the original
    _train(src, opt, 2)
    _train(dst, dst_opt, 2)
    for a, b in zip(src.parameters(), dst.parameters()):
        assert torch.equal(a, b)


def test_saving_over_an_existing_checkpoint_replaces_it(tmp_path):
    m = Tiny()
    canonical = tied_canonical_names(m, m.layers)
    for step in (1, 2):
        save_sharded_checkpoint(
            {"state_dict": m.state_dict(), "global_step": step},
            tmp_path / "last.ckpt",
            tag="pp0",
            canonical=canonical,
            layout={"pp": 1},
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    meta = torch.load(tmp_path / "last.ckpt" / "meta.pt", weights_only=True)
    assert meta["global_step"] == 2
    assert read_index(tmp_path / "last.ckpt")["optim_files"] == {}  # weights-only save


def test_scheduler_lists_follow_this_ranks_groups():
    p1, p2 = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p1], "lr": 0.1}, {"params": [p2], "lr": 0.2}])
    for g, (lr, init) in zip(opt.param_groups, [(0.05, 0.1), (0.07, 0.2)]):
        g["lr"], g["initial_lr"] = lr, init
    saved = {"base_lrs": [0.1], "_last_lr": [0.05], "last_epoch": 4}  # written by a 1-group rank
    state = adapt_scheduler_state(saved, opt)
    assert state == {"base_lrs": [0.1, 0.2], "_last_lr": [0.05, 0.07], "last_epoch": 4}


def test_group_mixing_different_saved_hyperparameters_is_refused(tmp_path):
    src = Tiny()
    opt = _adam(src, "decay_first")
    _train(src, opt, 1)
    canonical = tied_canonical_names(src, src.layers)
    path = save_sharded_checkpoint(
        {"state_dict": src.state_dict(), "optimizer_states": [optimizer_state_by_name(opt, src)]},
        tmp_path / "a.ckpt",
        tag="pp0",
        canonical=canonical,
        layout={"pp": 1},
    )
    dst = Tiny()
    with pytest.raises(CheckpointError, match="weight_decay: 0.1 vs 0.0"):
        load_optimizer_shard(path, [_adam(dst, "one_group")], dst, canonical)

"""A plain Lightning checkpoint's positional optimizer state, named for a pipeline rank.

A real single-process Trainer trains the tiny GPT 3 steps and saves; the file's positional state
is then named from param groups cut as pipeline stages cut them (a stage holding only 1-D
parameters has a single group: the no-decay one, at index 0), and must equal the by-name state
of the very optimizer that wrote it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from pp_common import MODEL_KW, Data  # noqa: E402

from lightning_pp.checkpoint.plain_file import (  # noqa: E402
    local_param_groups,
    optimizer_states_by_name,
    read_plain_checkpoint,
)
from lightning_pp.checkpoint.sharded import (  # noqa: E402
    CheckpointError,
    optimizer_state_by_name,
    tied_canonical_names,
)
from lightning_pp.models import GPT  # noqa: E402

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT(**MODEL_KW)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, Data(1, accumulate=1))
    path = tmp_path_factory.mktemp("plain") / "last.ckpt"
    trainer.save_checkpoint(path)
    optimizer = trainer.optimizers[0]
    canonical = tied_canonical_names(model, model.pipeline_layers())
    name_of = {}
    for name, p in model.named_parameters():  # the first name of a tied parameter: canonical
        name_of.setdefault(id(p), canonical.get(name, name))
    return {
        "path": path,
        "model": model,
        "optimizer": optimizer,
        "name_of": name_of,
        "canonical": canonical,
    }


def _as_two_stages(trained) -> list:
    """The run's groups cut in two 'ranks': A holds every 2-D parameter and half the 1-D ones,
    B only 1-D ones (so B's optimizer has one group, the no-decay one, at index 0)."""
    [groups] = local_param_groups([trained["optimizer"]], trained["name_of"])
    (decay_h, decay), (nodecay_h, nodecay) = groups
    half = len(nodecay) // 2
    rank_a = [(decay_h, decay), (nodecay_h, nodecay[:half])]
    rank_b = [(nodecay_h, nodecay[half:])]
    return [rank_a + rank_b]  # gathered: optimizer 0's groups of every rank


def test_positional_state_is_named_as_the_optimizer_itself_names_it(trained):
    ckpt = read_plain_checkpoint(trained["path"])
    merged = optimizer_states_by_name(ckpt, _as_two_stages(trained), "last.ckpt")
    want = optimizer_state_by_name(trained["optimizer"], trained["model"], trained["canonical"])
    assert set(merged[0]["state"]) == set(want["state"]) and len(want["state"]) > 10
    for name, state in want["state"].items():
        got = merged[0]["state"][name]
        assert got.keys() == state.keys(), name
        for key, value in state.items():
            assert torch.equal(got[key], value), (name, key)
    for name, gi in want["group_of"].items():
        assert merged[0]["group_of"][name] == want["param_groups"][gi], name


def test_an_optimizer_in_another_order_is_refused_naming_the_shapes(trained):
    ckpt = read_plain_checkpoint(trained["path"])
    group = ckpt["optimizer_states"][0]["param_groups"][0]
    group["params"] = list(reversed(group["params"]))  # the decay group, built backwards
    with pytest.raises(CheckpointError, match=r"has shape \(\d+(, \d+)*\), the parameter"):
        optimizer_states_by_name(ckpt, _as_two_stages(trained), "last.ckpt")


def test_groups_that_cannot_be_told_apart_are_refused(trained):
    ckpt = read_plain_checkpoint(trained["path"])
    for g in ckpt["optimizer_states"][0]["param_groups"]:
        g["weight_decay"] = 0.1  # both saved groups now look alike
    with pytest.raises(CheckpointError, match="matches 2 of the 2 saved group"):
        optimizer_states_by_name(ckpt, _as_two_stages(trained), "last.ckpt")


def test_a_group_of_another_size_is_refused(trained):
    ckpt = read_plain_checkpoint(trained["path"])
    groups = _as_two_stages(trained)
    groups[0][0] = (groups[0][0][0], groups[0][0][1][:-1])  # one 2-D parameter fewer
    with pytest.raises(
        CheckpointError,
        match=r"group 0 was saved with (\d+) parameter\(s\), this model's matching group has",
    ):
        optimizer_states_by_name(ckpt, groups, "last.ckpt")


def test_a_file_without_optimizer_state_is_refused(trained, tmp_path):
    ckpt = read_plain_checkpoint(trained["path"])
    ckpt.pop("optimizer_states")
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        optimizer_states_by_name(ckpt, _as_two_stages(trained), "x.ckpt")

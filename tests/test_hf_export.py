"""``lightning-pp consolidate CKPT --hf DIR``: a ``split=`` run's Hugging Face model, exported as a
``save_pretrained`` directory that ``AutoModelForCausalLM.from_pretrained`` loads.

One case of the shared 2-rank Trainer world trains an unmodified GPT-2 (tied head) and Llama
(untied) for two steps at pp2 under ``PipelineStrategy(split=...)``, saves, and predicts (the
pipelined model's logits). The test process exports each checkpoint with the CLI and loads it
with ``from_pretrained(..., output_loading_info=True)``: nothing missing or unexpected, and the
logits equal the pipelined model's and the consolidated state dict's. The refusals (no Hugging
Face model recorded, a model class transformers does not have, a non-empty target) are
single-process units on checkpoints written without a world.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from byom_models import LAYERS, model_fn  # noqa: E402
from worlds import world  # noqa: E402

from lightning_pp.checkpoint.consolidate import consolidated_state_dict  # noqa: E402
from lightning_pp.checkpoint.errors import CheckpointError  # noqa: E402
from lightning_pp.checkpoint.hf_export import export_hf, hf_config_of  # noqa: E402
from lightning_pp.checkpoint.strategy_io import save_pipeline_checkpoint  # noqa: E402
from lightning_pp.commands.cli import main as cli_main  # noqa: E402

TOL = 1e-5
MODELS = {"gpt2": "model.transformer.h", "llama": "model.model.layers"}


def _train(rank: int, size: int, out: str) -> None:
    """Each model: 2 steps at pp2 (split=), save, predict; rank 0 writes the logits."""
    import lightning as L
    from split_common import CausalLM, Data

    from lightning_pp import PipelineStrategy

    torch.set_num_threads(1)
    for name, split in MODELS.items():
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=size,
            strategy=PipelineStrategy(pp=2, microbatches=2, split=split),
            max_steps=2,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            use_distributed_sampler=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        module, data = CausalLM(name), Data(dp=1)
        trainer.fit(module, data)
        trainer.save_checkpoint(f"{out}/ckpt_{name}")
        logits = trainer.predict(module, data)
        if trainer.global_rank == 0:
            Path(out, f"{name}.json").write_text(json.dumps([t.tolist() for t in logits]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_export")
    world("trainer", 2).run(_train, str(out), timeout=600)
    return out


def _inputs() -> list[torch.Tensor]:
    from split_common import Data

    return [x for x, _ in Data(dp=1).predict_dataloader()]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_export_loads_with_from_pretrained_and_matches_the_pipelined_logits(
    runs, tmp_path, name, capsys
):
    ckpt, target = runs / f"ckpt_{name}", tmp_path / "hf"
    assert cli_main(["consolidate", str(ckpt), "--hf", str(target)]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "generation_config.json"} <= {
        p.name for p in target.iterdir()
    }
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        target, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and not info["error_msgs"], info
    assert type(model).__name__ == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[name]
    # tied head written once (HF's own layout), and tied again on load
    from safetensors import safe_open

    with safe_open(str(target / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) == (name == "llama")
    assert model.config.tie_word_embeddings == (name == "gpt2")

    plain = model_fn(name)[0]()
    plain.load_state_dict(consolidated_state_dict(ckpt, "model"), strict=True)
    plain.eval()
    pipelined = json.loads((runs / f"{name}.json").read_text())
    with torch.no_grad():
        for x, want in zip(_inputs(), pipelined, strict=True):
            want = torch.tensor(want)
            got, cons = model(input_ids=x).logits, plain(input_ids=x).logits
            assert ((got - want).norm() / want.norm()).item() <= TOL
            assert ((got - cons).norm() / cons.norm()).item() <= TOL
    # the export holds the trained weights, not a fresh initialisation
    fresh = model_fn(name)[0]()
    assert not torch.equal(fresh.state_dict()["lm_head.weight"], model.lm_head.weight)


# ------------------------------------------------------------------------- single process
class _Holder(nn.Module):
    """A LightningModule's shape: the Hugging Face model as an attribute."""

    def __init__(self, model: nn.Module | None) -> None:
        super().__init__()
        self.model = model if model is not None else nn.Linear(3, 3)


def _save(module: nn.Module, path: Path) -> Path:
    ckpt = {"state_dict": module.state_dict(), "global_step": 2}
    layout = {"pp": 1, "vpp": 1, "dp": 1}
    return save_pipeline_checkpoint(ckpt, path, module=module, layout=layout, canonical={})


def test_hf_config_of_records_the_outermost_models_only():
    assert hf_config_of(_Holder(None)) is None
    record = hf_config_of(_Holder(model_fn("llama")[0]()))
    assert list(record) == ["model"]  # not also model.model (the inner LlamaModel)
    assert record["model"]["class"] == "LlamaForCausalLM"
    assert record["model"]["config"]["num_hidden_layers"] == LAYERS
    assert json.loads(json.dumps(record)) == record


def test_export_from_a_single_process_checkpoint_round_trips(tmp_path):
    torch.manual_seed(0)
    hf = model_fn("gpt2")[0]().eval()
    ckpt = _save(_Holder(hf), tmp_path / "a.ckpt")
    out = export_hf(ckpt, tmp_path / "hf")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    x = torch.randint(1, 60, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, hf(input_ids=x).logits)
    with pytest.raises(CheckpointError, match="not an empty directory"):
        export_hf(ckpt, out)


def test_hf_on_a_checkpoint_without_a_hugging_face_model_names_what_is_missing(tmp_path, capsys):
    ckpt = _save(_Holder(None), tmp_path / "plain.ckpt")
    assert cli_main(["consolidate", str(ckpt), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "records no Hugging Face model" in err and "_Holder" in err
    assert "split=" in err and "--submodule" in err
    assert not (tmp_path / "hf").exists()


def test_hf_refuses_a_class_transformers_does_not_have(tmp_path, monkeypatch):
    import lightning_pp.checkpoint.hf_record as hf_record

    real = hf_record.hf_config_of

    def renamed(module):
        record = real(module)
        record["model"]["class"] = "RemoteCodeForCausalLM"
        return record

    monkeypatch.setattr(hf_record, "hf_config_of", renamed)  # where the save looks it up
    ckpt = _save(_Holder(model_fn("gpt2")[0]()), tmp_path / "a.ckpt")
    with pytest.raises(CheckpointError, match="'RemoteCodeForCausalLM' is not a model class"):
        export_hf(ckpt, tmp_path / "hf")


def test_hf_cli_refusals_name_the_flags(tmp_path, capsys):
    assert cli_main(["consolidate", str(tmp_path)]) == 2
    assert "--hf DIR" in capsys.readouterr().err
    assert cli_main(["consolidate", str(tmp_path), "--hf", "x", "--lightning"]) == 2
    assert "cannot go with --lightning" in capsys.readouterr().err

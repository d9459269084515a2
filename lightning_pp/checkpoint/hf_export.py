"""Export the Hugging Face model of a ``split=`` run as a ``save_pretrained`` directory.

A ``PipelineStrategy(split=...)`` run trains an unmodified ``transformers`` model held by the
LightningModule (``self.model = GPT2LMHeadModel(config)``). At save time :func:`hf_config_of`
records, for each such model, its class name, its ``config`` and its ``generation_config`` as
plain JSON in the checkpoint's metadata (``meta["lightning_pp"]["hf"]``). :func:`export_hf` reads
that record and the consolidated state dict, rebuilds the model class on the meta device (no
weight is initialised), loads the trained tensors into it (``strict``: no missing or unexpected
key) and writes it with the model's own ``save_pretrained``: safetensors, ``config.json``,
``generation_config.json``, and tied weights written once (``tie_word_embeddings``), so that
``AutoModelForCausalLM.from_pretrained(out)`` loads it with nothing missing.

Trust: only a class that ``transformers`` itself exports and that subclasses its
``PreTrainedModel`` is built (a model defined by remote code is refused, not imported); the config
is plain JSON.

Example::

    from lightning_pp.checkpoint.hf_export import export_hf
    export_hf("ckpts/step=500.ckpt", "hf-out/")   # CLI: lightning-pp consolidate CKPT --hf hf-out/
    model = AutoModelForCausalLM.from_pretrained("hf-out/")
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .consolidate import checkpoint_meta, consolidated_state_dict
from .errors import CheckpointError
from .hf_record import HF_META_KEY, hf_config_of

__all__ = ["HF_META_KEY", "export_hf", "hf_config_of", "hf_record_of"]


def _checkpoint_meta(path: Path) -> dict[str, Any]:
    """Lightning's metadata of a checkpoint directory, either format (no pickled code runs)."""
    return checkpoint_meta(path, weights_only=True)


def hf_record_of(path: str | os.PathLike, submodule: str | None = None) -> tuple[str, dict]:
    """``(attribute, record)`` of the Hugging Face model a checkpoint recorded.

    ``submodule`` picks one when the module held several; otherwise the only one is taken.
    Raises :class:`CheckpointError` naming what is missing.
    """
    path = Path(path)
    meta = _checkpoint_meta(path)
    pp_meta = meta.get("lightning_pp") or {}
    records = pp_meta.get(HF_META_KEY)
    cls = pp_meta.get("module_class", "an unknown class")
    if not records:
        raise CheckpointError(
            f"checkpoint {str(path)!r} records no Hugging Face model: --hf exports a "
            f"PipelineStrategy(split=...) run whose LightningModule ({cls}) holds a transformers "
            "PreTrainedModel (e.g. self.model = GPT2LMHeadModel(config)); a checkpoint written "
            "before lightning_pp recorded the model's config records none. Without --hf, "
            "consolidate --submodule ATTR writes the model's plain state dict"
        )
    if submodule is None:
        if len(records) > 1:
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds {len(records)} Hugging Face models "
                f"({', '.join(sorted(records))}); name one with --submodule"
            )
        submodule = next(iter(records))
    submodule = submodule.rstrip(".")
    if submodule not in records:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {submodule!r} is not a Hugging Face model of {cls}; "
            f"it recorded {', '.join(sorted(records))}"
        )
    return submodule, records[submodule]


def _model_class(name: str) -> type:
    import transformers

    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise CheckpointError(
            f"the checkpoint's Hugging Face model class {name!r} is not a model class of the "
            f"installed transformers ({transformers.__version__}); a model defined by remote "
            "code is not imported by the export: write its state dict with consolidate "
            "--submodule and call save_pretrained yourself"
        )
    return cls


def _check_loaded(model: nn.Module, state: Mapping[str, Tensor], where: str) -> None:
    """Every trained tensor is what the model now holds: a tie the config declares but the run
    did not keep (different values under the two names) is an error, not a silent pick."""
    held = model.state_dict()
    for name, tensor in state.items():
        got = held[name]
        if got.data_ptr() != tensor.data_ptr() and not torch.equal(got, tensor):
            raise CheckpointError(
                f"{where}: after tying the model's weights as its config says, {name!r} no "
                "longer holds the trained values (the run trained it untied?); set "
                "tie_word_embeddings to match the run"
            )


def build_hf_model(record: Mapping[str, Any], state: Mapping[str, Tensor], where: str) -> Any:
    """The recorded class, built on the meta device, holding ``state`` (keys checked, strict)."""
    cls = _model_class(record["class"])
    config = cls.config_class.from_dict(dict(record["config"]))
    with torch.device("meta"):
        model = cls(config)
    if record.get("generation_config") is not None and getattr(model, "generation_config", None):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_dict(dict(record["generation_config"]))
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: the saved keys do not match {record['class']}: "
            f"missing {missing[:5]} ({len(missing)}), unexpected {unexpected[:5]} "
            f"({len(unexpected)})"
        )
    model.load_state_dict(dict(state), strict=True, assign=True)
    model.tie_weights()
    _check_loaded(model, state, where)
    return model.eval()


def export_hf(
    path: str | os.PathLike, out: str | os.PathLike, submodule: str | None = None
) -> Path:
    """Write the Hugging Face model of checkpoint ``path`` to directory ``out`` with its own
    ``save_pretrained`` (safetensors + ``config.json`` + ``generation_config.json``).

    ``out`` must not exist or be empty (an export never mixes with older files). Returns ``out``.
    """
    path, out = Path(path), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--hf {str(out)!r} exists and is not an empty directory")
    submodule, record = hf_record_of(path, submodule)
    state = consolidated_state_dict(path, submodule)
    model = build_hf_model(record, state, f"checkpoint {str(path)!r}, {submodule!r}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # safetensors (the default since transformers 4.35)
    return out

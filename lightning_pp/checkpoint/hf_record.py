"""What a checkpoint records of the Hugging Face models a LightningModule holds.

The save (:mod:`.sharded`) stores :func:`hf_config_of`'s record as JSON in the checkpoint's
metadata; :mod:`.hf_export` reads it to rebuild the model for ``consolidate --hf``. Kept apart
from the export so the save imports nothing that reads checkpoints (no import cycle).

Example::

    from lightning_pp.checkpoint.hf_record import hf_config_of

    hf_config_of(finetune)  # {"model": {"class": "LlamaForCausalLM", "config": {...}, ...}}
"""

from __future__ import annotations

import json
import sys
from typing import Any

from torch import nn

__all__ = ["HF_META_KEY", "hf_config_of"]

#: key of the record under ``meta["lightning_pp"]``
HF_META_KEY = "hf"


def _json(obj: Any) -> Any:
    """Round-trip through JSON: the record must hold nothing a safe loader would refuse."""
    return json.loads(json.dumps(obj))


def hf_config_of(module: nn.Module) -> dict[str, dict[str, Any]] | None:
    """``{attribute: {"class", "config", "generation_config"}}`` for each outermost
    ``transformers.PreTrainedModel`` that ``module`` holds, or ``None`` when it holds none.

    ``transformers`` is not imported here: a module built without its modelling code holds no
    such model.
    The configs are stored in full (``use_diff=False``) so the export does not depend on the
    defaults of the ``transformers`` version that reads them.

    Example::

        hf_config_of(finetune)  # {"model": {"class": "LlamaForCausalLM", "config": {...}, ...}}
    """
    # A model instance means its class's module is loaded. Lightning imports ``transformers``
    # (lazily, via torchmetrics), so its presence says nothing, and ``tf.PreTrainedModel``
    # would load the modelling code (~0.1-0.2 s, on the first save of any run).
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return None
    base = modeling.PreTrainedModel
    found: dict[str, dict[str, Any]] = {}
    for name, sub in module.named_modules():
        if not name or not isinstance(sub, base):
            continue
        if any(name.startswith(outer + ".") for outer in found):
            continue  # inside a model already recorded (LlamaForCausalLM.model)
        gen = getattr(sub, "generation_config", None)
        found[name] = {
            "class": type(sub).__name__,
            "config": json.loads(sub.config.to_json_string(use_diff=False)),
            "generation_config": (
                json.loads(gen.to_json_string(use_diff=False)) if gen is not None else None
            ),
        }
    return _json(found) if found else None

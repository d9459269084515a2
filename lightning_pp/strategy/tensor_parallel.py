"""Tensor parallelism inside each stage: how a plan reaches this rank's layers.

``PipelineStrategy(tp=N)`` makes every stage ``N`` neighbouring ranks (the innermost dim of the
job's mesh, ``"tensor_parallel"``). At setup, once this rank holds only its own layers and
before the optimizer exists, their weights are cut over those ``N`` ranks as ``DTensor`` s:

* a :class:`~lightning_pp.strategy.model.PipelineLayers` model: its
  :meth:`~lightning_pp.strategy.model.PipelineMixin.pipeline_tensor_parallel` hook receives each
  local layer, its index and ``self.device_mesh["tensor_parallel"]`` and applies
  ``parallelize_module``, as a ``ModelParallelStrategy`` user does in ``configure_model``;
* a ``split=`` model (unmodified Hugging Face): ``tp_plan="auto"`` applies the model's own plan
  (``model.tp_plan``: its config's ``base_model_tp_plan`` and the head's ``_tp_plan``) with
  transformers' own styles to the modules this rank holds; a dict ``{pattern: style}`` replaces
  it (a style is a transformers style name such as ``"colwise"``, or a torch
  ``ParallelStyle``).

Stages exchange plain tensors: every layer's output is replicated over the tp ranks (after a
row-wise layer), and each tp rank sends its copy to the rank of the same tp index on the next
stage (:class:`~lightning_pp.layout.topology.PipelineTopology`), so the P2P layer, its shapes
and its handshake are the ones of ``tp=1``.

Example::

    trainer = L.Trainer(devices=4, strategy=PipelineStrategy(pp=2, tp=2))
    trainer.fit(DecoderLM(n_head=4), datamodule)      # lightning_pp.models.decoder

    PipelineStrategy(pp=2, tp=2, split="model.model.layers", tp_plan="auto")  # HF Llama
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

from ..layout.rules import PreflightError, check_tp_sizes
from ..layout.topology import TP_DIM

__all__ = [
    "TpPlan",
    "apply_hf_tp_plan",
    "apply_layer_hooks",
    "check_hf_sizes",
    "check_tp_plan_setting",
    "check_even_shards",
    "hf_model_of",
    "shard_stage",
    "tensor_parallel_mesh",
]

log = logging.getLogger("lightning_pp.strategy")

#: ``tp_plan``: ``"auto"`` (the model's own), ``{module pattern: style}``, or ``None``
TpPlan = str | Mapping[str, Any] | None


def check_tp_plan_setting(tp_plan: TpPlan, split: str | None) -> None:
    """``tp_plan`` is ``None``, ``"auto"`` or a dict, and only with ``split=`` (a
    ``PipelineLayers`` model shards itself in its ``pipeline_tensor_parallel`` hook)."""
    if tp_plan is None:
        return
    if not (tp_plan == "auto" or isinstance(tp_plan, Mapping)):
        raise PreflightError(
            f"tp_plan must be 'auto' (the model's own base_model_tp_plan / _tp_plan) or a dict "
            f"{{module pattern: style}}, got {tp_plan!r}",
            key="tp_plan",
        )
    if split is None:
        raise PreflightError(
            "tp_plan applies to split= models (unmodified Hugging Face models); a "
            "PipelineLayers model shards its layers in pipeline_tensor_parallel(layer, index, "
            "tp_mesh) instead: drop tp_plan",
            key="tp_plan",
        )


def apply_layer_hooks(module: Any, tp_mesh: Any) -> None:
    """The ``PipelineLayers`` path: the module's hook on every local layer, then the local
    members of each tied group become one parameter again (each module's parameters were
    replaced by new ``DTensor`` s one module at a time)."""
    layers = module.pipeline_layers()
    for index in layers.built_indices:
        module.pipeline_tensor_parallel(layers[index], index, tp_mesh)
    layers.retie()


def hf_model_of(module: nn.Module, split: str) -> nn.Module:
    """The outermost module on the path to the blocks (``split``) that carries a Hugging Face
    tensor-parallel plan (``tp_plan``): ``LlamaForCausalLM`` for ``"model.model.layers"``."""
    parts = split.split(".")
    for end in range(1, len(parts)):
        candidate = module.get_submodule(".".join(parts[:end]))
        if isinstance(getattr(candidate, "tp_plan", None), Mapping):
            return candidate
    raise PreflightError(
        f"tp_plan='auto': no module on the path {split!r} has a Hugging Face tensor-parallel "
        f"plan (a `tp_plan` attribute, from the config's base_model_tp_plan); pass tp_plan as "
        f"a dict {{module pattern: style}} instead",
        key="tp_plan",
    )


def check_hf_sizes(config: Any, tp: int) -> None:
    """A Hugging Face config's sizes against ``tp`` (the plan's rule,
    :func:`~lightning_pp.layout.rules.check_tp_sizes`): heads, KV heads, hidden and FFN widths
    and the vocabulary must divide, and the error names each that does not."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config

    def size(name: str) -> int | None:
        value = getattr(config, name, None)
        return value if isinstance(value, int) else None

    check_tp_sizes(
        tp,
        heads=size("num_attention_heads"),
        kv_heads=size("num_key_value_heads"),
        hidden=size("hidden_size"),
        ffn=size("intermediate_size"),
        vocab=size("vocab_size"),
    )


def _pattern(name: str) -> re.Pattern[str]:
    # Hugging Face's plans write a layer number as "*" ("model.layers.*.mlp.up_proj").
    return re.compile("^" + re.escape(name).replace(r"\*", r"\d+") + "$")


def _is_local(module: nn.Module) -> bool:
    """Whether this rank holds the module's own weights (another stage's are meta or gone)."""
    tensors = list(module.parameters(recurse=False))
    return bool(tensors) and all(t.device.type != "meta" for t in tensors)


def apply_hf_tp_plan(hf_model: nn.Module, tp_mesh: Any, plan: Mapping[str, Any]) -> list[str]:
    """Apply ``plan`` (``{module pattern: style}``) to the modules of ``hf_model`` this rank
    holds; returns their names. A style named by a string is transformers' own (its registry
    ``ALL_PARALLEL_STYLES``: the module's weights become ``DTensor`` s and its forward is
    wrapped); a torch ``ParallelStyle`` goes through ``parallelize_module``."""
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    unknown = {s for s in plan.values() if isinstance(s, str) and s not in ALL_PARALLEL_STYLES}
    if unknown:
        raise PreflightError(
            f"tp_plan styles {sorted(unknown)} are not transformers styles; use one of "
            f"{sorted(ALL_PARALLEL_STYLES)} or a torch ParallelStyle",
            key="tp_plan",
        )
    patterns = [(_pattern(k), style) for k, style in plan.items()]
    applied = []
    for name, module in hf_model.named_modules():
        style = next((s for p, s in patterns if p.match(name)), None)
        if style is None or not _is_local(module):
            continue
        if isinstance(style, ParallelStyle):
            parallelize_module(module, tp_mesh, style)
        else:
            hf_style = ALL_PARALLEL_STYLES[style]
            for param_name, _ in list(module.named_parameters(recurse=False)):
                hf_style.shard_param(module, param_name, tp_mesh)
            hf_style.install_forward(module, tp_mesh)
        applied.append(name)
    return applied


def check_even_shards(module: nn.Module, tp: int, rank: int) -> int:
    """Every tensor-parallel weight is cut into ``tp`` equal shards (uneven shards are not
    supported: the checkpoints, the clipping and the tests assume equal ones); returns how
    many parameters are sharded here."""
    sharded = 0
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor):
            continue
        for placement in p.placements:
            if placement.is_shard() and p.shape[placement.dim] % tp:  # type: ignore[attr-defined]
                raise PreflightError(
                    f"rank {rank}: {name} of shape {tuple(p.shape)} is sharded on dim "
                    f"{placement.dim} (size {p.shape[placement.dim]}) over tp={tp}, "  # type: ignore[attr-defined]
                    f"which does not divide it: shard only dims divisible by tp",
                    key="tp",
                )
        sharded += any(pl.is_shard() for pl in p.placements)
    return sharded


def tensor_parallel_mesh(mesh: Any) -> Any:
    """The job mesh's ``"tensor_parallel"`` dim."""
    return mesh[TP_DIM]


def shard_stage(module: Any, tp_mesh: Any, *, split: Any, tp_plan: TpPlan, rank: int) -> str:
    """Cut this rank's layers over the stage's tp ranks: the module's hook (``split`` is
    ``None``) or the Hugging Face plan on the ``split=`` path
    (:class:`~lightning_pp.strategy.split_build.SplitPipeline`). The model's sizes, the plan
    setting and the ties are checked first, alike on every rank, before the sharding's first
    collective; the shards are checked even afterwards. Returns what was done, for the log."""
    tp = tp_mesh.size()
    if split is None:
        apply_layer_hooks(module, tp_mesh)
        how = "by the pipeline_tensor_parallel hook"
    else:
        hf_model = hf_model_of(module, split.split)
        check_hf_sizes(getattr(hf_model, "config", None), tp)
        if tp_plan is None:
            raise PreflightError(
                f"tp={tp} with split={split.split!r} needs tp_plan: 'auto' (the model's own "
                f"plan: {type(hf_model).__name__}.tp_plan) or a dict {{module pattern: style}}",
                key="tp_plan",
            )
        split.refuse_local_ties(tp)
        plan = hf_model.tp_plan if tp_plan == "auto" else tp_plan
        assert isinstance(plan, Mapping)  # check_tp_plan_setting and hf_model_of said so
        apply_hf_tp_plan(hf_model, tp_mesh, plan)
        how = "by tp_plan='auto'" if tp_plan == "auto" else "by the given tp_plan"
    sharded = check_even_shards(module, tp, rank)
    return f"{sharded} weights sharded on rank {rank} {how}"

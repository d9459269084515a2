"""The memory part of ``lightning-pp plan``'s dry run: each pipeline rank's predicted peak, and
the heaviest rank under every data-parallel sharding, against the device's memory.

Reads from the run file: ``trainer.precision`` (``bf16-true``: bf16 parameters and gradients,
fp32 master weights and optimizer states), ``strategy.zero`` / ``strategy.fsdp`` /
``strategy.reshard_after_forward`` / ``strategy.bucket_cap_mb`` (through the plan),
``strategy.recompute`` (``None`` or ``"full"`` are modelled), and ``planner.memory_per_device``
/ ``planner.optimizer`` (``--memory-per-device`` / ``--optimizer`` override them). The
activations are measured on the meta device (:mod:`lightning_pp.planner.meta_profile`): one
sample of the data module, repeated to the plan's microbatch size; nothing is allocated.

Example::

    lines = memory_lines(cfg, checked.plan, checked.model_info, limit=80 << 30)
    print("\\n".join(lines))
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_pp.commands.config import ConfigError, RunConfig
from lightning_pp.layout.recompute_spec import format_bytes, parse_bytes

if TYPE_CHECKING:
    from lightning_pp.commands._common import MetaModelInfo
    from lightning_pp.layout.plan import PipelinePlan
    from lightning_pp.planner.profile import LayerCost
    from lightning_pp.planner.sharding import LayerTensors, StateBytes

__all__ = ["MemorySettings", "memory_lines", "memory_settings"]


@dataclass(frozen=True)
class MemorySettings:
    """What the memory report assumes, resolved from the flags and the run file."""

    limit: int | None
    limit_source: str
    optimizer: str
    precision: Any
    recompute: Any
    reshard_after_forward: bool


def memory_settings(cfg: RunConfig, args: argparse.Namespace | None = None) -> MemorySettings:
    """The flags (``--memory-per-device``, ``--optimizer``) over the ``planner`` section over
    the defaults (no limit, Adam); raises :class:`ConfigError` for a size that does not
    parse."""
    flag_limit = getattr(args, "memory_per_device", None)
    limit, source = None, ""
    if flag_limit is not None:
        value, source, key = flag_limit, "--memory-per-device", "--memory-per-device"
    else:
        value = cfg.get("planner.memory_per_device")
        source, key = (
            f"planner.memory_per_device in {cfg.origin('planner.memory_per_device')}",
            ("planner.memory_per_device"),
        )
    if value is not None:
        try:
            limit = parse_bytes(value, key=key)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    strategy = cfg.get("strategy")
    section = strategy if isinstance(strategy, dict) else {}
    return MemorySettings(
        limit=limit,
        limit_source=source if limit is not None else "",
        optimizer=getattr(args, "optimizer", None) or cfg.get("planner.optimizer") or "adam",
        precision=cfg.get("trainer.precision"),
        recompute=section.get("recompute"),
        reshard_after_forward=bool(section.get("reshard_after_forward", False)),
    )


def _param_dtype(state: StateBytes) -> Any:
    """The torch dtype the layers run in for activations: 16-bit parameters compute in bf16
    (the fp16 run's bytes are the same), else fp32 (``-mixed`` autocasts some of it: the fp32
    measurement is an upper bound)."""
    import torch

    return {2: torch.bfloat16, 8: torch.float64}.get(state.param, torch.float32)


def _measure(
    cfg: RunConfig,
    plan: PipelinePlan,
    module: Any,
    state: StateBytes,
    precision: Any,
    tp: int | None = None,
) -> tuple[list[LayerTensors] | None, list[LayerCost] | None, str]:
    """(each layer's tensor sizes, each layer's bytes at the plan's microbatch, a note): the
    layers' bytes measured on the meta device, as one of ``tp`` (default the plan's)
    tensor-parallel ranks holds them (:mod:`lightning_pp.planner.tensor_parallel`); ``None``
    and the reason where they cannot be."""
    from lightning_pp.commands.config import instantiate
    from lightning_pp.planner.meta_profile import (
        example_input,
        layers_tensor_shapes,
        meta_layers,
        tied_groups,
    )
    from lightning_pp.planner.tensor_parallel import (
        local_layer_costs,
        local_layers,
        record_tp_styles,
    )

    if module is None or not callable(getattr(module, "pipeline_layers", None)):
        return None, None, "the model has no pipeline_layers() to measure"
    tp = plan.tp if tp is None else tp
    layers = meta_layers(module)
    cut: list[Any] = []  # the tp styles: sequence parallelism cuts some inputs and outputs
    if tp > 1:
        styles = record_tp_styles(module, layers, tp)
        if styles is None:
            return (
                None,
                None,
                (
                    f"{type(module).__name__} has no pipeline_tensor_parallel hook calling "
                    f"parallelize_module: its tp={tp} shards are not known"
                ),
            )
        layers = local_layers(layers, styles, tp)
        cut = list(styles)
    tensors: list[LayerTensors] = list(layers_tensor_shapes(layers, tied_groups(module)))
    if plan.batch_size is None:
        return tensors, None, "no data.init_args.batch_size: the microbatch size is unknown"
    size = max(plan.microbatch_sizes(plan.batch_size))
    dtype = _param_dtype(state)
    try:
        x0 = example_input(module, cfg.get("data"), size, instantiate)
        costs = local_layer_costs([layer.to(dtype) for layer in layers], cut, tp, x0)
    except Exception as err:  # a data module or layer that cannot run on meta: say which
        return tensors, None, f"{type(err).__name__}: {err}"
    how = f"microbatch of {size} sample(s), {str(dtype).split('.')[-1]}"
    if "mixed" in str(precision):  # autocast keeps some activations 16-bit on the device
        how += f", an upper bound for {precision}"
    return tensors, costs, how


def _states_line(state: StateBytes, optimizer: str, precision: Any) -> str:
    master = f", fp32 master weights {state.master}" if state.master else ", no master weights"
    return (
        f"states ({precision or '32-true'}, {optimizer}): params {state.param} + grads "
        f"{state.grad}{master} + optimizer {state.optimizer} = {state.per_param} bytes per "
        f"parameter"
    )


def _recompute(spec: Any) -> tuple[str | None, str | None]:
    """(the memory model's recompute, or why it has none for ``spec``)."""
    if spec in (None, "full"):
        return spec, None
    return None, f"recompute={spec!r} is not modelled: activations counted without recompute"


def memory_lines(
    cfg: RunConfig,
    plan: PipelinePlan,
    info: MetaModelInfo | None,
    settings: MemorySettings,
) -> list[str]:
    """The report's memory sections for ``plan`` (its layers known)."""
    from lightning_pp.planner.plan_memory import compare_shardings
    from lightning_pp.planner.report import format_memory_table, format_sharding_table
    from lightning_pp.planner.sharding import StateBytes

    state = StateBytes.for_precision(settings.precision, settings.optimizer)
    module = None if info is None else info.module
    tensors, costs, how = _measure(cfg, plan, module, state, settings.precision)
    if tensors is None:
        if info is None or info.layer_params is None:
            return ["", "--- memory ---", f"  not predicted: {how}"]
        tensors = [[n] for n in info.layer_params]  # counts only: 1-D tensors
    recompute, unmodelled = _recompute(settings.recompute)
    rows = compare_shardings(
        plan,
        tensors,
        costs,
        state,
        recompute=recompute,
        reshard_after_forward=_reshard(plan, settings),
    )
    current = _current_label(plan, settings)
    mine = next((r for r in rows if r.label == current), rows[0])
    known = costs is not None
    tp_text = f", tensor-parallel rank of tp={plan.tp}" if plan.tp > 1 else ""
    out = [
        "",
        f"--- memory per pipeline rank (one data-parallel replica{tp_text}, sharding "
        f"{mine.label}"
        f"{f' over dp={plan.dp}' if plan.dp and plan.dp > 1 else ''}; peak of a step) ---",
        "  " + _states_line(state, settings.optimizer, settings.precision),
        "  activations: "
        + (
            f"measured on the meta device ({how}; recompute {recompute or 'none'}, "
            f"{plan.schedule.name} in-flight microbatches)"
            if known
            else f"not measured ({how}): totals without activations and buffers"
        ),
        *([f"  note: {unmodelled}"] if unmodelled else []),
        *("  " + line for line in format_memory_table(mine.ranks, activations=known).split("\n")),
        "  " + _verdict(mine, settings),
    ]
    if len(rows) > 1:
        out += [
            "",
            f"--- data-parallel sharding over dp={plan.dp} (heaviest pipeline rank; "
            f"* this config) ---",
            *(
                "  " + line
                for line in format_sharding_table(
                    rows, limit=settings.limit, current=current, activations=known
                ).split("\n")
            ),
            "  peak: the larger of forward/backward (zero=2 and fsdp still hold full "
            "gradients, fsdp the",
            "  gathered parameters) and the optimizer step; states at step: params + grads + "
            "master + optimizer there",
            "  choose one with strategy.zero=1, strategy.zero=2 or strategy.fsdp=true "
            "(docs/planner.md, 'Sharded memory')",
        ]
    return out + _tp_lines(cfg, plan, module, state, settings, recompute, mine)


def _tp_lines(
    cfg: RunConfig,
    plan: PipelinePlan,
    module: Any,
    state: StateBytes,
    settings: MemorySettings,
    recompute: str | None,
    mine: Any,
) -> list[str]:
    """The heaviest pipeline rank on one tensor-parallel rank at each tp of
    :data:`~lightning_pp.planner.tensor_parallel.TP_CANDIDATES` the world and the model allow
    (the others with the reason): the same pipeline and microbatch, ``dp = world / (pp x
    tp)``; the config's own sharding (``zero`` or ``fsdp``, both compose with tp) where
    dp > 1, else unsharded."""
    from lightning_pp.layout.rules import PreflightError
    from lightning_pp.planner.meta_profile import meta_layers
    from lightning_pp.planner.plan_memory import compare_shardings
    from lightning_pp.planner.report import format_tp_table
    from lightning_pp.planner.sharding import Sharding, allowed_shardings
    from lightning_pp.planner.tensor_parallel import TP_CANDIDATES, check_model_tp

    world = plan.world_size
    if world is None or module is None or not callable(getattr(module, "pipeline_layers", None)):
        return []
    layers = meta_layers(module)
    rows: list[tuple[int, int, Any]] = []
    known = True
    for tp in TP_CANDIDATES:
        if world % (plan.pp * tp):
            rows.append((tp, 0, f"world {world} % (pp {plan.pp} x tp {tp}) != 0"))
            continue
        dp = world // (plan.pp * tp)
        if tp == plan.tp:
            rows.append((tp, dp, mine))
            continue
        try:
            note = check_model_tp(module, layers, tp)
        except PreflightError as err:
            rows.append((tp, dp, str(err).split(": ")[0]))
            continue
        if note is not None:
            rows.append((tp, dp, "no tensor-parallel hook"))
            continue
        at = dataclasses.replace(plan, tp=tp, dp=dp, zero=0, fsdp=False)
        tensors, costs, _ = _measure(cfg, at, module, state, settings.precision, tp)
        if tensors is None:
            rows.append((tp, dp, "not measured"))
            continue
        known = known and costs is not None
        # the config's own sharding at this tp (zero and fsdp both compose with tp)
        label = allowed_shardings([_current_label(plan, settings)], dp)[0]
        sharding = Sharding.parse(label, dp=dp)
        got = compare_shardings(
            at, tensors, costs, state, recompute=recompute, shardings=[sharding]
        )
        rows.append((tp, dp, got[0]))
    limit = settings.limit
    return [
        "",
        f"--- tensor parallel: heaviest pipeline rank on one tp rank, pp={plan.pp} on {world} "
        f"processes (* this config) ---",
        *(
            "  " + line
            for line in format_tp_table(
                rows, limit=limit, current=plan.tp, activations=known
            ).split("\n")
        ),
        "  tp shards the attention and MLP Linears, the vocabulary embedding and the head; "
        "norms, the position",
        "  embedding and the stage boundary stay whole; each tp rank's share is sharded over "
        "dp as the config shards",
        "  (docs/planner.md, 'Tensor parallel'); choose one with strategy.tp=N",
    ]


def _reshard(plan: PipelinePlan, settings: MemorySettings) -> bool:
    """FSDP's ``reshard_after_forward``: the plan's (it checks it), else the config's."""
    return bool(getattr(plan, "reshard_after_forward", settings.reshard_after_forward))


def _current_label(plan: PipelinePlan, settings: MemorySettings) -> str:
    """The config's own sharding, as :attr:`Sharding.label` names it."""
    if plan.fsdp:
        return "fsdp+reshard" if _reshard(plan, settings) else "fsdp"
    return f"zero={plan.zero}" if plan.zero else "none"


def _verdict(row: Any, settings: MemorySettings) -> str:
    """``heaviest: pipeline rank 3, 131.2 GiB: does NOT fit 80.00 GiB (planner...)``."""
    m = row.heaviest
    text = f"heaviest: pipeline rank {m.rank}, {format_bytes(m.total)}"
    if settings.limit is None:
        return text + " (no memory limit given: planner.memory_per_device or --memory-per-device)"
    fits = m.total <= settings.limit
    verdict = "fits in" if fits else "does NOT fit in"
    return f"{text}: {verdict} {format_bytes(settings.limit)} ({settings.limit_source})"

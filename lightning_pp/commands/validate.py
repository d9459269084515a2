"""``lightning-pp validate CONFIG.yaml [key=value ...]``: check a run file and show the plan.

Prints the resolved config, the world / pipeline / batch arithmetic, the partition (which layers
each rank holds in each chunk, and its parameter count) and the predicted schedule grid and
bubble. Nothing is trained, no process is started and no weights are allocated: the model is
built on PyTorch's ``meta`` device, where tensors have shapes but no storage, so a 1B-parameter
template checks in seconds on a laptop.

Example::

    lightning-pp validate configs/gpt_1b_pp4_vpp2.yaml
    lightning-pp validate configs/demo_cpu.yaml strategy.pp=4 strategy.microbatches=8
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning_pp.commands.fit import (
    add_config_arguments,
    check_shape,
    fail,
    split_options,
)
from lightning_pp.config import (
    ConfigError,
    RunConfig,
    detect_launch_environment,
    instantiate,
    load_config,
)

__all__ = ["MetaModelInfo", "describe_partition", "meta_model_info", "register", "report", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``validate`` subcommand to the ``lightning-pp`` parser."""
    p = subparsers.add_parser(
        "validate",
        help="check a run file; print resolved config, partition and schedule (no training)",
        description=(
            "Check CONFIG (+ overrides) against the schema, then print the resolved config, "
            "the layer partition per rank/chunk with parameter counts (model built on the meta "
            "device: no memory) and the predicted schedule grid and bubble."
        ),
    )
    add_config_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        split_options(args, "validate")
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        return fail("validate", str(err))
    return report(cfg, command="validate")


class MetaModelInfo:
    """What the partition needs from a model, measured on the meta device.

    ``layer_params[i]`` counts layer i's parameters (a tied parameter counts in every layer that
    uses it: each rank holding such a layer stores a copy); ``total_params`` counts the whole
    model's unique parameters.
    """

    def __init__(
        self,
        cls_name: str,
        total_params: int,
        layer_names: list[str] | None,
        layer_params: list[int] | None,
        layer_costs: list[float] | None,
        on_meta: bool,
    ) -> None:
        self.cls_name = cls_name
        self.total_params = total_params
        self.layer_names = layer_names
        self.layer_params = layer_params
        self.layer_costs = layer_costs
        self.on_meta = on_meta

    @property
    def num_layers(self) -> int | None:
        return None if self.layer_params is None else len(self.layer_params)


def meta_model_info(cfg: RunConfig) -> MetaModelInfo:
    """Build the configured model on the meta device and count its parameters per layer."""
    import torch

    with torch.device("meta"):
        model = instantiate(cfg.get("model"))
        configure = getattr(model, "configure_model", None)
        if callable(configure):
            configure()
    params = list(model.parameters())
    on_meta = all(p.device.type == "meta" for p in params)
    total = sum(p.numel() for p in params)
    names = counts = costs = None
    layers_fn = getattr(model, "pipeline_layers", None)
    if callable(layers_fn):
        layers = layers_fn()
        counts = None
        custom = getattr(model, "pipeline_layer_params", None)
        if callable(custom):
            counts = custom()
        if counts is None:
            counts = []
            names = []
            for i in range(layers.num_layers):
                layer = layers[i] if i in layers else None
                if layer is None:  # not built here: build it alone, still on meta
                    with torch.device("meta"):
                        layer = layers._builders[i]()
                names.append(type(layer).__name__)
                counts.append(sum(p.numel() for p in layer.parameters()))
        costs_fn = getattr(model, "pipeline_layer_costs", None)
        costs = costs_fn() if callable(costs_fn) else None
    return MetaModelInfo(type(model).__name__, total, names, counts, costs, on_meta)


def _fmt_layers(rng: range, names: list[str] | None) -> str:
    span = f"{rng.start}" if len(rng) == 1 else f"{rng.start}-{rng.stop - 1}"
    if not names:
        return f"layers {span}"
    kinds: list[str] = []
    for i in rng:
        if not kinds or kinds[-1].split(" x")[0] != names[i]:
            kinds.append(names[i])
        else:
            base, _, n = kinds[-1].partition(" x")
            kinds[-1] = f"{base} x{int(n or 1) + 1}"
    return f"layers {span} ({', '.join(kinds)})"


def describe_partition(info: MetaModelInfo, settings: dict[str, Any]) -> list[str]:
    """One line per (rank, chunk) plus a per-rank parameter total."""
    from lightning_pp.partition import partition_layers

    pp, vpp = settings.get("pp", 1), settings.get("vpp", 1)
    method = settings.get("partition", "uniform") or "uniform"
    assert info.layer_params is not None
    ranges = partition_layers(
        len(info.layer_params),
        pp,
        vpp,
        method,
        layer_params=info.layer_params,
        layer_costs=info.layer_costs,
    )
    lines = []
    for r in range(pp):
        total = 0
        for c in range(vpp):
            rng = ranges[c * pp + r]
            n = sum(info.layer_params[i] for i in rng)
            total += n
            lines.append(
                f"  rank {r} chunk {c} (stage {c * pp + r}): "
                f"{_fmt_layers(rng, info.layer_names)}  {n:,} params"
            )
        lines.append(
            f"  rank {r} total: {total:,} params ({_human(total)}); fp32 weights + grads + "
            f"AdamW states ~ {_gigabytes(16 * total)} (activations not included)"
        )
    return lines


def _gigabytes(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"


def _human(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def report(cfg: RunConfig, command: str = "validate") -> int:
    """Print the plan for ``cfg``; 0 if it is consistent, 2 (with a message) if not."""
    from lightning_pp.schedules import render_grid, simulate

    launch = detect_launch_environment()
    try:
        shape = check_shape(cfg, launch)
    except ConfigError as err:
        return fail(command, str(err))
    head = f"config: {cfg.path}"
    if cfg.overrides:
        head += f"  overrides: {' '.join(cfg.overrides)}"
    out = [head]
    out += ["", "--- resolved config ---", cfg.to_yaml().rstrip()]

    settings = shape["settings"]
    out += ["", "--- processes ---"]
    if launch is not None:
        out.append(f"  launched by {launch.launcher}: {launch.detail}")
    world = shape.get("world")
    if world is None:
        out.append("  world size: decided at run time (trainer.devices is 'auto')")
    else:
        out.append(
            f"  world = num_nodes({shape['num_nodes']}) x devices({shape['devices']}) = {world}"
        )
    if settings:
        dp = shape.get("dp", "?")
        out.append(f"  pp={settings['pp']} x dp={dp}  (vpp={settings['vpp']} chunks per rank)")
    if shape.get("batch_size") is not None:
        line = f"  batch: {shape['batch_size']} per data-parallel replica"
        if shape.get("microbatch_size"):
            line += f" = {shape['microbatches']} microbatches of {shape['microbatch_size']}"
        if isinstance(shape.get("dp"), int):
            accumulate = (cfg.get("trainer") or {}).get("accumulate_grad_batches", 1)
            per_step = shape["batch_size"] * shape["dp"] * accumulate
            line += f"; global batch per optimizer step {per_step}"
            if accumulate > 1:
                line += f" (x accumulate_grad_batches={accumulate})"
        out.append(line)

    try:
        info = meta_model_info(cfg)
    except Exception as err:  # a user model that cannot be built: say which and why
        return fail(command, f"cannot build model {cfg.get('model')!r} on the meta device: {err}")
    out += ["", "--- model ---"]
    out.append(
        f"  {info.cls_name}: {info.total_params:,} parameters ({_human(info.total_params)}), "
        f"built on the meta device ({'no storage allocated' if info.on_meta else 'NOT all meta'})"
    )
    if settings and settings.get("pp") is None:
        out.append("  (pp=None: the pipeline spans all processes, known only at run time)")
    elif settings and info.layer_params is not None:
        method = settings.get("partition", "uniform")
        out += ["", f"--- partition ({method}, {info.num_layers} layers) ---"]
        try:
            out += describe_partition(info, settings)
        except ValueError as err:
            return fail(command, f"strategy ({cfg.section_origin('strategy')}): {err}")

    schedule = shape.get("schedule")
    if schedule is not None:
        result = simulate(schedule)
        out += [
            "",
            f"--- schedule ({schedule.name}, pp={schedule.pp}, vpp={schedule.vpp}, "
            f"microbatches={schedule.microbatches}; default costs t_b = 2 t_f) ---",
        ]
        out.append(render_grid(result))
    out += ["", f"OK: {cfg.path} is valid (nothing was trained or allocated)."]
    print("\n".join(out))
    return 0

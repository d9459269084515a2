"""``lightning-pp plan CONFIG.yaml [key=value ...]``: check a run file and show its pipeline plan.

Prints the resolved config, the processes, the model's size, the plan (shape, placement,
partition per rank and chunk with parameter counts, schedule and bubble, batch split: the lines
of :meth:`~lightning_pp.layout.plan.PipelinePlan.describe`, the same the strategy logs at start),
the predicted schedule grid, and each pipeline rank's predicted memory (parameters, gradients,
master weights, optimizer state, activations) with the heaviest rank under every data-parallel
sharding (none, ``zero=1``, ``zero=2``, ``fsdp``) against ``planner.memory_per_device``. Nothing
is trained, no process is started and no weights are allocated: the model is built on PyTorch's
``meta`` device, where tensors have shapes but no storage (the activations are measured there
too), so a 70B-parameter template checks in seconds on a laptop. ``lightning-pp validate`` is
a deprecated alias; ``lightning-pp fit --dry-run`` prints the same report.

Example::

    lightning-pp plan configs/gpt_1b_pp4_vpp2.yaml
    lightning-pp plan configs/gpt_70b_pp8.yaml strategy.zero=0   # 70B: which sharding fits
    lightning-pp plan configs/demo_cpu.yaml strategy.pp=4 strategy.microbatches=8
    lightning-pp plan configs/demo_cpu.yaml --search --devices 4   # profile + search shapes

``--search`` (see :mod:`lightning_pp.commands.plan_search` and docs/planner.md) profiles the
model and recommends a shape instead; without it the report is unchanged.
"""

from __future__ import annotations

import argparse
import sys

from lightning_pp.commands._common import add_config_arguments, check_run, fail, split_options
from lightning_pp.commands.config import ConfigError, RunConfig, load_config
from lightning_pp.commands.launch import detect_launch_environment
from lightning_pp.commands.plan_search import add_search_options, run_search
from lightning_pp.layout.plan import format_count

__all__ = ["register", "report", "run"]

_DESCRIPTION = (
    "Check CONFIG (+ overrides) against the schema and the pipeline rules, then print the "
    "resolved config, the plan (pp x dp, placement, layer partition per rank/chunk with "
    "parameter counts: the model is built on the meta device, no memory) and the predicted "
    "schedule grid and bubble."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plan`` (and its deprecated alias ``validate``) to the ``lightning-pp`` parser."""
    p = subparsers.add_parser(
        "plan",
        help="check a run file; print resolved config, partition and schedule (no training)",
        description=_DESCRIPTION,
    )
    add_search_options(p)
    add_config_arguments(p, add_search_options)
    p.set_defaults(func=run, _command="plan")
    alias = subparsers.add_parser(
        "validate",
        help="deprecated alias of `plan`",
        description=_DESCRIPTION + " Deprecated: use `lightning-pp plan`.",
    )
    add_search_options(alias)
    add_config_arguments(alias, add_search_options)
    alias.set_defaults(func=run, _command="validate")


def run(args: argparse.Namespace) -> int:
    command = getattr(args, "_command", "plan")
    if command == "validate":
        print(
            "lightning-pp validate is deprecated: use `lightning-pp plan` (same arguments)",
            file=sys.stderr,
        )
    try:
        split_options(args, command)
        if getattr(args, "tp", None) is not None:  # --tp N is strategy.tp=N
            args.overrides = [*args.overrides, f"strategy.tp={args.tp}"]
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        return fail(command, str(err))
    if getattr(args, "search", False):
        return run_search(cfg, args, command)
    given = [
        flag
        for flag, dest, default in getattr(args, "_search_only", ())
        if getattr(args, dest) != default
    ]
    if given:
        return fail(
            command,
            f"{', '.join(given)} {'is an option' if len(given) == 1 else 'are options'} of the "
            f"shape search, unused without it: add --search (plan without it checks the "
            f"config's own shape; its world size comes from the config's trainer)",
        )
    return report(cfg, command=command, args=args)


def report(cfg: RunConfig, command: str = "plan", args: argparse.Namespace | None = None) -> int:
    """Print the plan for ``cfg``; 0 if it is consistent, 2 (with a message) if not.

    With the layers known, the report ends with each pipeline rank's predicted memory and the
    heaviest rank's under every data-parallel sharding (:mod:`lightning_pp.commands.
    plan_memory`); a prediction over the memory limit is reported, not refused (exit 0)."""
    from lightning_pp.commands.plan_memory import memory_lines, memory_settings
    from lightning_pp.schedules import render_grid

    launch = detect_launch_environment()
    try:
        # The run may be meant for another machine (a GPU template checked on a laptop): a
        # missing accelerator is a note here; `fit` refuses it.
        checked = check_run(cfg, launch, model="require", this_machine=launch is not None)
        memory = memory_settings(cfg, args)
    except ConfigError as err:
        return fail(command, str(err))
    head = f"config: {cfg.path}"
    if cfg.overrides:
        head += f"  overrides: {' '.join(cfg.overrides)}"
    out = [head, "", "--- resolved config ---", cfg.to_yaml().rstrip()]

    out += ["", "--- processes ---"]
    if launch is not None:
        out.append(f"  launched by {launch.launcher}: {launch.detail}")
    if checked.world is None:
        out.append("  world size: decided at run time (trainer.devices is 'auto')")
    else:
        out.append(
            f"  world = num_nodes({checked.num_nodes}) x devices({checked.devices}) = "
            f"{checked.world}"
        )

    info = checked.model_info
    assert info is not None  # model="require" built it or failed
    out += ["", "--- model ---"]
    out.append(
        f"  {info.cls_name}: {info.total_params:,} parameters ({format_count(info.total_params)}), "
        f"built on the meta device ({'no storage allocated' if info.on_meta else 'NOT all meta'})"
    )

    plan = checked.plan
    if plan is None and checked.pipeline:
        out += ["", "--- plan ---"]
        out.append("  (pp=None: the pipeline spans all processes, known only at run time)")
    if plan is not None:
        out += ["", "--- plan ---"]
        lines = plan.describe(layer_names=info.layer_names, layer_params=info.layer_params)
        out += [f"  {line}" for line in lines]
        out += [
            "",
            f"--- schedule grid ({plan.schedule.name}; default costs t_b = 2 t_f, "
            f"no communication latency) ---",
            render_grid(plan.schedule),
        ]
        if plan.layer_ranges is not None:
            out += memory_lines(cfg, plan, info, memory)
    section = cfg.get("strategy")
    if isinstance(section, dict) and section.get("recompute") == "auto":
        # The one rule plan cannot apply: the planner needs activations measured on a batch.
        out.append(
            f"note: recompute='auto' with activation_budget={section.get('activation_budget')} "
            f"is checked only by fit, on the first batch (the planner measures each layer's "
            f"activations there): this plan does not say the budget fits"
        )
    out += [f"note: {note}" for note in checked.notes]
    out += ["", f"OK: {cfg.path} is valid (nothing was trained or allocated)."]
    print("\n".join(out))
    return 0

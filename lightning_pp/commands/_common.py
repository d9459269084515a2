"""What ``lightning-pp fit`` and ``lightning-pp plan`` share: arguments, errors, and the check of
a run before any process starts.

:func:`check_run` is the one pre-launch check. It reads the world from the launcher or the
trainer section, applies the few rules about the trainer and data sections that would otherwise
surface as a traceback on every rank, and hands the pipeline shape to
:class:`~lightning_pp.layout.plan.PipelinePlan`, which owns every pipeline rule; its errors come
back
naming the config key, where that value came from, and the fix.

Example:
    >>> from lightning_pp.commands.config import load_config
    >>> run = check_run(load_config("configs/demo_cpu.yaml"), None)  # doctest: +SKIP
    >>> (run.world, run.plan.pp, run.plan.dp)  # doctest: +SKIP
    (4, 2, 2)
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_pp.commands.config import (
    ConfigError,
    RunConfig,
    import_class,
    instantiate,
    is_class_spec,
    pipeline_strategy_class,
)
from lightning_pp.commands.launch import LaunchEnvironment
from lightning_pp.layout.plan import PipelinePlan
from lightning_pp.layout.rules import (
    PreflightError,
    check_schedule_vpp,
    check_settings,
    default_schedule,
)
from lightning_pp.schedules import chunks_per_rank

__all__ = [
    "MetaModelInfo",
    "RunCheck",
    "add_config_arguments",
    "check_run",
    "fail",
    "is_rank_zero",
    "meta_model_info",
    "pipeline_plan",
    "say",
    "split_options",
]


# --------------------------------------------------------------------------------------------
# Arguments and messages
# --------------------------------------------------------------------------------------------


def add_config_arguments(
    p: argparse.ArgumentParser, options: Callable[[argparse.ArgumentParser], None] | None = None
) -> None:
    """``CONFIG [KEY=VALUE ...]``; options may also come after the overrides.

    argparse cannot give a ``nargs="*"`` positional the values that follow an option
    (``fit run.yaml --dry-run a=1``), so the overrides take the rest of the command line and
    :func:`split_options` picks the options back out of it.
    """
    p.add_argument("config", help="YAML run file (see docs/config.md)")
    p.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        metavar="KEY=VALUE",
        help="dotlist overrides, e.g. trainer.max_steps=200 strategy.microbatches=16",
    )
    p.set_defaults(_options=options)


def split_options(args: argparse.Namespace, command: str) -> None:
    """Move options found among the overrides into ``args``; raise on an unknown option."""
    flags = argparse.ArgumentParser(prog=f"lightning-pp {command}", add_help=False)
    if args._options is not None:
        args._options(flags)
    parsed, rest = flags.parse_known_args(args.overrides)
    for key, value in vars(parsed).items():
        if value != flags.get_default(key):
            setattr(args, key, value)
    unknown = [r for r in rest if r.startswith("-")]
    if unknown:
        raise ConfigError(f"unrecognized option(s) {unknown}; overrides are written key=value")
    args.overrides = rest


def fail(command: str, message: str) -> int:
    """Print a user error without a traceback; exit code 2 (as argparse does)."""
    print(f"lightning-pp {command}: error: {message}", file=sys.stderr)
    return 2


def is_rank_zero() -> bool:
    """Rank 0 of the job, judged from the launcher's environment (before any Trainer exists)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def say(message: str) -> None:
    if is_rank_zero():
        print(message, flush=True)


# --------------------------------------------------------------------------------------------
# The model, measured without memory
# --------------------------------------------------------------------------------------------


@dataclass
class MetaModelInfo:
    """What the partition needs from a model, measured on the meta device.

    ``layer_params[i]`` counts layer i's parameters (a tied parameter counts in every layer that
    uses it: each rank holding such a layer stores a copy); ``total_params`` counts the whole
    model's unique parameters. ``layer_names`` is ``None`` when the model counts its own
    (``pipeline_layer_params``).
    """

    cls_name: str
    total_params: int
    layer_names: list[str] | None
    layer_params: list[int] | None
    layer_costs: list[float] | None
    on_meta: bool
    #: the module itself, on the meta device (what the pre-flight's module rules read)
    module: Any = field(default=None, repr=False, compare=False)

    @property
    def num_layers(self) -> int | None:
        return None if self.layer_params is None else len(self.layer_params)


def meta_model_info(cfg: RunConfig, *, layers: bool = True) -> MetaModelInfo:
    """Build the configured model on the meta device and count its parameters per layer.

    ``layers=False`` (a ``split=`` run): leave ``pipeline_layers()`` alone, since ``split=``
    cuts the named container, not the layers hook; a ``PipelineMixin`` whose hook cannot run
    is then refused by the split rules with their own fix (:func:`check_module`), instead of
    by the hook's message, whose fix is for the other path."""
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
    layers_fn = getattr(model, "pipeline_layers", None) if layers else None
    if callable(layers_fn):
        pipeline = layers_fn()
        custom = getattr(model, "pipeline_layer_params", None)
        counts = custom() if callable(custom) else None
        if counts is None:
            counts, names = [], []
            for i in range(pipeline.num_layers):
                layer = pipeline[i] if i in pipeline else None
                if layer is None:  # not built here: build it alone, still on meta
                    with torch.device("meta"):
                        layer = pipeline._builders[i]()
                names.append(type(layer).__name__)
                counts.append(sum(p.numel() for p in layer.parameters()))
        costs_fn = getattr(model, "pipeline_layer_costs", None)
        costs = costs_fn() if callable(costs_fn) else None
    return MetaModelInfo(type(model).__name__, total, names, counts, costs, on_meta, model)


# --------------------------------------------------------------------------------------------
# The run's shape
# --------------------------------------------------------------------------------------------

# PipelineStrategy arguments that are plan inputs (the plan checks them; the rest are the
# strategy's own business, checked against its signature when the config is loaded).
_PLAN_ARGS = (
    "pp",
    "vpp",
    "microbatches",
    "schedule",
    "group_size",
    "partition",
    "recv_lookahead",
    "bucket_cap_mb",
    "watchdog_timeout",
    "zero",
    "fsdp",
    "reshard_after_forward",
    "tp",
)

# Data-module counts that cannot be 0 or negative. The data module would only find out in
# setup(), on every rank at once; here they fail once, before anything starts.
_POSITIVE_DATA_ARGS = ("batch_size", "block_size", "max_chars")


def _pipeline_settings(cfg: RunConfig) -> dict[str, Any] | None:
    """The plan inputs of the run's PipelineStrategy: its signature's defaults updated by the
    config's ``strategy`` section; ``None`` when the run uses another strategy."""
    section = cfg.get("strategy")
    if section == "pipeline":
        section = {}
    elif section is None or isinstance(section, str) or is_class_spec(section):
        return None
    settings: dict[str, Any] = {}
    cls = pipeline_strategy_class()
    if cls is not None:
        for name, param in inspect.signature(cls).parameters.items():
            if name in _PLAN_ARGS and param.default is not inspect.Parameter.empty:
                settings[name] = param.default
    settings.update({k: v for k, v in (section or {}).items() if k in _PLAN_ARGS})
    return settings


def _data_key(cfg: RunConfig, name: str) -> str:
    """The dotted key of a data-module argument (``data.init_args.X`` or ``data.X``)."""
    return f"data.init_args.{name}" if cfg.get("data.class_path") else f"data.{name}"


def _where(cfg: RunConfig, key: str) -> str:
    return f"'{key}' in {cfg.origin(key)}"


def pipeline_plan(cfg: RunConfig, world: int | None) -> PipelinePlan | None:
    """The run's plan on ``world`` processes, without layers or batch (``None``: no pipeline).

    For messages after launch (the world is then known and the plan was already checked).
    """
    settings = _pipeline_settings(cfg)
    if settings is None or (settings.get("pp") is None and world is None):
        return None
    return PipelinePlan.build(world_size=world, warn=False, **settings)


def resolve_world(cfg: RunConfig, launch: LaunchEnvironment | None) -> tuple[int | None, int]:
    """(devices per node, nodes): from the launcher when processes come from outside.

    ``devices`` is ``None`` when Lightning decides it at run time (``"auto"``, ``-1``).
    """
    if launch is not None:
        return launch.devices, launch.num_nodes
    trainer = cfg.get("trainer") or {}
    devices = trainer.get("devices", "auto")
    num_nodes = trainer.get("num_nodes", 1)
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
        raise ConfigError(
            f"{_where(cfg, 'trainer.num_nodes')}: num_nodes={num_nodes!r} machines cannot run a "
            f"job; set trainer.num_nodes to a positive integer (1 on one machine)"
        )
    if isinstance(devices, list):
        if not devices:
            raise ConfigError(
                f"{_where(cfg, 'trainer.devices')}: an empty device list starts no process; list "
                f"at least one device index, or give a count such as trainer.devices=4"
            )
        devices = len(devices)
    elif isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices < 1:
        if devices != -1:  # -1 is Lightning's "every device of the machine"
            raise ConfigError(
                f"{_where(cfg, 'trainer.devices')}: devices={devices} starts no process; set "
                f"trainer.devices to the number of processes per node (e.g. 4), or 'auto'"
            )
    if not isinstance(devices, int) or devices < 1:
        accel = trainer.get("accelerator", "auto")
        devices = 1 if accel == "cpu" and devices == "auto" else None
    return devices, num_nodes


def _accelerator_available(name: str) -> bool | None:
    """Whether this machine has the named accelerator (``None``: not ours to judge)."""
    from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

    if name == "cuda":
        return CUDAAccelerator.is_available()
    if name == "mps":
        return MPSAccelerator.is_available()
    if name == "gpu":  # Lightning picks MPS on Apple silicon, else CUDA
        return CUDAAccelerator.is_available() or MPSAccelerator.is_available()
    return None


def check_trainer(cfg: RunConfig, *, this_machine: bool = True) -> list[str]:
    """Trainer values that would otherwise fail on every rank after launch, or silently.

    ``this_machine=False`` (``lightning-pp plan``, which may check a GPU run on a laptop): a
    missing accelerator is returned as a note instead of raised.
    """
    trainer = cfg.get("trainer") or {}
    for key in ("max_steps", "max_epochs"):
        value = trainer.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < -1:
            raise ConfigError(
                f"{_where(cfg, f'trainer.{key}')}: {key}={value} is not a limit; use a "
                f"non-negative number, or -1 for no limit"
            )
    accel = trainer.get("accelerator")
    if isinstance(accel, str) and _accelerator_available(accel.lower()) is False:
        message = (
            f"{_where(cfg, 'trainer.accelerator')}: accelerator={accel!r} but this machine has "
            f"no such device (Lightning finds none); use trainer.accelerator=cpu (or 'auto' to "
            f"take what exists)"
        )
        if this_machine:
            raise ConfigError(message)
        return [f"{message}. `lightning-pp fit` refuses to start here."]
    return []


def check_data(cfg: RunConfig) -> None:
    """Data-module counts (batch, block, corpus size) must be positive."""
    spec = cfg.get("data")
    if not is_class_spec(spec):
        return
    kwargs = (spec.get("init_args") or {}) if "class_path" in spec else spec
    for name in _POSITIVE_DATA_ARGS:
        value = kwargs.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            key = _data_key(cfg, name)
            raise ConfigError(
                f"{_where(cfg, key)}: {name}={value} holds no data; set {key} to a positive integer"
            )


def _check_tensor_parallel(module: Any, tp: int, *, layers: bool) -> None:
    """The model at ``tp`` (:func:`~lightning_pp.planner.tensor_parallel.check_model_tp`):
    its heads, KV heads, hidden, FFN and vocabulary sizes divide by ``tp``, and a
    ``PipelineLayers`` model has a ``pipeline_tensor_parallel`` hook; raises
    :class:`PreflightError` naming the numbers."""
    from lightning_pp.planner.meta_profile import meta_layers
    from lightning_pp.planner.tensor_parallel import check_model_tp

    note = check_model_tp(module, meta_layers(module) if layers else None, tp)
    if note is not None:
        raise PreflightError(note, key="tp")


@dataclass
class RunCheck:
    """What :func:`check_run` resolved: the world and, for a pipeline run, its plan
    (``None`` for ``pp=None`` over a world known only at run time)."""

    world: int | None
    devices: int | None
    num_nodes: int
    plan: PipelinePlan | None
    #: the run uses PipelineStrategy
    pipeline: bool
    model_info: MetaModelInfo | None = None
    #: what does not stop the run from being planned but would stop it here (see check_trainer)
    notes: tuple[str, ...] = ()


def _plan_error(
    cfg: RunConfig, err: PreflightError, devices: int | None, num_nodes: int, launched: bool
) -> ConfigError:
    """A plan error in the config's words: the key, where its value came from, the fix."""
    keys = {
        name: f"strategy.{name}" for name in (*_PLAN_ARGS, "dp", "recompute", "split_placement")
    }
    keys.update(
        world_size="trainer.devices",
        batch_size=_data_key(cfg, "batch_size"),
        accumulate_grad_batches="trainer.accumulate_grad_batches",
    )
    key = keys.get(err.key or "")
    if err.key == "num_layers":
        where = (
            f"model ({cfg.section_origin('model')}) cut by strategy "
            f"({cfg.section_origin('strategy')})"
        )
    elif key is not None:
        where = _where(cfg, key)
    else:
        where = f"strategy ({cfg.section_origin('strategy')})"
    message = f"{where}: {err}"
    if err.key in ("pp", "dp", "world_size") and devices is not None:
        source = "the launcher" if launched else "trainer.devices x trainer.num_nodes"
        message += f" [world = devices({devices}) x num_nodes({num_nodes}), from {source}]"
    return ConfigError(message)


def check_run(
    cfg: RunConfig,
    launch: LaunchEnvironment | None,
    *,
    model: str = "try",
    this_machine: bool = True,
) -> RunCheck:
    """Every check that can run before a process starts; raise :class:`ConfigError`.

    ``model``: ``"require"`` builds the model on the meta device and fails if it cannot be
    built (``lightning-pp plan``); ``"try"`` uses it for the layer check when it builds and
    leaves the check to the strategy otherwise (``fit``: a model that cannot live on the meta
    device may still train); ``"skip"`` does not build it. ``this_machine``: see
    :func:`check_trainer`.
    """
    # imported here, not at the top: `lightning-pp schedule` and `--help` register every
    # subcommand, and this module's import must not cost them torch (1.7 s on 2 cores)
    from lightning_pp.autosplit.split import SplitError

    notes = tuple(check_trainer(cfg, this_machine=this_machine))
    check_data(cfg)
    devices, num_nodes = resolve_world(cfg, launch)
    world = devices * num_nodes if devices is not None else None
    settings = _pipeline_settings(cfg)
    model_spec = cfg.get("model")
    target = model_spec.get("class_path", model_spec.get("_target_"))
    has_layers = hasattr(import_class(target), "pipeline_layers")
    strategy_spec = cfg.get("strategy")
    # PipelineStrategy(split=...) cuts an unmodified model between its blocks (no layers hook)
    split = isinstance(strategy_spec, Mapping) and bool(strategy_spec.get("split"))
    info = None
    if model == "require" or (model == "try" and settings is not None and (has_layers or split)):
        try:
            info = meta_model_info(cfg, layers=not split)
        except Exception as err:  # a user model that cannot be built on meta: say which and why
            if model == "require":
                raise ConfigError(
                    f"cannot build model {model_spec!r} on the meta device: {err}"
                ) from None
    if settings is None:
        return RunCheck(world, devices, num_nodes, None, False, info, notes)
    pp = settings.get("pp")
    vpp = chunks_per_rank(
        str(settings.get("schedule") or default_schedule(None)), settings.get("vpp")
    )
    # pp=None over a world not known yet: the strategy checks the module when it is
    cut = (pp if pp is not None else (world or 1)) * (vpp or 1) > 1
    if cut and not has_layers and not split:
        raise ConfigError(
            f"model {target} ({cfg.section_origin('model')}) has no pipeline_layers() "
            f"(see lightning_pp.strategy.model.PipelineMixin), so it cannot be cut into "
            f"pp({pp}) x vpp({vpp}) chunks; set strategy.pp=1 and strategy.vpp=1, or use a "
            f"non-pipeline strategy such as 'strategy: ddp'"
        )
    data_spec = cfg.get("data")
    batch = (data_spec.get("init_args") or {}).get("batch_size", data_spec.get("batch_size"))
    accumulate = (cfg.get("trainer") or {}).get("accumulate_grad_batches", 1)
    accumulate = accumulate if isinstance(accumulate, int) else 1
    try:
        if pp is None and world is None:  # one pipeline over a world known only at run time
            unknown_yet = ("pp", "schedule")  # need the pipeline size to be checked
            given = {k: v for k, v in settings.items() if k not in unknown_yet}
            check_settings(accumulate_grad_batches=accumulate, **given)
            schedule = settings.get("schedule")
            if isinstance(schedule, str):  # an explicit vpp it cannot run: known without pp
                check_schedule_vpp(schedule, settings.get("vpp"))
            return RunCheck(world, devices, num_nodes, None, True, info, notes)
        plan = PipelinePlan.build(
            world_size=world,
            batch_size=batch if isinstance(batch, int) else None,
            accumulate_grad_batches=accumulate,
            warn=False,
            **settings,
        )
        if info is not None and info.layer_params is not None:
            plan = plan.with_layers(
                len(info.layer_params),
                layer_params=info.layer_params,
                layer_costs=info.layer_costs,
            )
        if info is not None and info.module is not None and (has_layers or split):
            # The rules the strategy applies to the module on every rank after launch, by the
            # same function, on the meta build: refused here, once, instead of there.
            assert isinstance(strategy_spec, Mapping) or strategy_spec == "pipeline"
            section = strategy_spec if isinstance(strategy_spec, Mapping) else {}
            from lightning_pp.strategy.preflight import check_module

            plan = check_module(
                info.module,
                plan,
                split=section.get("split") or None,
                split_placement=section.get("split_placement"),
                recompute=None if section.get("recompute") == "auto" else section.get("recompute"),
            )
        if plan.tp > 1 and info is not None and info.module is not None:
            _check_tensor_parallel(info.module, plan.tp, layers=has_layers and not split)
    except PreflightError as err:
        raise _plan_error(cfg, err, devices, num_nodes, launch is not None) from None
    except SplitError as err:
        key = "strategy.split_placement" if str(err).startswith("placement") else "strategy.split"
        raise ConfigError(f"{_where(cfg, key)}: {err}") from None
    return RunCheck(world, devices, num_nodes, plan, True, info, notes)

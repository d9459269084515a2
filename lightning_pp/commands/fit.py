"""``lightning-pp fit CONFIG.yaml [key=value ...]``: train from a run file.

Example::

    lightning-pp fit configs/demo_cpu.yaml
    lightning-pp fit configs/demo_cpu.yaml strategy.pp=4 trainer.max_steps=50
    lightning-pp fit configs/gpt_1b_pp4_vpp2.yaml --dry-run      # same as `lightning-pp validate`
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 --master_addr HOST --master_port 29500 \\
        -m lightning_pp.cli fit configs/demo_cpu.yaml

A mistake in the config (unknown key, wrong type, impossible pipeline shape) prints one message
naming the key and the file, and exits with code 2 before any process is started.
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from collections.abc import Callable
from typing import Any

from lightning_pp.config import (
    ConfigError,
    LaunchEnvironment,
    RunConfig,
    SampleConfig,
    detect_launch_environment,
    import_class,
    instantiate,
    is_class_spec,
    load_config,
    pipeline_strategy_class,
)

__all__ = ["build_trainer", "register", "run", "train"]


def _fit_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check and print the plan (like `lightning-pp validate`) without training",
    )
    p.add_argument(
        "--losses-out",
        metavar="FILE",
        default=None,
        help="write 'step,loss' per optimizer step to FILE (global rank 0)",
    )
    p.add_argument("--ckpt-path", default=None, help="resume from this checkpoint")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``fit`` subcommand to the ``lightning-pp`` parser."""
    p = subparsers.add_parser(
        "fit",
        help="train a model from a YAML run file (+ key=value overrides)",
        description=(
            "Load CONFIG, apply key=value overrides (OmegaConf dotlist, e.g. strategy.pp=4), "
            "check every key against the Trainer/strategy/class signatures, then train."
        ),
    )
    _fit_options(p)
    add_config_arguments(p, _fit_options)
    p.set_defaults(func=run)


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
# Building the run
# --------------------------------------------------------------------------------------------


def strategy_settings(cfg: RunConfig, world: int | None = None) -> dict[str, Any]:
    """The pipeline shape this run asks for, with PipelineStrategy's defaults filled in.

    ``pp=None`` means "all processes" (resolved when ``world`` is known), ``microbatches=None``
    means ``pp`` and ``schedule=None`` means ``1f1b`` (``interleaved`` when ``vpp > 1``), as in
    :class:`~lightning_pp.strategy.PipelineStrategy`. Returns ``{}`` when the run does not use
    the pipeline strategy (another strategy name or a class spec).
    """
    section = cfg.get("strategy")
    if section == "pipeline":
        section = {}
    elif section is None or isinstance(section, str) or is_class_spec(section):
        return {}
    settings: dict[str, Any] = {}
    cls = pipeline_strategy_class()
    if cls is not None:
        import inspect

        for name, param in inspect.signature(cls).parameters.items():
            if param.default is not inspect.Parameter.empty:
                settings[name] = param.default
    settings.update(section or {})
    if settings.get("pp") is None and world is not None:
        settings["pp"] = world
    settings.setdefault("vpp", 1)
    if settings.get("microbatches") is None and settings.get("pp") is not None:
        settings["microbatches"] = settings["pp"]
    if settings.get("schedule") is None:
        settings["schedule"] = "interleaved" if settings["vpp"] > 1 else "1f1b"
    return settings


def resolve_world(cfg: RunConfig, launch: LaunchEnvironment | None) -> tuple[int | None, int]:
    """(devices per node, nodes): from the launcher when processes come from outside."""
    if launch is not None:
        return launch.devices, launch.num_nodes
    trainer = cfg.get("trainer") or {}
    devices = trainer.get("devices", "auto")
    num_nodes = int(trainer.get("num_nodes", 1))
    if isinstance(devices, list):
        devices = len(devices)
    elif isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or devices < 1:
        accel = trainer.get("accelerator", "auto")
        devices = 1 if accel == "cpu" and devices == "auto" else None
    return devices, num_nodes


def check_shape(cfg: RunConfig, launch: LaunchEnvironment | None) -> dict[str, Any]:
    """World / pipeline / batch arithmetic, checked before any process starts.

    Returns the numbers (world, pp, dp, microbatches, batch_size, microbatch_size) for printing.
    """
    shape: dict[str, Any] = {}
    devices, num_nodes = resolve_world(cfg, launch)
    world = devices * num_nodes if devices is not None else None
    settings = strategy_settings(cfg, world)
    shape["settings"] = settings
    pp = settings.get("pp") or 1
    vpp = settings.get("vpp", 1)
    shape.update(world=world, devices=devices, num_nodes=num_nodes, pp=pp, vpp=vpp)
    origin = cfg.origin("strategy.pp")
    if world is not None and settings:
        if world % pp:
            raise ConfigError(
                f"world size {world} (devices({devices}) * num_nodes({num_nodes})) is not a "
                f"multiple of strategy.pp={pp} ({origin}); use pp in "
                f"{[d for d in range(1, world + 1) if world % d == 0]}"
            )
        shape["dp"] = world // pp
    microbatches = settings.get("microbatches")
    batch_size = (cfg.get("data.init_args") or cfg.get("data") or {}).get("batch_size")
    shape.update(microbatches=microbatches, batch_size=batch_size)
    if isinstance(microbatches, int) and isinstance(batch_size, int):
        if batch_size % microbatches:
            raise ConfigError(
                f"batch_size={batch_size} (per data-parallel replica, {cfg.path}) is not "
                f"divisible by strategy.microbatches={microbatches} "
                f"({cfg.origin('strategy.microbatches')})"
            )
        shape["microbatch_size"] = batch_size // microbatches
    model_spec = cfg.get("model")
    if settings and pp * vpp > 1 and is_class_spec(model_spec):
        target = model_spec.get("class_path", model_spec.get("_target_"))
        if not hasattr(import_class(target), "pipeline_layers"):
            raise ConfigError(
                f"model {target} ({cfg.section_origin('model')}) has no pipeline_layers() "
                f"(see lightning_pp.model.PipelineMixin), so it cannot be cut into "
                f"pp({pp}) x vpp({vpp}) chunks; set strategy.pp=1 and strategy.vpp=1, or use a "
                f"non-pipeline strategy such as 'strategy: ddp'"
            )
    if settings.get("pp") and settings.get("microbatches"):
        from lightning_pp.schedules import build_schedule

        try:
            shape["schedule"] = build_schedule(
                settings["schedule"],
                pp=settings["pp"],
                microbatches=settings["microbatches"],
                vpp=settings["vpp"],
                group_size=settings.get("group_size"),
            )
        except ValueError as err:
            raise ConfigError(f"strategy ({cfg.section_origin('strategy')}): {err}") from None
    return shape


def attach_optimizer(model: Any, optimizer: dict, lr_scheduler: dict | None) -> None:
    """Give ``model`` a ``configure_optimizers`` built from the config's optimizer section.

    Replaces the module's own ``configure_optimizers`` for this run only (the instance, not the
    class). Parameters are taken when Lightning asks, after ``configure_model``: under the
    pipeline each rank then optimizes exactly the layers it holds.
    """

    def configure_optimizers(self: Any) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        opt = instantiate(optimizer, params)
        if lr_scheduler is None:
            return opt
        extra = ("interval", "frequency", "monitor")
        spec = {k: v for k, v in lr_scheduler.items() if k not in extra}
        config = {"scheduler": instantiate(spec, opt)}
        config.update({k: lr_scheduler[k] for k in extra if k in lr_scheduler})
        config.setdefault("interval", "step")
        return {"optimizer": opt, "lr_scheduler": config}

    model.configure_optimizers = types.MethodType(configure_optimizers, model)


def build_strategy(cfg: RunConfig) -> Any:
    section = cfg.get("strategy")
    if section is None or isinstance(section, str):
        return section
    if is_class_spec(section):
        return instantiate(section)
    cls = pipeline_strategy_class()
    if cls is None:
        raise ConfigError("the strategy section needs lightning_pp.strategy.PipelineStrategy")
    return cls(**section)


def build_trainer(
    cfg: RunConfig,
    launch: LaunchEnvironment | None = None,
    losses_out: str | None = None,
) -> Any:
    """An ``L.Trainer`` from the trainer/strategy/callbacks/logger sections."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ProgressBar

    from lightning_pp.config import _build_nested
    from lightning_pp.progress import LossFile, PipelineProgressBar

    kwargs = {k: _build_nested(v) for k, v in (cfg.get("trainer") or {}).items()}
    if launch is not None:
        kwargs["devices"], kwargs["num_nodes"] = launch.devices, launch.num_nodes
    callbacks = [instantiate(spec) for spec in (cfg.get("callbacks") or [])]
    if kwargs.get("enable_progress_bar", True) and not any(
        isinstance(c, ProgressBar) for c in callbacks
    ):
        callbacks.append(PipelineProgressBar())
    if losses_out:
        callbacks.append(LossFile(losses_out))
    logger = cfg.get("logger")
    if isinstance(logger, list):
        kwargs["logger"] = [instantiate(s) for s in logger]
    elif is_class_spec(logger):
        kwargs["logger"] = instantiate(logger)
    elif isinstance(logger, bool):
        kwargs["logger"] = logger
    strategy = build_strategy(cfg)
    if strategy is not None:
        kwargs["strategy"] = strategy
    return pl.Trainer(callbacks=callbacks, **kwargs)


def build_model_and_data(cfg: RunConfig) -> tuple[Any, Any]:
    model = instantiate(cfg.get("model"))
    datamodule = instantiate(cfg.get("data"))
    if cfg.get("optimizer") is not None:
        attach_optimizer(model, cfg.get("optimizer"), cfg.get("lr_scheduler"))
    vocab = getattr(datamodule, "vocab_size", None)
    model_vocab = getattr(model, "vocab_size", None)
    if model_vocab is None:
        model_vocab = getattr(getattr(model, "hparams", {}), "get", lambda *_: None)("vocab_size")
    if isinstance(vocab, int) and isinstance(model_vocab, int) and model_vocab < vocab:
        raise ConfigError(
            f"model vocab_size={model_vocab} is smaller than the data's vocab_size={vocab} "
            f"({cfg.path}): set model.init_args.vocab_size to at least {vocab}"
        )
    return model, datamodule


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    try:
        split_options(args, "fit")
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        return fail("fit", str(err))
    if args.dry_run:
        from lightning_pp.commands.validate import report

        return report(cfg, command="fit")
    launch = detect_launch_environment()
    try:
        check_shape(cfg, launch)
    except ConfigError as err:
        return fail("fit", str(err))
    return train(cfg, launch, losses_out=args.losses_out, ckpt_path=args.ckpt_path)


def train(
    cfg: RunConfig,
    launch: LaunchEnvironment | None,
    losses_out: str | None = None,
    ckpt_path: str | None = None,
) -> int:
    import lightning.pytorch as pl

    if launch is not None:
        trainer_cfg = cfg.get("trainer") or {}
        say(
            f"[lightning-pp] launched by {launch.launcher} ({launch.detail}): devices="
            f"{launch.devices} num_nodes={launch.num_nodes} (config said devices="
            f"{trainer_cfg.get('devices', 'auto')} num_nodes={trainer_cfg.get('num_nodes', 1)})"
        )
    seed = cfg.get("seed")
    if seed is not None:
        pl.seed_everything(seed, workers=True, verbose=False)
    try:
        model, datamodule = build_model_and_data(cfg)
        trainer = build_trainer(cfg, launch, losses_out=losses_out)
    except ConfigError as err:
        return fail("fit", str(err))
    except (ValueError, TypeError) as err:
        # Raised by a constructor (Trainer, strategy, user class) for a value the schema could
        # not judge, e.g. PipelineStrategy(pp=0): still the config's fault, not a crash.
        return fail("fit", f"{cfg.path}: {type(err).__name__}: {err}")
    if trainer.is_global_zero:
        s = strategy_settings(cfg, trainer.world_size)
        shape = (
            f"pp={s.get('pp')} vpp={s.get('vpp')} microbatches={s.get('microbatches')} "
            f"schedule={s.get('schedule')}"
            if s
            else f"strategy={type(trainer.strategy).__name__}"
        )
        print(
            f"[lightning-pp] fit {cfg.path}: world={trainer.world_size} "
            f"(num_nodes={trainer.num_nodes} x devices={trainer.num_devices}), {shape}",
            flush=True,
        )
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        print(f"[lightning-pp] fit finished in {time.perf_counter() - t0:.1f}s", flush=True)
    sample_cfg = cfg.sample
    if sample_cfg.enabled:
        text = sample_after_fit(trainer, model, cfg, sample_cfg)
        if trainer.is_global_zero and text is not None:
            print(
                f"[lightning-pp] sample (prompt {sample_cfg.prompt!r}):\n{sample_cfg.prompt}{text}",
                flush=True,
            )
    return 0


def _full_model_on_rank_zero(trainer: Any, model: Any, cfg: RunConfig) -> Any:
    """The whole trained model on global rank 0 (``None`` elsewhere).

    Under the pipeline each rank holds only its layers; parameter names are keyed by the
    original layer index, so the ranks' state_dicts merge into the unpipelined model's. Every
    rank must call this (it is a collective). Meant for small models (the CPU demo): a real
    large run should consolidate a checkpoint instead.
    """
    import torch.distributed as dist

    settings = strategy_settings(cfg, trainer.world_size)
    pipelined = settings.get("pp", 1) > 1 or settings.get("vpp", 1) > 1
    if not pipelined or trainer.world_size == 1:
        return model if trainer.is_global_zero else None
    if not dist.is_available() or not dist.is_initialized():
        return None
    local = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    if not trainer.is_global_zero:
        return None
    full = instantiate(cfg.get("model"))
    if callable(getattr(full, "configure_model", None)):
        full.configure_model()
    merged: dict[str, Any] = {}
    for part in gathered:
        merged.update(part)
    full.load_state_dict(merged)
    return full


def sample_after_fit(trainer: Any, model: Any, cfg: RunConfig, sample: SampleConfig) -> str | None:
    """Generate ``sample.max_new_tokens`` characters on global rank 0 (``None`` elsewhere)."""
    import torch

    from lightning_pp.data import generate

    full = _full_model_on_rank_zero(trainer, model, cfg)
    if full is None:
        return None
    full.eval()
    device = next(full.parameters()).device
    hparams = getattr(full, "hparams", {})
    block = hparams.get("block_size") if hasattr(hparams, "get") else None
    block = block or (cfg.get("data.init_args") or {}).get("block_size", 128)
    if hasattr(full, "pipeline_forward"):

        def logits_fn(idx: torch.Tensor) -> torch.Tensor:
            idx = idx.to(device)
            return full.pipeline_forward((idx, idx))

    else:

        def logits_fn(idx: torch.Tensor) -> torch.Tensor:
            return full(idx.to(device))

    return generate(
        logits_fn,
        sample.prompt,
        max_new_tokens=sample.max_new_tokens,
        block_size=block,
        temperature=sample.temperature,
        top_k=sample.top_k,
        seed=cfg.get("seed") or 0,
    )

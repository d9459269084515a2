"""``lightning-pp fit CONFIG.yaml [key=value ...]``: train from a run file.

Example::

    lightning-pp fit configs/demo_cpu.yaml
    lightning-pp fit configs/demo_cpu.yaml strategy.pp=4 trainer.max_steps=50
    lightning-pp fit configs/gpt_1b_pp4_vpp2.yaml --dry-run      # same as `lightning-pp plan`
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 --master_addr HOST --master_port 29500 \\
        -m lightning_pp fit configs/demo_cpu.yaml

A mistake in the config (unknown key, wrong type, impossible pipeline shape: the rules of
:class:`~lightning_pp.layout.plan.PipelinePlan`) prints one message naming the key, the file and the
fix, and exits with code 2 before any process is started.
"""

from __future__ import annotations

import argparse
import time
import types
from typing import Any

from lightning_pp.commands._common import (
    add_config_arguments,
    check_run,
    fail,
    pipeline_plan,
    say,
    split_options,
)
from lightning_pp.commands.config import (
    ConfigError,
    RunConfig,
    SampleConfig,
    instantiate,
    is_class_spec,
    load_config,
    pipeline_strategy_class,
)
from lightning_pp.commands.launch import LaunchEnvironment, detect_launch_environment

__all__ = ["build_trainer", "register", "run", "train"]


def _fit_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check and print the plan (like `lightning-pp plan`) without training",
    )
    p.add_argument(
        "--losses-out",
        metavar="FILE",
        default=None,
        help="write 'step,loss' per optimizer step to FILE (global rank 0)",
    )
    p.add_argument("--ckpt-path", default=None, help="resume from this checkpoint")
    p.add_argument(
        "--no-summary",
        dest="summary",
        action="store_false",
        help="no end-of-run summary (and no pipeline measurements added for it)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``fit`` subcommand to the ``lightning-pp`` parser."""
    p = subparsers.add_parser(
        "fit",
        help="train a model from a YAML run file (+ key=value overrides)",
        description=(
            "Load CONFIG, apply key=value overrides (OmegaConf dotlist, e.g. strategy.pp=4), "
            "check every key against the Trainer/strategy/class signatures and the pipeline "
            "plan, then train."
        ),
    )
    _fit_options(p)
    add_config_arguments(p, _fit_options)
    p.set_defaults(func=run)


# --------------------------------------------------------------------------------------------
# Building the run
# --------------------------------------------------------------------------------------------


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


def _measure_every(kwargs: dict[str, Any]) -> tuple[int, int]:
    """(measurement cadence, timeline cadence) in training batches for the added callbacks.

    Measurements follow ``log_every_n_steps`` (as the pipeline callbacks do by default), but at
    least once in a short run; the one timeline falls on the last measured step of the run.
    """
    every = int(kwargs.get("log_every_n_steps") or 50)
    max_steps = kwargs.get("max_steps", -1)
    if isinstance(max_steps, int) and max_steps > 0:
        every = max(1, min(every, max_steps))
        return every, max(every, max_steps // every * every)
    return every, every * 10


def _summary_callbacks(callbacks: list[Any], kwargs: dict[str, Any], pipelined: bool) -> list[Any]:
    """What the end-of-run summary reads: the pipeline monitors (unless configured already, in
    which case the summary reads those) and the
    :class:`~lightning_pp.callbacks.summary.RunSummary`."""
    from lightning_pp.callbacks import (
        ActivationMemoryMonitor,
        PipelineBubbleMonitor,
        PipelineTimeline,
    )
    from lightning_pp.callbacks.summary import RunSummary

    every, timeline_every = _measure_every(kwargs)
    added: list[Any] = []
    if pipelined:
        for cls, make in (
            (PipelineBubbleMonitor, lambda: PipelineBubbleMonitor(every_n_steps=every)),
            (ActivationMemoryMonitor, lambda: ActivationMemoryMonitor(every_n_steps=every)),
            (PipelineTimeline, lambda: PipelineTimeline(every_n_steps=timeline_every)),
        ):
            if not any(isinstance(c, cls) for c in callbacks):
                added.append(make())
    if not any(isinstance(c, RunSummary) for c in callbacks):
        added.append(RunSummary(every_n_steps=every))
    return added


def build_trainer(
    cfg: RunConfig,
    launch: LaunchEnvironment | None = None,
    losses_out: str | None = None,
    summary: bool = True,
) -> Any:
    """An ``L.Trainer`` from the trainer/strategy/callbacks/logger sections.

    Added unless configured: a progress display (a TQDM bar on a terminal, plain lines, at most
    one per logging interval, otherwise),
    :class:`~lightning_pp.callbacks.progress.FinalValidation`, and
    with ``summary`` the :class:`~lightning_pp.callbacks.summary.RunSummary` with the pipeline
    measurements it reads.
    """
    import sys

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ProgressBar

    from lightning_pp.callbacks.progress import (
        FinalValidation,
        LossFile,
        PipelineProgressBar,
        PlainProgress,
    )
    from lightning_pp.commands.config import _build_nested

    kwargs = {k: _build_nested(v) for k, v in (cfg.get("trainer") or {}).items()}
    if launch is not None:
        kwargs["devices"], kwargs["num_nodes"] = launch.devices, launch.num_nodes
    callbacks = [instantiate(spec) for spec in (cfg.get("callbacks") or [])]
    if not any(isinstance(c, FinalValidation) for c in callbacks):
        callbacks.append(FinalValidation())
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
    if summary:
        cls = pipeline_strategy_class()
        pipelined = cls is not None and isinstance(strategy, cls)
        callbacks += _summary_callbacks(callbacks, kwargs, pipelined)
    if kwargs.get("enable_progress_bar", True) and not any(
        isinstance(c, ProgressBar) for c in callbacks
    ):
        # Last, so that its line shows what the measurements of the same step found.
        interactive = sys.stdout.isatty()
        callbacks.append(PipelineProgressBar() if interactive else PlainProgress())
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
        from lightning_pp.commands.plan import report

        return report(cfg, command="fit")
    launch = detect_launch_environment()
    try:
        # Every rule that can be checked before launch, so that a mistake exits 2 here
        # instead of a traceback on every rank.
        check_run(cfg, launch, model="try")
    except ConfigError as err:
        return fail("fit", str(err))
    return train(
        cfg,
        launch,
        losses_out=args.losses_out,
        ckpt_path=args.ckpt_path,
        summary=getattr(args, "summary", True),
    )


def train(
    cfg: RunConfig,
    launch: LaunchEnvironment | None,
    losses_out: str | None = None,
    ckpt_path: str | None = None,
    summary: bool = True,
) -> int:
    import lightning.pytorch as pl

    from lightning_pp.callbacks.summary import RunSummary

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
        trainer = build_trainer(cfg, launch, losses_out=losses_out, summary=summary)
    except ConfigError as err:
        return fail("fit", str(err))
    except (ValueError, TypeError) as err:
        # Raised by a constructor (Trainer, strategy, user class) for a value the schema could
        # not judge, e.g. PipelineStrategy(pp=0): still the config's fault, not a crash.
        return fail("fit", f"{cfg.path}: {type(err).__name__}: {err}")
    if trainer.is_global_zero:
        plan = pipeline_plan(cfg, trainer.world_size)
        shape = (
            f"pp={plan.pp} vpp={plan.vpp} microbatches={plan.microbatches} "
            f"schedule={plan.schedule.name}"
            if plan is not None
            else f"strategy={type(trainer.strategy).__name__}"
        )
        print(
            f"[lightning-pp] fit {cfg.path}: world={trainer.world_size} "
            f"(num_nodes={trainer.num_nodes} x devices={trainer.num_devices}), {shape}",
            flush=True,
        )
    from lightning_pp.checkpoint.errors import CheckpointError
    from lightning_pp.planner.recompute import RecomputeBudgetError

    if ckpt_path is not None:
        _read_pipeline_checkpoints(trainer, ckpt_path)
    t0 = time.perf_counter()
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    except RecomputeBudgetError as err:
        # The one setting checked only after launch (recompute='auto' measures the first
        # batch). Every rank raises the same error together: rank 0 says it, once.
        if trainer.is_global_zero:
            fail("fit", f"{cfg.path}: 'strategy.activation_budget': {err}")
        return 2
    except CheckpointError as err:
        # A refused --ckpt-path (tampered, incomplete, unsafe to unpickle, another model's):
        # the loaders refuse on every rank together, before any state changed.
        if trainer.is_global_zero:
            fail("fit", f"--ckpt-path {ckpt_path}: {err}")
        return 2
    if trainer.is_global_zero:
        print(f"[lightning-pp] fit finished in {time.perf_counter() - t0:.1f}s", flush=True)
    sample_cfg = cfg.sample
    if sample_cfg.enabled:
        text = sample_after_fit(trainer, model, cfg, sample_cfg)
        if trainer.is_global_zero and text is not None:
            caption = sample_caption(trainer, cfg, sample_cfg)
            print(
                f"[lightning-pp] sample: {caption}\n"
                f"[lightning-pp] sample (prompt {sample_cfg.prompt!r}):\n{sample_cfg.prompt}{text}",
                flush=True,
            )
            for cb in trainer.callbacks:
                if isinstance(cb, RunSummary):
                    cb.add_sample(sample_cfg.prompt, text, caption)
    return 0


def _read_pipeline_checkpoints(trainer: Any, ckpt_path: str) -> None:
    """A plain Trainer (no PipelineStrategy) given a pipeline checkpoint directory reads it
    through :class:`~lightning_pp.checkpoint.PipelineCheckpointIO` (Lightning's own
    ``TorchCheckpointIO`` cannot open a directory); a CheckpointIO the config chose is kept."""
    import os

    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from lightning_pp.checkpoint import PipelineCheckpointIO

    strategy, pipeline = trainer.strategy, pipeline_strategy_class()
    if not os.path.isdir(ckpt_path) or (pipeline is not None and isinstance(strategy, pipeline)):
        return
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = PipelineCheckpointIO()


def sample_caption(trainer: Any, cfg: RunConfig, sample: SampleConfig) -> str:
    """What the sample comes from, in numbers: model size, training seen, loss, decoding.

    Facts only, no claim about its quality: the reader judges the text against the loss.
    """
    import math

    from lightning_pp.callbacks.summary import RunSummary
    from lightning_pp.commands._common import meta_model_info

    parts = []
    try:
        parts.append(f"a {meta_model_info(cfg).total_params / 1e6:.2f}M-parameter model")
    except Exception:  # a model that cannot be built on meta: the caption just says less
        pass
    parts.append(f"after {trainer.global_step} steps")
    summary = next((cb.summary for cb in trainer.callbacks if isinstance(cb, RunSummary)), {})
    if summary.get("tokens"):
        parts.append(f"{summary['tokens'] / 1e6:.1f}M tokens seen")
    val = summary.get("val_loss") or []
    if val:
        nats = val[-1][1]
        parts.append(f"validation loss {nats:.2f} nats = {nats / math.log(2):.2f} bits per token")
    decoding = "greedy" if sample.temperature <= 0 else f"temperature {sample.temperature:g}"
    if sample.top_k:
        decoding += f", top-k {sample.top_k}"
    return ", ".join(parts) + f"; {decoding}"


def _full_model_on_rank_zero(trainer: Any, model: Any, cfg: RunConfig) -> Any:
    """The whole trained model on global rank 0 (``None`` elsewhere).

    Under the pipeline each rank holds only its layers; parameter names are keyed by the
    original layer index, so the ranks' state_dicts merge into the unpipelined model's. Every
    rank must call this (it is a collective). Meant for small models (the CPU demo): a real
    large run should consolidate a checkpoint instead.
    """
    import torch.distributed as dist

    plan = pipeline_plan(cfg, trainer.world_size)
    pipelined = plan is not None and plan.num_stages > 1
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

    from lightning_pp.models.data import generate

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

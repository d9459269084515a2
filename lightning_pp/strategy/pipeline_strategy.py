"""PipelineStrategy: pipeline (x data) parallel training in the Lightning ``Trainer``.

Glue only: it decides *when* Lightning's hooks run and hands the work to its collaborators
(arrows point at what it calls; docs/strategy.md draws the whole picture)::

    PipelineStrategy -> PipelinePlan    every default and validity rule, with its message
                     -> LayerPlacement  which rank holds which layers and tied weights
                     -> LayerBuild      builds and stages this rank's layers (stage_build;
                                        SplitPipeline for split=)
                     -> engine_build    the engine and the DP gradient sync from the settings
                     -> train_step      the training step, and the Trainer setup it needs
                                        (no second backward; global-norm clipping)
                     -> eval_step       validation, test and predict: one forward-only path
                     -> compat          every private Lightning contact (_lightning_compat)
                     -> checkpoint      sharded save / load bodies
                     -> PipelineEngine  runs this rank's schedule (no Lightning inside)

Example::

    trainer = L.Trainer(accelerator="cpu", devices=4, max_steps=100,
                        strategy=PipelineStrategy(pp=2, vpp=2, microbatches=4))
    trainer.fit(GPT(n_layer=6), datamodule)    # world 4 = dp 2 x pp 2
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from . import _lightning_compat as compat
from . import eval_step, train_step
from .autosplit.strategy_glue import SplitPipeline
from .checkpoint import (
    load_strategy_checkpoint,
    remove_checkpoint_dir,
    save_strategy_checkpoint,
    strategy_optimizer_state,
)
from .engine_build import build_engine, build_grad_sync, log_start
from .failure import DEFAULT_WATCHDOG_TIMEOUT, PipelineAborted, report_failure
from .grad_sync import DeferredGradSync, TiedParameterSync
from .partition import PipelineChunk
from .placement import LayerPlacement
from .plan import PipelinePlan, check_recompute, check_settings, default_schedule
from .process_strategy import ProcessGroupStrategy, StartMethod
from .recompute import RecomputeSpec
from .stage_build import LayerBuild
from .topology import PipelineTopology, ProcessGroups, build_process_groups

__all__ = ["PipelineStrategy"]


class PipelineStrategy(ProcessGroupStrategy):
    """Pipeline-parallel (Megatron-style schedules) x data-parallel training.

    The world of ``num_nodes x devices`` processes is a ``pp x dp`` grid (``dp = world / pp``,
    pipeline outermost: global rank ``= pp_rank * dp + dp_rank``). The module's
    :class:`~lightning_pp.model.PipelineLayers` are cut into ``pp * vpp`` chunks; each rank builds
    and runs only the chunks the schedule places on it (:mod:`lightning_pp.placement`).

    Args:
        pp: pipeline stages (ranks per pipeline). ``None``: all processes in one pipeline.
        vpp: chunks per rank (virtual pipeline size). ``vpp > 1`` interleaves.
        microbatches: microbatches per batch; default ``pp`` (the smallest count that fills the
            pipeline; raise it to shrink the bubble ``(pp - 1) / (vpp * m)``).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, or the zero-bubble ``"zb-h1"``
            (vpp 1) and ``"zbv"`` (2 chunks per rank in V placement whatever vpp says when it is
            unset); default ``"1f1b"`` when ``vpp == 1`` and ``"interleaved"`` otherwise.
        partition: ``"uniform"``, ``"parameters"``, ``"cost"`` or a list of per-stage layer counts.
        group_size: interleaved schedule's microbatch group size (default ``pp``).
        release_outputs: free a sent activation's storage (only its autograd graph is kept).
        bucket_cap_mb: data-parallel all-reduce bucket size.
        start_method, process_group_backend, timeout: launching and the process group, see
            :class:`~lightning_pp.process_strategy.ProcessGroupStrategy`.
        watchdog_timeout: seconds a rank may block on one pipeline transfer before the step
            fails with a hang report (rank, awaited message, the other ranks' state, the grid);
            ``None`` disables. See docs/troubleshooting.md.
        check_finite: stop at the first NaN/inf (activation, loss or gradient) and name the
            stage and layer that produced it; costs a check per microbatch (off by default).
        recv_lookahead: post the receives of up to this many upcoming actions early, so data
            arrives while the rank computes; ``None``: 8 on gloo, 1 on NCCL (see
            :class:`~lightning_pp.engine.PipelineEngine`). Each adds one boundary buffer.
        split: pipeline a module that is NOT written with ``PipelineLayers``: the dotted name,
            relative to the LightningModule, of the ModuleList of repeated blocks
            (``"model.transformer.h"`` for a GPT-2 held as ``self.model``). Blocks are cut
            between; what runs before the first block goes to the first stage, after the last
            to the last stage. The module's own ``training_step``/``validation_step``/
            ``test_step``/``predict_step`` run as written, and state-dict keys stay the model's
            own (:mod:`lightning_pp.autosplit.strategy_glue`, docs/strategy.md "Bring your own
            model").
        split_placement: ``{module name: "first" | "last"}`` for modules beside the blocks whose
            registration order does not say on which end they run (``split`` only).
        recompute: activation recompute (``torch.utils.checkpoint``, non-reentrant) in training:
            ``None``, ``"full"``, a list of layer indices, ``"selective:<module pattern>"``
            (modules inside layers, e.g. ``"selective:attn"``) or ``"auto"`` (per rank, the
            cheapest layers that fit ``activation_budget``; planned on the first batch and
            logged). See docs/strategy.md "Fitting in memory".
        activation_budget: bytes of saved activations per rank for ``recompute="auto"``
            (an int or a string such as ``"6GiB"``).

    Example::

        trainer = L.Trainer(devices=4, strategy=PipelineStrategy(pp=4, microbatches=8))
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        pp: int | None = None,
        vpp: int = 1,
        microbatches: int | None = None,
        schedule: str | None = None,
        partition: str | Sequence[int] = "uniform",
        group_size: int | None = None,
        release_outputs: bool = True,
        bucket_cap_mb: float = 25.0,
        start_method: StartMethod = "popen",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        watchdog_timeout: float | None = DEFAULT_WATCHDOG_TIMEOUT,
        check_finite: bool = False,
        recv_lookahead: int | None = None,
        split: str | None = None,
        split_placement: dict[str, str] | None = None,
        recompute: RecomputeSpec = None,
        activation_budget: int | str | None = None,
    ) -> None:
        super().__init__(
            start_method=start_method,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._pp, self.vpp, self._microbatches = pp, vpp, microbatches
        self.schedule_name = schedule or default_schedule(vpp)
        self.partition = partition
        self.group_size = group_size
        self.release_outputs = release_outputs
        self.bucket_cap_mb = bucket_cap_mb
        self.watchdog_timeout = watchdog_timeout
        self.check_finite = check_finite
        self.recv_lookahead = recv_lookahead
        self.recompute, self.activation_budget = check_recompute(
            recompute, activation_budget, split=split
        )
        #: the ``recompute="auto"`` plan (every rank's choice), once the first batch ran
        self.recompute_plan: Any = None
        #: the ``split=`` path (an unmodified model cut between its blocks), else ``None``
        self.split_pipeline = SplitPipeline(split, split_placement) if split else None
        #: builds and stages this rank's layers: ``split=``'s, or the module's PipelineLayers
        self.stage_build: SplitPipeline | LayerBuild = self.split_pipeline or LayerBuild()
        #: the checked shape; complete once the world and the module's layers are known
        self.plan: PipelinePlan | None = None
        # Fail at construction, before any process starts: the settings, and the whole shape
        # when pp is given (pp=None: one pipeline over the world, whose size comes later).
        if pp is not None:
            self.plan = PipelinePlan.build(pp=pp, **self._settings())
        else:
            check_settings(**{k: v for k, v in self._settings().items() if k != "schedule"})

        self.topology: PipelineTopology | None = None
        self.groups: ProcessGroups | None = None
        #: which layers each rank holds (set once the module's layer count is known)
        self.placement: LayerPlacement | None = None
        self.chunks: list[PipelineChunk] = []
        self.engine: Any = None
        self.grad_sync: DeferredGradSync | None = None
        self.tied_sync = TiedParameterSync([])
        #: the engine's record of the last train/eval step on this rank (for callbacks)
        self.last_record: Any = None
        self._loss_scale = 1
        self._unclipped_precision: Precision | None = None

    # ------------------------------------------------------------------ sizes and devices
    @property
    def pp(self) -> int:
        """Pipeline stages; resolved to the world size when constructed with ``pp=None``."""
        return self._pp if self._pp is not None else self.world_size

    @property
    def dp(self) -> int:
        return self.world_size // self.pp

    @property
    def microbatches(self) -> int:
        if self.plan is not None:
            return self.plan.microbatches
        return self._microbatches or self.pp  # pp=None before the world is known: the plan's rule

    @property
    def layer_ranges(self) -> list[range] | None:
        """Layer range of every virtual stage, once the module's layers are known."""
        return list(self.placement.layer_ranges) if self.placement is not None else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard data over data-parallel replicas only: all stages of a pipeline see one batch."""
        if self.topology is not None:
            return {"num_replicas": self.topology.dp, "rank": self.topology.dp_rank}
        return {"num_replicas": self.dp, "rank": self.global_rank % self.dp}

    # ------------------------------------------------------------------ rules
    # Every validity rule the strategy applies, through its PipelinePlan (lightning_pp.plan holds
    # the rules and their messages). Each runs on every rank alike, before any communication
    # that a bad value would hang.
    def _settings(self) -> dict[str, Any]:
        names = ("vpp", "partition", "group_size", "recv_lookahead", "bucket_cap_mb")
        return {
            **{name: getattr(self, name) for name in names},
            "microbatches": self._microbatches,
            "watchdog_timeout": self.watchdog_timeout,
            "schedule": self.schedule_name,
        }

    # ------------------------------------------------------------------ launching
    @override
    def watched_ranks(self) -> list[int]:
        """Heartbeats checked: this pipeline's ranks and the next data-parallel replica's rank
        (every rank is then watched by someone, at O(pp) store reads per rank)."""
        if self.topology is None:
            return super().watched_ranks()
        topo = self.topology
        return [*topo.pipeline_ranks, (self.global_rank + 1) % self.world_size]

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        if self.num_processes == 0:
            return  # not connected to a Trainer yet
        world = self.world_size
        plan = self.plan or PipelinePlan.build(pp=world, **self._settings())
        self.plan = plan.on_trainer_world(
            world, pp=self._pp, num_nodes=self.num_nodes, devices=self.num_processes
        )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the default process group
        self.topology = PipelineTopology.from_world(self.world_size, self.global_rank, self.pp)
        self.groups = build_process_groups(self.topology, timeout=self._timeout)

    # ------------------------------------------------------------------ building the model
    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: this rank builds only its own stages."""
        with self.stage_build.build_context(self, self.lightning_module):
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.topology is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        self.stage_build.stage_module(self, module)  # this rank's stages only, checked
        self.precision_plugin.convert_module(module)
        self.model_to_device()
        assert self.plan is not None and self.placement is not None
        self.chunks = list(self.stage_build.chunks)
        self.tied_sync = self.stage_build.tied_sync(self)
        self.tied_sync.broadcast_weights()  # the copies start from the owner's values
        # Optimizers and precision; when fitting, Lightning's backward is switched off (the
        # schedule runs it) and gradient clipping goes by the whole pipeline's norm.
        train_step.setup_training(self, trainer)
        self.grad_sync = build_grad_sync(self)
        self.engine = build_engine(self)
        if self.is_global_zero:
            log_start(self)

    # ------------------------------------------------------------------ training
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """One pipelined forward+backward over the batch; returns the batch loss on every rank."""
        return train_step.train_step(self, args, kwargs)

    # ------------------------------------------------------------------ evaluation, prediction
    # One forward-only path (lightning_pp.eval_step): the last stage's result reaches every rank.
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return eval_step.step(self, "validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return eval_step.step(self, "test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's output (microbatches concatenated), on every rank of the pipeline, so
        ``trainer.predict`` returns predictions on global rank 0 too (as spawn launchers need)."""
        return eval_step.step(self, "predict_step", args, kwargs)

    # ------------------------------------------------------------------ checkpoints
    # A checkpoint is a directory: every stage writes its own tensors by original name, rank 0
    # Lightning's metadata (format and bodies: lightning_pp/checkpoint.py, docs/checkpoints.md).
    # It is loaded after setup, so each rank (of any later shape) reads only its own layers.
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers by parameter name

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's optimizer state keyed by parameter name (stages' indices would collide)."""
        return strategy_optimizer_state(self, optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Collective: write this rank's shard into the checkpoint directory ``filepath``."""
        save_strategy_checkpoint(self, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load this rank's layers (and optimizer state) by name, whatever pipeline shape wrote
        the checkpoint; return Lightning's metadata."""
        return load_strategy_checkpoint(self, checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint, by name, for this rank's layers only

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint directory (ModelCheckpoint's top-k rotation)."""
        if self.is_global_zero:
            remove_checkpoint_dir(filepath)

    # ------------------------------------------------------------------ teardown, registry
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Publish this rank's failure (e.g. from a callback) so the other ranks stop waiting."""
        # SystemExit (SIGTERM) is a stop every rank takes together, not a failure to publish.
        failed = not isinstance(exception, (PipelineAborted, SystemExit))
        if failed and compat.distributed_is_initialized():
            where = "Lightning hook or step"
            report_failure(compat.default_store(), self.global_rank, where, exception)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        train_step.teardown_training(self)  # Lightning's own backward, summaries, precision
        self.engine = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("pipeline", "popen"), ("pipeline_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"Pipeline x data parallel (start_method={start_method!r})",
                    start_method=start_method,
                )


# On import, so that Trainer(strategy="pipeline") and the YAML config's name resolve.
PipelineStrategy.register_strategies(StrategyRegistry)

"""PipelineStrategy: pipeline (x data) parallel training in the Lightning ``Trainer``.

Glue only: it decides *when* Lightning's hooks run and hands the work to its collaborators
(arrows point at what it calls; docs/strategy.md draws the whole picture)::

    PipelineStrategy -> RankLayout      the plan (every rule), the grid, the placement
                     -> LayerBuild      builds and stages this rank's layers (stage_build;
                                        SplitPipeline for split=)
                     -> engine_build    the engine and the DP gradient sync from the settings
                     -> TrainStep       the training step (train_step): no second backward,
                                        the loss log, recompute="auto" on the first batch
                     -> ForwardOnly     validation, test and predict: one forward-only path
                     -> compat          every private Lightning contact (_lightning_compat)
                     -> checkpoint      sharded save / load by name (lightning_pp.checkpoint)
                     -> PipelineEngine  runs this rank's schedule (no Lightning inside)

Each collaborator receives the objects it needs (the layout, the engine, the module, the
strategy as :class:`~lightning_pp.strategy.collectives.Collectives`), never the strategy itself.

Example::

    trainer = L.Trainer(accelerator="cpu", devices=4, max_steps=100,
                        strategy=PipelineStrategy(pp=2, vpp=2, microbatches=4))
    trainer.fit(GPT(n_layer=6), datamodule)    # world 4 = dp 2 x pp 2
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from .. import _lightning_compat as compat
from ..autosplit.split import SplitError
from ..checkpoint.directory import remove_checkpoint_dir
from ..checkpoint.strategy_io import (
    CheckpointSaver,
    load_pipeline_checkpoint,
    module_optimizer_state,
)
from ..layout.partition import PipelineChunk
from ..layout.placement import LayerPlacement
from ..layout.plan import PipelinePlan
from ..layout.rank_layout import RankLayout
from ..layout.recompute_spec import RecomputeSpec, Selective, check_recompute
from ..layout.rules import (
    PreflightError,
    check_schedule_vpp,
    check_settings,
    check_split_settings,
    default_schedule,
)
from ..layout.topology import (
    DP_DIM,
    TP_DIM,
    PipelineTopology,
    ProcessGroups,
    build_process_groups,
)
from ..runtime.distributed_optimizer import ShardedGradSync
from ..runtime.dtensor_state import DTensorOptimizer, counted_once
from ..runtime.errors import DEFAULT_WATCHDOG_TIMEOUT, PipelineAborted, report_failure
from ..runtime.fsdp_chunks import FsdpGradSync, reshard_chunks, unmix_foreach
from ..runtime.grad_sync import DeferredGradSync, TiedParameterSync
from ..runtime.recompute import select_targets, selective_units
from ..schedules import chunks_per_rank
from . import eval_step
from .auto_schedule import PROFILE_STEP, rebuild_from_step
from .engine_build import (
    LossScale,
    build_engine,
    build_grad_sync,
    log_start,
    module_io,
    shard_with_fsdp,
)
from .loss_count import LossCounts
from .model_summary import restore_summaries, use_stage_summaries
from .precision import GlobalNormClipping, clip_sharded_by_global_norm, with_global_norm_clipping
from .preflight import check_module, check_recompute_targets, meta_view
from .process_group import ProcessGroupStrategy, StartMethod
from .split_build import SplitPipeline
from .stage_build import LayerBuild
from .tensor_parallel import TpPlan, check_tp_plan_setting, shard_stage, tensor_parallel_mesh
from .train_step import TrainStep, clip_grad_by_global_norm

__all__ = ["PipelineStrategy"]

log = logging.getLogger("lightning_pp.strategy")


class PipelineStrategy(ProcessGroupStrategy):
    """Pipeline-parallel (Megatron-style schedules) x data-parallel training.

    The world of ``num_nodes x devices`` processes is a ``pp x dp x tp`` grid (``dp = world /
    (pp * tp)``, pipeline outermost, tensor parallel innermost: global rank ``= (pp_rank * dp +
    dp_rank) * tp + tp_rank``). The module's
    :class:`~lightning_pp.strategy.model.PipelineLayers` are cut into ``pp * vpp`` chunks; each
    rank builds
    and runs only the chunks the schedule places on it (:mod:`lightning_pp.layout.placement`).

    Args:
        pp: pipeline stages (ranks per pipeline). ``None``: all processes in one pipeline.
        vpp: chunks per rank (virtual pipeline size). ``vpp > 1`` interleaves. ``None`` (the
            default): the schedule's own, 2 for ``"zbv"`` and 1 for the others. A value given
            is never replaced: one the schedule cannot run (``zbv`` with ``vpp=1``, ``1f1b``
            with ``vpp=2``) is refused at construction.
        microbatches: microbatches per batch; default ``pp`` (the smallest count that fills the
            pipeline; raise it to shrink the bubble ``(pp - 1) / (vpp * m)``).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, or the zero-bubble ``"zb-h1"``
            (vpp 1) and ``"zbv"`` (exactly 2 chunks per rank in V placement), or ``"zb-auto"``
            (computed from costs measured on the second batch; V placement by default, loop
            for ``vpp=1``; see :mod:`lightning_pp.strategy.auto_schedule`); default
            ``"1f1b"`` when ``vpp`` is unset or 1 and ``"interleaved"`` otherwise.
        partition: ``"uniform"``, ``"parameters"``, ``"cost"`` or a list of per-stage layer counts.
        group_size: interleaved schedule's microbatch group size (default ``pp``).
        release_outputs: free a sent activation's storage (only its autograd graph is kept).
        bucket_cap_mb: data-parallel all-reduce bucket size.
        start_method, process_group_backend, timeout: launching and the process group, see
            :class:`~lightning_pp.strategy.process_group.ProcessGroupStrategy`.
        watchdog_timeout: seconds a rank may block on one pipeline transfer before the step
            fails with a hang report (rank, awaited message, the other ranks' state, the grid);
            ``None`` disables. See docs/troubleshooting.md.
        check_finite: stop at the first NaN/inf (activation, loss or gradient) and name the
            stage and layer that produced it; costs a check per microbatch (off by default).
        recv_lookahead: post the receives of up to this many upcoming actions early, so data
            arrives while the rank computes; ``None``: 8 on gloo, 1 on NCCL (see
            :class:`~lightning_pp.runtime.engine.PipelineEngine`). Each adds one boundary buffer.
        split: pipeline a module that is NOT written with ``PipelineLayers``: the dotted name,
            relative to the LightningModule, of the ModuleList of repeated blocks
            (``"model.transformer.h"`` for a GPT-2 held as ``self.model``). Blocks are cut
            between; what runs before the first block goes to the first stage, after the last
            to the last stage. The module's own ``training_step``/``validation_step``/
            ``test_step``/``predict_step`` run as written, and state-dict keys stay the model's
            own (:mod:`lightning_pp.strategy.split_build`, docs/strategy.md "Bring your own
            model").
        split_placement: ``{module name: "first" | "last"}`` for modules beside the blocks whose
            registration order does not say on which end they run (``split`` only).
        loss_normalization: how microbatch and replica losses combine: ``"auto"`` (default:
            by valid targets where a count is known, from the module's
            ``pipeline_loss_count(batch)`` or, with ``split``, the ``labels=`` of a Hugging
            Face model call; else by samples), ``"tokens"`` (by valid targets; an error if no
            count is found) or ``"samples"``. The step's loss, gradients and logged values are
            then the single-process loss over the global batch (:mod:`.loss_count`,
            docs/strategy.md "Loss normalization").
        recompute: activation recompute (``torch.utils.checkpoint``, non-reentrant) in training:
            ``None``, ``"full"``, a list of layer indices, ``"selective:<module pattern>"``
            (modules inside layers, e.g. ``"selective:attn"``) or ``"auto"`` (per rank, the
            cheapest layers that fit ``activation_budget``; planned on the first batch and
            logged). See docs/strategy.md "Fitting in memory".
        activation_budget: bytes of saved activations per rank for ``recompute="auto"``
            (an int or a string such as ``"6GiB"``).
        async_checkpoint: write checkpoints in the background (``dcp.async_save``): a save
            returns once this rank's tensors are copied, and the next steps overlap the write.
            A save waits for the previous one; loads and teardown wait for it too, and
            :meth:`wait_for_checkpoint` waits on demand. See docs/checkpoints.md
            "Asynchronous save".
        zero: shard over the data-parallel replicas, Megatron's distributed optimizer:
            ``1`` the optimizer state (each replica steps its 1/dp of every gradient bucket, then
            the updated parameters are all-gathered), ``2`` the gradients too (a bucket's
            full-size gradients are freed once its reduce-scatter starts). Elementwise
            optimizers (Adam, AdamW, SGD, ...). With ``tp > 1`` each tp rank's shard is cut
            into rows over its replicas. See docs/strategy.md "Scaling past one replica's
            memory".
        fsdp: FSDP2 (``fully_shard``) per chunk over the data-parallel replicas: parameters,
            gradients and optimizer state sharded (ZeRO-3). Not with ``zero``.
        reshard_after_forward: with ``fsdp``, free each chunk's gathered parameters after
            every forward (one all-gather per microbatch: for memory-bound runs); default
            ``False`` keeps them gathered for the whole step.
        tp: tensor-parallel ranks per stage (the innermost dim of the job's mesh, so a
            stage's tp group is neighbouring ranks: one node's devices). The world is
            ``pp x dp x tp``. Each local layer is sharded at setup: a ``PipelineLayers`` model
            by its ``pipeline_tensor_parallel`` hook, a ``split=`` model by ``tp_plan``. See
            docs/strategy.md "Tensor parallel".
        tp_plan: with ``split=`` and ``tp > 1``: ``"auto"`` applies the Hugging Face model's
            own plan (``base_model_tp_plan`` and the head's ``_tp_plan``) to the modules this
            rank holds; a dict ``{module pattern: style}`` is applied instead.
        overlap_param_gather: with ``zero``, leave the all-gather of the updated parameters
            running after the optimizer step; each bucket is finished by the first forward
            that reads it (Megatron's ``overlap_param_gather``). Parameter values read between
            the step and the next forward need :meth:`wait_for_parameters` first
            (checkpoints, evaluation and teardown call it).

    Example::

        trainer = L.Trainer(devices=4, strategy=PipelineStrategy(pp=4, microbatches=8))
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        pp: int | None = None,
        vpp: int | None = None,
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
        loss_normalization: str = "auto",
        recompute: RecomputeSpec = None,
        activation_budget: int | str | None = None,
        async_checkpoint: bool = False,
        zero: int = 0,
        fsdp: bool = False,
        reshard_after_forward: bool = False,
        overlap_param_gather: bool = False,
        tp: int = 1,
        tp_plan: TpPlan = None,
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
        # vpp as given (None: unset, the schedule's own); the ``vpp`` property is the resolved one
        self._pp, self._vpp, self._microbatches = pp, vpp, microbatches
        self.schedule_name = schedule or default_schedule(vpp)
        self.partition = partition
        self.group_size = group_size
        self.release_outputs = release_outputs
        self.bucket_cap_mb = bucket_cap_mb
        self.zero, self.fsdp = zero, fsdp
        check_tp_plan_setting(tp_plan, split)
        self.tp, self.tp_plan = tp, tp_plan
        self.reshard_after_forward = reshard_after_forward
        if not isinstance(overlap_param_gather, bool) or (overlap_param_gather and not zero):
            raise PreflightError(
                f"overlap_param_gather={overlap_param_gather!r} overlaps the distributed "
                f"optimizer's parameter all-gather with the next forwards: it needs zero=1 or "
                f"zero=2 (zero={zero!r}) and a bool",
                key="overlap_param_gather",
            )
        self.overlap_param_gather = overlap_param_gather
        self.watchdog_timeout = watchdog_timeout
        self.check_finite = check_finite
        self.recv_lookahead = recv_lookahead
        self.recompute, self.activation_budget = check_recompute(
            recompute, activation_budget, split=split
        )
        check_split_settings(
            split, split_placement, partition, pp=pp, vpp=chunks_per_rank(self.schedule_name, vpp)
        )
        #: how microbatch and replica losses combine (strategy/loss_count.py)
        self.loss_counts = LossCounts(loss_normalization)
        #: the ``split=`` path (an unmodified model cut between its blocks), else ``None``
        self.split_pipeline = SplitPipeline(split, split_placement) if split else None
        #: builds and stages this rank's layers: ``split=``'s, or the module's PipelineLayers
        self.stage_build: SplitPipeline | LayerBuild = self.split_pipeline or LayerBuild(partition)
        #: this rank's plan, grid and placement, learnt in phases (what collaborators receive)
        self.layout = RankLayout()
        # Fail at construction, before any process starts: the settings, and the whole shape
        # when pp is given (pp=None: one pipeline over the world, whose size comes later).
        if pp is not None:
            self.plan = PipelinePlan.build(pp=pp, **self._settings())
        else:
            check_settings(**{k: v for k, v in self._settings().items() if k != "schedule"})
            check_schedule_vpp(self.schedule_name, vpp)  # known without the world size

        self.chunks: list[PipelineChunk] = []
        self.engine: Any = None
        self.grad_sync: DeferredGradSync | FsdpGradSync | None = None
        self.tied_sync = TiedParameterSync([])
        #: the engine's record of the last train/eval step on this rank (for callbacks)
        self.last_record: Any = None
        self.loss_scale = LossScale()
        self._train: TrainStep | None = None
        self._recompute_plan: Any = None
        #: schedule="zb-auto": the schedule rebuilt from measured costs (auto_schedule)
        self.auto_schedule: Any = None
        self._auto_steps = 0  # zb-auto: training steps run before the rebuild
        self._eval: eval_step.ForwardOnly | None = None
        self._unclipped_precision: Precision | None = None
        #: under ``fsdp``: parameters FSDP2 leaves whole (shared by two local chunks)
        self._fsdp_whole: list[nn.Parameter] = []
        if not isinstance(async_checkpoint, bool):
            raise TypeError(f"async_checkpoint must be True or False, got {async_checkpoint!r}")
        #: writes this rank's checkpoints (in the background with ``async_checkpoint=True``)
        self.checkpoint_saver = CheckpointSaver(asynchronous=async_checkpoint)
        self._failed = False

    # ------------------------------------------------------------------ the rank's layout
    # The strategy's view of its RankLayout (callbacks and user code read these names).
    @property
    def plan(self) -> PipelinePlan | None:
        """The checked shape; complete once the world and the module's layers are known."""
        return self.layout.plan

    @plan.setter
    def plan(self, plan: PipelinePlan | None) -> None:
        self.layout.plan = plan

    @property
    def topology(self) -> PipelineTopology | None:
        """This rank's place in the ``pp x dp`` grid (after ``setup_environment``)."""
        return self.layout.topology

    @property
    def groups(self) -> ProcessGroups | None:
        return self.layout.groups

    @property
    def device_mesh(self) -> DeviceMesh:
        """The job's ``DeviceMesh``: dims ``"pipeline_parallel"`` (outermost),
        ``"data_parallel"`` and ``"tensor_parallel"`` (innermost; size 1 at ``tp=1``), the
        last two as Lightning's ``ModelParallelStrategy`` names them; every process group of
        the run comes from it (after ``setup_environment``)."""
        groups = self.layout.groups
        if groups is None or groups.mesh is None:
            raise RuntimeError(
                "PipelineStrategy.device_mesh is set up with the process groups, in "
                "setup_environment; it is not available before"
            )
        return groups.mesh

    @property
    def placement(self) -> LayerPlacement | None:
        """Which layers each rank holds (set once the module's layer count is known)."""
        return self.layout.placement

    @property
    def recompute_plan(self) -> Any:
        """The ``recompute="auto"`` plan (every rank's choice), once the first batch ran; it
        stays after the fit ends (a later fit plans again, on its own engine)."""
        return self._recompute_plan

    # ------------------------------------------------------------------ sizes and devices
    @property
    def pp(self) -> int:
        """Pipeline stages; resolved to ``world size / tp`` when constructed with ``pp=None``."""
        return self._pp if self._pp is not None else self.world_size // self.tp

    @property
    def vpp(self) -> int:
        """Chunks per rank: the plan's (the schedule's own when ``vpp`` was left unset)."""
        if self.plan is not None:
            return self.plan.vpp
        return chunks_per_rank(self.schedule_name, self._vpp)

    @property
    def dp(self) -> int:
        return self.world_size // (self.pp * self.tp)

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
        """Shard data over data-parallel replicas only: all stages of a pipeline (and all tp
        ranks of a stage) see one batch."""
        if self.topology is not None:
            return {"num_replicas": self.topology.dp, "rank": self.topology.dp_rank}
        return {"num_replicas": self.dp, "rank": (self.global_rank // self.tp) % self.dp}

    # ------------------------------------------------------------------ rules
    # Every validity rule the strategy applies, through its PipelinePlan (lightning_pp.layout.plan
    # holds
    # the rules and their messages). Each runs on every rank alike, before any communication
    # that a bad value would hang.
    def _settings(self) -> dict[str, Any]:
        names = (
            "partition",
            "group_size",
            "recv_lookahead",
            "bucket_cap_mb",
            "zero",
            "fsdp",
            "reshard_after_forward",
            "tp",
        )
        return {
            **{name: getattr(self, name) for name in names},
            "vpp": self._vpp,
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
        plan = self.plan or PipelinePlan.build(pp=max(1, world // self.tp), **self._settings())
        self.plan = plan.on_trainer_world(
            world, pp=self._pp, num_nodes=self.num_nodes, devices=self.num_processes
        )

    @override
    def before_launch(self, trainer: Any) -> None:
        """The pre-flight's module rules (:func:`~lightning_pp.strategy.preflight.check_module`:
        the layer or block count against ``pp * vpp`` and ``partition``, the ``split=``
        container and placement, the recompute targets), in the launching process before any
        rank starts, on a meta build of the module (its ``configure_model`` run on the meta
        device, then the module restored as it was). A module that cannot be built there is
        left to the ranks, which apply the same rules when they build it."""
        module = getattr(trainer, "lightning_module", None)
        if module is None or self.plan is None:
            return
        try:
            with meta_view(module) as view:
                check_module(
                    view,
                    self.plan,
                    split=self.split_pipeline.split if self.split_pipeline else None,
                    split_placement=self.split_pipeline.placement if self.split_pipeline else None,
                    recompute=None if self.recompute == "auto" else self.recompute,
                )
        except (PreflightError, SplitError):
            raise
        except Exception:  # not buildable on meta here: the ranks check it as they build
            return

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the default process group
        topo = PipelineTopology.from_world(self.world_size, self.global_rank, self.pp, tp=self.tp)
        self.layout.topology = topo
        self.layout.groups = build_process_groups(
            topo, timeout=self._timeout, device_type=self.root_device.type
        )
        # As Lightning's ModelParallelStrategy does: the model's hooks (configure_model first)
        # read the job's mesh as ``self.device_mesh``.
        if self.lightning_module is not None:
            compat.set_device_mesh(self.lightning_module, self.device_mesh)

    # ------------------------------------------------------------------ building the model
    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: this rank builds only its own stages."""
        with self.stage_build.build_context(self.layout, self.lightning_module, self.root_device):
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.topology is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        device, layout = self.root_device, self.layout
        # this rank's stages only, checked
        self.stage_build.stage_module(layout, module, self.precision_plugin, device)
        self.precision_plugin.convert_module(module)
        self.model_to_device()
        assert self.plan is not None and self.placement is not None
        if self.tp > 1:  # before the chunks, the tied groups and the optimizer read parameters
            self._shard_tensor_parallel(module)
        self.chunks = list(self.stage_build.chunks)
        self.tied_sync = self.stage_build.tied_sync(layout)
        self.tied_sync.broadcast_weights()  # the copies start from the owner's values
        if self.fsdp:  # before the optimizer exists: FSDP2 swaps in DTensor parameters
            self._fsdp_whole = shard_with_fsdp(
                self.chunks, layout, self.tied_sync, self.reshard_after_forward
            )
        self._setup_training(trainer)
        self._check_recompute_targets()
        self.grad_sync = build_grad_sync(
            self.chunks,
            layout,
            self.bucket_cap_mb,
            zero=self.zero,
            tied=self.tied_sync,
            fsdp_whole=self._fsdp_whole if self.fsdp else None,
            overlap_param_gather=self.overlap_param_gather,
        )
        if isinstance(self.grad_sync, ShardedGradSync):
            for optimizer in self.optimizers:  # each now steps this rank's rows
                self.grad_sync.shard_optimizer(optimizer)
            if self.overlap_param_gather:  # each module waits for its parameters' rows
                self.grad_sync.install_gather_hooks(self.chunks)
        if self._fsdp_whole:
            unmix_foreach(self.optimizers, self._fsdp_whole)
        if self.split_pipeline is not None:
            io = self.split_pipeline.engine_kwargs(self.loss_scale, device)
        else:
            io = module_io(module, self.global_rank, self.loss_scale)
        self.engine = build_engine(
            self.chunks,
            layout,
            io,
            self.grad_sync,
            device=device,
            release_outputs=self.release_outputs,
            watchdog_timeout=self.watchdog_timeout,
            check_finite=self.check_finite,
            recv_lookahead=self.recv_lookahead,
            recompute=self.recompute,
        )
        auto = self.recompute == "auto" and self.split_pipeline is None
        self._train = TrainStep(
            self.engine,
            layout,
            self.grad_sync,
            self.tied_sync,
            collectives=self,
            loss_scale=self.loss_scale,
            split=self.split_pipeline,
            activation_budget=self.activation_budget if auto else None,
            loss_counts=self.loss_counts,
        )
        self._eval = eval_step.ForwardOnly(
            self.engine, layout, module, self, device, loss_counts=self.loss_counts
        )
        if self.is_global_zero:
            log_start(self.plan, self.engine, self.grad_sync, self.bucket_cap_mb)

    def _shard_tensor_parallel(self, module: Any) -> None:
        """``tp > 1``: cut this rank's layers over its stage's tp ranks
        (:func:`~lightning_pp.strategy.tensor_parallel.shard_stage`)."""
        what = shard_stage(
            module,
            tensor_parallel_mesh(self.device_mesh),
            split=self.split_pipeline,
            tp_plan=self.tp_plan,
            rank=self.global_rank,
        )
        if self.is_global_zero:
            log.info(f"tensor parallel: tp={self.tp}, {what}")

    def _check_recompute_targets(self) -> None:
        """``recompute`` selects something in the model (the pre-flight's rule,
        :func:`~lightning_pp.strategy.preflight.check_recompute_targets`): layer indices from
        the plan's layer count; a pattern by this rank's matches summed over the world (every
        rank reaches setup; a rank may hold none of the matched modules), so every rank raises
        alike instead of training with nothing recomputed."""
        spec = self.recompute
        assert self.plan is not None and self.plan.layer_ranges is not None
        num_layers = self.plan.layer_ranges[-1].stop
        if isinstance(spec, tuple):
            check_recompute_targets(spec, num_layers, [])
        elif isinstance(spec, Selective):
            local = sum(len(t) for t in select_targets(self.chunks, spec))
            count = torch.tensor([local], dtype=torch.int64, device=self.root_device)
            if torch.distributed.is_initialized() and self.world_size > 1:
                torch.distributed.all_reduce(count)
            if int(count.item()) == 0:
                units = [u for chunk in self.chunks for u in selective_units(chunk)]
                check_recompute_targets(spec, num_layers, units)

    def _setup_training(self, trainer: pl.Trainer) -> None:
        """Lightning's optimizer and precision setup, in Lightning's order; when fitting, the
        Trainer's own backward is switched off (the schedule runs it), gradient clipping goes by
        the whole pipeline's norm and the model summary counts every stage."""
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            compat.reset_optimizers_and_schedulers(self)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if not fitting:
            return
        compat.optimizers_to_device(self.optimizers, self.root_device)
        # The pipeline runs backward inside training_step; Lightning must not run it again
        # (nor zero the gradients between our backward and the optimizer step).
        compat.set_skip_backward(trainer, True)
        self._unclipped_precision = self.precision_plugin
        self.precision_plugin = with_global_norm_clipping(self.precision_plugin, self._clip)
        use_stage_summaries(
            trainer.callbacks, self.layout, self.lightning_module, self.tied_sync, self
        )

    def _clip(self, params: Sequence[nn.Parameter], max_norm: float) -> Tensor:
        """``gradient_clip_val``: by the norm of every stage (lightning_pp.strategy.precision);
        under ``zero`` the optimizer's parameters are rows, distinct on every rank, so the
        squares are summed over the whole world, tied copies' rows counted once."""
        sync, tied = self.grad_sync, self.tied_sync
        topo = self.layout.need_topology()
        if isinstance(sync, ShardedGradSync):  # rows; a tp-replicated weight's on tp rank 0
            return clip_sharded_by_global_norm(params, max_norm, skip=sync.grad_norm_skip(tied))
        if topo.tp > 1:  # shards over tp (and dp, under fsdp): each value counted once
            skip = tied.non_owner_params()
            here = {DP_DIM: topo.dp_rank, TP_DIM: topo.tp_rank}
            # a replica's copy, a tp-replicated weight off tp rank 0
            skip.update(id(p) for p in params if not counted_once(p, here))
            return clip_sharded_by_global_norm(params, max_norm, skip=skip)
        if isinstance(sync, FsdpGradSync):
            return clip_sharded_by_global_norm(
                params,
                max_norm,
                skip=tied.non_owner_params(),
                replicated={id(p) for p in self._fsdp_whole},
                dp_rank=self.layout.need_topology().dp_rank,
            )
        return clip_grad_by_global_norm(params, max_norm, self.layout.need_groups(), tied)

    # ------------------------------------------------------------------ training
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """One pipelined forward+backward over the batch; returns the batch loss on every rank."""
        assert self._train is not None, "PipelineStrategy.setup has not run"
        loss = self._train.run(self.lightning_module, self.precision_plugin, args, kwargs)
        self.last_record = self._train.record
        self._recompute_plan = self._train.recompute_plan or self._recompute_plan
        if self.schedule_name == "zb-auto" and self.auto_schedule is None and self.last_record:
            self._auto_steps += 1
            if self._auto_steps >= PROFILE_STEP:  # the profiling step (the first warms up)
                self.auto_schedule = rebuild_from_step(
                    self.engine, self.layout, self.last_record, step=self._auto_steps
                )
        return loss

    # ------------------------------------------------------------------ evaluation, prediction
    # One forward-only path (lightning_pp.strategy.eval_step): the last stage's result reaches
    # every rank.
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_only("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_only("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's output (microbatches concatenated), on every rank of the pipeline, so
        ``trainer.predict`` returns predictions on global rank 0 too (as spawn launchers need)."""
        return self._forward_only("predict_step", args, kwargs)

    def _forward_only(self, hook: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        run = self._eval
        assert run is not None, "PipelineStrategy.setup has not run"
        try:
            if self.split_pipeline is not None:  # the module's own hook on every stage
                context = eval_step.hook_context(hook, self.precision_plugin)
                predict = hook == "predict_step"
                return self.split_pipeline.forward_only(
                    run, hook, args, kwargs, context, predict=predict
                )
            return eval_step.step(run, hook, args, self.precision_plugin)
        finally:
            self.last_record = run.record
            if self.fsdp:  # the forwards gathered every chunk: free them until the next step
                reshard_chunks(self.chunks)

    # ------------------------------------------------------------------ checkpoints
    # A checkpoint is a directory: every rank passes its own tensors by original name to DCP,
    # rank 0 writes Lightning's metadata (lightning_pp/checkpoint/, docs/checkpoints.md).
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
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        whole = self._unsharded([optimizer])[0]  # zero: gathered, as an unsharded run saves it
        return module_optimizer_state(whole, self.lightning_module, self._stored_names())

    def _unsharded(self, optimizers: Sequence[Optimizer]) -> list[Any]:
        """``optimizers`` as checkpoints see them: the module's own parameters, whole state
        (:class:`~lightning_pp.runtime.distributed_optimizer.UnshardedOptimizerView` under
        ``zero``), so any sharding saves and loads the same files."""
        sync = self.grad_sync
        if isinstance(sync, ShardedGradSync):
            return [sync.unsharded_view(o) for o in optimizers]
        if isinstance(sync, FsdpGradSync) or self.tp > 1:  # DTensor moments: read as shards
            return [DTensorOptimizer(o) for o in optimizers]
        return list(optimizers)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Collective: write this rank's tensors into the checkpoint directory ``filepath``
        (rank 0's path, so every rank writes into the same directory), DCP format."""
        if storage_options is not None:
            raise TypeError(
                "PipelineStrategy.save_checkpoint(..., storage_options=...) is not supported: "
                "the strategy writes a sharded checkpoint directory itself, not via CheckpointIO"
            )
        topo, placement = self.layout.need_topology(), self.layout.need_placement()
        self.wait_for_parameters()  # the dict holds the parameters themselves: complete them
        self.checkpoint_saver.save(
            checkpoint,
            self.broadcast(str(filepath)),
            module=self.lightning_module,
            layout={
                **placement.layout(),
                "dp": topo.dp,
                "tp": topo.tp,
                "world_size": self.world_size,
            },
            canonical=self._stored_names(),
        )

    def wait_for_parameters(self) -> None:
        """With ``overlap_param_gather``: finish the all-gathers of the updated parameters now
        (they otherwise finish at the next forward that reads them). Call it before reading
        parameter values between an optimizer step and the next forward (an EMA of the
        weights, a custom metric); checkpoints, evaluation and teardown do it themselves."""
        if isinstance(self.grad_sync, ShardedGradSync):
            self.grad_sync.finish_gather()

    def wait_for_checkpoint(self) -> None:
        """Collective (every rank calls it): block until the checkpoint being written in the
        background (``async_checkpoint``) is complete on disk; raise its error on every rank.
        A no-op when none is in flight."""
        self.checkpoint_saver.wait()

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Collective: load this rank's layers, and when fitting its optimizer state, by name,
        whatever pipeline shape wrote the checkpoint; return Lightning's metadata."""
        self.wait_for_checkpoint()  # ckpt_path="last" may be the one still being written
        trainer = self.lightning_module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        return load_pipeline_checkpoint(
            self.broadcast(str(checkpoint_path)),
            self.lightning_module,
            rank=self.global_rank,
            optimizers=self._unsharded(self.optimizers) if fitting else None,
            scheduler_configs=trainer.lr_scheduler_configs,
            weights_only=weights_only,
            canonical=self._stored_names(),
        )

    def _stored_names(self) -> dict[str, str] | None:
        """Tied member -> stored name, for the ``split=`` path (``None``: from the layers)."""
        split = self.split_pipeline
        return split.canonical_names() if split is not None else None

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint, by name, for this rank's layers only

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint directory (ModelCheckpoint's top-k rotation)."""
        pending = self.checkpoint_saver.pending_path
        if pending is not None and str(pending) == str(filepath):
            self.wait_for_checkpoint()  # it is published by the writer: let it finish first
        if self.is_global_zero:
            remove_checkpoint_dir(filepath)

    # ------------------------------------------------------------------ teardown, registry
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Publish this rank's failure (e.g. from a callback) so the other ranks stop waiting."""
        # SystemExit (SIGTERM) is a stop every rank takes together, not a failure to publish.
        failed = not isinstance(exception, (PipelineAborted, SystemExit))
        self._failed = not isinstance(exception, SystemExit)
        # A communication error (a closed connection, an unwatched collective of Lightning's or
        # of a checkpoint save) is often a killed peer's consequence: then that peer is named.
        if failed and compat.distributed_is_initialized() and self.failure_origin() is None:
            where = "Lightning hook or step"
            report_failure(compat.default_store(), self.global_rank, where, exception)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if not self._failed:  # after a failure the writer may wait on a lost peer: leave it
            self.wait_for_checkpoint()  # hidden (never complete), not block the exit on it
            self.wait_for_parameters()  # the module leaves the fit complete
        self._failed = False
        # Give the Trainer back its own backward, summaries and precision plugin.
        trainer = compat.trainer_of(self.lightning_module)
        compat.set_skip_backward(trainer, False)
        if trainer is not None:
            restore_summaries(trainer.callbacks)
        if isinstance(self.precision_plugin, GlobalNormClipping):
            self.precision_plugin = self._unclipped_precision
        self._unclipped_precision = None
        self.engine = None
        self._train = self._eval = None
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

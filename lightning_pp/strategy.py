"""PipelineStrategy: pipeline (x data) parallel training in the Lightning ``Trainer``.

Glue only: it decides *when* Lightning's hooks run and hands the work to its collaborators
(arrows point at what it calls; docs/strategy.md draws the whole picture)::

    PipelineStrategy -> PipelinePlan    every default and validity rule, with its message
                     -> LayerPlacement  which rank holds which layers and tied weights
                     -> compat          every private Lightning contact (_lightning_compat)
                     -> precision       clipping by the global norm, as a plugin subclass
                     -> checkpoint      sharded save / load bodies
                     -> PipelineEngine  runs this rank's schedule (no Lightning inside)

Example::

    trainer = L.Trainer(accelerator="cpu", devices=4, max_steps=100,
                        strategy=PipelineStrategy(pp=2, vpp=2, microbatches=4))
    trainer.fit(GPT(n_layer=6), datamodule)    # world 4 = dp 2 x pp 2
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from . import _lightning_compat as compat
from .autosplit.strategy_glue import SplitPipeline
from .checkpoint import (
    load_pipeline_checkpoint,
    module_optimizer_state,
    remove_checkpoint_dir,
    save_pipeline_checkpoint,
)
from .failure import DEFAULT_WATCHDOG_TIMEOUT, PipelineAborted, report_failure
from .grad_sync import DeferredGradSync, TiedParameterSync, tied_parameter_sync
from .microbatch import batch_size_of
from .model import (
    PipelineLayers,
    partition_weights,
    rebuilt_layers_match,
    replace_submodule,
    select_layers,
)
from .model_summary import StageInfo, restore_summaries, use_pipeline_summaries
from .partition import PipelineChunk
from .placement import LayerPlacement
from .plan import (
    PipelinePlan,
    PreflightError,
    check_module,
    check_settings,
    default_schedule,
    ignored_step_overrides,
    ignored_steps_message,
)
from .precision import GlobalNormClipping, clip_by_global_norm, with_global_norm_clipping
from .process_strategy import ProcessGroupStrategy, StartMethod
from .stage_logging import LogCall, capture_logs, refuse_logs, replay_logs
from .topology import PipelineTopology, ProcessGroups, build_process_groups

__all__ = ["PipelineStrategy"]

log = logging.getLogger(__name__)


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
        #: the ``split=`` path (an unmodified model cut between its blocks), else ``None``
        self.split_pipeline = SplitPipeline(split, split_placement) if split else None
        #: the checked shape; complete once the world and the module's layers are known
        self.plan: PipelinePlan | None = None
        self._check_shape()  # fail at construction, before any process starts

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
        self._warned_steps = False  # about the module's own *_step overrides, once

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

    def _check_shape(self) -> None:
        """At construction: the settings, and the whole shape when ``pp`` is given."""
        if self._pp is not None:
            self.plan = PipelinePlan.build(pp=self._pp, **self._settings())
        else:  # one pipeline over the world: the shape waits for the world size
            check_settings(**{k: v for k, v in self._settings().items() if k != "schedule"})

    def _check_world(self) -> None:
        if self.num_processes == 0:
            return  # not connected to a Trainer yet
        world = self.world_size
        plan = self.plan or PipelinePlan.build(pp=world, **self._settings())
        try:
            self.plan = plan.with_world(world)
        except PreflightError as e:
            raise PreflightError(
                f"PipelineStrategy(pp={self._pp}) does not divide the world size {world} "
                f"(num_nodes={self.num_nodes} x devices={self.num_processes}): {e}",
                key=e.key,
            ) from None

    def _check_layers(self, layers: PipelineLayers) -> None:
        """Cut the module's layers into stages; errors show the split that would result."""
        assert self.plan is not None
        params, costs = partition_weights(self.lightning_module, layers, self.partition)
        self.plan = self.plan.with_layers(layers.num_layers, layer_params=params, layer_costs=costs)
        assert self.plan.layer_ranges is not None
        self.placement = LayerPlacement(self.plan.schedule, self.plan.layer_ranges)

    def _check_batch(self, batch: Any) -> None:
        """Every rank of a pipeline sees the same batch, so a batch too small for the
        microbatches (a short last batch too) raises the same error on all of them, before any
        communication, instead of one rank failing and the rest waiting."""
        assert self.plan is not None
        try:
            size = batch_size_of(batch)
        except ValueError:
            return  # no batch dimension to split: the engine reports it with the action
        try:
            self.plan.check_batch(size)
        except PreflightError as e:
            raise PreflightError(f"rank {self.global_rank}: {e}", key=e.key) from None

    def _check_module(self, module: Any, layers: PipelineLayers | None = None) -> None:
        """Before ``configure_model`` (no ``layers``): the module can be cut. After it: every
        parameter lies in a layer, and no gradient scaler is in use."""
        if layers is None:
            check_module(module, configured=False)
            return
        inside = {id(p) for p in layers.parameters()}
        outside = [n for n, p in module.named_parameters() if id(p) not in inside]
        if outside:
            raise ValueError(
                f"parameters outside the PipelineLayers would never be trained by the pipeline: "
                f"{outside[:5]}{' ...' if len(outside) > 5 else ''}; move them into a layer"
            )
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "PipelineStrategy does not support a gradient scaler (precision='16-mixed'); "
                "use precision='bf16-mixed' or '32-true'"
            )

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
        self._check_world()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the default process group
        self.topology = PipelineTopology.from_world(self.world_size, self.global_rank, self.pp)
        self.groups = build_process_groups(self.topology, timeout=self._timeout)

    # ------------------------------------------------------------------ building the model
    def _select_layers(self, layers: PipelineLayers) -> list[int]:
        """Partition the model once its layer count is known; return this rank's layers."""
        assert self.topology is not None, "the process group must exist before configure_model"
        self._check_layers(layers)
        return self._local_layers()

    def _local_layers(self) -> list[int]:
        assert self.plan is not None and self.topology is not None
        return [i for r in self.plan.stage_layers(self.topology.pp_rank) for i in r]

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: PipelineLayers built here hold this rank's layers only."""
        if self.split_pipeline is not None:  # an unmodified model: its own build, staged
            with self.split_pipeline.build_context(self, self.lightning_module):
                yield
            return
        module = self.lightning_module
        built = None
        if module is not None:
            self._check_module(module)
            built = _built_layers(module)
        with select_layers(self._select_layers):
            yield
        if built is not None:
            self._keep_built_layers(module, built)

    def _keep_built_layers(self, module: Any, built: PipelineLayers) -> None:
        """``configure_model`` without an "already built" guard builds fresh layers each time
        Lightning calls it (again in validate/test/predict after fit): keep the built ones.

        Kept rather than replaced because they hold what the user trained (or loaded), and
        ``trainer.validate()`` after ``fit`` must evaluate that model; a rebuild of the same
        architecture is never what a user means. A different architecture is used as built."""
        rebuilt = _built_layers(module)
        if rebuilt is None or rebuilt is built:
            return
        name = type(module).__name__
        guard = "if getattr(self, 'layers', None) is not None: return"
        if rebuilt_layers_match(built, rebuilt) and replace_submodule(module, rebuilt, built):
            rank_zero_warn(
                f"{name}.configure_model() built new PipelineLayers although they were already "
                f"built (and possibly trained): Lightning calls configure_model() again in "
                f"validate/test/predict and in every fit. PipelineStrategy keeps the already "
                f"built layers and their weights, and drops the new ones (a plain Trainer would "
                f"use the freshly initialised ones). Start configure_model() with `{guard}`."
            )
        else:
            rank_zero_warn(
                f"{name}.configure_model() replaced its already built (possibly trained) "
                f"PipelineLayers by a different model; PipelineStrategy uses the new, freshly "
                f"initialised layers. If that is not intended, start configure_model() with "
                f"`{guard}`."
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.topology is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        split = self.split_pipeline
        if split is not None:
            split.stage_module(self, module)
        else:
            for hook in ("pipeline_layers", "pipeline_input", "pipeline_loss"):
                if not callable(getattr(module, hook, None)):
                    raise TypeError(
                        f"{type(module).__name__} lacks {hook}(); subclass "
                        f"lightning_pp.PipelineMixin, or pass PipelineStrategy(split=...)"
                    )
            if not self._warned_steps:
                self._warned_steps = True
                steps = ignored_step_overrides(module)
                if steps:
                    rank_zero_warn(ignored_steps_message(module, steps))
            layers = module.pipeline_layers()
            self._keep_local_layers(layers)
            self._check_module(module, layers)
        self.precision_plugin.convert_module(module)
        self.model_to_device()
        assert self.plan is not None and self.placement is not None
        if split is not None:
            self.chunks = list(split.chunks)
            self.tied_sync = split.tied_sync(self)
        else:
            ranges = self.plan.stage_layers(self.topology.pp_rank)
            self.chunks = [PipelineChunk([layers[i] for i in r], indices=r) for r in ranges]
            self.tied_sync = tied_parameter_sync(layers, self.placement, self.topology, self.groups)
        self.tied_sync.broadcast_weights()  # the copies start from the owner's values

        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            compat.reset_optimizers_and_schedulers(self)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            compat.optimizers_to_device(self.optimizers, self.root_device)
            # The pipeline runs backward inside training_step; Lightning must not run it again
            # (nor zero the gradients between our backward and the optimizer step).
            compat.set_skip_backward(trainer, True)
            self._unclipped_precision = self.precision_plugin
            self.precision_plugin = with_global_norm_clipping(
                self.precision_plugin, self.clip_grad_by_global_norm
            )
            # The model summary (printed at fit start) must count every stage, not rank 0's.
            use_pipeline_summaries(
                trainer.callbacks, self._gather_over_pipeline, self._stage_info()
            )
        self.grad_sync = DeferredGradSync(
            [list(c.parameters()) for c in self.chunks],
            self.groups.dp_group,
            self.topology.dp,
            self.bucket_cap_mb,
        )
        self.engine = self._build_engine()
        if self.is_global_zero:
            self._log_start()

    def _stage_info(self) -> StageInfo:
        """This rank's line in the model summary: its stages, and its tied copies' size."""
        assert self.plan is not None and self.topology is not None
        stages = self.plan.schedule.stages_of(self.topology.pp_rank)
        copies = self.tied_sync.non_owner_params()
        tied = sum(p.numel() for p in self.lightning_module.parameters() if id(p) in copies)
        return StageInfo(",".join(map(str, stages)), tied)

    def _gather_over_pipeline(self, obj: Any) -> list[Any]:
        """Collective over this rank's pipeline group: every stage's ``obj``, in stage order."""
        assert self.groups is not None
        assert self.topology is not None
        # One watched broadcast per stage (runs once, at fit start): all_gather_object has no
        # async_op, so it could not honour the watchdog.
        return [
            self.broadcast_object(
                obj, self.topology.global_rank(r), self.groups.pp_group, "the model summary"
            )
            for r in range(self.pp)
        ]

    def _keep_local_layers(self, layers: PipelineLayers) -> None:
        """Layers built outside ``configure_model`` (every rank built all): drop the others."""
        assert self.topology is not None
        if self.placement is not None:
            if sorted(layers.built_indices) == sorted(self._local_layers()):
                return  # built in configure_model, as intended
        else:
            warnings.warn(
                "PipelineLayers were built outside configure_model(): every rank built all "
                "layers and now drops the others. Build them in configure_model() so each "
                "rank materialises only its own.",
                stacklevel=3,
            )
        local = self._select_layers(layers)
        missing = set(local) - set(layers.built_indices)
        if missing:
            raise RuntimeError(
                f"rank {self.global_rank}: layers {sorted(missing)} of this stage were not built"
            )
        layers.keep_only(local)

    def _build_engine(self) -> Any:
        from .engine import PipelineEngine  # late import: the engine loads torch.distributed bits

        module = self.lightning_module
        assert self.grad_sync is not None

        rank = self.global_rank

        # Both run on one stage, per microbatch, inside the schedule: self.log there is refused
        # with a clear error (lightning_pp.stage_logging says why).
        def loss_fn(output: Any, microbatch: Any) -> Tensor:
            with refuse_logs(module, "pipeline_loss", rank):
                # Divided like Lightning divides a plain step's loss under gradient accumulation.
                return module.pipeline_loss(output, microbatch) / self._loss_scale

        def input_fn(microbatch: Any) -> Any:
            with refuse_logs(module, "pipeline_input", rank):
                return module.pipeline_input(microbatch)

        if self.split_pipeline is not None:
            io: dict[str, Any] = self.split_pipeline.engine_kwargs(self)
        else:
            io = {"loss_fn": loss_fn, "input_fn": input_fn}
        return PipelineEngine(
            self.chunks,
            self.plan.schedule,
            self.topology,
            self.groups,
            **io,
            loss_reduction="mean",
            release_outputs=self.release_outputs,
            on_chunk_grads_ready=self.grad_sync.on_chunk_grads_ready,
            device=self.root_device,
            watchdog_timeout=self.watchdog_timeout,
            check_finite=self.check_finite,
            recv_lookahead=self.recv_lookahead,
        )

    def _log_start(self) -> None:
        """Say the run's decisions once (global rank 0): shape, placement, partition per rank,
        schedule, and what the engine resolved for the transfers."""
        assert self.plan is not None and self.grad_sync is not None
        for line in self.plan.describe():
            log.info(line)
        log.info(
            f"engine: receive lookahead {self.engine.recv_lookahead} action(s); data-parallel "
            f"all-reduce in buckets of {self.bucket_cap_mb:g} MB ({self.grad_sync.num_buckets} "
            f"on rank 0, dp={self.dp})"
        )

    # ------------------------------------------------------------------ training
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """One pipelined forward+backward over the batch; returns the batch loss on every rank."""
        module = self.lightning_module
        trainer = module.trainer
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        self._check_batch(batch)
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            for optimizer in self.optimizers[:1]:  # automatic optimization steps optimizer 0
                compat.call_zero_grad_hooks(trainer, optimizer, batch_idx)
        last_micro_step = not compat.should_accumulate(trainer)
        assert self.grad_sync is not None
        self.grad_sync.enabled = last_micro_step
        self._loss_scale = accumulate
        try:
            with self.precision_plugin.train_step_context():
                if self.split_pipeline is not None:  # the module's own training_step per stage
                    result = self.split_pipeline.train_step(self.engine, module, args, kwargs)
                else:
                    result = self.engine.train_step(batch)
        finally:
            self._loss_scale = 1
        self.last_record = result.record
        if last_micro_step:
            self.grad_sync.wait()
            self.tied_sync.all_reduce_grads()
        loss = self._dp_mean(result.loss.detach()) * accumulate
        # Backward already ran inside the schedule; fire the hooks users expect around it.
        self.precision_plugin.pre_backward(loss, module)
        self.precision_plugin.post_backward(loss, module)
        if self.split_pipeline is not None:
            self.split_pipeline.replay_logs(self, module)  # what training_step logged
        else:
            module.pipeline_log_train_loss(loss)
        return loss

    def _dp_mean(self, value: Tensor) -> Tensor:
        assert self.topology is not None and self.groups is not None
        if self.topology.dp == 1:
            return value
        value = self.all_reduce(value.clone(), group=self.groups.dp_group, what="the step loss")
        return value / self.topology.dp

    def clip_grad_by_global_norm(self, params: Sequence[nn.Parameter], max_norm: float) -> Tensor:
        """Scale gradients so the norm over the WHOLE model (every stage) is at most ``max_norm``.

        Tied copies count once (on their owner), replicas are not summed twice. Returns the
        norm before clipping. ``gradient_clip_val`` gets here via :mod:`lightning_pp.precision`.
        """
        assert self.groups is not None
        skip = self.tied_sync.non_owner_params()
        return clip_by_global_norm(params, max_norm, self.groups.pp_group, skip=skip)

    # ------------------------------------------------------------------ evaluation, prediction
    def _forward_only(self, batch: Any, context: Callable, on_output: Callable, hook: str) -> Any:
        """Run the forward-only schedule. The rank holding the last stage turns the batch's output
        (microbatches concatenated) into ``on_output(output)``; every pipeline rank returns it.

        If ``on_output`` (the user's ``hook``) raises there, the other ranks, waiting in the
        broadcast, receive the failure instead of a value and stop with ``PipelineAborted``:
        one stage's error must not leave the others blocked in a collective."""
        assert self.topology is not None and self.groups is not None and self.placement
        with context():
            result = self.engine.eval_step(batch, collect_outputs=True)
        self.last_record = result.record
        last = self.placement.output_rank
        src = self.topology.global_rank(last)
        payload: list[Any] = [None]
        error: Exception | None = None
        if self.topology.pp_rank == last:
            try:
                payload = [(True, on_output(_concat_outputs(result.outputs)))]
            except Exception as e:
                if self.pp == 1:
                    raise
                error, payload = e, [(False, {"type": type(e).__name__, "message": str(e)})]
        if self.pp > 1:
            payload = [self.broadcast_object(payload[0], src, self.groups.pp_group, "outputs")]
        ok, value = payload[0]
        if error is not None:
            raise error
        if not ok:
            origin = {"rank": src, "where": hook, **value}
            raise PipelineAborted(
                f"rank {self.global_rank}: stopped because rank {src} (last stage) failed in "
                f"{hook}(): {value['type']} (its error is printed by rank {src})",
                self.global_rank,
                src,
                origin,
            )
        return value

    def _eval(self, batch: Any, split: str, context: Callable) -> dict[str, Tensor]:
        """``pipeline_eval_step`` on the last stage, averaged over replicas, logged everywhere."""
        self._check_batch(batch)
        module, topo, groups = self.lightning_module, self.topology, self.groups
        assert topo is not None and groups is not None

        def metrics(output: Any) -> tuple[list[str], Tensor, list[LogCall]]:
            # What the hook self.log()s is captured here and replayed on every rank below.
            with context(), capture_logs(module, "pipeline_eval_step", self.global_rank) as logs:
                values = module.pipeline_eval_step(output, batch, split)
            stacked = torch.stack([torch.as_tensor(v).detach().float() for v in values.values()])
            if topo.dp > 1:  # average over replicas (each saw a different shard)
                self.all_reduce(stacked, group=groups.dp_group, what="the eval metrics")
                stacked = stacked / topo.dp
            return list(values), stacked.cpu(), logs

        names, stacked, logs = self._forward_only(batch, context, metrics, "pipeline_eval_step")
        values = {n: stacked[i].to(self.root_device) for i, n in enumerate(names)}
        module.pipeline_log_eval(values, split)
        replay_logs(module, logs, groups.dp_group, self.root_device)
        return values

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        context = self.precision_plugin.val_step_context
        if self.split_pipeline is not None:
            return self.split_pipeline.forward_only(self, "validation_step", args, kwargs, context)
        return self._eval(args[0], "val", context)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        context = self.precision_plugin.test_step_context
        if self.split_pipeline is not None:
            return self.split_pipeline.forward_only(self, "test_step", args, kwargs, context)
        return self._eval(args[0], "test", context)

    def _predict_output(self, output: Any) -> Any:
        return _to_cpu(output) if self.pp > 1 else output

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's output (microbatches concatenated), on every rank of the pipeline, so
        ``trainer.predict`` returns predictions on global rank 0 too (as spawn launchers need)."""
        context = self.precision_plugin.predict_step_context
        if self.split_pipeline is not None:
            return self.split_pipeline.forward_only(
                self, "predict_step", args, kwargs, context, predict=True
            )
        return self._forward_only(args[0], context, self._predict_output, "predict_step")

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
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return module_optimizer_state(optimizer, self.lightning_module, self._canonical_names())

    def _canonical_names(self) -> dict[str, str] | None:
        """Tied member -> stored name, for the ``split=`` path (``None``: from the layers)."""
        split = self.split_pipeline
        return split.canonical_names() if split is not None else None

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Collective: write this rank's shard into the checkpoint directory ``filepath``."""
        if storage_options is not None:
            raise TypeError(
                "PipelineStrategy.save_checkpoint(..., storage_options=...) is not supported: "
                "the strategy writes a sharded checkpoint directory itself, not via CheckpointIO"
            )
        topo, placement = self.topology, self.placement
        assert topo is not None and placement is not None
        save_pipeline_checkpoint(
            checkpoint,
            self.broadcast(str(filepath)),
            module=self.lightning_module,
            pp_rank=topo.pp_rank,
            dp_rank=topo.dp_rank,
            layout={**placement.layout(), "dp": topo.dp, "world_size": self.world_size},
            barrier=self.barrier,
            canonical=self._canonical_names(),
        )

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load this rank's layers (and optimizer state) by name, whatever pipeline shape wrote
        the checkpoint; return Lightning's metadata."""
        trainer = self.lightning_module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        return load_pipeline_checkpoint(
            self.broadcast(str(checkpoint_path)),
            self.lightning_module,
            rank=self.global_rank,
            optimizers=list(self.optimizers) if fitting else None,
            scheduler_configs=trainer.lr_scheduler_configs,
            weights_only=weights_only,
            canonical=self._canonical_names(),
        )

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
        trainer = compat.trainer_of(self.lightning_module)
        compat.set_skip_backward(trainer, False)
        if trainer is not None:
            restore_summaries(trainer.callbacks)
        if isinstance(self.precision_plugin, GlobalNormClipping):
            self.precision_plugin = self._unclipped_precision
        self._unclipped_precision = None
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


def _built_layers(module: Any) -> PipelineLayers | None:
    """The module's PipelineLayers if it holds some built layers, else ``None``."""
    try:
        layers = module.pipeline_layers()
    except Exception:  # not built yet: pipeline_layers() says so by raising
        return None
    return layers if isinstance(layers, PipelineLayers) and layers.built_indices else None


def _concat_outputs(outputs: Sequence[Any]) -> Any:
    """Join per-microbatch outputs along dim 0 (tensors, or tuples/lists of tensors)."""
    first = outputs[0]
    if isinstance(first, Tensor):
        return torch.cat(list(outputs), dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(_concat_outputs([o[i] for o in outputs]) for i in range(len(first)))
    return list(outputs)


def _to_cpu(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.cpu()
    if isinstance(x, (tuple, list)):
        return type(x)(_to_cpu(t) for t in x)
    return x


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    PipelineStrategy.register_strategies(StrategyRegistry)


_register()

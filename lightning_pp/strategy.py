"""PipelineStrategy: pipeline (x data) parallel training in the Lightning ``Trainer``.

Glue only: topology, partitioning, schedules and the engine live in their own modules. This file
decides *when* Lightning's hooks run and keeps everything users rely on working: optimizers and
LR schedulers, gradient accumulation, clipping by the global norm, logging and monitors on every
rank, the usual launchers (``devices=N``, ``torchrun``, SLURM, several nodes).

Example::

    import lightning as L
    from lightning_pp import PipelineStrategy
    from lightning_pp.models import GPT

    trainer = L.Trainer(accelerator="cpu", devices=4, max_steps=100,
                        strategy=PipelineStrategy(pp=2, vpp=2, microbatches=4))
    trainer.fit(GPT(n_layer=6), datamodule)    # world 4 = dp 2 x pp 2
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import (
    _MultiProcessingLauncher,
    _SubprocessScriptLauncher,
)
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer

from .checkpoint import (
    adapt_scheduler_state,
    load_model_shard,
    load_optimizer_shard,
    optimizer_state_by_name,
    read_index,
    save_sharded_checkpoint,
    tied_canonical_names,
)
from .failure import DEFAULT_WATCHDOG_TIMEOUT, PipelineAborted, report_failure
from .grad_sync import DeferredGradSync, TiedGroup, TiedParameterSync, global_grad_norm
from .microbatch import batch_size_of
from .model import PipelineLayers, _split_name, select_layers
from .partition import PipelineChunk, local_layer_indices
from .preflight import (
    PreflightError,
    check_batch,
    check_layers,
    check_module,
    check_schedule_args,
    check_world,
)
from .schedules import build_schedule, check_positive
from .topology import PipelineTopology, ProcessGroups, build_process_groups

__all__ = ["PipelineStrategy"]

log = logging.getLogger(__name__)


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


class PipelineStrategy(ParallelStrategy):
    """Pipeline-parallel (Megatron-style schedules) x data-parallel training.

    The world of ``num_nodes x devices`` processes is a ``pp x dp`` grid (``dp = world / pp``,
    pipeline outermost: global rank ``= pp_rank * dp + dp_rank``). The module's
    :class:`~lightning_pp.model.PipelineLayers` are cut into ``pp * vpp`` chunks; rank ``r`` builds
    and runs chunks ``r, r + pp, ...`` only.

    Args:
        pp: pipeline stages (ranks per pipeline). ``None``: all processes in one pipeline.
        vpp: chunks per rank (virtual pipeline size). ``vpp > 1`` interleaves.
        microbatches: microbatches per batch; default ``pp`` (the smallest count that fills the
            pipeline; raise it to shrink the bubble ``(pp - 1) / (vpp * m)``).
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``; default ``"1f1b"`` when
            ``vpp == 1`` and ``"interleaved"`` otherwise.
        partition: ``"uniform"``, ``"parameters"``, ``"cost"`` or a list of per-stage layer counts.
        group_size: interleaved schedule's microbatch group size (default ``pp``).
        release_outputs: free a sent activation's storage (only its autograd graph is kept).
        bucket_cap_mb: data-parallel all-reduce bucket size.
        start_method: ``"popen"`` (re-run the script per rank, like ``ddp``) or ``"spawn"``/
            ``"fork"`` (in-process launch, like ``ddp_spawn``).
        watchdog_timeout: seconds a rank may block on one pipeline transfer before the step
            fails with a hang report (rank, awaited message, the other ranks' state, the grid);
            ``None`` disables. See docs/troubleshooting.md.
        check_finite: stop at the first NaN/inf (activation, loss or gradient) and name the
            stage and layer that produced it; costs a check per microbatch (off by default).
        recv_lookahead: post the receives of up to this many upcoming actions early, so data
            arrives while the rank computes; ``None``: 8 on gloo, 1 on NCCL (see
            :class:`~lightning_pp.engine.PipelineEngine`). Each adds one boundary buffer.

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
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
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
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        sizes = {
            "pp": pp,
            "vpp": vpp,
            "microbatches": microbatches,
            "recv_lookahead": recv_lookahead,
        }
        check_positive(**{name: value for name, value in sizes.items() if value is not None})
        self._pp = pp
        self.vpp = vpp
        self._microbatches = microbatches
        self.schedule_name = schedule or ("1f1b" if vpp == 1 else "interleaved")
        self.partition = partition
        self.group_size = group_size
        self.release_outputs = release_outputs
        self.bucket_cap_mb = bucket_cap_mb
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.watchdog_timeout = watchdog_timeout
        self.check_finite = check_finite
        self.recv_lookahead = recv_lookahead
        self._num_nodes = 1
        if pp is not None:
            self._check_schedule(pp)  # fail at construction, before any process starts

        self.topology: PipelineTopology | None = None
        self.groups: ProcessGroups | None = None
        self.layer_ranges: list[range] | None = None
        self.chunks: list[PipelineChunk] = []
        self.engine: Any = None
        self.grad_sync: DeferredGradSync | None = None
        self.tied_sync = TiedParameterSync([])
        #: the engine's record of the last train/eval step on this rank (for callbacks)
        self.last_record: Any = None
        self._loss_scale = 1
        self._original_clip: Any = None

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
        return self._microbatches if self._microbatches is not None else self.pp

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning's connector to sync ``self.log(sync_dist=True)`` and inject samplers."""
        return True

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard data over data-parallel replicas only: all stages of a pipeline see one batch."""
        if self.topology is not None:
            return {"num_replicas": self.topology.dp, "rank": self.topology.dp_rank}
        return {"num_replicas": self.dp, "rank": self.global_rank % self.dp}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def _check_schedule(self, pp: int) -> None:
        # preflight: the generators' rules, plus a did-you-mean and a bubble warning for m < pp
        check_schedule_args(self.schedule_name, pp, self._microbatches, self.vpp, self.group_size)

    # ------------------------------------------------------------------ launching
    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        world = self.world_size
        if self._pp is not None and world >= 1 and self.num_processes > 0:
            try:
                check_world(world, self._pp)
            except PreflightError as e:
                raise PreflightError(
                    f"PipelineStrategy(pp={self._pp}) does not divide the world size {world} "
                    f"(num_nodes={self.num_nodes} x devices={self.num_processes}): {e}"
                ) from None
        if self.num_processes > 0:
            self._check_schedule(self.pp)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            # The launcher itself starts nothing when torchrun/SLURM created the processes.
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        elif not self.cluster_environment.creates_processes_externally:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        self.topology = PipelineTopology.from_world(self.world_size, self.global_rank, self.pp)
        self.groups = build_process_groups(self.topology, timeout=self._timeout)

    # ------------------------------------------------------------------ building the model
    def _local_indices(self) -> list[int]:
        assert self.topology is not None and self.layer_ranges is not None
        ranges = local_layer_indices(self.layer_ranges, self.topology.pp_rank, self.pp, self.vpp)
        return [i for r in ranges for i in r]

    def _select_layers(self, layers: PipelineLayers) -> list[int]:
        """Partition the model once its layer count is known; return this rank's layers."""
        assert self.topology is not None, "the process group must exist before configure_model"
        module = self.lightning_module
        params = costs = None
        if self.partition == "parameters":
            params = getattr(module, "pipeline_layer_params", lambda: None)()
            if params is None:
                params = layers.layer_param_counts()
        elif self.partition == "cost":
            costs = getattr(module, "pipeline_layer_costs", lambda: None)()
            if costs is None:
                raise ValueError(
                    "partition='cost' needs the module to implement pipeline_layer_costs()"
                )
        # preflight: errors name the numbers and show the split that would result
        self.layer_ranges = check_layers(
            layers.num_layers,
            self.pp,
            self.vpp,
            self.partition,
            layer_params=params,
            layer_costs=costs,
        )
        return self._local_indices()

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: PipelineLayers built here hold this rank's layers only."""
        if self.lightning_module is not None:
            check_module(self.lightning_module, configured=False)
        with select_layers(self._select_layers):
            yield

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.topology is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        for hook in ("pipeline_layers", "pipeline_input", "pipeline_loss"):
            if not callable(getattr(module, hook, None)):
                raise TypeError(
                    f"{type(module).__name__} lacks {hook}(); subclass lightning_pp.PipelineMixin"
                )
        layers = module.pipeline_layers()
        if self.layer_ranges is None or sorted(layers.built_indices) != self._local_indices():
            if self.layer_ranges is None:
                warnings.warn(
                    "PipelineLayers were built outside configure_model(): every rank built all "
                    "layers and now drops the others. Build them in configure_model() so each "
                    "rank materialises only its own.",
                    stacklevel=2,
                )
            self._select_layers(layers)
            missing = set(self._local_indices()) - set(layers.built_indices)
            if missing:
                raise RuntimeError(
                    f"rank {self.global_rank}: layers {sorted(missing)} of this stage "
                    "were not built"
                )
            layers.keep_only(self._local_indices())
        self._check_all_params_in_layers(module, layers)
        self.precision_plugin.convert_module(module)
        self.model_to_device()
        self._reject_grad_scaler()

        ranges = local_layer_indices(self.layer_ranges, self.topology.pp_rank, self.pp, self.vpp)
        self.chunks = [PipelineChunk([layers[i] for i in r], indices=r) for r in ranges]
        self._setup_tied(layers)

        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            # The pipeline runs backward inside training_step; Lightning must not run it again
            # (nor zero the gradients between our backward and the optimizer step).
            trainer.fit_loop._skip_backward = True
            self._patch_clipping()
        self.grad_sync = DeferredGradSync(
            [list(c.parameters()) for c in self.chunks],
            self.groups.dp_group,
            self.topology.dp,
            self.bucket_cap_mb,
        )
        self.engine = self._build_engine()

    def _check_all_params_in_layers(self, module: nn.Module, layers: PipelineLayers) -> None:
        inside = {id(p) for p in layers.parameters()}
        outside = [n for n, p in module.named_parameters() if id(p) not in inside]
        if outside:
            raise ValueError(
                f"parameters outside the PipelineLayers would never be trained by the pipeline: "
                f"{outside[:5]}{' ...' if len(outside) > 5 else ''}; move them into a layer"
            )

    def _reject_grad_scaler(self) -> None:
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "PipelineStrategy does not support a gradient scaler (precision='16-mixed'); "
                "use precision='bf16-mixed' or '32-true'"
            )

    def _setup_tied(self, layers: PipelineLayers) -> None:
        """Create tie groups across ranks and make the copies start equal."""
        topo, groups = self.topology, self.groups
        assert topo is not None and groups is not None and self.layer_ranges is not None
        stage_of_layer = {i: s for s, r in enumerate(self.layer_ranges) for i in r}
        tied: list[TiedGroup] = []
        for names in layers.tied:
            pp_ranks = sorted({stage_of_layer[_split_name(n)[0]] % self.pp for n in names})
            owner_pp = stage_of_layer[_split_name(names[0])[0]] % self.pp
            if len(pp_ranks) < 2:
                continue
            lists = [[topo.global_rank(r, d) for r in pp_ranks] for d in range(topo.dp)]
            group = groups.new_groups(lists)  # collective: every rank, same order
            local = [n for n in names if _split_name(n)[0] in layers]
            if not local:
                continue
            tied.append(
                TiedGroup(
                    names=tuple(names),
                    param=layers.get_parameter(local[0]),
                    owner_rank=topo.global_rank(owner_pp),
                    ranks=lists[topo.dp_rank],
                    group=group,
                )
            )
        self.tied_sync = TiedParameterSync(tied)
        self.tied_sync.broadcast_weights()

    def _build_engine(self) -> Any:
        from .engine import PipelineEngine  # late import: the engine loads torch.distributed bits

        module = self.lightning_module
        schedule = build_schedule(
            self.schedule_name,
            pp=self.pp,
            microbatches=self.microbatches,
            vpp=self.vpp,
            group_size=self.group_size,
        )

        def loss_fn(output: Any, microbatch: Any) -> Tensor:
            # Divided like Lightning divides a plain step's loss under gradient accumulation.
            return module.pipeline_loss(output, microbatch) / self._loss_scale

        return PipelineEngine(
            self.chunks,
            schedule,
            self.topology,
            self.groups,
            loss_fn=loss_fn,
            input_fn=module.pipeline_input,
            loss_reduction="mean",
            release_outputs=self.release_outputs,
            on_chunk_grads_ready=self.grad_sync.on_chunk_grads_ready,
            device=self.root_device,
            watchdog_timeout=self.watchdog_timeout,
            check_finite=self.check_finite,
            recv_lookahead=self.recv_lookahead,
        )

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ training
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """One pipelined forward+backward over the batch; returns the batch loss on every rank."""
        trainer = self.lightning_module.trainer
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        self._check_batch(batch)
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            self._zero_grad(trainer, batch_idx)
        last_micro_step = not trainer.fit_loop._should_accumulate()
        assert self.grad_sync is not None
        self.grad_sync.enabled = last_micro_step
        self._loss_scale = accumulate
        try:
            with self.precision_plugin.train_step_context():
                result = self.engine.train_step(batch)
        finally:
            self._loss_scale = 1
        self.last_record = result.record
        if last_micro_step:
            self.grad_sync.wait()
            self.tied_sync.all_reduce_grads()
        loss = self._dp_mean(result.loss.detach()) * accumulate
        module = self.lightning_module
        # Backward already ran inside the schedule; fire the hooks users expect around it.
        self.precision_plugin.pre_backward(loss, module)
        self.precision_plugin.post_backward(loss, module)
        module.pipeline_log_train_loss(loss)
        return loss

    def _check_batch(self, batch: Any) -> None:
        """Preflight on every batch, before any communication of the step: each rank of a
        pipeline sees the same batch, so a batch too small for the microbatches raises the same
        :class:`PreflightError` on all of them instead of one rank failing and the rest waiting
        (a short last batch of an epoch is caught too; the check is one size comparison)."""
        try:
            size = batch_size_of(batch)
        except ValueError:
            return  # no batch dimension to split: the engine reports it with the action
        try:
            check_batch(size, self.microbatches, self.dp)
        except PreflightError as e:
            raise PreflightError(f"rank {self.global_rank}: {e}") from None

    def _zero_grad(self, trainer: pl.Trainer, batch_idx: int) -> None:
        for optimizer in self.optimizers[:1]:  # automatic optimization steps optimizer 0
            call._call_callback_hooks(trainer, "on_before_zero_grad", optimizer)
            call._call_lightning_module_hook(trainer, "on_before_zero_grad", optimizer)
            call._call_lightning_module_hook(
                trainer, "optimizer_zero_grad", trainer.current_epoch, batch_idx, optimizer
            )

    def _dp_mean(self, value: Tensor) -> Tensor:
        assert self.topology is not None and self.groups is not None
        if self.topology.dp == 1:
            return value
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.groups.dp_group)
        return value / self.topology.dp

    # -- gradient clipping by the global norm --------------------------------------------------
    def _patch_clipping(self) -> None:
        plugin = self.precision_plugin
        if self._original_clip is None:
            self._original_clip = (plugin, plugin.__dict__.get("clip_grad_by_norm"))
        strategy = self

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
            strategy.clip_grad_by_global_norm(list(plugin.main_params(optimizer)), clip_val)

        # Per-instance override: Lightning routes clipping through the precision plugin, whose
        # default computes a local norm: under a pipeline each rank holds only a slice.
        plugin.clip_grad_by_norm = clip_grad_by_norm

    def clip_grad_by_global_norm(self, params: Sequence[nn.Parameter], max_norm: float) -> Tensor:
        """Scale gradients so the norm over the WHOLE model (every stage) is at most ``max_norm``.

        Tied copies are counted once (on their owner); replicas are not summed twice. Returns the
        global norm before clipping.
        """
        assert self.groups is not None
        norm = global_grad_norm(
            params, self.groups.pp_group, skip=self.tied_sync.non_owner_params()
        )
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.device))
        return norm

    # ------------------------------------------------------------------ evaluation
    def _eval(self, batch: Any, stage: str, context: Any) -> dict[str, Tensor]:
        assert self.topology is not None and self.groups is not None
        self._check_batch(batch)
        with context():
            result = self.engine.eval_step(batch, collect_outputs=True)
        self.last_record = result.record
        module = self.lightning_module
        src = self.topology.global_rank(self.pp - 1)
        payload: list[Any] = [None]
        if self.topology.is_last_stage:
            output = _concat_outputs(result.outputs)
            with context():
                values = module.pipeline_eval_step(output, batch, stage)
            names = list(values)
            stacked = torch.stack([torch.as_tensor(values[n]).detach().float() for n in names])
            if self.topology.dp > 1:  # average over replicas (each saw a different shard)
                dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=self.groups.dp_group)
                stacked = stacked / self.topology.dp
            payload = [(names, stacked.cpu())]
        if self.pp > 1:
            dist.broadcast_object_list(payload, src=src, group=self.groups.pp_group)
        names, stacked = payload[0]
        return {n: stacked[i].to(self.root_device) for i, n in enumerate(names)}

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        values = self._eval(args[0], "val", self.precision_plugin.val_step_context)
        self.lightning_module.pipeline_log_eval(values, "val")
        return values

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        values = self._eval(args[0], "test", self.precision_plugin.test_step_context)
        self.lightning_module.pipeline_log_eval(values, "test")
        return values

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's output (microbatches concatenated), on every rank of the pipeline.

        The last stage computes it and sends it to the other stages, so ``trainer.predict``
        returns predictions on global rank 0 too (spawn launchers return rank 0's results).
        """
        assert self.topology is not None and self.groups is not None
        with self.precision_plugin.predict_step_context():
            result = self.engine.eval_step(args[0], collect_outputs=True)
        self.last_record = result.record
        payload: list[Any] = [None]
        if self.topology.is_last_stage:
            payload = [_concat_outputs(result.outputs)]
        if self.pp > 1:
            payload = [_to_cpu(payload[0])]
            dist.broadcast_object_list(
                payload, src=self.topology.global_rank(self.pp - 1), group=self.groups.pp_group
            )
        return payload[0]

    # ------------------------------------------------------------------ checkpoints
    # A checkpoint is a directory: every stage writes its own tensors by original name, rank 0
    # Lightning's metadata (format: lightning_pp/checkpoint.py, docs/checkpoints.md). It is
    # loaded after setup, so each rank (of any later shape) reads only its own layers.
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers by parameter name

    def _canonical_names(self) -> dict[str, str]:
        module = self.lightning_module
        return tied_canonical_names(module, module.pipeline_layers())

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's optimizer state keyed by parameter name (stages' indices would collide)."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
        return optimizer_state_by_name(optimizer, self.lightning_module, self._canonical_names())

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Collective: write this rank's shard into the checkpoint directory ``filepath``."""
        if storage_options is not None:
            raise TypeError(
                "PipelineStrategy.save_checkpoint(..., storage_options=...) is not supported: "
                "the strategy writes a sharded checkpoint directory itself, not via CheckpointIO"
            )
        assert self.topology is not None and self.layer_ranges is not None
        path = self.broadcast(str(filepath))
        topo = self.topology
        cls = type(self.lightning_module)
        # lets `lightning-pp consolidate --lightning` rebuild the unpipelined module
        checkpoint["lightning_pp"] = {"module_class": f"{cls.__module__}:{cls.__qualname__}"}
        save_sharded_checkpoint(
            checkpoint,
            path,
            tag=f"pp{topo.pp_rank}" if topo.dp_rank == 0 else None,
            canonical=self._canonical_names(),
            layout={
                "pp": self.pp,
                "vpp": self.vpp,
                "dp": topo.dp,
                "world_size": self.world_size,
                "num_layers": self.layer_ranges[-1].stop,
                "layer_ranges": [[r.start, r.stop] for r in self.layer_ranges],
            },
            barrier=self.barrier,
        )

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load this rank's layers (and their optimizer state) by name; return the metadata.

        Works whatever pipeline shape wrote the checkpoint: names do not depend on it.
        """
        from lightning.fabric.utilities.cloud_io import _load as pl_load

        path = self.broadcast(str(checkpoint_path))
        index = read_index(path)
        module = self.lightning_module
        canonical = self._canonical_names()
        strict = module.strict_loading
        trainer = module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        used: list[str] = []
        error = None
        try:  # any rank's failure is raised on every rank: none is left waiting in a collective
            used = load_model_shard(path, module, canonical, strict=strict, index=index)
            if fitting:
                optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
                load_optimizer_shard(path, optimizers, module, canonical, index=index)
        except Exception as exc:
            error = f"rank {self.global_rank}: {type(exc).__name__}: {exc}"
        gathered: list[Any] = [(used, error)]
        if _distributed_is_initialized():
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, (used, error))
        errors = [e for _, e in gathered if e]
        if errors:
            raise RuntimeError(f"loading checkpoint {path!r} failed: " + "; ".join(errors))
        if strict:
            saved = {n for names in index["model_files"].values() for n in names}
            unused = sorted(saved - {n for names, _ in gathered for n in names})
            if unused:
                raise RuntimeError(
                    f"checkpoint {path!r}: {len(unused)} saved tensor(s) belong to no rank of "
                    f"this model: {unused[:5]} (set LightningModule.strict_loading=False to allow)"
                )
        meta = pl_load(
            f"{path}/{index['meta_file']}", map_location="cpu", weights_only=weights_only
        )
        if fitting and "lr_schedulers" in meta:
            # saved by rank 0: fit its per-group lists to THIS rank's param groups
            meta["lr_schedulers"] = [
                adapt_scheduler_state(state, cfg.scheduler.optimizer)
                for state, cfg in zip(meta["lr_schedulers"], trainer.lr_scheduler_configs)
            ]
        return meta

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint, by name, for this rank's layers only

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint directory (ModelCheckpoint's top-k rotation)."""
        if self.is_global_zero:
            import shutil
            from pathlib import Path

            path = Path(filepath)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ teardown, registry
    def on_exception(self, exception: BaseException) -> None:
        """Publish this rank's failure (e.g. from a callback) so the other ranks stop waiting."""
        if not isinstance(exception, PipelineAborted) and _distributed_is_initialized():
            try:
                store = dist.distributed_c10d._get_default_store()
            except Exception:
                store = None
            report_failure(store, self.global_rank, "Lightning hook or step", exception)
        super().on_exception(exception)

    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and module._trainer is not None:
            module._trainer.fit_loop._skip_backward = False
        if self._original_clip is not None:
            plugin, original = self._original_clip
            if original is None:
                plugin.__dict__.pop("clip_grad_by_norm", None)
            else:
                plugin.clip_grad_by_norm = original
            self._original_clip = None
        self.engine = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in (("pipeline", "popen"), ("pipeline_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"Pipeline x data parallel (start_method={start_method!r})",
                    start_method=start_method,
                )


def _register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    PipelineStrategy.register_strategies(StrategyRegistry)


_register()

"""Every contact lightning_pp has with private Lightning (and torch) internals, in one place.

Written against Lightning 2.6 (2.6.6 tested). Each helper says what it touches and why no public
API does the job. When Lightning changes one of these, this module is the only one to fix;
``tests/test_lightning_private.py`` fails if a private Lightning name appears anywhere else in the
package.

Not listed here because they are *overrides*, not calls: ``PipelineStrategy._configure_launcher``
(the accelerator connector calls this private hook of ``Strategy`` to ask a strategy for its
launcher; every Lightning strategy overrides it) and the ``_launcher`` attribute it sets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

if TYPE_CHECKING:  # only for annotations: importing Lightning at module load is not needed
    import lightning.pytorch as pl
    from lightning.fabric.plugins import ClusterEnvironment
    from lightning.pytorch.strategies.strategy import Strategy

__all__ = [
    "agent_hosts_store",
    "set_device_mesh",
    "call_zero_grad_hooks",
    "configure_optimizers_and_schedulers",
    "default_process_group_backend",
    "default_store",
    "distributed_is_initialized",
    "hpc_save_path",
    "init_dist_connection",
    "load_file",
    "logging_step",
    "model_summary_settings",
    "multiprocessing_launcher",
    "optimizers_to_device",
    "reset_optimizers_and_schedulers",
    "set_skip_backward",
    "should_accumulate",
    "subprocess_script_launcher",
    "sync_ddp_if_available",
    "trainer_of",
]


# ------------------------------------------------------------------------------- the fit loop
def set_skip_backward(trainer: pl.Trainer | None, skip: bool) -> None:
    """``trainer.fit_loop._skip_backward`` (private property, 2.6).

    Why: the pipeline runs backward inside ``training_step`` (interleaved with forwards); the
    automatic-optimization closure must then run only the step, not backward again and not
    ``zero_grad`` between our backward and the optimizer step. Lightning's own
    ``StochasticWeightAveraging`` and NeMo's Megatron strategy use this same switch.
    """
    if trainer is not None:
        trainer.fit_loop._skip_backward = skip


def should_accumulate(trainer: pl.Trainer) -> bool:
    """``trainer.fit_loop._should_accumulate()`` (private method, 2.6).

    Why: the data-parallel and tied-gradient reductions must run on the last micro-step of an
    accumulation window only, and Lightning's rule for it (``accumulate_grad_batches``, the end
    of the epoch, a limited number of batches) exists only as this private method. Re-deriving it
    would drift from Lightning's decision to step the optimizer.
    """
    return bool(trainer.fit_loop._should_accumulate())


def call_zero_grad_hooks(trainer: pl.Trainer, optimizer: Optimizer, batch_idx: int) -> None:
    """Lightning's zero-grad sequence: ``on_before_zero_grad`` (callbacks, then module) and
    ``LightningModule.optimizer_zero_grad``, via ``trainer.call._call_*_hook`` (private, 2.6).

    Why: with backward skipped (see :func:`set_skip_backward`) the closure no longer zeroes the
    gradients; the strategy must, at the start of each accumulation window, and users' hooks
    expect to run then. The private callers add the profiler sections and ``_current_fx_name``
    bookkeeping (for ``self.log`` inside the hooks) that calling the hooks directly would miss.
    """
    from lightning.pytorch.trainer import call

    call._call_callback_hooks(trainer, "on_before_zero_grad", optimizer)
    call._call_lightning_module_hook(trainer, "on_before_zero_grad", optimizer)
    call._call_lightning_module_hook(
        trainer, "optimizer_zero_grad", trainer.current_epoch, batch_idx, optimizer
    )


def logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs metrics at: ``fit_loop.epoch_loop._batches_that_stepped``
    (private counter, 2.6), falling back to the public ``global_step``.

    Why: callbacks that write to the loggers directly must use the same x-axis as ``self.log``;
    ``global_step`` differs from it (it counts every optimizer's steps).
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    return int(getattr(loop, "_batches_that_stepped", trainer.global_step))


def model_summary_settings(callback: Any) -> tuple[int, dict[str, Any]]:
    """``ModelSummary._max_depth`` and ``._summarize_kwargs`` (private attributes, 2.6) of a
    model summary callback (``ModelSummary``, ``RichModelSummary``).

    Why: under the strategy the summary must gather every stage's rows before printing
    (:mod:`lightning_pp.strategy.model_summary`); the pipeline's version of ``on_fit_start`` needs
    the
    depth and the printing options the user gave the callback, which Lightning keeps only in these
    attributes.
    """
    return int(callback._max_depth), dict(callback._summarize_kwargs)


def trainer_of(module: pl.LightningModule | None) -> pl.Trainer | None:
    """``LightningModule._trainer`` (private attribute, 2.6), or ``None``.

    Why: the public ``module.trainer`` raises when no trainer is attached; teardown must work
    whether or not one is.
    """
    return None if module is None else module._trainer


def set_device_mesh(module: pl.LightningModule, mesh: Any) -> None:
    """Set what ``module.device_mesh`` returns: ``LightningModule._device_mesh`` (private
    attribute, 2.6; Lightning's own ``ModelParallelStrategy.setup_environment`` sets it the same
    way, there is no public setter).

    Why: the model's hooks (``configure_model`` first) read the job's mesh as
    ``self.device_mesh``, as they do under ``ModelParallelStrategy``.
    """
    module._device_mesh = mesh


# ------------------------------------------------------------------------------- the strategy
def reset_optimizers_and_schedulers(strategy: Strategy) -> None:
    """``Strategy._reset_optimizers_and_schedulers()`` (private, 2.6).

    Why: ``setup`` creates the optimizers after the model was cut to this rank's layers; a
    strategy reused across ``fit`` calls must drop the previous ones first, as Lightning's own
    ``Strategy.setup`` does through this method.
    """
    strategy._reset_optimizers_and_schedulers()


def optimizers_to_device(optimizers: list[Optimizer], device: torch.device) -> None:
    """``lightning.fabric.utilities.optimizer._optimizers_to_device`` (private, 2.6).

    Why: optimizer state restored from a checkpoint sits on the CPU; it must follow the
    parameters to this rank's device, as Lightning's ``Strategy.setup`` does with this helper.
    """
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def subprocess_script_launcher(
    cluster_environment: ClusterEnvironment,
    num_processes: int,
    num_nodes: int,
    before_launch: Callable[[Any], None] | None = None,
) -> Any:
    """A subclass of ``lightning.pytorch.strategies.launchers._SubprocessScriptLauncher``
    (private, 2.6) whose ``launch`` supervises the children it starts.

    Why: ``start_method="popen"`` launches like ``strategy="ddp"`` (re-run the script per local
    rank; nothing when torchrun/SLURM started the processes); Lightning exposes the launcher only
    as this private class. Its ``launch`` is re-stated (validate, ``_call_children_scripts``,
    ``_set_num_threads_if_needed``, run) to swap Lightning's child-process observer for
    :class:`lightning_pp.runtime.processes.ChildSupervisor`: Lightning's kills every process at its
    next
    5-second poll after a child fails (often before the survivors said who failed) and leaves
    the children running when the launcher itself fails (they end up with parent pid 1).
    """
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from .runtime.processes import ChildSupervisor

    class SupervisingSubprocessLauncher(_SubprocessScriptLauncher):
        def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
            if before_launch is not None:
                before_launch(trainer)  # refuse before any child process exists
            self.cluster_environment.validate_settings(
                num_devices=self.num_processes, num_nodes=self.num_nodes
            )
            supervisor = None
            if not self.cluster_environment.creates_processes_externally:
                self._call_children_scripts()
                supervisor = ChildSupervisor(self.procs).start()
            _set_num_threads_if_needed(num_processes=self.num_processes)
            try:
                return function(*args, **kwargs)
            except SIGTERMException:
                # Every rank stops together and saves (the strategy's on_exception, which
                # Lightning calls after this returns): the children must not be killed now.
                raise
            except BaseException:
                if supervisor is not None:
                    supervisor.end_children()  # nothing outlives a failed launcher
                raise

    return SupervisingSubprocessLauncher(cluster_environment, num_processes, num_nodes)


def multiprocessing_launcher(
    strategy: Strategy, start_method: str, before_launch: Callable[[Any], None] | None = None
) -> Any:
    """``lightning.pytorch.strategies.launchers._MultiProcessingLauncher`` (private, 2.6).

    Why: ``start_method="spawn"/"fork"`` launches in-process like ``strategy="ddp_spawn"``
    (needed under pytest and notebooks); private class, as above. ``before_launch(trainer)``
    runs in the launching process before any process starts (the strategy's pre-flight).
    """
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

    class CheckedMultiProcessingLauncher(_MultiProcessingLauncher):
        def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
            if before_launch is not None:
                before_launch(trainer)
            return super().launch(function, *args, trainer=trainer, **kwargs)

    return CheckedMultiProcessingLauncher(strategy, start_method=start_method)


# ------------------------------------------------------------------------------- distributed
def distributed_is_initialized() -> bool:
    """``lightning.fabric.utilities.distributed._distributed_is_initialized`` (private, 2.6).

    Why: the same test Lightning's strategies use (``torch.distributed.is_initialized`` is not
    defined on builds without distributed support).
    """
    from lightning.fabric.utilities.distributed import _distributed_is_initialized

    return _distributed_is_initialized()


def default_process_group_backend(device: torch.device) -> str:
    """``_get_default_process_group_backend_for_device`` (private, 2.6): gloo on CPU, nccl on
    CUDA, ... Why: pick the backend exactly as ``strategy="ddp"`` would."""
    from lightning.fabric.utilities.distributed import (
        _get_default_process_group_backend_for_device,
    )

    return _get_default_process_group_backend_for_device(device)


def init_dist_connection(
    cluster_environment: ClusterEnvironment, backend: str, **kwargs: Any
) -> None:
    """``lightning.fabric.utilities.distributed._init_dist_connection`` (private, 2.6).

    Why: initialises the default process group from the cluster environment (MASTER_ADDR/PORT,
    ranks) exactly like Lightning's DDP/FSDP strategies, including its checks and env setup.
    """
    from lightning.fabric.utilities.distributed import _init_dist_connection

    _init_dist_connection(cluster_environment, backend, **kwargs)


def sync_ddp_if_available(tensor: torch.Tensor, group: Any, reduce_op: Any) -> torch.Tensor:
    """``lightning.fabric.utilities.distributed._sync_ddp_if_available`` (private, 2.6).

    Why: ``Strategy.reduce`` (used by ``self.log(sync_dist=True)``) must reduce with Lightning's
    semantics (``"mean"``/``"sum"`` strings, a no-op without a process group).
    """
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available

    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def agent_hosts_store() -> bool:
    """Whether a torchelastic agent (torchrun) hosts the job's store: torch's private
    ``torch.distributed.rendezvous._torchelastic_use_agent_store`` (torch 2.x), which reads the
    ``TORCHELASTIC_USE_AGENT_STORE`` variable the agent sets for its workers.

    Why: under ``env://`` rank 0 hosts the store unless an agent does; the strategy starts a
    store process of its own exactly when rank 0 would otherwise host it
    (:mod:`lightning_pp.runtime.store_host`), so it must ask the same question torch asks.
    """
    try:
        from torch.distributed.rendezvous import _torchelastic_use_agent_store
    except ImportError:  # moved: read the variable it reads
        import os

        return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    return bool(_torchelastic_use_agent_store())


def default_store() -> Any:
    """The default process group's key-value store, or ``None`` (torch private:
    ``torch.distributed.distributed_c10d._get_default_store``, torch 2.x).

    Why: a failure outside the engine (a callback, a Lightning hook) is published on the store so
    the other ranks stop instead of waiting in their next transfer.
    """
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group, or the private API moved: no failure channel
        return None


def hpc_save_path(trainer: pl.Trainer) -> str:
    """``trainer._checkpoint_connector.hpc_save_path(default_root_dir)`` (private, 2.6):
    ``<default_root_dir>/hpc_ckpt_<n+1>.ckpt``.

    Why: a checkpoint saved on SIGTERM under SLURM must be where Lightning looks when the
    requeued job starts again (``_hpc_resume_path``: the highest ``hpc_ckpt_<n>`` there), as
    Lightning's own auto-requeue saves it; the numbering rule exists only here.
    """
    return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)


# ------------------------------------------------------------------------------- checkpoints
def load_file(path: str, *, map_location: Any = None, weights_only: bool | None = None) -> Any:
    """``lightning.fabric.utilities.cloud_io._load`` (private, 2.6).

    Why: Lightning's checkpoint loader (local paths and fsspec URLs, and its ``weights_only``
    default) for the metadata file, so it loads exactly as Lightning's own checkpoints do.
    """
    from lightning.fabric.utilities.cloud_io import _load

    return _load(path, map_location=map_location, weights_only=weights_only)


def configure_optimizers_and_schedulers(module: Any) -> tuple[list[Optimizer], list[Any]]:
    """Call ``module.configure_optimizers()`` and normalise it the way the Trainer does:
    ``lightning.pytorch.core.optimizer._configure_optimizers`` and
    ``_configure_schedulers_{automatic,manual}_opt`` (private, 2.6).

    Why: consolidating a checkpoint into a plain Lightning one rebuilds the optimizers and
    scheduler configs outside any Trainer; every return form ``configure_optimizers`` accepts
    (dicts, lists, tuples, monitors) is parsed only by these private functions.
    Returns ``(optimizers, lr_scheduler_configs)``.
    """
    from lightning.pytorch.core.optimizer import (
        _configure_optimizers,
        _configure_schedulers_automatic_opt,
        _configure_schedulers_manual_opt,
    )

    optimizers, schedulers, monitor = _configure_optimizers(module.configure_optimizers())
    if getattr(module, "automatic_optimization", True):
        return optimizers, _configure_schedulers_automatic_opt(schedulers, monitor)
    return optimizers, _configure_schedulers_manual_opt(schedulers)

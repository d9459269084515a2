"""ProcessGroupStrategy: launching, the default process group and collectives.

What any multi-process Lightning strategy needs and ``DDPStrategy`` has too, kept apart from the
pipeline so :mod:`lightning_pp.strategy` reads as pipeline decisions only: the process launchers
(``devices=N``, ``torchrun``, SLURM, spawn), ranks from the cluster environment, the default
process group, and ``barrier``/``broadcast``/``reduce``. Private Lightning contacts go through
:mod:`lightning_pp._lightning_compat`.

Example::

    class MyStrategy(ProcessGroupStrategy):
        ...  # setup(), training_step(), ... ; launching and collectives are inherited
"""

from __future__ import annotations

import logging
import pickle
import signal
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from .. import _lightning_compat as compat
from ..layout.topology import set_group_timeout
from ..runtime.failure import (
    DEFAULT_WATCHDOG_TIMEOUT,
    FailureMonitor,
    monitored_wait,
    set_collective_monitor,
)
from ..runtime.heartbeats import ProcessWatcher
from ..runtime.processes import SIGTERM_EXIT_CODE, install_excepthook, slurm_job_id, slurm_requeue
from ..runtime.store_host import StoreHost, connect_store, publish_key_prefix

__all__ = ["ProcessGroupStrategy"]

log = logging.getLogger(__name__)

# Lightning's barriers while the job starts: ranks legitimately arrive seconds apart (imports,
# data set-up on one rank), so these wait at least as long as the pipeline's set-up rendezvous.
_SETUP_BARRIERS = ("pre_setup", "post_setup", "run-stage", "_dataloader()", "resume_end")
_SETUP_WAIT = 120.0

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class ProcessGroupStrategy(ParallelStrategy):
    """A parallel strategy with one process per device and a default process group.

    Args:
        start_method: ``"popen"`` (re-run the script per rank, like ``ddp``) or ``"spawn"``/
            ``"fork"`` (in-process launch, like ``ddp_spawn``). Nothing is launched when the
            processes come from outside (torchrun, SLURM).
        process_group_backend: ``None`` picks Lightning's default for the device (gloo on CPU).
        timeout: the process group's collective timeout.

    Every collective it issues (``barrier``, ``broadcast``, ``reduce``, ``all_gather`` and the
    helpers :meth:`all_reduce` / :meth:`broadcast_object`) waits through a
    :class:`~lightning_pp.runtime.failure.FailureMonitor`: it stops when another rank fails and
    raises
    a hang report naming the rank and the collective after ``watchdog_timeout`` seconds
    (an attribute, default 300 s; ``None`` disables). A
    :class:`~lightning_pp.runtime.heartbeats.ProcessWatcher` per rank names a rank that vanished and
    ends a
    process blocked where no monitor watches. SIGTERM saves a checkpoint (when checkpointing is
    configured), requeues a SLURM job (``auto_requeue``) and exits with code 143.
    """

    def __init__(
        self,
        *,
        start_method: StartMethod = "popen",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        #: seconds a collective may block before a hang report (subclasses set it from their
        #: own argument); ``None`` disables the watchdog (the abort channel stays on)
        self.watchdog_timeout: float | None = DEFAULT_WATCHDOG_TIMEOUT
        self._watcher: ProcessWatcher | None = None
        self._collectives: FailureMonitor | None = None
        self._sigterm_received = False
        self._sigterm_ranks: list[int] = []
        self._store_host: StoreHost | None = None
        self._store_owner = "hosted by rank 0"

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning's connector to sync ``self.log(sync_dist=True)`` and inject samplers."""
        return True

    @property
    @override
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
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        """Called by the accelerator connector and in ``setup_environment``."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            # The launcher itself starts nothing when torchrun/SLURM created the processes.
            self._launcher = compat.subprocess_script_launcher(
                self.cluster_environment, self.num_processes, self.num_nodes, self.before_launch
            )
        elif not self.cluster_environment.creates_processes_externally:
            self._launcher = compat.multiprocessing_launcher(
                self, self._start_method, self.before_launch
            )

    def before_launch(self, trainer: Any) -> None:
        """Checks that need the Trainer and the module but no process group, run by the
        launcher before it starts any process (so a mistake is raised once, in the launching
        process). Subclasses add theirs; nothing here."""

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = backend = (
            self._process_group_backend or compat.default_process_group_backend(self.root_device)
        )
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        store = None
        if not compat.distributed_is_initialized():
            store = self._job_store()
            if store is not None:
                kwargs["store"] = store
        elif self._timeout is not None:
            # An earlier Trainer of this process made the group, and Lightning leaves an
            # existing group as it is: this strategy's timeout would be silently ignored.
            if not set_group_timeout(self._timeout):
                rank_zero_warn(
                    f"the process group exists already (an earlier Trainer of this process); "
                    f"this torch cannot change its timeout, so timeout={self._timeout} is not "
                    f"applied"
                )
        compat.init_dist_connection(self.cluster_environment, backend, **kwargs)
        default = compat.default_store()
        if store is not None and self._store_host is not None and default is not None:
            group = dist.group.WORLD
            names = [f"{group.group_name}/"] if group is not None else []
            publish_key_prefix(store, default, [*names, ""])
        self._start_failure_handling()

    def _job_store(self) -> Any:
        """The job's store, hosted outside rank 0 (:mod:`lightning_pp.runtime.store_host`), or
        ``None`` for torch's own ``env://`` rendezvous (a single process, or torchrun, whose agent
        hosts it already).

        Why: every failure channel goes through this store. Inside rank 0 (``env://`` without an
        agent: Lightning's launcher, SLURM, spawn) a stopped rank 0 would freeze the whole job
        with nothing printed, and a killed one would take every channel down with it."""
        if self.world_size < 2:
            return None
        if compat.agent_hosts_store():
            self._store_owner = "hosted by torchrun's agent"
            return None
        env = self.cluster_environment
        assert env is not None
        address, port = env.main_address, env.main_port
        if self.global_rank == 0:
            stale = (self.watchdog_timeout or 60.0) + 10.0
            self._store_host = StoreHost.start(address, port, self.world_size, stale=stale)
            self._store_owner = f"hosted by {self._store_host.describe()}"
        else:
            self._store_owner = f"hosted by lightning-pp's store process at {address}:{port}"
        return connect_store(address, port, self._timeout)

    # ------------------------------------------------------------------ failures
    def watched_ranks(self) -> list[int]:
        """The ranks whose heartbeats this rank checks (default: all). Every rank must be
        watched by some other rank; a subclass narrows it to keep the store traffic small."""
        return list(range(self.world_size))

    def _start_failure_handling(self) -> None:
        """The collective monitor, the heartbeat watcher and the one-failure-printed-once hook."""
        store = compat.default_store()
        backend = dist.get_backend()
        self._collectives = FailureMonitor(
            store,
            self.global_rank,
            watchdog_timeout=self.watchdog_timeout,
            poll_works=backend == "nccl",
            pipeline_ranks=range(self.world_size),
        )
        set_collective_monitor(self._collectives)
        if store is not None and self.world_size > 1 and self._watcher is None:
            self._watcher = ProcessWatcher(
                store,
                self.global_rank,
                self.world_size,
                watchdog_timeout=self.watchdog_timeout,
                watch=self.watched_ranks,
                store_owner=self._store_owner,
            ).start()
        rank = self.global_rank  # not ``self``: the hook stays for the process's life
        install_excepthook(lambda: rank)

    def failure_origin(self) -> dict | None:
        """What the rank that failed first published, when it is another rank (one that raised,
        or vanished without a word: :meth:`ProcessWatcher.failure_origin`), else ``None``: this
        rank's own error is then the cause."""
        if self._watcher is None:
            return None
        return self._watcher.failure_origin()

    def _stop_failure_handling(self) -> None:
        # After a failure the watcher stays: it ends this process should it block on its way
        # out. Otherwise the rank is finished and the others must no longer watch it.
        if self._watcher is not None and not self._watcher.job_failed():
            self._watcher.stop()
            self._watcher = None
        set_collective_monitor(None)

    def _wait(self, works: Sequence[Any], what: str, group: Any = None, name: str = "") -> None:
        """Wait for a collective's works, watched (hang report, abort channel)."""
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        min_timeout = _SETUP_WAIT if name and name.endswith(_SETUP_BARRIERS) else 0.0
        works = [w for w in works if w is not None]
        if self._collectives is None:
            monitored_wait(works, what, ranks)
        else:
            self._collectives.wait(works, what, ranks=ranks, min_timeout=min_timeout)

    def _comm_device(self) -> torch.device:
        return self.root_device if dist.get_backend() == "nccl" else torch.device("cpu")

    def all_reduce(
        self, tensor: Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, what: str = ""
    ) -> Tensor:
        """In-place ``all_reduce`` of ``tensor`` over ``group``, watched; returns ``tensor``."""
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        self._wait([work], f"in all_reduce{' of ' + what if what else ''}", group)
        return tensor

    def broadcast_object(self, obj: Any, src: int, group: Any = None, what: str = "") -> Any:
        """``obj`` of global rank ``src`` on every rank of ``group``: pickled into tensors and
        sent with two watched broadcasts (``broadcast_object_list`` cannot be waited for with a
        watchdog: it has no ``async_op``)."""
        device = self._comm_device()
        mine = dist.get_rank() == src
        data = pickle.dumps(obj) if mine else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        label = f"in broadcast{' of ' + what if what else ''} from rank {src}"
        self._wait([dist.broadcast(size, src=src, group=group, async_op=True)], label, group)
        if mine:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        else:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        self._wait([dist.broadcast(payload, src=src, group=group, async_op=True)], label, group)
        return obj if mine else pickle.loads(payload.cpu().numpy().tobytes())

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def barrier(self, name: str | None = None) -> None:
        if not compat.distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            work = dist.barrier(device_ids=[self.root_device.index], async_op=True)
        else:
            work = dist.barrier(async_op=True)
        self._wait([work], f"in barrier {name!r}" if name else "in barrier", name=name or "")

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not compat.distributed_is_initialized():
            return obj
        return self.broadcast_object(obj, src)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Lightning's ``_sync_ddp`` semantics (``"mean"``/``"avg"``, ``"sum"``, ... or a
        ``ReduceOp``; in place), with a watched ``all_reduce`` and without its extra barrier."""
        if not isinstance(tensor, Tensor) or not compat.distributed_is_initialized():
            return tensor
        divide = False
        op: Any = reduce_op if reduce_op is not None else dist.ReduceOp.SUM
        if isinstance(reduce_op, str):
            name = "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
            divide = name == "avg"  # gloo has no AVG: sum, then divide (as Lightning does)
            op = dist.ReduceOp.SUM if divide else getattr(dist.ReduceOp, name.upper())
        self.all_reduce(tensor, op=op, group=group, what=f"a value reduced with {reduce_op!r}")
        if not divide:
            return tensor
        size = dist.get_world_size(group)
        if not torch.is_floating_point(tensor):
            return tensor.copy_(tensor / size)
        return tensor.div_(size)

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        if sync_grads or not compat.distributed_is_initialized():
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        work = dist.all_gather(out, tensor, group=group, async_op=True)
        self._wait([work], "in all_gather", group)
        return torch.stack(out)

    # ------------------------------------------------------------------ SIGTERM, teardown
    # Lightning's SIGTERM handling stops each rank where its *own* flag is first checked (after
    # the batch in which the signal arrived), so ranks signalled a moment apart stop at
    # different points, and a collective save then hangs. Here the handler only records the
    # signal (and forwards it to the launched children, as Lightning's does); every rank
    # decides at the start of each training batch, with one small all_reduce, whether any rank
    # was signalled, and all stop there together.
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._sigterm_received = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm_signal)  # Lightning restores its own

    def _on_sigterm_signal(self, signum: int, frame: Any) -> None:
        if not self._sigterm_received and self.launcher is not None:
            self.launcher.kill(signum)  # the children this process launched, if any
        self._sigterm_received = True

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        stop = self._sigterm_received
        if self.world_size > 1 and compat.distributed_is_initialized():
            flag = torch.tensor([int(stop)], device=self._comm_device())
            stop = bool(self.all_reduce(flag, op=dist.ReduceOp.MAX, what="the SIGTERM flag").item())
        if stop:
            self._sigterm_ranks = self._signalled_ranks()
            raise SIGTERMException()

    def _signalled_ranks(self) -> list[int]:
        """The global ranks that received the SIGTERM. Every rank calls it at the same batch
        (the vote above told all of them to stop), so this second collective, which runs once
        per job, is matched everywhere. Without it the line said rank 0 received a signal that
        a scheduler had sent to rank 2 only."""
        if self.world_size <= 1 or not compat.distributed_is_initialized():
            return [self.global_rank] if self._sigterm_received else []
        flags = torch.zeros(self.world_size, dtype=torch.int32, device=self._comm_device())
        flags[self.global_rank] = int(self._sigterm_received)
        flags = self.all_reduce(flags, op=dist.ReduceOp.SUM, what="which ranks got SIGTERM")
        return [r for r, f in enumerate(flags.tolist()) if f]

    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            self._on_sigterm(exception)
        super().on_exception(exception)

    def _on_sigterm(self, exception: SIGTERMException) -> None:
        """Lightning stops every rank at the same point after SIGTERM (a broadcast of the flag
        and a barrier), then raises ``SIGTERMException``, a ``SystemExit`` with code 0: a job
        killed by its scheduler would look successful. Save a checkpoint where Lightning's SLURM
        auto-requeue saves and resumes it (when checkpointing is configured), requeue the SLURM
        job from rank 0 (``SLURMEnvironment(auto_requeue=True)``), say so, and exit 143."""
        trainer = self.lightning_module.trainer
        ranks = self._sigterm_ranks or [self.global_rank]
        who = _rank_list(ranks, self.world_size)
        said = [
            f"{who} received SIGTERM; every rank stopped at step {trainer.global_step} "
            f"(max_steps={trainer.max_steps})"
        ]
        if trainer.checkpoint_callback is not None:
            path = trainer.strategy.broadcast(compat.hpc_save_path(trainer))
            trainer.save_checkpoint(path)  # collective: every rank writes its shard
            said.append(f"saved checkpoint {path}")
        else:
            said.append("checkpointing is off (enable_checkpointing=False): nothing saved")
        env = self.cluster_environment
        if isinstance(env, SLURMEnvironment) and env.auto_requeue and self.is_global_zero:
            job = slurm_job_id()
            if job is None:
                said.append("SLURM job id unknown: not requeued")
            else:
                code = slurm_requeue(job)
                said.append(
                    f"requeued SLURM job {job}"
                    if code == 0
                    else f"`scontrol requeue {job}` failed with code {code}"
                )
        said.append(f"exiting with code {SIGTERM_EXIT_CODE}")
        if self.is_global_zero:
            print("[lightning-pp] " + "; ".join(said), flush=True)
        exception.code = SIGTERM_EXIT_CODE

    @override
    def teardown(self) -> None:
        self._stop_failure_handling()
        super().teardown()


def _rank_list(ranks: list[int], world_size: int) -> str:
    """``rank 2``, ``ranks 1, 3`` or ``all 4 ranks``."""
    if len(ranks) == world_size and world_size > 1:
        return f"all {world_size} ranks"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks))

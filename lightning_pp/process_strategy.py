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

from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from . import _lightning_compat as compat

__all__ = ["ProcessGroupStrategy"]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


class ProcessGroupStrategy(ParallelStrategy):
    """A parallel strategy with one process per device and a default process group.

    Args:
        start_method: ``"popen"`` (re-run the script per rank, like ``ddp``) or ``"spawn"``/
            ``"fork"`` (in-process launch, like ``ddp_spawn``). Nothing is launched when the
            processes come from outside (torchrun, SLURM).
        process_group_backend: ``None`` picks Lightning's default for the device (gloo on CPU).
        timeout: the process group's collective timeout.
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
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        elif not self.cluster_environment.creates_processes_externally:
            self._launcher = compat.multiprocessing_launcher(self, self._start_method)

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
        compat.init_dist_connection(self.cluster_environment, backend, **kwargs)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def barrier(self, name: str | None = None) -> None:
        if not compat.distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not compat.distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return compat.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

"""Processes started outside Lightning: torchrun, ``fabric run``, SLURM ``srun``.

The CLI reads the launcher's world before anything is built, so that a config's
``trainer.devices``/``num_nodes`` cannot disagree with the processes that actually exist.

Example:
    >>> env = detect_launch_environment(
    ...     {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    ... )
    >>> (env.launcher, env.devices, env.num_nodes)
    ('torchrun', 2, 2)
    >>> detect_launch_environment({}) is None
    True
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LaunchEnvironment", "detect_launch_environment"]


@dataclass(frozen=True)
class LaunchEnvironment:
    """Processes started outside Lightning (torchrun, ``fabric run``, SLURM ``srun``)."""

    launcher: str
    devices: int
    num_nodes: int
    world_size: int
    detail: str


def detect_launch_environment(environ: Mapping[str, str] | None = None) -> LaunchEnvironment | None:
    """Devices per node and node count from the launcher, using Lightning's own detection.

    ``TorchElasticEnvironment`` (torchrun / ``fabric run``) and ``SLURMEnvironment`` (srun) say
    whether processes were created externally; Lightning then insists that
    ``devices * num_nodes`` equals the launcher's world size, so we take both from it.
    Returns ``None`` when Lightning will launch the processes itself.
    """
    env = os.environ if environ is None else environ
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    if environ is None:
        elastic, slurm = TorchElasticEnvironment.detect(), SLURMEnvironment.detect()
    else:  # for tests: the same conditions, read from the given mapping
        elastic = "TORCHELASTIC_RUN_ID" in env
        slurm = "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")
    if elastic:
        world = int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_WORLD_SIZE", world))
        return LaunchEnvironment(
            "torchrun",
            local,
            max(1, world // local),
            world,
            f"WORLD_SIZE={world} LOCAL_WORLD_SIZE={local}",
        )
    if slurm:
        ntasks = int(env["SLURM_NTASKS"])
        nnodes = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")))
        return LaunchEnvironment(
            "slurm",
            max(1, ntasks // nnodes),
            nnodes,
            ntasks,
            f"SLURM_NTASKS={ntasks} SLURM_NNODES={nnodes}",
        )
    return None

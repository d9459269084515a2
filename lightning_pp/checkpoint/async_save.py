"""A checkpoint written in the background while training goes on (``dcp.async_save``).

Three facts shape this module:

- **The written values are those of the moment the save started.** The next optimizer steps
  change parameters and moments in place while the writer runs. DCP's ``FileSystemWriter`` is
  its own stager and copies every tensor into fresh CPU memory before ``async_save`` returns
  (torch 2.13 ``BlockingAsyncStager.stage``; DCP's generic offload, ``tensor.to("cpu")``, would
  *not* copy a CPU tensor). tests/test_checkpoint_async.py holds the writer at a gate while the
  tensors change, so a torch that stopped copying would fail there.
- **A background collective needs a process group of its own.** DCP's threaded writer gathers
  every rank's write results (then rank 0 writes ``.metadata``) while the main thread runs the
  pipeline's sends and all-reduces. Two threads issuing collectives on one group can interleave
  them differently on different ranks, so the async save uses a separate gloo group
  (:func:`checkpoint_group`, made once, collectively, on every rank).
- **Completion is rank 0's, and needs no collective.** DCP's save returns on rank 0 only after
  every rank's data files are written and ``.metadata`` is; so rank 0 alone can then write the
  completion marker and publish the directory (``finish``), in the writer's thread. Until then
  the directory is a hidden ``.partial`` one: a kill at any point leaves the previous checkpoint
  as the newest complete one.

Example::

    group = checkpoint_group()                               # once, on every rank
    pending = start_async_save(state, tmp_dir, group, finish=publish if rank == 0 else None)
    ...                                                      # training steps
    pending.wait()                                           # before the next save, at teardown
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .errors import CheckpointError

__all__ = ["PendingSave", "checkpoint_group", "start_async_save"]


def checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo group of every rank for background checkpoint collectives (collective call);
    ``None`` without an initialised process group (one process: nothing to coordinate)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")


class PendingSave:
    """One checkpoint being written: :meth:`wait` blocks until it is written and, on the rank
    that publishes it, published; a failure of the write or of ``finish`` is raised there.

    Example::

        pending = start_async_save(state, tmp, group, finish=None)
        pending.done()   # False while the writer runs
        pending.wait()   # raises CheckpointError naming the path if the write failed
    """

    def __init__(self, future: Future, path: Path, finish: Callable[[], None] | None) -> None:
        self.path = path
        self._future = future
        self._finish = finish
        self._finished = threading.Event()
        self._error: BaseException | None = None
        future.add_done_callback(self._on_written)

    def _on_written(self, future: Future) -> None:
        try:
            future.result()
            if self._finish is not None:
                self._finish()
        except BaseException as exc:  # kept for wait(): a writer thread has nobody to raise to
            self._error = exc
        finally:
            self._finished.set()

    def done(self) -> bool:
        """Written (and published, where this rank publishes) or failed."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until :meth:`done`; raise the write's (or ``finish``'s) error, naming the path."""
        if not self._finished.wait(timeout):
            raise CheckpointError(
                f"the asynchronous save of {str(self.path)!r} did not finish within {timeout} s"
            )
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(
                f"the asynchronous save of {str(self.path)!r} failed: "
                f"{type(error).__name__}: {error}"
            ) from error


def start_async_save(
    state: dict[str, Any],
    directory: str | Path,
    group: dist.ProcessGroup | None,
    *,
    finish: Callable[[], None] | None,
) -> PendingSave:
    """Write ``state``'s tensors to ``directory`` through ``dcp.async_save`` on ``group``
    (collective: every rank calls it); returns once they are copied (staged). ``finish`` runs in the
    writer's thread after this rank's DCP save returned (rank 0: publish the directory)."""
    writer = dcp.FileSystemWriter(str(directory))
    kwargs: dict[str, Any] = {"storage_writer": writer}
    if group is None:
        kwargs["no_dist"] = True
    else:
        kwargs["process_group"] = group
    with torch.no_grad():
        future = dcp.async_save(state, **kwargs)
    if not isinstance(future, Future):  # an AsyncSaveResponse (torch >= 2.9 with a stager)
        future = future.upload_completion
    return PendingSave(future, Path(directory), finish)

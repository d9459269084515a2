"""A checkpoint written in the background while training goes on (``dcp.async_save``).

Three facts shape this module:

- **The written values are those of the moment the save started.** The next optimizer steps
  change parameters and moments in place while the writer runs, so every tensor is copied
  (staged) before ``async_save`` returns: into CPU buffers that are kept for the group's next
  save (:class:`StagingBuffers`). Fresh buffers each time (what DCP's ``FileSystemWriter``
  stages into) cost page faults: 70 ms against 12 ms to copy 113 MB in one idle process, and
  up to 350 ms per save with four ranks on two cores (benchmarks/bench_async_save.py); a kept
  buffer costs one copy of the rank's share of the state in host memory. DCP's generic
  offload (``tensor.to("cpu")``) would *not* copy a CPU tensor. tests/test_checkpoint_async.py
  holds the writer at a gate while the tensors change, so a stager that stopped copying would
  fail there.
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
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..layout.topology import once_per_default_group
from .errors import CheckpointError

__all__ = ["PendingSave", "StagingBuffers", "checkpoint_group", "start_async_save"]


def checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo group of every rank for background checkpoint collectives (collective call);
    ``None`` without an initialised process group (one process: nothing to coordinate).

    One per process and default group
    (:func:`~lightning_pp.layout.topology.once_per_default_group`): a second run in the process
    (another ``Trainer``) does not leave a gloo communicator and its network thread behind."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return once_per_default_group(("checkpoint",), lambda: dist.new_group(backend="gloo"))


class StagingBuffers:
    """CPU copies of one save's tensors, reused by the next save of the same shapes.

    :meth:`stage` copies every plain tensor of a nested state dict into a buffer of the same
    path, dtype and shape (allocated at the first save, reused afterwards), so a save costs one
    ``memcpy`` of the state and no new memory. Other tensors (a ``DTensor``) are staged by DCP's
    own stager, fresh each time. The buffers hold the values until the write that reads them is
    done: :meth:`stage` refuses (returns ``None``) while they are :attr:`busy`.

    Example::

        buffers = StagingBuffers()
        staged = buffers.stage({"w": weight}, fallback=lambda sd: sd)   # copies weight
        ...                                   # the writer reads ``staged``; then:
        buffers.release()
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, ...], torch.Tensor] = {}
        self.busy = False

    @property
    def nbytes(self) -> int:
        """Host memory the kept buffers take."""
        return sum(b.untyped_storage().nbytes() for b in self._buffers.values())

    def stage(
        self, state: Mapping[str, Any], fallback: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> dict[str, Any] | None:
        """A copy of ``state`` in the kept buffers (``None`` while :attr:`busy`); marks them
        busy until :meth:`release`. ``fallback`` stages one non-plain tensor (``{"t": x}``)."""
        if self.busy:
            return None
        self.busy = True
        used: set[tuple[str, ...]] = set()

        def copy(path: tuple[str, ...], value: Any) -> Any:
            if isinstance(value, Mapping):
                return {k: copy((*path, str(k)), v) for k, v in value.items()}
            if type(value) is not torch.Tensor:  # a DTensor or another subclass: DCP's way
                return fallback({"t": value})["t"] if isinstance(value, torch.Tensor) else value
            buf = self._buffers.get(path)
            if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                buf = torch.empty(value.shape, dtype=value.dtype, device="cpu")
                self._buffers[path] = buf
            used.add(path)
            return buf.copy_(value.detach())

        try:
            with torch.no_grad():
                staged = copy((), state)
        except BaseException:
            self.busy = False
            raise
        for path in set(self._buffers) - used:  # a tensor gone from the state: free its copy
            del self._buffers[path]
        return staged

    def release(self) -> None:
        """The write that read the staged copy is over: the next save may overwrite it."""
        self.busy = False


#: one set of kept buffers per writer group (one per :class:`~.strategy_io.CheckpointSaver`),
#: dropped with the group
_BUFFERS: weakref.WeakKeyDictionary[Any, StagingBuffers] = weakref.WeakKeyDictionary()


def _buffers_of(group: dist.ProcessGroup | None) -> StagingBuffers:
    if group is None:  # one process: nothing to key the buffers on; a fresh set each save
        return StagingBuffers()
    buffers = _BUFFERS.get(group)
    if buffers is None:
        buffers = _BUFFERS[group] = StagingBuffers()
    return buffers


class _StagingWriter(dcp.FileSystemWriter):
    """DCP's file writer, staging into :class:`StagingBuffers` (fresh ones while busy)."""

    def __init__(self, path: str, buffers: StagingBuffers) -> None:
        super().__init__(path)
        self._kept = buffers
        self.staged_into: StagingBuffers | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        fallback = super().stage
        staged = self._kept.stage(state_dict, fallback)
        if staged is not None:
            self.staged_into = self._kept
            return staged
        return fallback(state_dict)  # the kept buffers are still being written: fresh ones


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
    writer = _StagingWriter(str(directory), _buffers_of(group))
    kwargs: dict[str, Any] = {"storage_writer": writer}
    if group is None:
        kwargs["no_dist"] = True
    else:
        kwargs["process_group"] = group
    try:
        with torch.no_grad():
            future = dcp.async_save(state, **kwargs)
    except BaseException:
        if writer.staged_into is not None:  # nothing will read the copy
            writer.staged_into.release()
        raise
    if not isinstance(future, Future):  # an AsyncSaveResponse (torch >= 2.9 with a stager)
        future = future.upload_completion
    if writer.staged_into is not None:
        kept = writer.staged_into
        future.add_done_callback(lambda _: kept.release())
    return PendingSave(future, Path(directory), finish)

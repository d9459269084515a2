"""Saving the DCP format: every rank passes what it holds, rank 0 writes the rest and the marker.

Steps (all collective; a failure anywhere raises on every rank and removes the hidden directory):

1. rank 0 creates ``.NAME.partial-TOKEN`` (:func:`~.directory.new_partial_dir`);
2. each rank splits its Lightning dict into DCP's tensors and a description
   (:func:`~.dcp_meta.split_rank_state`); the descriptions are gathered and rank 0 writes the
   metadata (:mod:`.meta_codec`) into the hidden directory;
3. ``dcp.save``: each rank passes its names (a tied copy only by the rank holding the canonical
   one); ``dp`` replicas pass the same names and DCP's planner keeps one writer per name;
4. rank 0 writes the manifest LAST (the marker), then renames the directory into place; every
   rank waits for that.

:func:`start_async_dcp_checkpoint` does 1-2 in the caller's thread and 3-4 in DCP's writer
thread (``dcp.async_save`` through :func:`~.async_save.start_async_save`): it returns once the
tensors are copied, and the returned :class:`~.async_save.PendingSave` is waited for before the
next save and at teardown.

Example::

    save_dcp_checkpoint(ckpt, "ckpts/step=5.ckpt", canonical=canonical, layout={"pp": 2})
    pending = start_async_dcp_checkpoint(ckpt, path, canonical=canonical, layout=layout,
                                         writer_group=group)   # group = checkpoint_group()
    ...; pending.wait()
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .agree import broadcast_first, gather_all, group_rank, raise_together, report_errors
from .async_save import PendingSave, start_async_save
from .dcp_meta import FORMAT, VERSION, merge_descriptions, split_rank_state
from .directory import new_partial_dir, publish
from .errors import CheckpointError
from .manifest import write_manifest
from .meta_codec import write_meta

__all__ = ["save_dcp_checkpoint", "start_async_dcp_checkpoint"]

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for the default group


@dataclass
class _Prepared:
    """A save after steps 1-2: where it writes, and this rank's tensors for DCP."""

    path: Path
    tmp: Path
    rank: int
    state: dict[str, Any]
    what: str

    def cleanup(self) -> None:
        if self.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def finish(self) -> None:
        """Rank 0, once every rank's data is written: the marker last, then the rename."""
        write_manifest(self.tmp, {"format": FORMAT, "version": VERSION})
        publish(self.tmp, self.path)


def _prepare(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    canonical: Mapping[str, str],
    layout: Mapping[str, Any],
    process_group: ProcessGroup,
) -> _Prepared:
    """Steps 1-2 (collective): the hidden directory, this rank's DCP state, the metadata."""
    path = Path(path)
    rank = group_rank(process_group)
    what = f"saving checkpoint {str(path)!r} failed"
    made: tuple[str | None, str | None] = (None, None)
    if rank == 0:
        try:
            made = (str(new_partial_dir(path)), None)
        except Exception as exc:
            made = (None, f"{type(exc).__name__}: {exc}")
    tmp_name, error = broadcast_first(made, process_group)
    if error is not None:
        raise CheckpointError(f"{what}: rank 0: {error}")
    prep = _Prepared(path, Path(str(tmp_name)), rank, {}, what)
    desc: dict[str, Any] = {"model": {}}
    try:
        prep.state, desc = split_rank_state(checkpoint, canonical)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    descs = gather_all((desc, error), process_group)
    report_errors([e for _, e in descs], what, prep.cleanup)
    if rank == 0:  # now, not in a writer thread: Lightning's dict may change after we return
        try:
            meta = {
                "format": FORMAT,
                "version": VERSION,
                "layout": dict(layout),
                "tied": sorted([c, n] for n, c in canonical.items() if n != c),
                **merge_descriptions([d for d, _ in descs]),
                "lightning": checkpoint,
            }
            write_meta(prep.tmp, meta)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    raise_together(error if rank == 0 else None, process_group, what, prep.cleanup)
    return prep


def save_dcp_checkpoint(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    *,
    canonical: Mapping[str, str],
    layout: Mapping[str, Any],
    process_group: ProcessGroup = None,
) -> Path:
    """Collective: every rank calls it with its own Lightning ``checkpoint`` dict.

    Args:
        checkpoint: Lightning's dict; ``state_dict`` holds this rank's tensors and
            ``optimizer_states`` the dicts of :func:`~.by_name.optimizer_state_by_name` (absent
            for a weights-only save). Consumed. Rank 0's other entries are the metadata.
        path: the final directory (the same on every rank).
        canonical: tied member name -> canonical name (:func:`~.by_name.tied_canonical_names`).
        layout: the run's shape (pp, vpp, dp, layer ranges...), recorded in the metadata.
        process_group: the ranks that save together (default: all).

    Returns the final directory. Raises :class:`CheckpointError` on every rank if any rank
    failed; the hidden ``.NAME.partial-*`` directory is then removed and ``path`` untouched.

    Example::

        ckpt = {"state_dict": module.state_dict(), "global_step": 5,
                "optimizer_states": [optimizer_state_by_name(opt, module, canonical)]}
        save_dcp_checkpoint(ckpt, "ckpts/step=5.ckpt", canonical=canonical, layout={"pp": 2})
    """
    prep = _prepare(checkpoint, path, canonical, layout, process_group)
    error = None
    try:  # DCP gathers every rank's write result: a failure raises on every rank
        with warnings.catch_warnings():  # one process (no process group) is meant, not a slip
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            writer = dcp.FileSystemWriter(str(prep.tmp))
            dcp.save(prep.state, storage_writer=writer, process_group=process_group)
    except CheckpointException as exc:  # a BaseException: each failed rank's error, in one line
        error = "; ".join(
            f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(exc.failures.items())
        )
        error = f"the DCP write failed ({error})"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    raise_together(error, process_group, prep.what, prep.cleanup)
    if prep.rank == 0:
        try:
            prep.finish()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    # also the barrier: nobody returns before the directory is published
    raise_together(error, process_group, prep.what, prep.cleanup)
    return prep.path


def start_async_dcp_checkpoint(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    *,
    canonical: Mapping[str, str],
    layout: Mapping[str, Any],
    writer_group: ProcessGroup,
    process_group: ProcessGroup = None,
) -> PendingSave:
    """Collective: :func:`save_dcp_checkpoint` whose tensor write runs in the background.

    Returns once every rank's tensors are copied (so training may change them); the write, then
    on rank 0 the marker and the rename, run in DCP's writer thread, whose collectives use
    ``writer_group`` (:func:`~.async_save.checkpoint_group`: a group no other thread uses).
    The previous save's :class:`~.async_save.PendingSave` must have been waited for (it may
    still write into the hidden directory this one replaces). A failure of the background part
    is raised by :meth:`~.async_save.PendingSave.wait`, naming the path; ``path`` then keeps
    its previous checkpoint, if any.

    Example::

        group = checkpoint_group()      # once, on every rank
        pending = start_async_dcp_checkpoint(ckpt, path, canonical=canonical, layout=layout,
                                             writer_group=group)
        ...                             # training steps
        pending.wait()
    """
    prep = _prepare(checkpoint, path, canonical, layout, process_group)
    finish = prep.finish if prep.rank == 0 else None
    try:
        return start_async_save(prep.state, prep.tmp, writer_group, finish=finish)
    except BaseException as exc:  # staging failed: nothing runs in the background
        prep.cleanup()
        raise CheckpointError(f"{prep.what}: {type(exc).__name__}: {exc}") from exc

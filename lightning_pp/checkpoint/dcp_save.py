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
next save and at teardown. Before the copy, the ``dp`` replicas split their identical tensors
among themselves (:func:`split_replicas`): each rank copies only what it will write, as DCP's
planner would have decided after the copy (with dp=2, half the copy; the files are the same).

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .agree import gather_all, group_rank, raise_together, report_errors
from .async_save import PendingSave, start_async_save
from .dcp_meta import FORMAT, VERSION, merge_descriptions, split_rank_state
from .directory import new_partial_dir, publish
from .errors import CheckpointError
from .manifest import write_manifest
from .meta_codec import write_meta

__all__ = ["save_dcp_checkpoint", "split_replicas", "start_async_dcp_checkpoint"]

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for the default group
Key = tuple[str, ...]  # a tensor's path in a rank's DCP state, e.g. ("state_dict", "layers.1.w")


def plain_tensor_sizes(state: Mapping[str, Any], path: Key = ()) -> dict[Key, int]:
    """Bytes of every plain tensor of a nested DCP state, by path. A ``DTensor`` (or any other
    tensor subclass) is left out: ranks holding one name hold different shards of it."""
    out: dict[Key, int] = {}
    for k, v in state.items():
        if isinstance(v, Mapping):
            out.update(plain_tensor_sizes(v, (*path, str(k))))
        elif type(v) is torch.Tensor:
            out[(*path, str(k))] = v.numel() * v.element_size()
    return out


def split_replicas(sizes: Sequence[Mapping[Key, int]]) -> list[set[Key]]:
    """Which plain tensors each rank writes, from every rank's :func:`plain_tensor_sizes`.

    A path several ranks hold (``dp`` replicas: bitwise-equal copies) goes to one of them, the
    one with the fewest bytes so far, largest tensors first, ties to the lower rank: every rank
    computes the same answer. DCP's save planner would drop the same duplicates after staging
    (``dedup_save_plans``); deciding first spares the other replicas the copy.

    Example::

        split_replicas([{("w",): 8, ("b",): 4}, {("w",): 8, ("b",): 4}])
        # -> [{("w",)}, {("b",)}]
    """
    load = [0] * len(sizes)
    owned: list[set[Key]] = [set() for _ in sizes]
    every = {key: n for s in sizes for key, n in s.items()}
    for key in sorted(every, key=lambda k: (-every[k], k)):
        holders = [r for r, s in enumerate(sizes) if key in s]
        r = min(holders, key=lambda r: (load[r], r))
        owned[r].add(key)
        load[r] += every[key]
    return owned


def _keep_only(state: Mapping[str, Any], drop: set[Key], path: Key = ()) -> dict[str, Any]:
    """``state`` without the paths in ``drop`` (and without the containers that leaves empty)."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        here = (*path, str(k))
        if isinstance(v, Mapping):
            kept = _keep_only(v, drop, here)
            if kept or not v:
                out[k] = kept
        elif here not in drop:
            out[k] = v
    return out


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
    split: bool = False,
) -> _Prepared:
    """Steps 1-2 (collective): the hidden directory, this rank's DCP state, the metadata;
    ``split``: this rank's state keeps only the replicated tensors it writes
    (:func:`split_replicas`)."""
    path = Path(path)
    rank = group_rank(process_group)
    what = f"saving checkpoint {str(path)!r} failed"
    made: str | None = None
    error: str | None = None
    if rank == 0:
        try:
            made = str(new_partial_dir(path))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    state: dict[str, Any] = {}
    desc: dict[str, Any] = {"model": {}}
    sizes: dict[Key, int] = {}
    if error is None:
        try:
            state, desc = split_rank_state(checkpoint, canonical)
            sizes = plain_tensor_sizes(state) if split else {}
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    # One exchange carries rank 0's hidden directory and every rank's description and error:
    # each collective costs every rank a wait (tens of ms on an oversubscribed host).
    descs = gather_all((made, desc, error, sizes), process_group)
    tmp_name = descs[0][0]  # None when making it was rank 0's error: nothing to clean up
    prep = _Prepared(path, Path(tmp_name), rank, state, what) if tmp_name else None
    report_errors([e for _, _, e, _ in descs], what, prep.cleanup if prep else None)
    assert prep is not None  # rank 0's failure to make it was reported, and raised, above
    if split:
        mine = split_replicas([s for _, _, _, s in descs])[rank]
        prep.state = _keep_only(prep.state, set(sizes) - mine)
    if rank == 0:  # now, not in a writer thread: Lightning's dict may change after we return
        try:
            meta = {
                "format": FORMAT,
                "version": VERSION,
                "layout": dict(layout),
                "tied": sorted([c, n] for n, c in canonical.items() if n != c),
                **merge_descriptions([d for _, d, _, _ in descs]),
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
    prep = _prepare(checkpoint, path, canonical, layout, process_group, split=True)
    finish = prep.finish if prep.rank == 0 else None
    try:
        return start_async_save(prep.state, prep.tmp, writer_group, finish=finish)
    except BaseException as exc:  # staging failed: nothing runs in the background
        prep.cleanup()
        raise CheckpointError(f"{prep.what}: {type(exc).__name__}: {exc}") from exc

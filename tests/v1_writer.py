"""The version-1 checkpoint writer, kept with the tests of the version-1 reader.

Saves write the DCP format now (lightning_pp/checkpoint/dcp_format.py); the package still reads
version-1 directories for one release (lightning_pp/checkpoint/sharded.py). The tests need real
version-1 directories to read, so the writer that made them lives here: the layout it writes
(``model.ppN.pt``, ``optim.ppN.pt``, ``meta.pt``, ``index.json`` written last, then a rename) is
what :func:`lightning_pp.checkpoint.sharded.read_index` and the loaders expect.

Example::

    save_sharded_checkpoint(ckpt, tmp / "step=5.ckpt", tag="pp0", canonical={}, layout=layout)
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor

from lightning_pp.checkpoint import sharded
from lightning_pp.checkpoint.directory import fsync_dir, new_partial_dir, publish
from lightning_pp.checkpoint.errors import CheckpointError
from lightning_pp.checkpoint.sharded import FORMAT, INDEX_FILE, META_FILE, VERSION, _dist

__all__ = ["save_sharded_checkpoint"]


def _broadcast(obj: Any) -> Any:
    if not _dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier(barrier: Callable[[], None] | None) -> None:
    if barrier is not None:
        barrier()
    elif _dist():
        dist.barrier()


def save_sharded_checkpoint(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    *,
    tag: str | None,
    canonical: Mapping[str, str],
    layout: Mapping[str, Any],
    barrier: Callable[[], None] | None = None,
) -> Path:
    """Collective: every rank calls it with its own ``checkpoint`` dict (Lightning's format).

    Args:
        checkpoint: Lightning's dict; ``state_dict`` holds this rank's tensors and
            ``optimizer_states`` the dicts of :func:`optimizer_state_by_name`. Consumed.
        path: the final directory (the same on every rank).
        tag: file tag of this rank's shard (``"pp2"``), or ``None`` when this rank writes no
            tensors (a data-parallel replica other than ``dp_rank == 0``).
        canonical: tied member name -> canonical name (:func:`tied_canonical_names`).
        layout: shape of the run (pp, vpp, dp, layer ranges), recorded in the index.

    Returns the final directory. Raises on every rank if any rank failed to write its part.
    """
    path = Path(path)
    rank = dist.get_rank() if _dist() else 0
    tmp: Path | None = None
    if rank == 0:
        tmp = new_partial_dir(path)
    tmp = Path(_broadcast(str(tmp)))

    state_dict = checkpoint.pop("state_dict", {})
    optim_states = checkpoint.pop("optimizer_states", None)
    report: dict[str, Any] = {"rank": rank, "error": None, "tag": tag}
    try:
        if tag is not None:
            # a tied member is stored once, under its canonical name, by the rank holding that
            model = {
                k: v.detach().cpu() if isinstance(v, Tensor) else v
                for k, v in state_dict.items()
                if canonical.get(k, k) == k
            }
            sharded._save_file(model, tmp / f"model.{tag}.pt")
            report["model"] = sorted(model)
            if optim_states is not None:
                optim = [_to_cpu(s) for s in optim_states]
                sharded._save_file(optim, tmp / f"optim.{tag}.pt")
                report["optim"] = sorted({n for s in optim for n in s["group_of"]})
        if rank == 0:
            sharded._save_file(checkpoint, tmp / META_FILE)
    except Exception as exc:  # reported to every rank below: nobody blocks on a failed peer
        report["error"] = f"{type(exc).__name__}: {exc}"
    reports = sharded._all_gather(report)
    errors = [f"rank {r['rank']}: {r['error']}" for r in reports if r["error"]]
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint {str(path)!r} failed: " + "; ".join(errors))

    if rank == 0:
        writers = [r for r in reports if r["tag"] is not None]
        index = {
            "format": FORMAT,
            "version": VERSION,
            "complete": True,
            "layout": dict(layout),
            "tied": sorted({(c, n) for n, c in canonical.items() if n != c}),
            "meta_file": META_FILE,
            "model_files": {f"model.{r['tag']}.pt": r["model"] for r in writers},
            "optim_files": {f"optim.{r['tag']}.pt": r["optim"] for r in writers if "optim" in r},
        }
        _write_index(tmp, index)
        publish(tmp, path)
    _barrier(barrier)  # nobody returns before the final directory exists
    return path


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _write_index(directory: Path, index: dict[str, Any]) -> None:
    tmp = directory / f"{INDEX_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / INDEX_FILE)
    fsync_dir(directory)

"""Every rank of a checkpoint save or load decides together: all go on, or all raise.

A rank that raised alone would leave the others waiting in the next collective (a hang, not an
error), and a load that failed on one rank after others had changed their weights would leave a
model half old, half new. So each step that can fail locally ends with an exchange of the
ranks' errors, and every rank raises the same :class:`CheckpointError` naming the failed ranks.
Without an initialised process group (one process) each helper is the identity.

Example::

    error = None
    try:
        prepare()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    raise_together(error, group, f"loading checkpoint {path!r} failed")
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.distributed as dist

from .errors import CheckpointError

__all__ = [
    "broadcast_first",
    "check_all_claimed",
    "error_text",
    "gather_all",
    "group_rank",
    "raise_together",
    "report_errors",
]

ProcessGroup = Any  # dist.ProcessGroup, or None for the default group


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_rank(group: ProcessGroup = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if _distributed() else 0


def gather_all(obj: Any, group: ProcessGroup = None) -> list[Any]:
    """Every rank's ``obj``, in group-rank order (collective; objects are pickled in memory
    between the job's own processes, never read from a checkpoint)."""
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_first(obj: Any, group: ProcessGroup = None) -> Any:
    """Group rank 0's ``obj`` on every rank (collective)."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def error_text(exc: BaseException) -> str:
    """What a rank reports of its failure: our own message as it is (it names the file or the
    tensor), any other exception with its type."""
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def check_all_claimed(saved: Iterable[str], claimed: Iterable[str], where: str) -> None:
    """A strict load: every saved tensor is one some rank of this model asked for."""
    unused = sorted(set(saved) - set(claimed))
    if unused:
        raise CheckpointError(
            f"{where}: {len(unused)} saved tensor(s) belong to no rank of this model: "
            f"{unused[:5]} (set LightningModule.strict_loading=False to allow)"
        )


def raise_together(
    error: str | None,
    group: ProcessGroup,
    what: str,
    cleanup: Callable[[], None] | None = None,
) -> None:
    """Raise :class:`CheckpointError` on every rank if any rank's ``error`` is not ``None``
    (collective): ``"{what}: rank 1: ...; ranks 0, 3: ..."`` (ranks with the same error, such
    as one DCP reported to all, are named together). ``cleanup`` runs first, on every rank."""
    report_errors([e for e in gather_all(error, group)], what, cleanup)


def report_errors(
    errors: Sequence[str | None], what: str, cleanup: Callable[[], None] | None = None
) -> None:
    """:func:`raise_together` for errors already gathered (``errors[r]``: rank r's or None)."""
    by_message: dict[str, list[int]] = {}
    for r, e in enumerate(errors):
        if e:
            by_message.setdefault(e, []).append(r)
    if not by_message:
        return
    if cleanup is not None:
        cleanup()
    parts = [
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {e}"
        for e, rs in by_message.items()
    ]
    raise CheckpointError(f"{what}: " + "; ".join(parts))

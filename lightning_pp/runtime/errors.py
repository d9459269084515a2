"""What a failure says, and the one key that tells every rank about it.

- :class:`PipelineAborted`: this rank stopped because another one failed first (named);
- :class:`PipelineHang`: the watchdog fired on this rank (what it waited for, the others' state);
- :func:`report_failure`: the first failing rank writes ``lightning_pp/abort`` into the job's
  c10d store (``compare_set``: exactly one rank is the origin); :func:`decode_origin` reads it.

The watchers that act on the key live beside this module: :mod:`.failure` (every blocking wait
of the pipeline: abort channel and hang watchdog) and :mod:`.heartbeats` (process liveness).

Example::

    report_failure(store, rank=2, where="F mb=3 chunk=0", error=exc)   # the first one wins
    origin = decode_origin(store.get(abort_key()).decode())             # {"rank": 2, ...}
"""

from __future__ import annotations

import json
import time
from typing import Any

__all__ = [
    "DEFAULT_EXIT_GRACE",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_POLL_INTERVAL",
    "DEFAULT_WATCHDOG_TIMEOUT",
    "VANISHED",
    "PipelineAborted",
    "aborted_message",
    "PipelineHang",
    "abort_key",
    "decode_origin",
    "origin_summary",
    "report_failure",
]


DEFAULT_WATCHDOG_TIMEOUT = 300.0
"""Seconds a rank may stay blocked on one point-to-point wait before the watchdog fires."""


DEFAULT_POLL_INTERVAL = 0.05
"""Seconds between two checks of the abort key while a wait is blocked."""


DEFAULT_HEARTBEAT_INTERVAL = 1.0
"""Seconds between two heartbeats of a :class:`ProcessWatcher` (and its checks of the others)."""


DEFAULT_EXIT_GRACE = 3.0
"""Seconds a process may stay blocked outside a watched wait after another rank failed, before
its :class:`ProcessWatcher` ends it."""


_NAMESPACE = "lightning_pp"


VANISHED = "RankVanished"
"""The ``type`` of an abort published for a rank that stopped without reporting anything."""


class PipelineAborted(RuntimeError):
    """This rank stopped because another rank failed first.

    ``rank``: this rank. ``origin_rank``: the rank that failed (``-1`` if unknown).
    ``origin``: what the origin published (``rank``, ``where``, ``type``, ``message``). Its full
    error and traceback are printed by the origin itself; this message names it, without
    repeating the text, so that the job's log shows the cause once.
    """

    def __init__(self, message: str, rank: int, origin_rank: int, origin: dict) -> None:
        super().__init__(message)
        self.rank = rank
        self.origin_rank = origin_rank
        self.origin = origin


class PipelineHang(RuntimeError):
    """The watchdog fired: this rank waited longer than ``watchdog_timeout`` on one transfer.

    ``states`` maps global rank -> the state that rank last published (``pp_rank``, ``index``,
    ``action``, ``what``, ``age``), used by the engine to mark the schedule grid.
    """

    def __init__(self, message: str, rank: int, what: str, states: dict[int, dict]) -> None:
        super().__init__(message)
        self.rank = rank
        self.what = what
        self.states = states


def decode_origin(raw: str) -> dict:
    try:
        origin = json.loads(raw)
        if isinstance(origin, dict):
            return origin
    except ValueError:
        pass
    return {"rank": -1, "where": "", "type": "", "message": raw}


def origin_summary(origin: dict) -> str:
    """``rank 1: F mb=0 chunk=0: ValueError``: who, where, what kind, but not the message."""
    parts = [f"rank {origin.get('rank', -1)}"]
    parts += [origin[k] for k in ("where", "type") if origin.get(k)]
    return ": ".join(parts)


def aborted_message(rank: int, origin: dict, doing: str) -> str:
    """What a rank stopped by another rank's failure says, in one line: ``rank 2: stopped
    {doing} because rank 0 vanished: <what its watcher saw>`` (a vanished rank prints nothing
    itself, so everything is said here), or ``... because rank 1 failed first [rank 1: F mb=0
    chunk=0: ValueError]; that rank prints the error and its traceback``."""
    origin_rank = int(origin.get("rank", -1))
    who = f"rank {origin_rank}" if origin_rank >= 0 else "another rank"
    if origin.get("type") == VANISHED:
        return f"rank {rank}: stopped {doing} because {who} vanished: {origin.get('message', '')}"
    return (
        f"rank {rank}: stopped {doing} because {who} failed first [{origin_summary(origin)}]; "
        f"that rank prints the error and its traceback"
    )


def report_failure(
    store: Any,
    rank: int,
    where: str,
    error: BaseException | str,
    *,
    kind: str = "",
    extra: dict | None = None,
) -> bool:
    """Write the abort key for ``rank`` unless it is already set; True if this call set it.

    ``where`` names what failed (``"F mb=3 chunk=0"``, ``"on_train_batch_end"``); ``error`` is
    the exception (or a text). Call it from any place that catches a rank's failure outside the
    engine, e.g. a strategy's ``on_exception``, so the other ranks stop instead of waiting.

    Example::

        store = torch.distributed.distributed_c10d._get_default_store()
        report_failure(store, dist.get_rank(), "on_train_batch_end", exc)
    """
    if store is None:
        return False
    if isinstance(error, BaseException):
        kind, message = type(error).__name__, str(error)
    else:
        message = str(error)
    text = json.dumps(
        {
            "rank": rank,
            "where": where,
            "type": kind,
            "message": message[:2000],
            "t": time.time(),
            **(extra or {}),
        }
    )
    try:
        current = store.compare_set(abort_key(), "", text)
    except Exception:
        return False
    if isinstance(current, bytes):
        current = current.decode(errors="replace")
    return current == text


def abort_key() -> str:
    """The store key the first failing rank writes (its origin record, JSON)."""
    return f"{_NAMESPACE}/abort"

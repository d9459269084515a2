"""What the kernel says about a process on this host: gone, a zombie, stopped, running.

A channel that needs no store and no socket: a rank's watcher (:mod:`.heartbeats`) and the
job's store process (:mod:`.store_host`) read ``/proc/<pid>/stat`` of the processes they know
to tell a killed or stopped process from a slow one.

Example::

    state = process_state(pid)          # "R", "S", "T" (stopped), "Z" (zombie), None (gone)
    if state in STOPPED: ...
    print(STATE_WORDS.get(state, "running"))
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["GONE", "STATE_WORDS", "STOPPED", "is_gone", "pid_namespace", "process_state"]


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...)
    or ``None`` when there is no such process (read from ``/proc``; ``"?"`` elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[1].split()[0]  # the command name may contain spaces


STATE_WORDS: dict[str | None, str] = {
    "T": "stopped (SIGSTOP or a debugger)",
    "t": "stopped by a tracer",
    "D": "in uninterruptible I/O",
    "Z": "dead (a zombie)",
    None: "gone",
}
"""Words for the states worth reporting (a running or sleeping process is not reported)."""


STOPPED = ("T", "t")
"""States of a process that cannot react to any signal but SIGKILL until it is continued."""


GONE = (None, "Z")
"""States of a process that has ended (a zombie has; only its parent's bookkeeping is left)."""


def is_gone(pid: int) -> bool:
    """Whether ``pid`` has ended (absent from the process table, or a zombie)."""
    return process_state(pid) in GONE


def pid_namespace() -> str:
    """This process's pid namespace (``pid:[4026531836]``), ``""`` where unknown: two processes
    with the same host name see each other's pids only when this matches (containers)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""

"""Child processes that end with the process that started them, however that one ended.

A rank that leads a process group of its own (``setsid``, so that its parent can kill it with
everything it started) is not taken along when its parent dies outright: SIGKILL, the OOM
killer, a closed terminal. It then waits in its next collective until the process group's
timeout, or computes on for as long as its work takes, holding its memory, its port and the
forkserver that forked it. The fix needs no signal handler in the parent (a SIGKILL runs
none): the parent keeps one end of a pipe on which nothing is ever sent, each child watches
the other end, and the kernel closes the parent's end when the parent dies, whatever killed it.

Example (a world of ranks forked from a multiprocessing context ``ctx``)::

    for_children, keep = owner_link(ctx)
    procs = [ctx.Process(target=rank_main, args=(r, for_children)) for r in range(4)]
    for p in procs:
        p.start()
    for_children.close()  # the children hold their copies; the parent keeps only ``keep``
    try:
        ...  # wait for the world
    finally:
        keep.close()

    def rank_main(rank, link):
        die_with_owner(link)  # first thing in the child
        ...
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

__all__ = ["die_with_owner", "owner_link"]


def owner_link(ctx: Any) -> tuple[Any, Any]:
    """``(for the children, for the parent)``: a one-way pipe from ``ctx`` (a multiprocessing
    context, so that its end can be handed to children that context starts). The parent keeps
    its end open for as long as the children may live; nothing is ever sent on it."""
    return ctx.Pipe(duplex=False)


def die_with_owner(link: Any) -> None:
    """In a child, first thing: lead a process group of its own (``setsid``), and kill that
    group (the child and whatever it started) once the parent's end of ``link``
    (:func:`owner_link`) closes. A daemon thread waits on the pipe; it wakes only at end of
    file, which the kernel delivers when the last holder of the parent's end is gone."""
    try:
        os.setsid()
    except OSError:  # already a group leader
        pass

    def watch() -> None:
        try:
            link.recv()  # returns only at end of file (raises): the parent never writes
        except (EOFError, OSError):
            pass
        if os.getpgid(0) == os.getpid():  # this process leads its group (setsid above)
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="lightning-pp-die-with-owner", daemon=True).start()

"""The job's c10d store in a process of its own, so that no rank takes the store down with it.

Under ``torch.distributed``'s ``env://`` rendezvous (Lightning's launcher ``devices=N``, SLURM
tasks, the spawn launcher) rank 0 hosts the job's TCPStore inside its own process, and every
failure channel of the job goes through that store: heartbeats, the abort key, the watchdog's
reports. A rank 0 that is stopped (SIGSTOP, a debugger) freezes every store call of the job, so
nobody can even say what happened; a rank 0 that is killed takes the store down, and every
survivor's next store call fails with a C++ warning and its stack frames. torchrun has neither
problem: its agent, not a rank, hosts the store.

:class:`StoreHost` gives the other launchers the same: global rank 0 starts a small process
(``python -m lightning_pp.runtime.store_host``) that does nothing but serve the store, and every
rank, rank 0 included, connects to it as a client (:func:`connect_store`). Rank 0 is then a rank
like any other to the watchers (:mod:`.heartbeats`): stopped, it is named after
``watchdog_timeout`` and killed; killed, it is named at once.

The store process leaves by itself. While the process that started it lives (its stdin pipe is
open and it is still its parent) it only serves. Then it serves on until every rank is over: a
rank on its host when its process is gone, a rank elsewhere when its heartbeat says it finished
or has not moved for ``stale`` seconds, a rank that never sent a heartbeat at once (without
rank 0 it can never join the job). SIGTERM (a scheduler's preemption reaching the whole process
group) means the same, since the ranks are saving and still need it; SIGINT (Ctrl-C) is left to
the ranks.

Example (what :class:`~lightning_pp.strategy.process_group.ProcessGroupStrategy` does)::

    if global_rank == 0:
        host = StoreHost.start("127.0.0.1", 29500, world_size=4, stale=310.0)
    store = connect_store("127.0.0.1", 29500, timeout=timedelta(minutes=30))
    dist.init_process_group("gloo", rank=global_rank, world_size=4, store=store)
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from .heartbeats import ProcessWatcher
from .local_process import is_gone, pid_namespace

__all__ = ["PREFIX_KEY", "StoreHost", "connect_store", "publish_key_prefix"]

PREFIX_KEY = "lightning_pp/store_host/prefix"
"""Where rank 0 tells the store process under which prefix the ranks' keys are (see
:func:`publish_key_prefix`)."""

STARTUP_TIMEOUT = 120.0
"""Seconds rank 0 waits for the store process to listen (it imports torch: slow on a loaded
machine, and the other ranks are importing at the same moment)."""

_HOSTS: list[StoreHost] = []  # alive as long as this process: the pipe must stay open


class StoreHost:
    """The store process of a job, as seen from global rank 0 that started it.

    :meth:`start` returns once the store listens on ``port`` (or raises, naming the port and
    the cause); the process then outlives rank 0 and leaves once the ranks have (see the module
    docstring). ``pid`` is the store process's pid.

    Example::

        host = StoreHost.start("127.0.0.1", 29500, world_size=4, stale=310.0)
        print(host.describe())   # "lightning-pp's store process (pid 4242, port 29500)"
    """

    def __init__(self, proc: subprocess.Popen, address: str, port: int) -> None:
        self.proc = proc
        self.address = address
        self.port = port

    @property
    def pid(self) -> int:
        return self.proc.pid

    def describe(self) -> str:
        return f"lightning-pp's store process (pid {self.pid}, port {self.port})"

    @classmethod
    def start(
        cls,
        address: str,
        port: int,
        world_size: int,
        *,
        stale: float,
        startup_timeout: float = STARTUP_TIMEOUT,
    ) -> StoreHost:
        """Start the store process for ``world_size`` ranks on ``port`` and wait until it
        listens. ``stale``: seconds without a heartbeat after which a rank on another host is
        taken as gone once rank 0 has left."""
        env = dict(os.environ)
        # The package as this process imported it, whatever the child's working directory.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        cmd = [
            sys.executable,
            "-m",
            __name__,
            "--address",
            address,
            "--port",
            str(port),
            "--world-size",
            str(world_size),
            "--stale",
            f"{stale:g}",
        ]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        line = _read_line(proc.stdout, startup_timeout)
        proc.stdout.close()
        if line == "ready":
            host = cls(proc, address, port)
            _HOSTS.append(host)
            return host
        if line.startswith("error "):
            why = line[len("error ") :]
        elif proc.poll() is None:
            why = f"it did not say it listens within {startup_timeout:g} s"
        else:
            why = f"it exited with code {proc.returncode} (its error is printed above)"
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        in_use = "EADDRINUSE" in why or "address already in use" in why
        fix = (
            "set MASTER_PORT to a free port, or unset it to let Lightning pick one"
            if in_use
            else "see the error above; a store process can be started by hand with "
            f"`{sys.executable} -m {__name__} --address {address} --port {port} "
            f"--world-size {world_size} --stale 60` to see it"
        )
        raise RuntimeError(
            f"lightning-pp could not start the job's store on port {port} (MASTER_PORT): "
            f"{why}. Fix: {fix}"
        )


def _read_line(stream: IO[bytes], timeout: float) -> str:
    """One line from ``stream`` within ``timeout`` seconds ("" on EOF or timeout)."""
    deadline = time.monotonic() + timeout
    data = b""
    fd = stream.fileno()
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return ""
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def connect_store(address: str, port: int, timeout: timedelta | None = None) -> Any:
    """A client of the job's store at ``address:port`` (retries until the store listens, up to
    ``timeout``, torch's process-group default when ``None``)."""
    from torch.distributed import TCPStore
    from torch.distributed.constants import default_pg_timeout

    return TCPStore(
        address,
        port,
        None,
        False,
        timeout=timeout if timeout is not None else default_pg_timeout,
        wait_for_workers=False,
    )


def publish_key_prefix(store: Any, default_store: Any, candidates: Sequence[str]) -> str | None:
    """Tell the store process (through ``store``, the job's store as :func:`connect_store`
    returned it) the prefix under which ``default_store`` (the default process group's view of
    it, where the heartbeats are written) keeps its keys: the first of ``candidates`` (e.g.
    ``"<group name>/"``, ``""``) under which a probe written through ``default_store`` is
    found. Returns it (``None``: none matched; the store process then sees no heartbeats and
    leaves as soon as rank 0 has).

    Why: ``init_process_group(store=...)`` hands the group a ``PrefixStore`` over the store, and
    torch names that prefix itself."""
    probe = "lightning_pp/store_host/probe"
    default_store.set(probe, "1")
    from torch.distributed import PrefixStore

    for prefix in candidates:
        view = PrefixStore(prefix, store) if prefix else store
        if view.check([probe]):
            store.set(PREFIX_KEY, prefix)
            return prefix
    return None


# ------------------------------------------------------------------------------- the process
class _Leave(Exception):
    """SIGTERM while the starter lives: serve on until the ranks are over."""


def _serve_while_starter_lives(parent: int) -> None:
    """Return when the process that started this one is gone: its end of the stdin pipe closed,
    or this process was re-parented (a process forked by rank 0, a data loader worker, may
    hold the pipe open for a while after rank 0 died)."""
    stdin = sys.stdin.fileno()
    while os.getppid() == parent:
        if select.select([stdin], [], [], 1.0)[0] and not os.read(stdin, 4096):
            return


def _serve_until_ranks_are_over(store: Any, world_size: int, stale: float, parent: int) -> None:
    """Serve until no rank needs the store any more (see the module docstring)."""
    host, pidns = socket.gethostname(), pid_namespace()
    if store.check([PREFIX_KEY]):
        from torch.distributed import PrefixStore

        prefix = store.get(PREFIX_KEY).decode()
        store = PrefixStore(prefix, store) if prefix else store
    changed: dict[int, tuple[bytes, float]] = {}
    while True:
        now = time.monotonic()
        # The starter (rank 0) still alive, after a SIGTERM: it still needs the store.
        pending = ["starter"] if os.getppid() == parent else []
        for r in range(world_size):
            key = ProcessWatcher.heartbeat_key(r)
            if not store.check([key]):
                continue  # never joined the job: without rank 0 it never will
            raw = store.get(key)
            if r not in changed or changed[r][0] != raw:
                changed[r] = (raw, now)
            try:
                value = json.loads(raw.decode())
            except ValueError:
                continue
            if value.get("host") == host and value.get("pidns", "") == pidns:
                over = is_gone(int(value.get("pid", -1)))
            else:
                over = bool(value.get("done")) or now - changed[r][1] > stale
            if not over:
                pending.append(str(r))
        if not pending:
            return
        time.sleep(0.25)


def _listen(address: str, port: int) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(
        address, port, None, True, timeout=timedelta(seconds=60), wait_for_workers=False
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The store process: listen, say ``ready`` (or ``error <why>``) on stdout, serve, and
    leave when no rank needs the store any more."""
    parser = argparse.ArgumentParser(prog="python -m lightning_pp.runtime.store_host")
    parser.add_argument("--address", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--stale", type=float, required=True)
    args = parser.parse_args(argv)
    parent = os.getppid()
    # Ctrl-C reaches the whole process group: rank 0 handles it; this process must not print a
    # KeyboardInterrupt of its own (it leaves once rank 0 and the others have).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        store = _listen(args.address, args.port)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"error {type(e).__name__}: {first}", flush=True)
        return 1

    def leave(signum: int, frame: Any) -> None:
        raise _Leave()

    signal.signal(signal.SIGTERM, leave)
    try:
        print("ready", flush=True)
        sys.stdout.close()
        _serve_while_starter_lives(parent)
    except _Leave:
        pass  # a preemption or Ctrl-C: the ranks are saving or stopping and still need it
    # From here on the ranks decide; no signal but SIGKILL takes the store from them.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _serve_until_ranks_are_over(store, args.world_size, args.stale, parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The job's store: hosted outside rank 0, and what a rank does when it stops answering.

* :class:`~lightning_pp.runtime.store_host.StoreHost`, the process that hosts the store when
  rank 0 otherwise would: it serves on after the process that started it was killed, for as
  long as a rank of the job lives, then leaves by itself; a port in use is one clear error.
* :class:`~lightning_pp.runtime.heartbeats.ProcessWatcher` on a store that stops answering (its
  host stopped): the guard thread ends the process after ``watchdog_timeout`` with one line and
  kills a stopped local rank it knows; it stays quiet while the store answers; ``stop()`` does
  not hang on a frozen store.
* :func:`~lightning_pp.runtime.processes.consequence_line`: an error caused by another rank's
  failure prints one line naming that rank.

The whole jobs (Lightning's launcher, torchrun, SLURM tasks, with rank 0 stopped or killed) are
in tests/test_fault_jobs.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from lightning_pp.planner.verify import free_port
from lightning_pp.runtime import heartbeats
from lightning_pp.runtime.errors import VANISHED, abort_key, report_failure
from lightning_pp.runtime.heartbeats import ProcessWatcher
from lightning_pp.runtime.local_process import pid_namespace, process_state
from lightning_pp.runtime.processes import consequence_line
from lightning_pp.runtime.store_host import StoreHost, _serve_until_ranks_are_over, connect_store

# Timing: watchers must act within sub-second windows. Runs after every background job
# (conftest.py).
pytestmark = pytest.mark.timing


def _beat(pid: int, n: int = 1, host: str | None = None, **extra: object) -> str:
    value = {"n": n, "host": host or socket.gethostname(), "pid": pid, "pidns": pid_namespace()}
    return json.dumps({**value, **extra})


def _wait(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# ---- the store process --------------------------------------------------------------------------

# A "rank 0": starts the store process, writes the heartbeats of rank 0 (itself) and rank 1 (a
# pid it is given), says the host's pid, then waits to be killed.
_STARTER = textwrap.dedent(
    """
    import json, os, socket, sys, time
    from lightning_pp.runtime.local_process import pid_namespace
    from lightning_pp.runtime.store_host import StoreHost, connect_store
    port, rank1 = int(sys.argv[1]), int(sys.argv[2])
    host = StoreHost.start("127.0.0.1", port, 2, stale=60.0)
    store = connect_store("127.0.0.1", port)
    for rank, pid in ((0, os.getpid()), (1, rank1)):
        value = {"n": 1, "host": socket.gethostname(), "pid": pid, "pidns": pid_namespace()}
        store.set(f"lightning_pp/heartbeat/{rank}", json.dumps(value))
    store.set("written", "yes")
    print(host.pid, flush=True)
    time.sleep(600)
    """
)


def test_the_store_process_outlives_rank_0_and_leaves_after_the_last_rank():
    port = free_port()
    rank1 = subprocess.Popen(["sleep", "600"])
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER, str(port), str(rank1.pid)],
        stdout=subprocess.PIPE,
        text=True,
    )
    host_pid = None
    try:
        line = starter.stdout.readline()
        assert line.strip().isdigit(), (line, starter.poll())
        host_pid = int(line)
        starter.kill()  # rank 0 killed: the store must stay, rank 1 still needs it
        starter.wait(timeout=10)
        store = connect_store("127.0.0.1", port)
        assert store.get("written") == b"yes"
        time.sleep(2.0)  # it has noticed rank 0 is gone (it looks every second)
        assert process_state(host_pid) not in (None, "Z"), "left while rank 1 was alive"
        assert store.get("written") == b"yes"
        del store
        rank1.kill()  # the last rank gone: the store process leaves by itself
        rank1.wait(timeout=10)
        # It notices within 0.25 s; the bound is for its interpreter's exit (torch's teardown),
        # which took over 5 s in a loaded CI run.
        assert _wait(lambda: process_state(host_pid) in (None, "Z"), 60.0), "did not leave"
    finally:
        for proc in (starter, rank1):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if host_pid is not None and process_state(host_pid) not in (None, "Z"):
            os.kill(host_pid, signal.SIGKILL)


def test_a_port_in_use_is_one_clear_error_naming_it():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError) as info:
            StoreHost.start("127.0.0.1", port, 2, stale=60.0)
    text = str(info.value)
    assert f"could not start the job's store on port {port} (MASTER_PORT)" in text, text
    assert "address already in use" in text and "Fix: set MASTER_PORT" in text, text


class FakeStore:
    """The part of a c10d store the watchers use, in memory; :meth:`freeze` makes every call
    block (a stopped store host) until :meth:`thaw`."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self._open = threading.Event()
        self._open.set()

    def freeze(self) -> None:
        self._open.clear()

    def thaw(self) -> None:
        self._open.set()

    def _gate(self) -> None:
        self._open.wait()

    def set(self, key: str, value: str | bytes) -> None:
        self._gate()
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        self._gate()
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        self._gate()
        return all(k in self.data for k in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._gate()
        current = self.data.get(key, b"")
        if current == expected.encode():
            self.data[key] = desired.encode()
            return desired.encode()
        return current


def test_the_store_process_takes_remote_ranks_as_over_when_done_or_silent():
    store = FakeStore()
    store.set(ProcessWatcher.heartbeat_key(0), _beat(1, host="elsewhere", done=True))
    store.set(ProcessWatcher.heartbeat_key(1), _beat(1, host="elsewhere"))  # silent, not done
    t0 = time.monotonic()
    _serve_until_ranks_are_over(store, 3, stale=1.0, parent=-1)  # rank 2 never joined
    waited = time.monotonic() - t0
    assert 1.0 <= waited < 3.0, waited  # the silent one is over after ``stale``


# ---- a rank whose store stops answering ---------------------------------------------------------


@pytest.fixture
def stopped_peer():
    """A process on this host, stopped (as a SIGSTOPped rank 0 would be)."""
    proc = subprocess.Popen(["sleep", "600"])
    os.kill(proc.pid, signal.SIGSTOP)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _watch(store: FakeStore, exits: list[int], **kw) -> ProcessWatcher:
    return ProcessWatcher(
        store,
        rank=1,
        world_size=2,
        watchdog_timeout=0.5,
        interval=0.05,
        exit=exits.append,
        store_owner="hosted by rank 0",
        **kw,
    ).start()


def test_a_store_that_stops_answering_ends_the_rank_and_its_stopped_host(
    stopped_peer, capsys, monkeypatch
):
    monkeypatch.setattr(heartbeats, "STORE_CALL_LIMIT", 0.5)
    store, exits = FakeStore(), []
    beating = threading.Event()

    def rank0_beats() -> None:  # rank 0's heartbeat moves until its store host freezes
        n = 0
        while not beating.is_set():
            n += 1
            store.data[ProcessWatcher.heartbeat_key(0)] = _beat(stopped_peer.pid, n).encode()
            time.sleep(0.02)

    thread = threading.Thread(target=rank0_beats, daemon=True)
    thread.start()
    watcher = _watch(store, exits)
    try:
        time.sleep(0.3)  # a few rounds: rank 0 (pid, host) is known
        beating.set()
        store.freeze()
        t0 = time.monotonic()
        assert _wait(lambda: exits, 5.0), "the guard never ended the process"
        seconds = time.monotonic() - t0
        assert exits == [1]
        assert 0.5 <= seconds < 2.0, seconds  # watchdog_timeout + three intervals, not forever
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if "PipelineAborted" in ln]
        assert len(lines) == 1, err
        assert "rank 1: the job's store (hosted by rank 0) has not answered for" in lines[0]
        assert (
            f"rank 0 on host {socket.gethostname()} (pid {stopped_peer.pid}) is stopped" in lines[0]
        )
        assert stopped_peer.wait(timeout=5) == -signal.SIGKILL  # nothing stopped left behind
        # and stop() does not hang on the frozen store
        t1 = time.monotonic()
        watcher.stop()
        assert time.monotonic() - t1 < 2.0
    finally:
        beating.set()
        store.thaw()
        watcher.stop()


def test_a_store_that_answers_never_trips_the_guard():
    store, exits = FakeStore(), []
    store.set(ProcessWatcher.heartbeat_key(0), _beat(os.getpid()))  # a live local rank 0
    watcher = _watch(store, exits, watch=lambda: [])  # rank 0's silence is not the point here
    try:
        time.sleep(2.0)  # four times the guard's limit
        assert exits == []
    finally:
        watcher.stop()
    assert json.loads(store.data[ProcessWatcher.heartbeat_key(1)])["done"] is True


# ---- an error caused by another rank -----------------------------------------------------------


def test_an_error_caused_by_a_vanished_rank_prints_one_line_naming_it():
    store, exits = FakeStore(), []
    watcher = _watch(store, exits, watch=lambda: [])
    try:
        error = RuntimeError("[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer")
        assert consequence_line(error, 1) is None  # nobody failed: this rank's own error
        vanished = "rank 0 on host h (pid 7) exited without reporting an error; noticed by rank 1"
        report_failure(store, 0, "heartbeat", vanished, kind=VANISHED)
        line = consequence_line(error, 1)
        assert line == (
            "[rank1]: PipelineAborted: rank 1: stopped with RuntimeError (Connection closed by "
            f"peer) because rank 0 vanished: {vanished}\n"
        )
        assert consequence_line(KeyboardInterrupt(), 1) is None
        store.data[abort_key()] = json.dumps({"rank": 1, "type": "ValueError"}).encode()
        assert consequence_line(error, 1) is None  # this rank failed first: its own traceback
    finally:
        watcher.stop()

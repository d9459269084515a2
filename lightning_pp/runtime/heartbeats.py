"""Heartbeats: telling "my peer vanished" from "I failed", and ending what cannot end by itself.

One :class:`ProcessWatcher` per rank publishes a heartbeat into the job's c10d store and reads
the others'; a rank whose process is gone, stopped or silent for ``watchdog_timeout`` is declared
vanished (through :func:`~lightning_pp.runtime.errors.report_failure`), and a process still
blocked ``exit_grace`` seconds after any failure, somewhere no monitor watches, is ended.
:class:`~lightning_pp.runtime.failure.FailureMonitor` asks the running watcher
(:func:`current_watcher`) who is gone when a wait fails.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .errors import (
    _NAMESPACE,
    DEFAULT_EXIT_GRACE,
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_WATCHDOG_TIMEOUT,
    VANISHED,
    abort_key,
    decode_origin,
    origin_summary,
    report_failure,
)
from .local_process import GONE as _GONE
from .local_process import STATE_WORDS as _STATE_WORDS
from .local_process import STOPPED as _STOPPED
from .local_process import pid_namespace as _pid_namespace
from .local_process import process_state as _process_state

__all__ = ["STORE_CALL_LIMIT", "ProcessWatcher", "bounded", "current_watcher"]

T = TypeVar("T")

STORE_CALL_LIMIT = 5.0
"""Seconds a store call made outside the watcher's thread may take (finishing, explaining a
failure) before it is given up: a frozen store must not keep a process from exiting."""


def bounded(call: Callable[[], T], seconds: float, default: T) -> T:
    """``call()`` on a helper thread, its result within ``seconds``, else ``default`` (also when
    it raises). For store calls that must not block a process forever (the store's host may be
    stopped); the helper thread stays blocked, harmless: it is a daemon."""
    box: list[T] = []

    def run() -> None:
        try:
            box.append(call())
        except Exception:
            pass

    thread = threading.Thread(target=run, name="lightning_pp-store-call", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # interpreter shutdown (an atexit handler, Python >= 3.12): no threads
        run()
        return box[0] if box else default
    thread.join(seconds)
    return box[0] if box else default


_WATCHER: ProcessWatcher | None = None


def current_watcher() -> ProcessWatcher | None:
    """The running :class:`ProcessWatcher` of this process, if any."""
    return _WATCHER


class ProcessWatcher:
    """Heartbeats and a last-resort exit for one rank of a multi-process job.

    A daemon thread writes ``lightning_pp/heartbeat/<rank>`` (host, pid, a counter) into the
    job's c10d store every ``interval`` seconds and reads everyone else's. That answers the
    question a survivor cannot answer from a closed socket: *who* is gone.

    * A rank on this host whose process is gone (or a zombie) without having published a
      failure is declared vanished at once: "killed (SIGKILL, the OOM killer, ...)".
    * A rank whose heartbeat has not advanced for ``watchdog_timeout`` seconds is declared
      vanished: a stopped process (SIGSTOP), a lost node, a process stuck in native code that
      holds the GIL. When it runs on this host it is killed (SIGKILL), so that no launcher has
      to wait for a process that can no longer react to SIGTERM.
    * Declaring publishes the abort key with the vanished rank as the origin (``type``
      ``RankVanished``, its host and pid): every watched wait then stops naming it.
    * Once any rank has failed, a process still alive ``exit_grace`` seconds later is blocked
      somewhere no monitor watches (a collective issued by Lightning itself, a user's
      collective): the watcher prints one line and ends it (``os._exit(1)``). The origin gets
      three times as long (it is printing its error).
    * A second thread, which never touches the store, watches the first: when the store has not
      answered (or has only failed) for ``watchdog_timeout`` plus three intervals, its host is
      stopped, killed or unreachable (``store_owner`` says who hosts it). No failure can be
      published any more: the thread prints one line naming the store, and what this host's
      process table says of the ranks it knows, SIGKILLs those of them that are stopped (a
      stopped rank 0 hosting the store would be left behind) and ends this process.

    The heartbeat of a rank is judged by whether its value *changes*, timed on the reader's
    clock, so clocks of different hosts need not agree. :meth:`stop` marks the rank finished:
    a rank that ends normally is never declared vanished.

    ``watch`` returns the ranks to check (default: all); every rank should be watched by at
    least one other.

    Example::

        watcher = ProcessWatcher(store, rank=1, world_size=4, watchdog_timeout=300.0).start()
        ...                       # training
        watcher.stop()            # finished: the others no longer watch this rank
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        watchdog_timeout: float | None = DEFAULT_WATCHDOG_TIMEOUT,
        interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        exit_grace: float = DEFAULT_EXIT_GRACE,
        exit: Callable[[int], Any] = os._exit,
        watch: Callable[[], Sequence[int]] | None = None,
        store_owner: str = "hosted by rank 0",
    ) -> None:
        self.store = store
        self.store_owner = store_owner
        self._watch = watch
        self.rank = rank
        self.world_size = world_size
        self.watchdog_timeout = watchdog_timeout
        self.interval = interval
        self.exit_grace = exit_grace
        self._exit = exit
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.pidns = _pid_namespace()
        self._count = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # rank -> (last value read, monotonic time it last changed, decoded value)
        self._seen: dict[int, tuple[bytes, float, dict]] = {}
        self._abort_seen: float | None = None
        # the watcher thread's store rounds, read by the guard thread: (finished rounds, did the
        # last one fail)
        self._rounds = 0
        self._round_failed = False
        self._guard: threading.Thread | None = None

    @staticmethod
    def heartbeat_key(rank: int) -> str:
        return f"{_NAMESPACE}/heartbeat/{rank}"

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> ProcessWatcher:
        """Write the first heartbeat and start the thread; becomes :func:`current_watcher`."""
        global _WATCHER
        self._beat(done=False)
        self._thread = threading.Thread(target=self._run, name="lightning_pp-watcher", daemon=True)
        self._thread.start()
        self._guard = threading.Thread(
            target=self._guard_store, name="lightning_pp-guard", daemon=True
        )
        self._guard.start()
        _WATCHER = self
        atexit.register(self.stop)  # a normal interpreter exit is not a vanished rank
        return self

    def stop(self) -> None:
        """Mark this rank finished (the others stop watching it) and end the thread."""
        global _WATCHER
        if self._stop.is_set():
            return
        self._stop.set()
        # atexit's reference would keep this watcher, and through ``watch`` its strategy, the
        # model and the optimizer, alive for the rest of the process (one set per fit).
        atexit.unregister(self.stop)
        # Both threads first: a heartbeat of the watcher's own written after "done" would undo
        # it, and the guard, which wakes at once on the stop event, would otherwise hold this
        # watcher (and what it refers to) a moment after ``stop`` returns.
        for thread in (self._thread, self._guard):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=2 * self.interval)
        bounded(lambda: self._beat(done=True), STORE_CALL_LIMIT, None)
        if _WATCHER is self:
            _WATCHER = None

    def job_failed(self) -> bool:
        """Whether some rank has published a failure (the abort key is set); ``True`` too when
        the store does not answer (the job is ending badly)."""
        return bounded(lambda: bool(self.store.check([abort_key()])), STORE_CALL_LIMIT, True)

    def failure_origin(self, look: bool = True) -> dict | None:
        """What the rank that failed first published, when that is another rank, else ``None``.

        With ``look``, when no rank has published yet, this process's peers are checked first
        (:meth:`find_vanished`): an error seen here (a closed connection) is often the first
        sign of a peer that was killed before anyone noticed. Every store call is bounded
        (:data:`STORE_CALL_LIMIT`). For a process about to report its own failure, so that the
        consequence of another rank's is not reported as a cause."""

        def read() -> dict | None:
            if not self.store.check([abort_key()]):
                return None
            return decode_origin(self.store.get(abort_key()).decode(errors="replace"))

        origin = bounded(read, STORE_CALL_LIMIT, None)
        if origin is None and look:
            time.sleep(0.05)  # the origin writes the key before its sockets close
            origin = bounded(read, STORE_CALL_LIMIT, None)
            if origin is None:
                bounded(lambda: self.find_vanished(), STORE_CALL_LIMIT + 2 * self.interval, False)
                origin = bounded(read, STORE_CALL_LIMIT, None)
        if origin is None or origin.get("rank") == self.rank:
            return None
        return origin

    def _beat(self, done: bool) -> None:
        self._count += 1
        value = {"n": self._count, "host": self.host, "pid": self.pid, "pidns": self.pidns}
        if done:
            value["done"] = True
        self.store.set(self.heartbeat_key(self.rank), json.dumps(value))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat(done=False)
                self._check()
            except Exception:
                # The store does not answer (its host exited?): the guard thread decides.
                self._round_failed = True
            else:
                self._round_failed = False
            self._rounds += 1

    # -- the store itself ---------------------------------------------------------------------
    def _guard_store(self) -> None:
        """The second thread: end this process when the store has stopped answering (see the
        class docstring). Time is counted in this thread's own ticks, at most two intervals
        each, so that a process that was itself stopped (Ctrl-Z) or starved of the GIL for a
        while does not read its own pause as the store's."""
        if self.watchdog_timeout is None:
            return
        limit = self.watchdog_timeout + 3 * self.interval
        troubled, rounds, last = 0.0, self._rounds, time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            step, last = min(now - last, 2 * self.interval), now
            moved, rounds = self._rounds != rounds, self._rounds
            if moved and not self._round_failed:
                troubled = 0.0
                continue
            troubled += step
            if troubled > limit and not self._stop.is_set():
                self._store_lost(troubled)
                return

    def _store_lost(self, seconds: float) -> None:
        """The store has not answered for ``seconds``: say so in one line, end what is stopped
        on this host, leave."""
        known = []
        stopped = []
        with self._lock:
            seen = {r: v for r, (_, _, v) in self._seen.items()}
        for r, value in sorted(seen.items()):
            if value.get("done") or not self._local(value):
                continue
            pid = int(value.get("pid", -1))
            state = _process_state(pid)
            if state in _STATE_WORDS:
                known.append(
                    f"rank {r} on host {value.get('host')} (pid {pid}) is {_STATE_WORDS[state]}"
                )
            if state in _STOPPED:
                stopped.append(pid)
        text = (
            f"PipelineAborted: rank {self.rank}: the job's store ({self.store_owner}) has not "
            f"answered for {seconds:.1f} s (watchdog_timeout={self.watchdog_timeout:g} s): its "
            f"host is stopped, killed or unreachable, and no failure can be reported through it"
            + (f"; {'; '.join(known)}" if known else "")
            + "; exiting"
        )
        try:
            sys.stdout.flush()
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
            for pid in stopped:  # it cannot act on the launcher's SIGTERM
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        finally:
            self._exit(1)

    # -- what the others are doing ----------------------------------------------------------
    def _read(self, ranks: Sequence[int]) -> dict[int, tuple[float, dict]]:
        """rank -> (seconds since its heartbeat last changed, its value), for ranks that beat."""
        now = time.monotonic()
        out: dict[int, tuple[float, dict]] = {}
        keys = [self.heartbeat_key(r) for r in ranks]
        present = [r for r, k in zip(ranks, keys) if self.store.check([k])]
        for r in present:
            raw = self.store.get(self.heartbeat_key(r))
            with self._lock:
                last = self._seen.get(r)
                if last is None or last[0] != raw:
                    try:
                        value = json.loads(raw.decode())
                    except ValueError:
                        continue
                    self._seen[r] = last = (raw, now, value)
            out[r] = (now - last[1], last[2])
        return out

    def _local(self, value: dict) -> bool:
        return value.get("host") == self.host and value.get("pidns", "") == self.pidns

    def describe_ranks(self, ranks: Sequence[int]) -> dict[int, str]:
        """rank -> ``heartbeat 0.4 s ago (host h, pid 123)``, plus the process state when it
        runs on this host and is not running normally. For hang reports."""
        try:
            beats = self._read([r for r in ranks if r != self.rank])
        except Exception:
            return {}
        out = {}
        for r, (age, value) in beats.items():
            text = f"heartbeat {age:.1f} s ago (host {value.get('host')}, pid {value.get('pid')})"
            if value.get("done"):
                text += ", finished"
            elif self._local(value):
                state = _process_state(int(value.get("pid", -1)))
                if state in _STATE_WORDS:
                    text += f", process {_STATE_WORDS[state]}"
            out[r] = text
        return out

    def find_vanished(self, ranks: Sequence[int] | None = None, wait: float | None = None) -> bool:
        """Look for a rank that is gone without a report and declare it (True if one was).

        On this host the process table answers at once. For the others, heartbeats are
        watched for ``wait`` seconds (default two intervals): a rank whose heartbeat does not
        move in that time is gone. Called by a monitor when a transfer fails."""
        candidates = [r for r in (ranks or range(self.world_size)) if r != self.rank]
        candidates = list(dict.fromkeys(candidates))
        try:
            beats = self._read(candidates)
            live = {r: v for r, (_, v) in beats.items() if not v.get("done")}
            local = {r: v for r, v in live.items() if self._local(v)}
            remote = [r for r in live if r not in local]
            before = {r: live[r].get("n") for r in remote}
            deadline = time.monotonic() + (2 * self.interval if wait is None else wait)
            while True:
                # A killed process closes its sockets while it exits, a moment before the
                # process table shows it gone: look again until the deadline.
                for r, value in local.items():
                    state = _process_state(int(value.get("pid", -1)))
                    if state in _GONE:
                        return self._declare(r, value, _KILLED)
                    if state in _STOPPED:
                        return self._declare(
                            r,
                            value,
                            f"stopped sending heartbeats: its process is {_STATE_WORDS[state]}",
                        )
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            if remote:
                after = self._read(remote)
                for r in remote:
                    if r in after and after[r][1].get("n") == before[r]:
                        return self._declare(r, after[r][1], "stopped sending heartbeats")
        except Exception:
            return False
        return False

    def _check(self) -> None:
        """One round of the thread: react to a failure, then look for a vanished rank."""
        key = abort_key()
        if self.store.check([key]):
            origin = decode_origin(self.store.get(key).decode(errors="replace"))
            now = time.monotonic()
            if self._abort_seen is None:
                self._abort_seen = now
            mine = origin.get("rank") == self.rank
            grace = self.exit_grace * (3 if mine else 1)
            self._kill_stopped_peers()
            if now - self._abort_seen > grace:
                self._give_up(origin, now - self._abort_seen)
            return
        ranks = self._watch() if self._watch is not None else range(self.world_size)
        beats = self._read([r for r in ranks if r != self.rank])
        for r, (age, value) in beats.items():
            if value.get("done"):
                continue
            state = None
            if self._local(value):
                state = _process_state(int(value.get("pid", -1)))
                if state in _GONE:
                    self._declare(r, value, _KILLED)
                    return
            if self.watchdog_timeout is not None and age > self.watchdog_timeout:
                how = f", its process is {_STATE_WORDS[state]}" if state in _STATE_WORDS else ""
                self._declare(
                    r,
                    value,
                    f"stopped sending heartbeats {age:.1f} s ago (watchdog_timeout="
                    f"{self.watchdog_timeout:g} s){how}",
                )
                return

    def _kill_stopped_peers(self) -> None:
        """The job has failed: end every stopped process of it on this host. A stopped process
        cannot act on the SIGTERM its launcher sends; left alone it would keep torchrun or
        Lightning's launcher waiting (torchrun SIGKILLs only after 30 s) or outlive the job."""
        beats = self._read([r for r in range(self.world_size) if r != self.rank])
        for _, value in beats.values():
            if value.get("done") or not self._local(value):
                continue
            pid = int(value.get("pid", -1))
            if _process_state(pid) in _STOPPED:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def _declare(self, rank: int, value: dict, reason: str) -> bool:
        """Publish ``rank`` as the origin of the failure; kill it if it is a stuck local process.
        True if this call published it (False: some rank had already failed)."""
        host, pid = value.get("host", "?"), value.get("pid", -1)
        message = f"rank {rank} on host {host} (pid {pid}) {reason}; noticed by rank {self.rank}"
        first = report_failure(
            self.store, rank, "heartbeat", message, kind=VANISHED, extra={"host": host, "pid": pid}
        )
        if self._local(value) and _process_state(int(pid)) not in _GONE:
            # A stopped or wedged process cannot act on SIGTERM; the job is over for it.
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        return first

    def _give_up(self, origin: dict, seconds: float) -> None:
        """This process outlived a failure: it is blocked where no monitor watches. End it."""
        who = f"rank {origin.get('rank', -1)}"
        text = (
            f"PipelineAborted: rank {self.rank}: still running {seconds:.1f} s after {who} "
            f"failed [{origin_summary(origin)}]; blocked outside a watched wait (e.g. a "
            f"collective issued by Lightning or user code): exiting"
        )
        try:
            sys.stdout.flush()
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        finally:
            self._exit(1)


_KILLED = "exited without reporting an error (killed: SIGKILL, the OOM killer, or a crash)"

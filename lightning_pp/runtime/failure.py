"""Failures that end cleanly and together: an abort channel and a hang watchdog.

A pipeline rank that raises leaves its neighbours blocked on receives that will never arrive;
torch's own process-group timeout (30 minutes by default) is far too long, and the error it
finally prints names nobody. :class:`FailureMonitor` fixes both:

* **Abort channel.** The rank that fails first writes one key, ``lightning_pp/abort``, into the
  job's c10d store (``compare_set``, so exactly one rank is "the origin"). Every blocking wait of
  the P2P layer checks that key every ``poll_interval`` seconds and raises
  :class:`PipelineAborted` (naming the failed rank, its action and exception type) instead of
  blocking on. The origin's own error, with its traceback, is printed by the origin only.
* **Hang watchdog.** A wait that lasts longer than ``watchdog_timeout`` raises
  :class:`PipelineHang`, naming this rank, what it waits for (``rank 2: waiting for activation of
  mb=5 chunk=1 from rank 1``) and what the other ranks of its pipeline last published. The engine
  adds the schedule grid with every known rank's step marked and sets the abort key.

Why a helper thread: gloo's point-to-point ``Work`` objects report ``is_completed() == False``
until ``wait()`` has been called, and ``wait(timeout)`` poisons the whole gloo context when it
expires. So the blocking ``wait()`` runs on a helper thread while the calling thread waits on an
event in short slices, free to raise. Backends whose works report completion (NCCL) are polled
directly instead. When the wait is already complete the cost is one queue hand-off (tens of
microseconds); the store is touched only by waits that last longer than ``poll_interval``
(one ``set`` to publish the rank's state, then one ``check`` per interval).

Example (what the engine does around every blocking wait)::

    monitor = FailureMonitor.from_default_store(rank, watchdog_timeout=300.0)
    monitor.set_context(step=0, index=3, action="B mb=1 chunk=0", pp_rank=1)
    monitor.wait(works, "waiting for gradient of mb=1 chunk=0 from rank 2", peer=2)
    ...
    except Exception as e:                  # a rank's own failure
        monitor.report_failure(f"rank {rank}: B mb=1 chunk=0: {type(e).__name__}: {e}")
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_EXIT_GRACE",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_POLL_INTERVAL",
    "DEFAULT_WATCHDOG_TIMEOUT",
    "FailureMonitor",
    "PipelineAborted",
    "PipelineHang",
    "ProcessWatcher",
    "current_watcher",
    "monitored_wait",
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


def _decode_origin(raw: str) -> dict:
    try:
        origin = json.loads(raw)
        if isinstance(origin, dict):
            return origin
    except ValueError:
        pass
    return {"rank": -1, "where": "", "type": "", "message": raw}


def _origin_summary(origin: dict) -> str:
    """``rank 1: F mb=0 chunk=0: ValueError``: who, where, what kind, but not the message."""
    parts = [f"rank {origin.get('rank', -1)}"]
    parts += [origin[k] for k in ("where", "type") if origin.get(k)]
    return ": ".join(parts)


def _wait_all(works: Sequence[Any]) -> list[BaseException]:
    """``wait()`` on each work in turn; the first error (in a list, to hand across threads)."""
    try:
        for w in works:
            w.wait()
    except BaseException as e:
        return [e]
    return []


class _Waiter(threading.Thread):
    """Runs blocking ``Work.wait()`` calls so the calling thread can keep watching."""

    def __init__(self) -> None:
        super().__init__(name="lightning_pp-p2p-wait", daemon=True)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            works, box, done = job
            box += _wait_all(works)  # handed back to the caller, raised there
            done.set()


class FailureMonitor:
    """Abort channel + hang watchdog for one rank (see the module docstring).

    Args:
        store: a c10d store shared by every rank of the job (``None``: no abort channel; the
            watchdog still fires, but cannot name the others or stop them).
        rank: this process's global rank.
        watchdog_timeout: seconds one wait may block before :class:`PipelineHang`; ``None``
            disables the watchdog (the abort channel stays on).
        poll_interval: seconds between abort-key checks during a blocked wait.
        poll_works: wait by polling ``Work.is_completed()`` (NCCL) instead of a helper thread
            (gloo, whose works complete only inside ``wait()``).

    Example::

        monitor = FailureMonitor.from_default_store(rank=3, watchdog_timeout=5.0)
        monitor.wait(works, "waiting for activation of mb=0 chunk=0 from rank 2", peer=2)
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        *,
        watchdog_timeout: float | None = DEFAULT_WATCHDOG_TIMEOUT,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        poll_works: bool = False,
        pipeline_ranks: Sequence[int] = (),
    ) -> None:
        if watchdog_timeout is not None and not watchdog_timeout > 0:
            raise ValueError(
                f"watchdog_timeout must be a positive number of seconds or None (disabled), "
                f"got {watchdog_timeout!r}"
            )
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        self.store = store
        self.rank = rank
        self.watchdog_timeout = watchdog_timeout
        self.poll_interval = poll_interval
        self.poll_works = poll_works
        self.pipeline_ranks = list(pipeline_ranks)
        self._context: dict[str, Any] = {"step": 0, "index": -1, "action": "", "pp_rank": -1}
        self._waiter: _Waiter | None = None
        self._broken = False  # a wait was abandoned: the helper thread is stuck on it

    @classmethod
    def from_default_store(cls, rank: int, **kwargs: Any) -> FailureMonitor:
        """A monitor on the default process group's store (requires ``init_process_group``)."""
        import torch.distributed as dist

        store = None
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # no default group / private API changed: watchdog without channel
            store = None
        if "poll_works" not in kwargs:
            try:
                kwargs["poll_works"] = dist.get_backend() == "nccl"
            except Exception:
                kwargs["poll_works"] = False
        return cls(store, rank, **kwargs)

    # -- keys ----------------------------------------------------------------------------------
    @staticmethod
    def abort_key() -> str:
        return f"{_NAMESPACE}/abort"

    @staticmethod
    def state_key(rank: int) -> str:
        return f"{_NAMESPACE}/state/{rank}"

    # -- context (cheap: attribute writes only) -------------------------------------------------
    def set_context(self, *, step: int, index: int, action: Any, pp_rank: int = -1) -> None:
        """What this rank is doing now; published only if a wait blocks. ``action``: a text,
        or an object with ``describe()`` (an :class:`~lightning_pp.schedules.Action`), which is
        turned into text only when needed (this runs before every action)."""
        self._context = {"step": step, "index": index, "action": action, "pp_rank": pp_rank}

    @property
    def context(self) -> dict[str, Any]:
        """The current context with ``action`` as text."""
        ctx = dict(self._context)
        action = ctx["action"]
        if not isinstance(action, str):
            ctx["action"] = action.describe()
        return ctx

    # -- the abort channel ----------------------------------------------------------------------
    def aborted(self) -> dict | None:
        """The origin's failure (``rank``, ``where``, ``type``, ``message``) if some rank has
        failed, else ``None``."""
        if self.store is None:
            return None
        key = self.abort_key()
        try:
            if not self.store.check([key]):
                return None
            return _decode_origin(self.store.get(key).decode(errors="replace"))
        except Exception:  # the store went away: the job is ending; nothing to add
            return None

    def report_failure(self, where: str, error: BaseException | str) -> bool:
        """Publish this rank's failure unless another rank did first. True: this rank is first."""
        return report_failure(self.store, self.rank, where, error)

    def raise_if_aborted(self, what: str = "") -> None:
        origin = self.aborted()
        if origin is not None:
            raise self._aborted_error(origin, what)

    def _aborted_error(self, origin: dict, what: str) -> PipelineAborted:
        origin_rank = int(origin.get("rank", -1))
        ctx = self.context
        doing = what or "between steps"
        if ctx["action"]:
            doing += f" (step {ctx['step']}, {ctx['action']})"
        who = f"rank {origin_rank}" if origin_rank >= 0 else "another rank"
        if origin.get("type") == VANISHED:
            # The vanished rank prints nothing (it is dead or stopped): say it all here.
            return PipelineAborted(
                f"rank {self.rank}: stopped {doing} because {who} vanished: "
                f"{origin.get('message', '')}",
                self.rank,
                origin_rank,
                origin,
            )
        return PipelineAborted(
            f"rank {self.rank}: stopped {doing} because {who} failed first "
            f"[{_origin_summary(origin)}]; that rank prints the error and its traceback",
            self.rank,
            origin_rank,
            origin,
        )

    # -- published state --------------------------------------------------------------------
    def publish(self, what: str) -> None:
        if self.store is None:
            return
        state = dict(self.context, what=what, t=time.time())
        try:
            self.store.set(self.state_key(self.rank), json.dumps(state))
        except Exception:
            pass

    def peer_states(self, ranks: Sequence[int]) -> dict[int, dict]:
        """What each of ``ranks`` last published (rank -> state with ``age`` in seconds)."""
        out: dict[int, dict] = {}
        if self.store is None:
            return out
        now = time.time()
        for r in ranks:
            key = self.state_key(r)
            try:
                if not self.store.check([key]):
                    continue
                state = json.loads(self.store.get(key).decode())
            except Exception:
                continue
            state["age"] = max(0.0, now - state.pop("t", now))
            out[r] = state
        return out

    # -- waiting ----------------------------------------------------------------------------
    def wait(
        self,
        works: Sequence[Any],
        what: str | Callable[[], str],
        peer: int | None = None,
        *,
        min_timeout: float = 0.0,
        landed: Callable[[], bool] | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        """Wait for ``works``; raise :class:`PipelineAborted` or :class:`PipelineHang` instead of
        blocking forever. ``what`` describes the wait for messages (a string or a callable).
        ``min_timeout`` raises the watchdog limit for this wait only (set-up rendezvous, where
        ranks legitimately arrive seconds apart). ``landed``: a cheap test that the works'
        data has already arrived (their ``wait()`` cannot block); when it says so, the works
        are waited for on this thread, skipping the helper-thread hand-off. ``ranks``: the
        ranks taking part (a collective's group), listed in a hang report instead of the
        pipeline's."""
        if not works:
            return
        if landed is not None and not self._broken and landed():
            self._finish(_wait_all(works), what, peer, ranks)
            return
        limit = self.watchdog_timeout
        if limit is not None:
            limit = max(limit, min_timeout)
        if self._broken:
            # An earlier wait was abandoned; its works still occupy the helper thread.
            self.raise_if_aborted(_text(what))
            raise RuntimeError(
                f"rank {self.rank}: a previous point-to-point wait was abandoned after an "
                f"abort or hang; this process group cannot be used for pipeline traffic again"
            )
        t0 = time.monotonic()
        if self.poll_works:
            done = lambda: all(w.is_completed() for w in works)  # noqa: E731
        else:
            if self._waiter is None:
                self._waiter = _Waiter()
            event, box = threading.Event(), []
            self._waiter.jobs.put((list(works), box, event))
            # The first slice is short: most waits finish within it and touch no store.
            if event.wait(self.poll_interval):
                self._finish(box, what, peer, ranks)
                return
            done = event.is_set
        published = False
        sleep = 1e-4
        next_check = t0 + self.poll_interval
        while not done():
            now = time.monotonic()
            if now >= next_check:
                if not published:
                    self.publish(_text(what))
                    published = True
                origin = self.aborted()
                if origin is not None:
                    self._broken = not self.poll_works
                    raise self._aborted_error(origin, _text(what))
                if limit is not None and now - t0 > limit:
                    self._broken = not self.poll_works
                    # The peer may be the cause rather than a fellow victim: a stopped process
                    # (SIGSTOP), a lost node. Its heartbeat watchdog runs on the same limit, so
                    # which fires first is a race; blame the vanished rank, not this one.
                    self._blame_vanished(peer, ranks)
                    origin = self.aborted()
                    if origin is not None and origin.get("rank") != self.rank:
                        raise self._aborted_error(origin, _text(what))
                    raise self._hang_error(_text(what), now - t0, peer, ranks)
                next_check = now + self.poll_interval
            if self.poll_works:
                time.sleep(sleep)
                sleep = min(sleep * 2, 2e-3)
            else:
                event.wait(max(1e-4, next_check - time.monotonic()))
        if published:  # the state said "waiting": correct it, or a hang report would mislead
            self.publish("computing (its last wait ended)")
        if self.poll_works:
            box = _wait_all(works)  # surfaces a backend error of a completed work
        self._finish(box, what, peer, ranks)

    def _finish(
        self,
        box: list[BaseException],
        what: str | Callable[[], str],
        peer: int | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        if not box:
            return
        self.explain_failure(_text(what), box[0], peer, ranks)
        raise box[0]

    def explain_failure(
        self,
        what: str,
        error: BaseException,
        peer: int | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        """A transfer or collective failed (typically "connection closed by peer"). If another
        rank published a failure, this is its consequence: raise :class:`PipelineAborted`
        naming it. If a rank vanished without a word (SIGKILL, the OOM killer, a lost node),
        publish that rank as the origin and raise naming it. Otherwise return (the caller
        raises ``error``: this rank's own failure)."""
        origin = self.aborted()
        if origin is None:
            time.sleep(self.poll_interval)  # the origin writes before its sockets close
            origin = self.aborted()
        if origin is None:
            self._blame_vanished(peer, ranks)
            origin = self.aborted()  # this rank's finding, or another rank's (first wins)
        if origin is not None and origin.get("rank") != self.rank:
            raise self._aborted_error(origin, what) from error

    def _blame_vanished(self, peer: int | None, ranks: Sequence[int] | None) -> None:
        """Ask the heartbeat watcher whether the peer or a rank of the group is gone (killed,
        stopped, lost) and, if so, publish it as the origin of the failure."""
        watcher = current_watcher()
        if watcher is None:
            return
        suspects = [r for r in [peer, *(ranks or self.pipeline_ranks)] if r is not None]
        watcher.find_vanished(suspects or None)

    def _hang_error(
        self, what: str, waited: float, peer: int | None, ranks: Sequence[int] | None = None
    ) -> PipelineHang:
        ctx = self.context
        lines = [
            f"rank {self.rank}: watchdog: blocked {waited:.1f} s (watchdog_timeout="
            f"{self.watchdog_timeout:g} s) {what}"
            + (f" (step {ctx['step']}, {ctx['action']})" if ctx["action"] else "")
        ]
        others = [r for r in (self.pipeline_ranks if ranks is None else ranks) if r != self.rank]
        if peer is not None and peer not in others and peer != self.rank:
            others.append(peer)
        states = self.peer_states(others)
        watcher = current_watcher()
        beats = watcher.describe_ranks(others) if watcher is not None else {}
        if others:
            group = "this pipeline" if ranks is None else "this collective"
            lines.append(f"the other ranks of {group}, as they last reported:")
            for r in others:
                tag = " (the peer)" if r == peer else ""
                s = states.get(r)
                beat = f"; {beats[r]}" if r in beats else ""
                if s is None:
                    lines.append(
                        f"  rank {r}{tag}: nothing published (computing, finished, not started, "
                        f"or never blocked longer than {self.poll_interval:g} s){beat}"
                    )
                else:
                    lines.append(
                        f"  rank {r}{tag}: step {s['step']} {s['action'] or '-'}: {s['what']} "
                        f"(reported {s['age']:.1f} s ago){beat}"
                    )
        lines.append(
            "likely causes: ranks running different schedules or microbatch counts, a peer "
            "stuck in user code or a collective, a shape the receiver cannot match; raise "
            "watchdog_timeout if a step is legitimately that slow"
        )
        own = dict(ctx, what=what, age=0.0)
        return PipelineHang("\n".join(lines), self.rank, what, {**states, self.rank: own})


def _text(what: str | Callable[[], str]) -> str:
    return what() if callable(what) else what


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
        current = store.compare_set(FailureMonitor.abort_key(), "", text)
    except Exception:
        return False
    if isinstance(current, bytes):
        current = current.decode(errors="replace")
    return current == text


# ------------------------------------------------------------------------------------------------
# Heartbeats: telling "my peer vanished" from "I failed", and ending what cannot end by itself
# ------------------------------------------------------------------------------------------------


def _process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...)
    or ``None`` when there is no such process (read from ``/proc``; ``"?"`` elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[1].split()[0]


_STATE_WORDS = {
    "T": "stopped (SIGSTOP or a debugger)",
    "t": "stopped by a tracer",
    "D": "in uninterruptible I/O",
    "Z": "dead (a zombie)",
    None: "gone",
}


_STOPPED = ("T", "t")  # cannot react to any signal but SIGKILL until continued


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


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
    ) -> None:
        self.store = store
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
        _WATCHER = self
        atexit.register(self.stop)  # a normal interpreter exit is not a vanished rank
        return self

    def stop(self) -> None:
        """Mark this rank finished (the others stop watching it) and end the thread."""
        global _WATCHER
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._beat(done=True)
        except Exception:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval)
        if _WATCHER is self:
            _WATCHER = None

    def job_failed(self) -> bool:
        """Whether some rank has published a failure (the abort key is set)."""
        try:
            return bool(self.store.check([FailureMonitor.abort_key()]))
        except Exception:
            return True  # the store is gone: the job is ending badly

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
                # The store is gone: the job is ending (its host exited). Nothing to watch with.
                continue

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
                    if state in (None, "Z"):
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
        key = FailureMonitor.abort_key()
        if self.store.check([key]):
            origin = _decode_origin(self.store.get(key).decode(errors="replace"))
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
                if state in (None, "Z"):
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
        if self._local(value) and _process_state(int(pid)) not in (None, "Z"):
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
            f"failed [{_origin_summary(origin)}]; blocked outside a watched wait (e.g. a "
            f"collective issued by Lightning or user code): exiting"
        )
        try:
            sys.stdout.flush()
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        finally:
            self._exit(1)


_KILLED = "exited without reporting an error (killed: SIGKILL, the OOM killer, or a crash)"


def monitored_wait(
    works: Sequence[Any],
    what: str,
    ranks: Sequence[int] | None = None,
    monitor: Any = None,
    min_timeout: float = 0.0,
) -> None:
    """Wait for collective ``works`` through ``monitor`` (default: the process's collective
    monitor, see :func:`set_collective_monitor`), so that the wait honours the watchdog and the
    abort channel; a plain ``wait()`` when there is none. ``min_timeout``: see
    :meth:`FailureMonitor.wait` (set-up collectives, where ranks arrive seconds apart)."""
    works = [w for w in works if w is not None]
    monitor = monitor or _COLLECTIVE_MONITOR
    if monitor is None:
        for w in works:
            w.wait()
        return
    ranks = list(ranks) if ranks is not None else None
    monitor.wait(works, what, ranks=ranks, min_timeout=min_timeout)


_COLLECTIVE_MONITOR: FailureMonitor | None = None


def set_collective_monitor(monitor: FailureMonitor | None) -> None:
    """The monitor that :func:`monitored_wait` uses by default (set by the strategy)."""
    global _COLLECTIVE_MONITOR
    _COLLECTIVE_MONITOR = monitor

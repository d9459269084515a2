"""Every blocking wait of the pipeline, watched: an abort channel and a hang watchdog.

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

import json
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .errors import (
    _NAMESPACE,
    DEFAULT_POLL_INTERVAL,
    DEFAULT_WATCHDOG_TIMEOUT,
    PipelineAborted,
    PipelineHang,
    abort_key,
    aborted_message,
    decode_origin,
    report_failure,
)
from .heartbeats import current_watcher

__all__ = [
    "DEFAULT_WATCHDOG_TIMEOUT",
    "FailureMonitor",
    "PipelineAborted",
    "PipelineHang",
    "monitored_wait",
    "report_failure",
    "set_collective_monitor",
]


# Polled waits (NCCL, whose works report completion): the sleep between two polls of
# ``is_completed()``, by how long the wait has lasted. A completion is seen at the next poll, so
# the sleep is what a blocked receive adds to its hop, on the pipeline's critical path whenever
# the rank waits there. A sleep doubling from 0.1 ms to 2 ms noticed a completed work 0.2-1.8 ms
# late (median, waits of 0.5-20 ms: ``python benchmarks/poll_latency.py``), a few percent of a
# GPU step per blocked hop. Short polls for the first second of a wait; after that the wait is a
# stall, not a hop, and polls every millisecond cost next to no CPU.
_FAST_POLL_S = 1e-4
_FAST_POLL_FOR_S = 1.0
_SLOW_POLL_S = 1e-3


def _poll_sleep(waited: float) -> float:
    """Seconds to sleep before the next ``is_completed()`` poll of a wait that has lasted
    ``waited`` seconds (see :data:`_FAST_POLL_S`)."""
    return _FAST_POLL_S if waited < _FAST_POLL_FOR_S else _SLOW_POLL_S


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
            if job is None:  # its monitor is gone (see FailureMonitor.wait)
                return
            works, box, done = job
            box += _wait_all(works)  # handed back to the caller, raised there
            done.set()
            # Drop the finished job before blocking on the next one: otherwise this idle frame
            # keeps the last wait's works, and with them its buffers, for as long as it lives.
            del job, works, box, done


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
        return abort_key()

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
            return decode_origin(self.store.get(key).decode(errors="replace"))
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
        ctx = self.context
        doing = what or "between steps"
        if ctx["action"]:
            doing += f" (step {ctx['step']}, {ctx['action']})"
        message = aborted_message(self.rank, origin, doing)
        return PipelineAborted(message, self.rank, int(origin.get("rank", -1)), origin)

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
                # The thread ends with its monitor (one per engine: a process running several
                # fits would otherwise keep one idle thread per engine it ever built).
                weakref.finalize(self, self._waiter.jobs.put, None)
            event, box = threading.Event(), []
            self._waiter.jobs.put((list(works), box, event))
            # The first slice is short: most waits finish within it and touch no store.
            if event.wait(self.poll_interval):
                self._finish(box, what, peer, ranks)
                return
            done = event.is_set
        published = False
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
                time.sleep(_poll_sleep(now - t0))
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

"""Launched jobs that run beside the in-process tests, started when the session starts.

A launched job (a real launcher starting 2-6 fresh interpreters that each import Lightning,
about 7 s of CPU apiece) spends much of its wall time waiting: for its ranks to import, for a
watchdog, for a grace period. The in-process tests leave one of the two cores idle most of the
time. So the jobs that only need their own output checked are started in the background at the
first test, ``WORKERS`` at a time, while the rest of the suite runs; their tests, collected
last, read the verdicts.

Tests whose assertions involve time measured on the machine (a measured bubble against the
simulator, an exit grace) must not share the CPU with a background job: their files carry
``pytestmark = pytest.mark.timing`` and run after every background job has finished
(``conftest.py`` orders the session and calls :func:`drain` before the first of them).

A test module offers jobs with a module-level function::

    def background_jobs(items, tmp_path_factory) -> dict[str, Callable[[], str]]:
        # items: this module's selected tests; return only the jobs they read
        return {"sigterm": lambda: _sigterm_case(Job(tmp_path_factory.mktemp("sigterm")))}

    def test_sigterm(...):
        background.check("sigterm")        # fails with the job's error, or returns its "ok" text

A job returns a short description when its checks passed and raises (``pytest.fail``, an
``assert``) otherwise; it kills whatever it started before it returns, as every launched test
does (tests/jobs.py). Each job keeps the bounds it always had (its start timeout, its
watchdog), measured from its own events, not from the session's.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

__all__ = ["WAIT", "check", "drain", "jobs_of_tests", "shutdown", "start", "summary"]

#: jobs at once. The foreground tests use about one core; two jobs fill the rest without
#: starving either side (three, as the fault matrix ran alone, put 12+ processes on 2 cores).
WORKERS = 2

#: pytest-timeout of a test that reads a verdict (``@pytest.mark.timeout(background.WAIT)``):
#: it may wait for every job queued before its own on a loaded 2-core machine. Each job keeps
#: its own bounds (its start timeout, its watchdog) and kills what it started at its end.
WAIT = 1800

_pool: ThreadPoolExecutor | None = None
_futures: dict[str, Future] = {}
_lock = threading.Lock()
_started_at: float | None = None
#: name -> (seconds after the first start when the job began, when it ended)
_spans: dict[str, tuple[float, float]] = {}


def _run(name: str, fn: Callable[[], str]) -> tuple[bool, str, float]:
    t0 = time.monotonic()
    try:
        return True, fn(), time.monotonic() - t0
    except BaseException as e:  # pytest.fail raises an OutcomeException: a BaseException
        return False, f"{type(e).__name__}: {e}", time.monotonic() - t0
    finally:
        assert _started_at is not None
        _spans[name] = (t0 - _started_at, time.monotonic() - _started_at)


def jobs_of_tests(
    items: Iterable, tmp_path_factory, table: dict[str, Callable[[Path], str]]
) -> dict[str, Callable[[], str]]:
    """The usual ``background_jobs``: ``table`` maps a test's name to its job (called with a
    fresh temporary directory); the job of each selected test, named after the test."""
    names = {getattr(item, "originalname", item.name) for item in items} & set(table)
    return {
        name: functools.partial(table[name], tmp_path_factory.mktemp(name[:40]))
        for name in sorted(names)
    }


def start(jobs: dict[str, Callable[[], str]]) -> None:
    """Queue ``jobs`` (name -> job); names must be unique over the session."""
    global _pool, _started_at
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="background-job")
            _started_at = time.monotonic()
        for name, fn in jobs.items():
            if name in _futures:
                raise ValueError(f"background job {name!r} started twice")
            _futures[name] = _pool.submit(_run, name, fn)


def check(name: str) -> str:
    """Wait for job ``name``; fail the calling test with the job's error, or return its text."""
    if name not in _futures:
        pytest.fail(
            f"background job {name!r} was not started (is its module's background_jobs "
            f"returning it for this selection?)"
        )
    ok, text, seconds = _futures[name].result()
    if not ok:
        pytest.fail(f"background job {name!r} failed after {seconds:.0f}s: {text}", pytrace=False)
    return f"{text} (background, {seconds:.0f}s)"


def summary() -> str | None:
    """One line for the end of the session: how many jobs ran and when the last one ended (in
    seconds after the first started), to show whether the background set the session's pace."""
    if not _spans:
        return None
    end = max(e for _, e in _spans.values())
    took = {name: e - b for name, (b, e) in _spans.items()}
    ranked = sorted(took, key=took.__getitem__, reverse=True)
    slowest = ", ".join(f"{n} {took[n]:.0f} s" for n in ranked[:8])
    return (
        f"background jobs: {len(_spans)} ran {WORKERS} at a time, {sum(took.values()):.0f} s of "
        f"job time, the last ended {end:.0f} s after the first started; slowest: {slowest}"
    )


def drain() -> None:
    """Wait until every started job has finished (before the timing-sensitive tests)."""
    for future in list(_futures.values()):
        future.result()


def shutdown() -> None:
    """End of session: cancel what has not started, wait for what runs (each job is bounded
    and kills its processes itself)."""
    global _pool
    with _lock:
        if _pool is not None:
            _pool.shutdown(wait=True, cancel_futures=True)
            _pool = None
        _futures.clear()

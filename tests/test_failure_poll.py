"""The polled wait (NCCL's, whose works report completion) notices a completed work within one
short poll, and backs off only once the wait is a stall. On a fake clock: no wall-clock limits;
what is asserted is when the monitor looks, not how fast this machine is."""

from __future__ import annotations

import types

import pytest

from lightning_pp.runtime import failure
from lightning_pp.runtime.errors import PipelineHang
from lightning_pp.runtime.failure import FailureMonitor

pytestmark = pytest.mark.quick


class _Clock:
    """Fake ``time`` for the monitor: ``sleep`` advances ``monotonic`` and is recorded."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[tuple[float, float]] = []  # (time slept at, seconds)

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append((self.now, seconds))
        self.now += seconds


class _Work:
    def __init__(self, clock: _Clock, at: float) -> None:
        self.clock, self.at, self.waited = clock, at, False

    def is_completed(self) -> bool:
        return self.clock.now >= self.at

    def wait(self) -> bool:
        self.waited = True
        return True


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(failure, "time", types.SimpleNamespace(**{
        name: getattr(c, name) for name in ("monotonic", "time", "sleep")
    }))  # fmt: skip
    return c


@pytest.mark.parametrize("after", [0.0003, 0.0123, 0.4])
def test_a_completed_work_is_noticed_within_one_short_poll(clock: _Clock, after: float) -> None:
    monitor = FailureMonitor(None, 0, poll_works=True, watchdog_timeout=30.0)
    start = clock.now
    work = _Work(clock, start + after)
    monitor.wait([work], "a work")
    assert work.waited  # the completed work is waited for (a backend error surfaces there)
    # seen at the first poll after it completed: the old doubling up to 2 ms returned a 12.3 ms
    # wait at 14.9 ms (polls at 0.1, 0.3, 0.7, 1.5, 3.1, 5.1, ...)
    assert start + after <= clock.now <= start + after + 1e-4 + 1e-12
    assert max(s for _, s in clock.sleeps) <= 1e-4


def test_a_stalled_wait_backs_off_to_millisecond_polls(clock: _Clock) -> None:
    monitor = FailureMonitor(None, 0, poll_works=True, watchdog_timeout=30.0)
    start = clock.now
    monitor.wait([_Work(clock, start + 3.0)], "a stalled work")
    fast = [s for t, s in clock.sleeps if t - start < 1.0]
    slow = [s for t, s in clock.sleeps if t - start >= 1.0]
    assert max(fast) <= 1e-4 and set(slow) == {1e-3}
    # about 1 s / 0.1 ms + 2 s / 1 ms polls: bounded CPU for a long stall
    assert len(clock.sleeps) < 1.0 / 1e-4 + 2.0 / 1e-3 + 10
    assert start + 3.0 <= clock.now <= start + 3.0 + 1e-3 + 1e-12


def test_the_watchdog_still_fires_between_short_polls(clock: _Clock) -> None:
    monitor = FailureMonitor(None, 0, poll_works=True, watchdog_timeout=2.0, poll_interval=0.05)
    start = clock.now
    with pytest.raises(PipelineHang, match="a work that never completes"):
        monitor.wait([_Work(clock, float("inf"))], "a work that never completes")
    assert 2.0 <= clock.now - start <= 2.0 + 0.05 + 1e-3 + 1e-9

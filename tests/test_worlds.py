"""The shared-world harness itself: cases run on every rank, a failing or hanging case is
reported with every rank's story and takes the world down, and the next call gets a new one."""

from __future__ import annotations

import os
import time

import pytest
from distributed import DistributedFailure, kill_all, kill_and_expect_gone
from worlds import World, world

from lightning_pp.runtime.local_process import is_gone

pytestmark = pytest.mark.quick


def _rank_and_pid(rank, size, scale):
    import torch.distributed as dist

    return dist.get_rank() * scale, size, os.getpid()


def _fails_on_rank_1(rank, size):
    print(f"rank {rank} says hello", flush=True)
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    return rank


def _sleeps(rank, size):
    time.sleep(60 if rank == 0 else 0)
    return rank


def test_cases_share_the_ranks_and_failures_name_the_rank():
    w = world("gloo", 2)
    first = w.run(_rank_and_pid, 10)
    second = w.run(_rank_and_pid, 1)
    assert [v for v, _, _ in first] == [0, 10] and [s for _, s, _ in first] == [2, 2]
    assert [p for _, _, p in first] == [p for _, _, p in second]  # the same processes
    with pytest.raises(DistributedFailure) as err:
        w.run(_fails_on_rank_1)
    text = str(err.value)
    assert "rank 1 broke on purpose" in text and "ValueError" in text
    assert "rank 1 says hello" in text  # the rank's own output, shown on failure
    assert not w.alive
    fresh = world("gloo", 2)  # the failed world was replaced
    assert fresh is not w and fresh.run(_rank_and_pid, 1)[1][0] == 1


def test_a_hanging_case_is_killed_at_its_timeout():
    w = World("gloo", 2)
    t0 = time.monotonic()
    with pytest.raises(DistributedFailure) as err:
        w.run(_sleeps, timeout=4)
    assert time.monotonic() - t0 < 30
    assert "killed after timeout=4s" in str(err.value)
    assert not w.alive
    for pid in err.value.pids:  # every rank is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


_SESSION = """
import json, sys, time
sys.path.insert(0, {tests!r})
import distributed
distributed.PRELOAD[:] = []  # a bare forkserver: the ranks import what they use (faster here)
from worlds import World
if __name__ == "__main__":
    w = World("gloo", 2)
    ranks = w.pids
    stat = open(f"/proc/{{ranks[0]}}/stat").read()
    server = int(stat.rsplit(")", 1)[1].split()[1])  # the ranks' parent: the forkserver
    print(json.dumps({{"ranks": ranks, "server": server}}), flush=True)
    time.sleep(600)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_killed_session_leaves_no_world_behind(tmp_path):
    """A test session killed outright (SIGKILL: no clean-up runs) takes its world along: the
    ranks, which run in sessions of their own, kill themselves once the session's end of their
    owner pipe closes, and the forkserver then exits too. Before, both stayed for good."""
    import json
    import select
    import subprocess
    import sys

    script = tmp_path / "session.py"
    script.write_text(_SESSION.format(tests=os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    pids: list[int] = []
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the session did not build its world within 120 s"
        started = json.loads(proc.stdout.readline())
        pids = [*started["ranks"], started["server"]]
        assert not any(map(is_gone, pids)), started
        assert not kill_and_expect_gone(proc, pids), f"left running: {started}"
    finally:
        kill_all([proc.pid, *pids])
        proc.wait(timeout=30)

"""The shared-world harness itself: cases run on every rank, a failing or hanging case is
reported with every rank's story and takes the world down, and the next call gets a new one."""

from __future__ import annotations

import os
import time

import pytest
from distributed import DistributedFailure
from worlds import World, world

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

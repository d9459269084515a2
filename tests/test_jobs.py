"""tests/jobs.py: a timed-out job is killed with everything it started, its output is kept."""

from __future__ import annotations

import sys
import time

from jobs import kill_group, run_job, wait_group_gone

from lightning_pp.runtime.local_process import is_gone


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not is_gone(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def test_exit_code_and_merged_output():
    r = run_job(["sh", "-c", "echo to-stdout; echo to-stderr >&2; exit 3"], timeout=60)
    assert not r.timed_out
    assert r.returncode == 3
    assert "to-stdout\n" in r.output and "to-stderr\n" in r.output
    assert r.describe().startswith("exit code 3: sh -c")


def test_timeout_kills_the_group_and_keeps_the_output():
    r = run_job(["sh", "-c", "echo before-the-hang; exec sleep 30"], timeout=1)
    print(f"timed-out job returned after {r.seconds:.2f} s")
    assert r.timed_out
    assert r.seconds < 30  # did not wait for the sleep to end
    assert r.returncode == -9  # SIGKILL
    assert "before-the-hang" in r.output
    assert r.describe().startswith("timed out after 1s: sh -c")
    assert wait_group_gone(r.pgid, within=5)


def test_timeout_kills_a_descendant_that_left_the_session():
    # Like a torchrun worker: own session, and it holds the output pipe (reading it must not hang)
    script = "setsid sleep 60 & echo escaped=$!; sleep 60"
    r = run_job(["sh", "-c", script], timeout=2)
    assert r.timed_out
    assert r.seconds < 60
    escaped = int(r.output.split("escaped=")[1].split()[0])
    assert _gone_within(escaped, 5), f"pid {escaped} outlived the job"


def test_leftovers_killed_by_default_and_kept_on_request():
    # the leader exits at once; a background child stays in the group (not on the pipe)
    cmd = ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo child=$!"]
    r = run_job(cmd, timeout=60)
    assert r.returncode == 0 and not r.timed_out
    assert wait_group_gone(r.pgid, within=5)

    r = run_job(cmd, timeout=60, kill_leftovers=False)
    assert r.returncode == 0
    child = int(r.output.split("child=")[1].split()[0])
    assert not is_gone(child)
    assert not wait_group_gone(r.pgid, within=0.5)  # it really waits on a live group
    kill_group(r.pgid)
    assert wait_group_gone(r.pgid, within=5)


def test_env_and_cwd_reach_the_job(tmp_path):
    code = "import os; print(os.environ['JOBS_TEST_VALUE'], os.getcwd())"
    r = run_job(
        [sys.executable, "-c", code], env={"JOBS_TEST_VALUE": "forty-two"}, cwd=tmp_path, timeout=60
    )
    assert r.returncode == 0, r.describe()
    assert r.output.split() == ["forty-two", str(tmp_path)]

"""Start a test job in its own session and make sure nothing of it outlives a timeout.

Every multi-process test launches a command (torchrun, a script using Lightning's launcher, a
shell example) whose processes must all be gone when the test is over, and a hung job must turn
into a failure with the job's output, never into a hung test run. This module is the one place
that does it:

* the job starts in a new session (``start_new_session=True``), so its process group id is the
  leader's pid and one ``killpg`` reaches every process that stayed in the group;
* processes that left the group (torchrun starts each worker in its own session) are found by
  walking ``/proc`` for descendants of the leader *before* anything is killed (once the leader is
  gone they are re-parented and no longer findable);
* stderr is merged into stdout, and the output gathered up to a timeout is kept.

Usage::

    from jobs import run_job

    result = run_job([sys.executable, "script.py"], env=env, timeout=240)
    if result.timed_out:
        pytest.fail(result.describe(4000))
    assert result.returncode == 0, result.tail(4000)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from lightning_pp.planner.verify import free_port  # a job's rendezvous port

# After a kill, how long to keep collecting output that is still buffered in the pipe. Bounded:
# a process that escaped both the group and the descendant walk may hold the pipe open forever.
DRAIN_SECONDS = 10.0


@dataclass(frozen=True)
class JobResult:
    """What :func:`run_job` saw.

    ``returncode`` is the leader's exit status (negative: killed by that signal; after a timeout
    it is ``-SIGKILL``). ``pgid`` is the job's process group id (the leader's pid), usable with
    :func:`wait_group_gone` after the job. ``seconds`` is the wall time ``run_job`` took.
    """

    cmd: tuple[str, ...]
    returncode: int
    output: str
    timed_out: bool
    seconds: float
    timeout: float
    pgid: int

    def tail(self, chars: int = 4000) -> str:
        """The last ``chars`` characters of the merged stdout/stderr."""
        return self.output[-chars:]

    def describe(self, chars: int = 4000) -> str:
        """One-line verdict (timed out / exit code) with the command, then the output tail."""
        if self.timed_out:
            what = f"timed out after {self.timeout}s"
        else:
            what = f"exit code {self.returncode}"
        return f"{what}: {' '.join(self.cmd)}\n{self.tail(chars)}"


def start_job(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    stdout: IO | None = None,
) -> subprocess.Popen:
    """Start ``cmd`` as the leader of a new session, stderr merged into stdout.

    ``env`` is the complete environment (``None``: inherit this process's). ``stdout`` is an open
    file to write the output to; ``None`` gives a pipe (bytes). Stop it with :func:`kill_job`.
    """
    return subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=None if env is None else dict(env),
        stdout=subprocess.PIPE if stdout is None else stdout,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, whatever its session or group (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while we were looking
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name may contain spaces
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_job(pgid: int) -> None:
    """SIGKILL the job led by ``pgid``: its process group and every descendant of the leader.

    Call it while the leader is not yet reaped (``proc.poll()`` is ``None``): the descendant walk
    starts from its pid. Does not reap the leader (call ``proc.wait()`` after).
    """
    # Snapshot first: killing the leader re-parents its children and hides them from the walk.
    for pid in descendants(pgid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    kill_group(pgid)


def kill_group(pgid: int) -> None:
    """SIGKILL whatever is left in process group ``pgid`` (safe after the leader was reaped)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    """Whether any process is still in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_group_gone(pgid: int, within: float) -> bool:
    """Poll until process group ``pgid`` is empty; ``False`` if it still is not after ``within`` s.

    Kills nothing: a caller that gets ``False`` should :func:`kill_group` and fail.
    """
    deadline = time.monotonic() + within
    while group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def _text(raw: bytes | None) -> str:
    # Like text mode's universal newlines, without its failure on a torn multi-byte character.
    text = (raw or b"").decode("utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def run_job(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float,
    kill_leftovers: bool = True,
) -> JobResult:
    """Run ``cmd`` in its own session until it ends or ``timeout`` seconds pass; never hangs.

    The job has ended when its leader exited and every holder of its output pipe closed it (so
    the output of a launcher's child ranks is complete). On timeout the job is killed
    (:func:`kill_job`), reaped, and the output gathered so far is returned with
    ``timed_out=True``. With ``kill_leftovers`` (default), whatever is still in the group after
    the job ended (a rank left behind by a failed peer) is killed too; pass ``False`` to check
    with :func:`wait_group_gone` that the job cleans up by itself.
    """
    start = time.monotonic()
    proc = start_job(cmd, env=env, cwd=cwd)
    timed_out = False
    try:
        raw, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_job(proc.pid)
        try:  # what is still buffered in the pipe; communicate() resumes without losing output
            raw, _ = proc.communicate(timeout=DRAIN_SECONDS)
        except subprocess.TimeoutExpired as e:  # an escaped process holds the pipe: stop reading
            raw = e.output
            proc.stdout.close()
            proc.wait()
    finally:
        if proc.returncode is None:  # interrupted (e.g. Ctrl-C): take the whole job down
            kill_job(proc.pid)
            proc.wait()
        elif kill_leftovers:  # the leader is reaped (its pid may be reused): the group only
            kill_group(proc.pid)
    return JobResult(
        cmd=tuple(str(c) for c in cmd),
        returncode=proc.returncode,
        output=_text(raw),
        timed_out=timed_out,
        seconds=time.monotonic() - start,
        timeout=timeout,
        pgid=proc.pid,
    )


def torchrun_command(nproc: int, script: str | Path, *args: str) -> list[str]:
    """``python -m torch.distributed.run`` of ``script`` on ``nproc`` local processes, one
    node, rendezvous on a free local port: the launcher users run."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
        *args,
    ]

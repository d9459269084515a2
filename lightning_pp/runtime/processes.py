"""The processes of a job: ending them together, printing a failure once, leaving on SIGTERM.

Three pieces used by :class:`~lightning_pp.strategy.process_group.ProcessGroupStrategy`:

* :class:`ChildSupervisor`: the launching process (local rank 0 under ``devices=N``) watches the
  ranks it started. When one exits with an error, the others get ``grace`` seconds to stop by
  themselves (they do, through the abort channel), then every child still there is killed with
  SIGKILL (which also ends a stopped process; SIGTERM would stay pending on it) and so is the
  launcher. When the launcher itself fails, :meth:`ChildSupervisor.end_children` does the same
  before it exits, so no rank is left behind with parent pid 1.
* :func:`install_excepthook`: a pipeline failure prints the cause once. The rank that failed
  first prints its original traceback and the step report; a rank stopped by another rank's
  failure prints one ``PipelineAborted`` line. The process then exits at once with code 1:
  an interpreter teardown that destroys abandoned gloo work can block for minutes.
* :func:`slurm_requeue`: ``scontrol requeue <job id>``, as Lightning's
  ``SLURMEnvironment(auto_requeue=True)`` does, for the SIGTERM path of the strategy.

Example::

    supervisor = ChildSupervisor(procs).start()     # in the launching process
    try:
        train()
    except BaseException:
        supervisor.end_children()                   # nothing outlives a failed launcher
        raise
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .errors import DEFAULT_EXIT_GRACE, aborted_message
from .failure import PipelineAborted, PipelineHang
from .heartbeats import current_watcher

__all__ = [
    "SIGTERM_EXIT_CODE",
    "ChildSupervisor",
    "consequence_line",
    "format_failure",
    "install_excepthook",
    "slurm_job_id",
    "slurm_requeue",
]

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
"""Exit code of a rank that stopped because of SIGTERM (the shell's convention, 143)."""

# Exit codes of children that left because of SIGTERM (handled: 143; not handled: -15). The
# launcher is on the same path then and finishes by itself; they are not failures to act on.
_SIGTERM_CODES = (SIGTERM_EXIT_CODE, -signal.SIGTERM)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGKILL)  # also ends a stopped process
        except OSError:
            pass


class ChildSupervisor:
    """Watch the child ranks of a launching process; end the job together on a failure.

    Replaces Lightning's child-process observer, which SIGKILLs every process (the launcher
    included) at its next 5-second poll after a child fails, often before the survivors have
    printed who failed, and which dies with the launcher, leaving the children behind.

    Args:
        procs: the child processes (``subprocess.Popen``), local ranks 1, 2, ...
        grace: seconds the remaining processes get to stop by themselves after a child failed.
        poll: seconds between two looks at the children.
        exit: called with 1 to end the launcher when it outlives the grace (``os._exit``).
    """

    def __init__(
        self,
        procs: Sequence[subprocess.Popen],
        *,
        grace: float = 2 * DEFAULT_EXIT_GRACE,
        poll: float = 0.25,
        exit: Callable[[int], Any] = os._exit,
    ) -> None:
        self.procs = list(procs)
        self.grace = grace
        self.poll = poll
        self._exit = exit
        self._done = threading.Event()

    def start(self) -> ChildSupervisor:
        threading.Thread(target=self._run, name="lightning_pp-children", daemon=True).start()
        atexit.register(self._at_exit)
        return self

    def _run(self) -> None:
        failed_at: float | None = None
        while not self._done.wait(self.poll):
            codes = [p.poll() for p in self.procs]
            if all(c == 0 for c in codes):
                return
            bad = [
                (i + 1, p.pid, c)
                for i, (p, c) in enumerate(zip(self.procs, codes))
                if c not in (None, 0, *_SIGTERM_CODES)
            ]
            if not bad:
                continue
            now = time.monotonic()
            failed_at = failed_at or now
            if now - failed_at < self.grace:
                continue
            for p in self.procs:
                _kill(p)
            local, pid, code = bad[0]
            sys.stderr.write(
                f"[lightning-pp] local rank {local} (pid {pid}) exited with code {code} and this "
                f"launcher was still running {self.grace:g} s later: ending the job\n"
            )
            sys.stderr.flush()
            self._exit(1)
            return

    def end_children(self, grace: float | None = None) -> None:
        """The launcher is failing: give the children ``grace`` seconds, then SIGKILL them."""
        self._done.set()
        deadline = time.monotonic() + (self.grace if grace is None else grace)
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        for p in self.procs:
            _kill(p)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def _at_exit(self) -> None:
        # The launcher leaves normally: children still running are finishing their own work
        # (Lightning's behaviour); only stop watching them.
        self._done.set()


# ------------------------------------------------------------------------------- error output
def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def format_failure(exc: BaseException, rank: int | None = None) -> str | None:
    """What a rank prints for a pipeline failure, or ``None`` for any other exception.

    * stopped by another rank (:class:`PipelineAborted` anywhere in the chain): one line;
    * the rank that failed first (a ``PipelineStepError`` or :class:`PipelineHang`): the
      traceback of the original exception (the user's frames, where it happened) followed by
      the step report (rank, action, schedule grid), without Lightning's and the engine's
      frames and without repeating the cause's text in every link of the chain.
    """
    chain = _chain(exc)
    aborted = next((e for e in chain if isinstance(e, PipelineAborted)), None)
    prefix = f"[rank{rank}]: " if rank is not None else ""
    if aborted is not None:
        return f"{prefix}PipelineAborted: {aborted}\n"
    step = next((e for e in chain if type(e).__name__ == "PipelineStepError"), None)
    if step is None and not any(isinstance(e, PipelineHang) for e in chain):
        return None
    report = step or next(e for e in chain if isinstance(e, PipelineHang))
    root = chain[-1]
    lines: list[str] = []
    if root is not report and not isinstance(root, PipelineHang):
        # Only the root's own frames: its chain is printed as the report below.
        lines += traceback.format_exception(type(root), root, root.__traceback__, chain=False)
        lines.append("\nwhich failed this pipeline step:\n")
    lines.append(f"{type(report).__name__}: {report}\n")
    text = "".join(lines)
    if prefix:
        text = "".join(prefix + ln for ln in text.splitlines(keepends=True))
    return text


_HOOK_INSTALLED = False


# gloo's and c10d's messages start with their C++ source location: "[.../pair.cc:553] ..."
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def consequence_line(exc: BaseException, rank: int) -> str | None:
    """One ``PipelineAborted`` line when ``exc`` is the consequence of another rank's failure
    (that rank raised first, or vanished: asked of this process's
    :class:`~lightning_pp.runtime.heartbeats.ProcessWatcher`), else ``None``.

    Errors of unwatched communication, e.g. a closed connection inside a collective of a
    checkpoint save after its peer was killed, would otherwise print a full traceback that
    names nobody."""
    watcher = current_watcher()
    if watcher is None or not isinstance(exc, Exception):
        return None
    origin = watcher.failure_origin()
    if origin is None:
        return None
    first = _SOURCE_LOCATION.sub("", (str(exc).splitlines() or [""])[0])
    if len(first) > 100:
        first = first[:97] + "..."
    doing = f"with {type(exc).__name__}" + (f" ({first})" if first else "")
    return f"[rank{rank}]: PipelineAborted: {aborted_message(rank, origin, doing)}\n"


def install_excepthook(rank: Callable[[], int]) -> None:
    """Print pipeline failures with :func:`format_failure` and exit at once (code 1).

    An exception caused by another rank's failure prints one line
    (:func:`consequence_line`). Other exceptions go to the previous hook (torch's, which
    prefixes ``[rankN]:``); the process then also exits at once, since the job has failed and
    its gloo teardown can block.
    """
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED:
        return
    _HOOK_INSTALLED = True
    previous = sys.excepthook

    def hook(exc_type: type, exc: BaseException, tb: Any) -> None:
        try:
            text = format_failure(exc, rank())
            if text is None:
                text = consequence_line(exc, rank())
            if text is None:
                previous(exc_type, exc, tb)
            else:
                sys.stderr.write(text)
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(1)

    sys.excepthook = hook


# ------------------------------------------------------------------------------- SLURM
def slurm_job_id(environ: dict[str, str] | None = None) -> str | None:
    """The id ``scontrol requeue`` takes: ``ARRAYJOB_TASK`` for an array task, else the job's."""
    env = os.environ if environ is None else environ
    array = env.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{env['SLURM_ARRAY_TASK_ID']}" if array is not None else env.get("SLURM_JOB_ID")
    if job is None or not re.fullmatch(r"[0-9_]+", job):
        return None
    return job


def slurm_requeue(job_id: str) -> int:
    """Run ``scontrol requeue JOB_ID``; its exit code (127 when ``scontrol`` is missing)."""
    try:
        return subprocess.call(["scontrol", "requeue", job_id])
    except FileNotFoundError:
        return 127

"""Shared worlds: ``size`` ranks forked once, serving many cases, across test files.

A :class:`World` is a set of rank processes forked from the test session's forkserver (torch,
Lightning and the package already imported there, :data:`distributed.PRELOAD`), each looping
over cases sent to it. Two kinds:

- ``"gloo"``: the default process group is initialised once (a file store), as
  :func:`distributed.run_distributed` does; each case builds its own subgroups. For engine-level
  cases.
- ``"trainer"``: the ranks look like torchrun's workers (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``, ``TORCHELASTIC_RUN_ID``...), so Lightning picks its
  ``TorchElasticEnvironment`` and creates no process: each case runs a real ``Trainer`` with
  ``devices=size``; the first one initialises the process group, the next ones reuse it. For
  Trainer-level cases, which then pay no interpreter start and no ``import lightning`` (about
  9 s per process on a 2-core machine) and no launcher.

The real launchers (Lightning's, torchrun, ``fabric run``, SLURM's environment) keep their own
tests, which launch real jobs (:mod:`jobs`).

A world lives for the whole session (:func:`world`), one per ``(kind, size)``; it is closed at
the session's end (``conftest.py``). A case that fails on any rank, or runs past its timeout,
takes the world down (every rank's process group killed) and the next case gets a fresh one,
so one broken case cannot leave state behind for the next. Cases must leave the process as they
found it otherwise (environment variables, global switches): the usual test hygiene.

Usage (``fn`` must be a module-level function, importable by the ranks)::

    from worlds import world

    def _case(rank, size, scale):
        return float(torch.distributed.get_rank()) * scale

    def test_it():
        assert world("gloo", 2).run(_case, 10.0) == [0.0, 10.0]
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import queue as queue_mod
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from distributed import DistributedFailure, _context, _kill

from lightning_pp.runtime.owned_process import die_with_owner, owner_link

__all__ = ["World", "close_all", "world"]

#: the per-case default, seconds; a case may ask for more
DEFAULT_TIMEOUT = 300.0


def _serve(
    kind: str,
    rank: int,
    size: int,
    init: str,
    tasks: Any,
    results: Any,
    log: str,
    owner: Any,
) -> None:
    """One rank: set up once, then run cases until told to stop. Its output (Lightning's
    banners, the strategy's start log, warnings) goes to the file ``log``: a passing test
    prints nothing, a failing one shows the tail of every rank's log. ``owner``: the ranks' end
    of the session's :func:`~lightning_pp.runtime.owned_process.owner_link` (the rank dies with
    the session)."""
    die_with_owner(owner)  # its own process group, tied to the session's life
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if kind == "gloo":
            dist.init_process_group(
                "gloo",
                init_method=f"file://{init}",
                rank=rank,
                world_size=size,
                timeout=timedelta(seconds=120),
            )
        else:
            # What torchrun gives each worker: Lightning's TorchElasticEnvironment then takes
            # the ranks from here and launches nothing.
            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=init,
                WORLD_SIZE=str(size),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(size),
                GROUP_RANK="0",
                NODE_RANK="0",
                TORCHELASTIC_RUN_ID="lightning-pp-tests",
            )
        results.put((None, rank, True, None))  # ready
    except BaseException:
        results.put((None, rank, False, traceback.format_exc()))
        return
    while True:
        item = tasks.get()
        if item is None:
            break
        case, fn, args, dump_after = item
        # A case that hangs prints every thread's stack shortly before the parent kills it.
        faulthandler.dump_traceback_later(max(1.0, dump_after), exit=False)
        try:
            value, ok = fn(rank, size, *args), True
        except BaseException:
            value, ok = traceback.format_exc(), False
        finally:
            faulthandler.cancel_dump_traceback_later()
        try:
            results.put((case, rank, ok, value))
        except Exception:  # an unpicklable value: report that instead
            results.put((case, rank, False, traceback.format_exc()))


class World:
    """``size`` ranks of ``kind`` (``"gloo"`` or ``"trainer"``) forked once; see the module
    docstring. :meth:`run` sends one case to every rank and returns their values."""

    def __init__(self, kind: str, size: int) -> None:
        if kind not in ("gloo", "trainer"):
            raise ValueError(f"kind must be 'gloo' or 'trainer', got {kind!r}")
        self.kind, self.size = kind, size
        self._cases = itertools.count()
        ctx = _context()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(size)]
        if kind == "gloo":
            fd, init = tempfile.mkstemp(prefix="lpp_world_")
            os.close(fd)
            os.unlink(init)  # FileStore creates it; a stale file would confuse it
            self._init_file: str | None = init
        else:
            from lightning_pp.planner.verify import free_port

            init, self._init_file = str(free_port()), None
        self._logdir = tempfile.mkdtemp(prefix=f"lpp_{kind}{size}_")
        self.logs = [os.path.join(self._logdir, f"rank{r}.log") for r in range(size)]
        # Kept open while the world lives: the ranks die when it closes (this process's end)
        for_ranks, self._owner = owner_link(ctx)
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(
                    kind, r, size, init, self._tasks[r], self._results, self.logs[r], for_ranks
                ),
                daemon=True,
            )
            for r in range(size)
        ]  # fmt: skip
        for p in self._procs:
            p.start()
        for_ranks.close()
        self.alive = True
        self._collect(None, timeout=120.0)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_TIMEOUT) -> list:
        """``fn(rank, size, *args)`` on every rank; their return values in rank order.

        Raises:
            DistributedFailure: a rank raised (its traceback included), died or ran past
                ``timeout``; the world is then closed (the next :func:`world` call builds a
                new one).
        """
        if not self.alive:
            raise RuntimeError(f"the {self.kind} world of {self.size} was closed")
        case = next(self._cases)
        for q in self._tasks:
            q.put((case, fn, args, timeout - 3))
        return self._collect(case, timeout, name=getattr(fn, "__name__", str(fn)))

    def _collect(self, case: int | None, timeout: float, name: str = "set-up") -> list:
        done: dict[int, Any] = {}
        failures: dict[int, str] = {}
        start = time.monotonic()
        deadline = start + timeout
        first_failure: float | None = None
        while len(done) + len(failures) < self.size and time.monotonic() < deadline:
            try:
                got, rank, ok, value = self._results.get(timeout=0.2)
            except queue_mod.Empty:
                for r, p in enumerate(self._procs):
                    if r not in done and r not in failures and not p.is_alive():
                        failures[r] = f"exited with code {p.exitcode} without a result"
                if failures and first_failure is None:
                    first_failure = time.monotonic()
                    deadline = min(deadline, first_failure + 10.0)
                continue
            if got != case:
                continue  # a late answer of an earlier, failed case (its world is gone)
            if ok:
                done[rank] = value
            else:
                failures[rank] = value
                if first_failure is None:
                    first_failure = time.monotonic()
                    deadline = min(deadline, first_failure + 10.0)
        if len(done) == self.size:
            return [done[r] for r in range(self.size)]
        for r in range(self.size):
            if r not in done and r not in failures:
                failures[r] = (
                    f"killed: still running {time.monotonic() - first_failure:.1f}s after "
                    f"rank(s) {sorted(failures)} failed"
                    if first_failure is not None
                    else f"killed after timeout={timeout:.0f}s"
                )
        pids = self.pids
        self.close(keep_logs=True)
        parts = [f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures)]
        parts += [
            f"--- rank {r}: the end of its output ---\n{self.log_tail(r)}" for r in range(self.size)
        ]
        shutil.rmtree(self._logdir, ignore_errors=True)
        raise DistributedFailure(
            f"{len(failures)} of {self.size} ranks failed running {name} in the shared "
            f"{self.kind} world:\n" + "\n".join(parts),
            failures,
            done,
            pids,
            [r for r in failures if r not in done],
        )

    def log_tail(self, rank: int, chars: int = 3000) -> str:
        """The last ``chars`` characters of what ``rank`` printed (every case so far)."""
        try:
            with open(self.logs[rank], errors="replace") as f:
                return f.read()[-chars:]
        except OSError as e:
            return f"(no output: {e})"

    def close(self, keep_logs: bool = False) -> None:
        """Stop every rank (and whatever it started); the world cannot run cases after."""
        if not self.alive:
            return
        self.alive = False
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            _kill(p)
            if p.pid is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # anything the rank left in its group
                except (ProcessLookupError, PermissionError, OSError):
                    pass
        for p in self._procs:
            p.join(timeout=5)
        self._owner.close()
        if self._init_file is not None:
            try:
                os.unlink(self._init_file)
            except OSError:
                pass
        if not keep_logs:
            shutil.rmtree(self._logdir, ignore_errors=True)


_WORLDS: dict[tuple[str, int], World] = {}


def world(kind: str, size: int) -> World:
    """The session's live world of ``kind`` and ``size`` (built on first use, rebuilt after a
    failed case)."""
    key = (kind, size)
    current = _WORLDS.get(key)
    if current is None or not current.alive:
        current = _WORLDS[key] = World(kind, size)
    return current


def close_all() -> None:
    """Close every world (the session's end)."""
    for w in list(_WORLDS.values()):
        w.close()
    _WORLDS.clear()


SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


def script_main(rank: int, size: int, script: str, argv: list[str]) -> None:
    """A case that runs ``tests/scripts/<script>.py``'s ``main()`` with ``argv``, as torchrun
    would run it on this rank (the scripts read their world from the environment)."""
    import importlib
    import sys

    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    module = importlib.import_module(script)
    saved = sys.argv
    sys.argv = [os.path.join(SCRIPTS, f"{script}.py"), *argv]
    try:
        module.main()
    finally:
        sys.argv = saved

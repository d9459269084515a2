"""Multi-process test harness: run a function on every rank of a real gloo process group.

Usage (``fn`` must be a module-level function, importable by the ranks)::

    from distributed import run_distributed

    def _worker(rank, world_size, scale):
        t = torch.full((1,), float(rank))
        dist.all_reduce(t)
        return t.item() * scale

    def test_sum():
        assert run_distributed(_worker, 2, 10.0) == [10.0, 10.0]

Amortize start-up: starting a group costs an interpreter, the torch import and a rendezvous, so
let ONE group run a whole list of cases and return per-case results. Ranks are forked from a
forkserver that imported torch and the engine once (:func:`_context`): a world of 4 starts in
about 0.1 s where spawned ranks took 5-6 s on 2 cores, each importing torch itself.

Guarantees: every run has a wall-clock ``timeout`` after which every worker's process group
(the worker and anything it started) is killed and the test fails with a message; when a rank
fails, the others get ``grace`` seconds to finish (they may be blocked on the failed rank) and are
then killed. The raised :class:`DistributedFailure` carries each failing rank's traceback.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning_pp.runtime.owned_process import die_with_owner, owner_link

__all__ = ["DistributedFailure", "run_distributed"]


class DistributedFailure(AssertionError):
    """One or more ranks failed, crashed or were killed.

    ``failures`` maps rank -> traceback text (or a reason such as ``killed after timeout``);
    ``results`` holds the return values of the ranks that finished; ``pids`` the worker process
    ids (all reaped when this is raised); ``killed`` the ranks the harness had to kill.
    """

    def __init__(
        self,
        message: str,
        failures: dict[int, str],
        results: dict[int, Any],
        pids: list[int] | None = None,
        killed: list[int] | None = None,
    ):
        super().__init__(message)
        self.failures = failures
        self.results = results
        self.pids = pids or []
        self.killed = killed or []


def kill_and_expect_gone(proc: Any, pids: list[int], within: float = 30.0) -> list[int]:
    """SIGKILL ``proc`` (a ``subprocess.Popen`` that started the processes ``pids``), then wait
    up to ``within`` seconds for every one of ``pids`` to end; return those still running. The
    caller asserts on the result and kills what is left (:func:`kill_all`)."""
    from lightning_pp.runtime.local_process import is_gone

    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=within)
    deadline = time.monotonic() + within
    while not all(map(is_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if not is_gone(p)]


def kill_all(pids: list[int]) -> None:
    """SIGKILL every one of ``pids`` still there (a test's clean-up, whatever it found)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    args: tuple,
    results: Any,
    pg_timeout: float,
    backend: str,
    dump_after: float,
    owner: Any,
) -> None:
    die_with_owner(owner)  # its own process group, gone with the test session
    # A hung rank prints every thread's stack to stderr shortly before the parent kills it.
    faulthandler.dump_traceback_later(max(1.0, dump_after), exit=False)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        try:
            value, ok = fn(rank, world_size, *args), True
        except BaseException:
            value, ok = traceback.format_exc(), False
        # Report before tearing down: destroying a group whose waits were abandoned after an
        # abort can block, and a rank that never reports looks like a hang, hiding its error.
        results.put((rank, ok, value))
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


#: what the forkserver imports once; each rank is forked from it with these loaded
PRELOAD = [
    "torch",
    "torch.distributed",
    "lightning_pp.runtime.engine",
    # Trainer worlds (worlds.py): each rank gets Lightning without paying ~9 s to import it
    "lightning.pytorch",
    "lightning_pp.strategy",
    "lightning_pp.models.gpt",
]


def _context() -> Any:
    """The ``forkserver`` context, torch preloaded. A rank still starts from a clean process:
    the server only imported modules (it never ran a torch op, so no thread pool is forked),
    and it was itself started fresh, not forked from pytest."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _kill(proc: mp.process.BaseProcess) -> None:
    if proc.pid is None or not proc.is_alive():
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass
    proc.kill()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    grace: float = 10.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (forked from the forkserver);
    return per-rank values.

    Args:
        timeout: wall-clock seconds for the whole run; then everything is killed.
        pg_timeout: the process-group timeout (blocked collectives/receives raise after it).
        grace: seconds the surviving ranks get after the first rank failed.

    Raises:
        DistributedFailure: with every failing rank's traceback (and which ranks were killed).
    """
    ctx = _context()
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="lpp_store_")
    os.close(fd)
    os.unlink(init_file)  # FileStore creates it; a stale file from another run would confuse it
    for_ranks, owner = owner_link(ctx)
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                fn, r, world_size, init_file, args, results, pg_timeout, backend, timeout - 3,
                for_ranks,
            ),
            daemon=True,
        )
        for r in range(world_size)
    ]  # fmt: skip
    for p in procs:
        p.start()
    for_ranks.close()  # the ranks hold their copies; this process keeps only ``owner``
    done: dict[int, Any] = {}
    failures: dict[int, str] = {}
    start = time.monotonic()
    deadline = start + timeout
    first_failure: float | None = None
    killed: list[int] = []
    try:
        while len(done) + len(failures) < world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, ok, value = results.get(timeout=min(0.2, deadline - now))
            except queue_mod.Empty:
                # A rank that died without reporting (segfault, os._exit) never will.
                for r, p in enumerate(procs):
                    if r not in done and r not in failures and not p.is_alive():
                        time.sleep(0.2)  # its last message may still be in the pipe
                        try:
                            while True:
                                rr, ok2, v2 = results.get_nowait()
                                (done if ok2 else failures)[rr] = v2
                        except queue_mod.Empty:
                            pass
                        if r not in done and r not in failures:
                            failures[r] = f"exited with code {p.exitcode} without a result"
                if failures and first_failure is None:
                    first_failure = time.monotonic()
                    deadline = min(deadline, first_failure + grace)
                continue
            if ok:
                done[rank] = value
            else:
                failures[rank] = value
                if first_failure is None:
                    first_failure = time.monotonic()
                    deadline = min(deadline, first_failure + grace)
    finally:
        for r, p in enumerate(procs):
            if r not in done and r not in failures:
                killed.append(r)
                elapsed = time.monotonic() - start
                if first_failure is not None:
                    failed = sorted(failures)
                    failures[r] = (
                        f"killed: still running {time.monotonic() - first_failure:.1f}s after "
                        f"rank(s) {failed} failed"
                    )
                else:
                    failures[r] = f"killed after timeout={timeout:.0f}s (ran {elapsed:.1f}s)"
            _kill(p)
        for p in procs:
            p.join(timeout=5)
        results.close()
        owner.close()
        try:
            os.unlink(init_file)
        except OSError:
            pass
    if failures:
        parts = [f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures)]
        raise DistributedFailure(
            f"{len(failures)} of {world_size} ranks failed running {fn.__name__}:\n"
            + "\n".join(parts),
            failures,
            done,
            [p.pid for p in procs],
            killed,
        )
    return [done[r] for r in range(world_size)]

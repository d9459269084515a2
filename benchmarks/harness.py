"""Shared plumbing for the benchmarks: process launch, step timing, busy time, activation bytes.

Everything here is applied identically to lightning_pp and to ``torch.distributed.pipelining``,
so that the two are measured with the same ruler:

* :func:`launch` spawns one process per pipeline rank, joins them with a deadline and kills the
  whole group on timeout (a benchmark must never hang).
* :class:`Instrumented` wraps one pipeline chunk; it records the chunk's forward and backward
  wall time (the rank's *busy* time) and the bytes autograd saves for backward (activations),
  deduplicated by storage and excluding parameters.
* :func:`timed_step` runs one training step between two synchronisation points and returns the
  pipeline's wall time, ``max(end) - min(start)`` over ranks.

Example:
    >>> import torch
    >>> sink = RankStats()
    >>> chunk = Instrumented(torch.nn.Linear(4, 4), sink)
    >>> chunk(torch.randn(2, 4)).sum().backward()
    >>> sink.fwd_s > 0 and sink.bwd_s > 0 and sink.peak_saved_bytes > 0
    True
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pp.planner.verify import free_port, start_world
from lightning_pp.runtime.owned_process import die_with_owner

# --------------------------------------------------------------------------------------------
# Machine description (goes into every results file)
# --------------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """nproc, CPU model, load average, torch/lightning versions, date: what a reader needs."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    try:
        import lightning

        lightning_version = lightning.__version__
    except ImportError:  # pragma: no cover - lightning is a hard dependency of the project
        lightning_version = "n/a"
    gpu = None
    if torch.cuda.is_available():
        gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "gpu": gpu,
        "loadavg": [round(x, 2) for x in load],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning_version,
        "commit": commit,
    }


# --------------------------------------------------------------------------------------------
# Process launch
# --------------------------------------------------------------------------------------------


def init_process_group(rank: int, world_size: int, port: int, device: str) -> torch.device:
    """Join the benchmark's process group (gloo on CPU, nccl on CUDA); return this rank's device."""
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if device == "cuda":
        local = rank % torch.cuda.device_count()
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=_dt.timedelta(seconds=120),
        **({"device_id": dev} if device == "cuda" else {}),
    )
    return dev


def _worker_entry(fn, rank, world_size, port, device, args, queue, owner) -> None:
    die_with_owner(owner)  # a killed benchmark takes its ranks along
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        dev = init_process_group(rank, world_size, port, device)
        result = fn(rank, world_size, dev, args)
        queue.put((rank, "ok", result))
    except BaseException:  # report every failure to the parent, with the rank that raised it
        queue.put((rank, "error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def launch(
    fn: Callable[[int, int, torch.device, Any], Any],
    world_size: int,
    args: Any,
    *,
    device: str = "cpu",
    timeout: float = 1800.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, device, args)`` on ``world_size`` ranks forked from a fresh
    forkserver that imported torch once (the planner's :func:`world_context`); return results.

    ``fn`` must be importable (defined at module level). On any rank's error, or when ``timeout``
    seconds pass, every still-running worker is killed and a ``RuntimeError``
    (:class:`~lightning_pp.planner.verify.WorldFailure`) names the rank.
    """
    port = free_port()
    return start_world(
        _worker_entry,
        lambda rank, queue: (fn, rank, world_size, port, device, args, queue),
        world_size,
        timeout=timeout,
        poll=5.0,
    )


# --------------------------------------------------------------------------------------------
# Per-rank instrumentation: busy time and saved activation bytes
# --------------------------------------------------------------------------------------------


@dataclass
class RankStats:
    """What :class:`Instrumented` chunks of one rank accumulate during one step."""

    fwd_s: float = 0.0
    bwd_s: float = 0.0
    saved_bytes: int = 0
    peak_saved_bytes: int = 0
    _storages: dict = field(default_factory=dict, repr=False)
    _bwd_start: dict = field(default_factory=dict, repr=False)
    params: set = field(default_factory=set, repr=False)

    @property
    def busy_s(self) -> float:
        return self.fwd_s + self.bwd_s

    def reset(self) -> None:
        """Start a new step (live saved bytes carry over: they should be zero between steps)."""
        self.fwd_s = self.bwd_s = 0.0
        self.peak_saved_bytes = self.saved_bytes


class _Saved:
    """Holder of one saved tensor; its lifetime is the autograd graph's hold on the storage."""

    __slots__ = ("tensor", "key", "stats")

    def __init__(self, tensor: torch.Tensor, key, stats: RankStats) -> None:
        self.tensor, self.key, self.stats = tensor, key, stats

    def __del__(self) -> None:
        entry = self.stats._storages.get(self.key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.stats._storages[self.key]
            self.stats.saved_bytes -= entry[1]


def _pack(stats: RankStats):
    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        nbytes = min(t.numel() * t.element_size(), storage.nbytes())
        if storage.data_ptr() in stats.params or nbytes == 0:
            return t  # parameters are not activations; empty storages cost nothing
        # One key per distinct view: a transpose or ``view_as`` of a saved tensor counts once,
        # while a microbatch slice of a big batch counts its own bytes, not the whole batch's.
        key = (storage.data_ptr(), t.storage_offset(), nbytes, str(t.device))
        entry = stats._storages.get(key)
        if entry is None:
            stats._storages[key] = [1, nbytes]
            stats.saved_bytes += nbytes
            stats.peak_saved_bytes = max(stats.peak_saved_bytes, stats.saved_bytes)
        else:
            entry[0] += 1
        # A detached alias, as the engine's own meter stores: holding ``t`` itself (an output,
        # with its grad_fn) forms a cycle through the graph that only a releasing backward
        # breaks. A split backward's I retains the graph, so every microbatch's activations
        # then stayed counted (and alive) forever: 390 MB "peaks" under zb-h1 for a 16 MB bound.
        return _Saved(t.detach(), key, stats)

    return pack


def _unpack(obj):
    return obj.tensor if isinstance(obj, _Saved) else obj


class _BackwardEnd(torch.autograd.Function):
    """Identity on the chunk's input whose backward closes the chunk's backward interval."""

    @staticmethod
    def forward(ctx, x, chunk):  # type: ignore[override]
        ctx.chunk = chunk
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.chunk._close_backward()
        return grad, None


class Instrumented(nn.Module):
    """Wrap a chunk: time its forward/backward and meter the tensors autograd saves inside it.

    Saved bytes are counted per distinct view (a tensor saved twice, or a same-size view of it,
    counts once) and parameters are excluded; a storage leaves the count when the last autograd
    node holding it is freed. The meter's hooks are installed innermost, around the chunk only,
    so the same ruler applies to both pipeline implementations.

    Backward time runs from the gradient's arrival at the chunk's output to the input gradient
    (or, for a chunk whose input needs no gradient, the last parameter gradient: the marker must
    not make the first stage compute an input gradient it would otherwise skip). One chunk's
    backwards never overlap (each rank runs one action at a time), so one open interval suffices.
    """

    def __init__(self, inner: nn.Module, stats: RankStats, *, weight_hook: bool = True) -> None:
        super().__init__()
        self.inner = inner
        self.stats = stats
        self._bwd_t0: float | None = None
        params = [p for p in inner.parameters() if p.requires_grad]
        stats.params.update(p.untyped_storage().data_ptr() for p in params)
        self._hook = None
        # weight_hook=False for split-backward schedules: torch's weight step runs
        # autograd.grad, which refuses a multi-grad hook on leaves ("A leaf node was passed to
        # _will_engine_execute_node ..."); the backward interval then closes at the input
        # gradient only (the first stage's is not measured).
        if params and weight_hook:
            self._hook = torch.autograd.graph.register_multi_grad_hook(
                params, lambda grads: self._close_backward(), mode="all"
            )

    def _close_backward(self) -> None:
        if self._bwd_t0 is not None:
            self.stats.bwd_s += time.perf_counter() - self._bwd_t0
            self._bwd_t0 = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = self.stats
        if x.requires_grad:
            x = _BackwardEnd.apply(x, self)
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(_pack(stats), _unpack):
            y = self.inner(x)
        if y.is_cuda:
            torch.cuda.synchronize(y.device)
        stats.fwd_s += time.perf_counter() - t0
        if y.requires_grad:
            # A hook, not an identity Function: the chunk's output must stay a plain (non-view)
            # tensor, or an engine that frees sent outputs (Megatron-style) could not free it.
            y.register_hook(self._open_backward)
        return y

    def _open_backward(self, grad: torch.Tensor) -> None:
        self._bwd_t0 = time.perf_counter()


# --------------------------------------------------------------------------------------------
# Step timing
# --------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(step: Callable[[], Any], device: torch.device) -> tuple[float, float, float]:
    """Run ``step`` on every rank; return (wall seconds of the whole pipeline, start, end).

    Ranks meet at a barrier, each stamps its own start and end with the system-wide monotonic
    clock (same host), and the step's time is ``max(end) - min(start)``.
    """
    sync(device)
    dist.barrier()
    start = time.perf_counter()
    step()
    sync(device)
    end = time.perf_counter()
    stamps = torch.tensor([-start, end], dtype=torch.float64, device=device)
    dist.all_reduce(stamps, op=dist.ReduceOp.MAX)
    s, e = -stamps[0].item(), stamps[1].item()
    return e - s, s, e


def gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """All ranks' ``values`` (same length everywhere), indexed by rank."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")

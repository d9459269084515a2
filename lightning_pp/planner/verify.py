"""Run candidate shapes for a few steps and compare the planner's predictions with measurement.

``lightning-pp plan CONFIG --search --verify K`` runs the top ``K`` candidates and the config's
own shape, each in its own spawned world of ``dp x pp`` processes on the engine directly (as
``benchmarks/`` do; no Lightning loop, so what is measured is the pipeline step the planner
predicts), and prints predicted against measured step time and heaviest-rank activation peak.

What one run measures (:func:`measure`): ``warmup`` steps, then ``steps`` timed ones. A step's
time is ``max(end) - min(start)`` over every rank (ranks meet at a barrier first), from the
start of ``train_step`` to the end of the data-parallel gradient all-reduce (the optimizer step
is not run, and not predicted); the median is reported. The timed steps run without the
saved-bytes meter, as training does; one more, untimed step runs with it: the activation peak
of a rank is that step's ``StepRecord.peak_saved_bytes`` (``measure_memory=True``), the largest
over the rank's data-parallel replicas.

Every world runs under a deadline; on a failure or a timeout every process of the world (each
leads its own process group) is killed, and the failure is reported for that candidate only.

Calibration (:func:`fit_links`): a compute scale and the engine's fixed cost per action, fitted
over every action of a run (its measured compute, duration minus receive wait, against what the
profile says its layers cost, :func:`fit_compute`); the hop latency is
:func:`~lightning_pp.callbacks.analysis.p2p_latency` of the same records.

Example::

    spec = RunSpec(builder, batch, pp=2, vpp=1, microbatches=4, schedule="1f1b", counts=(3, 3))
    got = measure(spec, world=2, timeout=120)
    got.step_s, got.peak_saved          # median seconds; per pipeline rank bytes
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import multiprocessing as mp
import os
import queue as queue_mod
import random
import signal
import socket
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.owned_process import die_with_owner, owner_link
from ..runtime.records import StepRecord
from ..schedules import Op

__all__ = [
    "BuiltModel",
    "Calibration",
    "Measured",
    "RunSpec",
    "VerifyRow",
    "WorldFailure",
    "build_config_model",
    "calibrate_from_run",
    "fit_compute",
    "fit_links",
    "fit_timed",
    "format_verify_table",
    "measure",
    "measure_many",
    "pct_error",
    "resize_batch",
    "free_port",
    "run_world",
    "wait_for_world",
]


class WorldFailure(RuntimeError):
    """A spawned world failed: a rank raised, died, or the deadline passed (every process of
    it has been killed)."""


# ---- spawning a world -----------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a world's rendezvous), from below the kernel's
    ephemeral range where there is one.

    A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, which every
    outgoing connection draws from too (gloo opens one per pair of ranks), so between choosing
    the port and listening on it another process could take it: a job's store then failed
    with EADDRINUSE on such a port (35127) in a CI run with other jobs beside it. Nothing is
    handed out below the range unless asked for by number.

    Example:
        >>> 1024 <= free_port() < 65536
        True
    """
    low = _ephemeral_low()
    if low > _FIRST_PORT:
        for port in random.Random().sample(range(_FIRST_PORT, low), 64):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_FIRST_PORT = 20000  # above the registered services most machines run


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux), 0 where unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _child(
    fn: Callable[[int, int, Any], Any],
    rank: int,
    world: int,
    port: int,
    payload: Any,
    results: Any,
    threads: int,
    owner: Any,
) -> None:
    # Its own process group, so the parent can kill it and anything it started at once; and
    # gone with the parent, however that one ends (a killed `lightning-pp plan` left its ranks
    # computing or blocked in a collective until the group's timeout).
    die_with_owner(owner)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=_dt.timedelta(seconds=120),
        )
        results.put((rank, "ok", fn(rank, world, payload)))
    except BaseException:  # every failure goes to the parent, naming the rank
        results.put((rank, "error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _kill_tree(proc: Any) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own group (setsid)
    except (ProcessLookupError, PermissionError, OSError):
        pass
    if proc.is_alive():
        proc.kill()
    proc.join(timeout=5)


#: What every rank of a measuring world imports. The forkserver imports it once; each rank is
#: then forked from it in about 0.1 s, where a spawned rank paid its own ``import torch`` (about
#: 2.5 s of CPU each on a 2-core machine, for every world of a search or benchmark). The ranks
#: still start clean: the server only imported modules (it ran no torch op, so no thread pool
#: is forked) and was itself started fresh, not forked from the caller.
WORLD_PRELOAD = ("torch", "torch.distributed", "lightning_pp.runtime.engine")


def world_context() -> Any:
    """The multiprocessing context measuring worlds start their ranks from (a forkserver that
    preloads :data:`WORLD_PRELOAD`, added to whatever preload the caller already set, so a
    program's own forkserver keeps its modules)."""
    import multiprocessing.forkserver as forkserver

    ctx = mp.get_context("forkserver")
    # private attribute, read with a default: only the preload list set earlier in this process
    current = list(getattr(forkserver._forkserver, "_preload_modules", None) or [])
    ctx.set_forkserver_preload(list(dict.fromkeys([*current, *WORLD_PRELOAD])))
    return ctx


def run_world(
    fn: Callable[[int, int, Any], Any],
    world: int,
    payload: Any,
    *,
    timeout: float,
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world, payload)`` on ``world`` processes (forked from
    :func:`world_context`'s server) joined in a gloo group; return the results by rank. ``fn``
    must be importable (module level). The ranks end with this process, however it ends
    (:mod:`~lightning_pp.runtime.owned_process`).

    Raises:
        WorldFailure: a rank raised (its traceback), died (its exit code), or ``timeout``
            seconds passed (which ranks had finished). Every process is killed first.
    """
    port = free_port()
    return start_world(
        _child,
        lambda r, results: (fn, r, world, port, payload, results, threads),
        world,
        timeout=timeout,
        poll=1.0,
    )


def start_world(
    target: Callable[..., None],
    args_of: Callable[[int, Any], tuple[Any, ...]],
    world: int,
    *,
    timeout: float,
    poll: float,
) -> list[Any]:
    """Start ``world`` processes from :func:`world_context`'s server, each running
    ``target(*args_of(rank, results), owner)`` (``results``: the queue it reports to;
    ``owner``: its end of this process's :func:`~lightning_pp.runtime.owned_process.owner_link`,
    for :func:`~lightning_pp.runtime.owned_process.die_with_owner`), and wait for them
    (:func:`wait_for_world`). Used by :func:`run_world` and by ``benchmarks/harness.launch``."""
    ctx = world_context()
    results = ctx.Queue()
    for_ranks, owner = owner_link(ctx)
    procs = [
        ctx.Process(target=target, args=(*args_of(r, results), for_ranks), daemon=True)
        for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        for_ranks.close()  # the ranks hold their copies; this process keeps only ``owner``
        return wait_for_world(procs, results, timeout=timeout, poll=poll)
    finally:
        owner.close()


def wait_for_world(procs: Sequence[Any], results: Any, *, timeout: float, poll: float) -> list[Any]:
    """The parent's side of a spawned world: collect ``(rank, "ok" | "error", value)`` from
    ``results`` until every rank reported; return the values by rank. Every ``poll`` seconds
    without a message, a rank that exited without reporting ends the wait. Whatever happens,
    every process still running afterwards is killed with its process tree. Used by
    :func:`start_world`.

    Raises:
        WorldFailure: a rank raised (its traceback), died (its exit code), or ``timeout``
            seconds passed (which ranks had finished).
    """
    world = len(procs)
    got: dict[int, Any] = {}
    error: str | None = None
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                error = f"timed out after {timeout:.0f} s; ranks finished: {sorted(got)}"
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, poll))
            except queue_mod.Empty:
                dead = [
                    r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got
                ]
                if dead:
                    codes = [procs[r].exitcode for r in dead]
                    error = f"rank(s) {dead} died without a result (exit codes {codes})"
                    break
                continue
            if status == "error":
                error = value
                break
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10 if error is None else 0.5)
        for p in procs:
            if p.is_alive():
                _kill_tree(p)
        results.close()
    if error is not None:
        raise WorldFailure(error)
    return [got[r] for r in range(world)]


# ---- one candidate's run --------------------------------------------------------------------


@dataclass
class BuiltModel:
    """What a run needs of a model: its pipeline layers in order, the first layer's input
    from a microbatch, and the loss of a microbatch from the last layer's output."""

    layers: list[nn.Module]
    input_fn: Callable[[Any], Any]
    loss_fn: Callable[[Any, Any], torch.Tensor]


def build_config_model(
    model_spec: dict[str, Any],
    seed: int | None = None,
    *,
    instantiate: Callable[[Any], Any],
) -> BuiltModel:
    """Build a config's ``model:`` section (a :class:`~lightning_pp.strategy.model.PipelineMixin`)
    and
    return its layers and hooks (every layer is built on every rank; each runs its own).
    ``instantiate(spec)`` builds the spec (the CLI's, a module-level function: ranks unpickle
    it)."""
    if isinstance(seed, int):
        torch.manual_seed(seed)
    model = instantiate(model_spec)
    configure = getattr(model, "configure_model", None)
    if callable(configure):
        configure()
    container = model.pipeline_layers()
    model.train()
    layers = [container[i] for i in range(container.num_layers)]
    return BuiltModel(layers, model.pipeline_input, model.pipeline_loss)


def resize_batch(batch: Any, n: int) -> Any:
    """``batch`` with ``n`` samples: every tensor sliced, or repeated along dim 0."""

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        reps = -(-n // t.shape[0])
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:n].clone() if reps > 1 else t[:n].clone()

    if isinstance(batch, dict):
        return {k: one(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(one(t) for t in batch)
    return one(batch)


@dataclass(frozen=True)
class RunSpec:
    """One shape to run: ``builder()`` makes the model in each process (a picklable callable:
    a module-level function or a ``functools.partial`` of one); ``batch``: one data-parallel
    replica's batch; the shape; ``warmup`` + ``steps`` train steps."""

    builder: Callable[[], BuiltModel]
    batch: Any
    pp: int
    vpp: int
    microbatches: int
    schedule: str
    counts: tuple[int, ...]
    recompute: str | None = None
    warmup: int = 2
    steps: int = 3
    keep_records: bool = False
    #: after the steps, time messages between pipeline ranks 0 and 1 (see :func:`probe_link`)
    probe_links: bool = False

    @classmethod
    def for_candidate(
        cls,
        builder: Callable[[], BuiltModel],
        batch: Any,
        cand: Any,
        *,
        warmup: int,
        steps: int,
        keep_records: bool = False,
        probe_links: bool = False,
    ) -> RunSpec:
        """The run of a search candidate (:class:`~lightning_pp.planner.search.Candidate`):
        its shape, split and recompute setting, on ``batch`` resized to its batch size."""
        return cls(
            builder,
            resize_batch(batch, cand.batch_size),
            pp=cand.pp,
            vpp=cand.vpp,
            microbatches=cand.microbatches,
            schedule=cand.schedule,
            counts=cand.counts,
            recompute=cand.recompute,
            warmup=warmup,
            steps=steps,
            keep_records=keep_records,
            probe_links=probe_links,
        )


@dataclass
class Measured:
    """One run: median step seconds (every step's in ``steps_s``), the activation peak of each
    pipeline rank (bytes, worst data-parallel replica), and, when kept, the step records of
    data-parallel replica 0 (``records[i]``: pipeline rank i's, one per timed step)."""

    step_s: float
    steps_s: list[float]
    peak_saved: list[int]
    records: list[list[StepRecord]] = field(default_factory=list)
    seconds: float = 0.0
    #: ``(latency_s, bytes_per_s)`` between pipeline ranks 0 and 1 (``RunSpec.probe_links``)
    link: tuple[float, float] | None = None


def _run_worker(rank: int, world: int, specs: Sequence[RunSpec]) -> list[dict[str, Any]]:
    return [_run_one(rank, world, spec) for spec in specs]


def _run_one(rank: int, world: int, spec: RunSpec) -> dict[str, Any]:
    from ..layout.partition import PipelineChunk
    from ..layout.rules import check_layers
    from ..layout.topology import PipelineTopology, build_process_groups
    from ..runtime.engine import PipelineEngine
    from ..runtime.grad_sync import DeferredGradSync
    from ..schedules import build_schedule

    model = spec.builder()
    schedule = build_schedule(
        spec.schedule, pp=spec.pp, microbatches=spec.microbatches, vpp=spec.vpp
    )
    ranges = check_layers(len(model.layers), spec.pp, schedule.vpp, list(spec.counts))
    topo = PipelineTopology.from_world(world, rank, pp=spec.pp)
    groups = build_process_groups(topo)
    chunks = [
        PipelineChunk([model.layers[i] for i in ranges[s]], ranges[s])
        for s in schedule.stages_of(topo.pp_rank)
    ]
    sync = None
    if topo.dp > 1:
        sync = DeferredGradSync([list(c.parameters()) for c in chunks], groups.dp_group, topo.dp)
    engine = PipelineEngine(
        chunks,
        schedule,
        topo,
        groups,
        loss_fn=model.loss_fn,
        input_fn=model.input_fn,
        on_chunk_grads_ready=None if sync is None else sync.on_chunk_grads_ready,
        measure_memory=True,
        recompute=spec.recompute,
    )
    params = [p for c in chunks for p in c.parameters()]
    times: list[float] = []
    peak = 0
    records: list[StepRecord] = []
    # The timed steps run as training does, without the saved-bytes meter (its Python hook on
    # every saved tensor made a transformer's forward 10-20 % slower than trained); one more
    # step, untimed, runs with it for the activation peak.
    for i in range(spec.warmup + spec.steps + 1):
        metered = i == spec.warmup + spec.steps
        engine.measure_memory = metered
        dist.barrier()
        start = time.perf_counter()
        result = engine.train_step(spec.batch)
        if sync is not None:
            sync.wait()
        end = time.perf_counter()
        for p in params:
            p.grad = None
        # one clock on one host (perf_counter is CLOCK_MONOTONIC): the step is first start to
        # last end over every rank
        stamps = torch.tensor([-start, end], dtype=torch.float64)
        dist.all_reduce(stamps, op=dist.ReduceOp.MAX)
        if metered:
            peak = int(result.record.peak_saved_bytes)
        elif i >= spec.warmup:
            times.append(float(stamps[1] + stamps[0]))
            if spec.keep_records and topo.dp_rank == 0:
                records.append(result.record)
    link = None
    if spec.probe_links and topo.pp > 1 and topo.pp_rank < 2:
        peer = topo.next_rank if topo.pp_rank == 0 else topo.prev_rank
        link = probe_link(peer, first=topo.pp_rank == 0, group=groups.pp_group)
    return {
        "pp_rank": topo.pp_rank,
        "times": times,
        "peak": peak,
        "records": records,
        "link": link,
    }


#: probe message sizes (float32 elements): small for the latency, large for the bandwidth
_PROBE_SMALL, _PROBE_LARGE = 256, 1 << 20


def probe_link(
    peer: int, *, first: bool, group: Any = None, rounds: int = 10
) -> tuple[float, float] | None:
    """``(latency_s, bytes_per_s)`` of the link to global rank ``peer``: ``rounds`` ping-pongs
    of a 1 KiB and of a 4 MiB tensor (after one of each, untimed); one way is half the fastest
    round trip, the latency the small message's one way, the bandwidth the extra bytes over the
    extra time of the large one (``None`` where the large one was not slower). ``first``: this
    side sends first. Both sides must call it.

    The fastest round trip, not the median: it is the one the host's other work disturbed
    least. With the median, a loaded 2-core host once timed the 1 KiB message slower than the
    4 MiB one, and the calibration went without a bandwidth (a CI run)."""
    times = {}
    for n in (_PROBE_SMALL, _PROBE_LARGE):
        buf = torch.zeros(n)
        rtts = []
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            if first:
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
            else:
                dist.recv(buf, peer, group=group)
                dist.send(buf, peer, group=group)
            if r:
                rtts.append(time.perf_counter() - t0)
        times[n] = min(rtts) / 2
    extra = times[_PROBE_LARGE] - times[_PROBE_SMALL]
    if extra <= 0:
        return None
    return times[_PROBE_SMALL], (_PROBE_LARGE - _PROBE_SMALL) * 4 / extra


def _combine(spec: RunSpec, out: Sequence[dict[str, Any]], seconds: float) -> Measured:
    peaks = [0] * spec.pp
    records: list[list[StepRecord]] = [[] for _ in range(spec.pp)]
    for r in out:
        peaks[r["pp_rank"]] = max(peaks[r["pp_rank"]], r["peak"])
        if r["records"]:
            records[r["pp_rank"]] = r["records"]
    times = out[0]["times"]
    return Measured(
        statistics.median(times),
        times,
        peaks,
        records if spec.keep_records else [],
        seconds,
        link=out[0].get("link"),
    )


def measure(spec: RunSpec, world: int, *, timeout: float, threads: int = 1) -> Measured:
    """Run ``spec`` on ``world`` processes (``dp = world / pp``); see the module notes.

    Raises:
        WorldFailure: the run failed or timed out (its processes are killed).
    """
    return measure_many([spec], world, timeout=timeout, threads=threads)[0]


def measure_many(
    specs: Sequence[RunSpec], world: int, *, timeout: float, threads: int = 1
) -> list[Measured]:
    """Run several shapes one after the other in ONE world of ``world`` processes (each with
    its own engine and process groups), saving the start-up of a world per shape. ``timeout``
    covers them all; ``Measured.seconds`` is the world's time divided evenly.

    Raises:
        WorldFailure: a run failed or the deadline passed (every process is killed).
    """
    started = time.perf_counter()
    out = run_world(_run_worker, world, list(specs), timeout=timeout, threads=threads)
    each = (time.perf_counter() - started) / max(1, len(specs))
    return [_combine(spec, [r[i] for r in out], each) for i, spec in enumerate(specs)]


# ---- calibration ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """Fitted from one run's records: ``overhead_s`` per action and ``compute_scale`` (measured
    action time = ``compute_scale`` x profiled + ``overhead_s``), ``latency_s`` per hop (mean;
    0 with one stage), and how many actions / hops they rest on."""

    overhead_s: float
    latency_s: float
    actions: int
    hops: int
    compute_scale: float = 1.0
    #: bytes per second between pipeline neighbours, where the run timed it (``None``: not)
    bandwidth: float | None = None
    #: mean wait of a receive whose data was sent before it asked (0 with one stage); part of
    #: ``latency_s``, which is the whole hop (see ``ModelProfile.receive_s``)
    receive_s: float = 0.0


#: the fitted slope is trusted within these bounds; outside them (or without spread in the
#: profiled times) the scale stays 1 and the overhead is the median excess
_SCALE_BOUNDS = (0.5, 4.0)


def fit_timed(actions: Sequence[tuple[float, float | None, float]]) -> tuple[float, float]:
    """``(scale, overhead)`` from actions whose layers were timed apart from the engine:
    ``(nominal, layers, compute)`` each (``StepEvent.layers`` and ``StepEvent.compute``). The
    scale is measured layer time over profiled time, summed over the actions (long actions
    weigh more; 1 where nothing was profiled); the overhead is the median of ``compute -
    layers``, what the engine adds around the layers, never negative.

    Why not :func:`fit_compute`'s line: separating a slope from an intercept needs the
    profiled times to differ widely and the measurements to be quiet. On this 2-core machine
    one shape's actions spread by 10 to 20 %, and the fitted overhead of the same run came out
    anywhere from 0 to 3.4 ms per action while the layers absorbed the rest; measuring the two
    apart leaves nothing to disentangle.

    Example:
        >>> fit_timed([(1.0, 1.2, 1.5), (2.0, 2.4, 2.7), (0.0, 0.0, 0.2)])
        (1.2, 0.3)
    """
    nominal = sum(n for n, _, _ in actions)
    layers = sum(lay or 0.0 for _, lay, _ in actions)
    scale = layers / nominal if nominal > 0 and layers > 0 else 1.0
    overhead = statistics.median(c - (lay or 0.0) for _, lay, c in actions) if actions else 0.0
    return round(scale, 12), round(max(overhead, 0.0), 12)


def fit_compute(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(scale, overhead)`` with ``measured ~= scale * nominal + overhead`` over the
    ``(nominal, measured)`` action times: least squares for the slope (it needs profiled times
    that differ by at least 20 %, e.g. F and B), then the overhead as the median residual,
    never negative. Without that spread: scale 1, overhead the median of ``measured -
    nominal``.

    Why a slope: a layer that computes (not a virtual-device sleep) runs slower inside a
    pipeline whose processes share cores than alone in the profiler, in proportion to its
    cost; a per-action constant cannot carry that (it was fitted at 4.8 ms per action on a
    transformer whose actions cost 10-60 ms).

    Example:
        >>> fit_compute([(1.0, 2.5), (2.0, 4.5), (4.0, 8.5)])
        (2.0, 0.5)
        >>> fit_compute([(1.0, 1.5), (1.0, 1.7)])
        (1.0, 0.6)
    """
    if not pairs:
        return 1.0, 0.0
    nom = [n for n, _ in pairs]
    scale = 1.0
    if min(nom) > 0 and max(nom) >= 1.2 * min(nom):
        mean_n = statistics.fmean(nom)
        mean_m = statistics.fmean(m for _, m in pairs)
        var = sum((n - mean_n) ** 2 for n in nom)
        slope = sum((n - mean_n) * (m - mean_m) for n, m in pairs) / var
        if _SCALE_BOUNDS[0] <= slope <= _SCALE_BOUNDS[1]:
            scale = slope
    overhead = max(statistics.median(m - scale * n for n, m in pairs), 0.0)
    return round(scale, 12), round(overhead, 12)


def fit_links(
    records: Sequence[Sequence[StepRecord]],
    nominal: Callable[[int, int, Op], float],
) -> Calibration:
    """Fit the engine's per-action overhead, the compute scale and the hop latency from step
    records.

    ``records[r]``: pipeline rank r's records (one per step, all ranks the same steps);
    ``nominal(rank, chunk, op)``: what the profile says the action's layers cost (no
    overhead). Scale and overhead: :func:`fit_timed` where the engine timed each action's
    layers (``StepEvent.layers``), else :func:`fit_compute` over every action's ``(nominal,
    compute)``; latency = :func:`~lightning_pp.callbacks.analysis.p2p_latency` per step,
    averaged; the receive cost =
    :func:`~lightning_pp.callbacks.analysis.receive_overhead` per step, averaged over the steps
    where a receive asked after its data was sent.

    Example:
        >>> from lightning_pp.runtime.records import StepEvent
        >>> from lightning_pp.schedules import build_schedule
        >>> s = build_schedule("1f1b", pp=1, microbatches=2)
        >>> ev = [StepEvent(a, 0.0, 1.5 if a.op is Op.F else 2.5) for a in s.ranks[0]]
        >>> cal = fit_links([[StepRecord(0, 0, s, 0.0, ev)]], lambda r, c, op: 1.0 if op is Op.F
        ...                 else 2.0)
        >>> cal.compute_scale, cal.overhead_s
        (1.0, 0.5)
    """
    from .measured import cross_stage_receives, p2p_latency, receive_overhead

    events = [
        (nominal(r, e.action.chunk, e.action.op), e)
        for r, recs in enumerate(records)
        for rec in recs
        for e in rec.events
    ]
    if events and all(e.layers is not None for _, e in events):
        scale, overhead = fit_timed([(n, e.layers, e.compute) for n, e in events])
    else:  # records without the layers' own time: fit both from the action times
        scale, overhead = fit_compute([(n, e.compute) for n, e in events])
    steps = min((len(recs) for recs in records), default=0)
    latencies, receives, hops = [], [], 0
    if len(records) > 1:
        for i in range(steps):
            one = [recs[i] for recs in records]
            got = cross_stage_receives(one, [0.0] * len(one))
            n = sum(1 for st, _, sent in got if st < sent)
            if n:
                latencies.append(p2p_latency(one))
                hops += n
            if len(got) > n:  # some receive asked after its data was sent
                receives.append(receive_overhead(one))
    latency = statistics.fmean(latencies) if latencies else 0.0
    return Calibration(
        overhead,
        latency,
        len(events),
        hops,
        scale,
        receive_s=statistics.fmean(receives) if receives else 0.0,
    )


def calibrate_from_run(
    got: Measured,
    plan: Any,
    layers: Sequence[Any],
    recompute: str | None,
    profile: Any,
) -> Calibration:
    """The calibration of one measured run of ``plan`` (``got`` with its records): each
    action's nominal cost is what ``profile`` says its layers cost, unscaled and without the
    engine's overhead (a forward recomputed in ``B``/``I`` included), fitted by
    :func:`fit_links`; the bandwidth is what the run's link probe timed, if it ran one.
    What ``plan --calibrate`` and ``benchmarks/bench_planner.py`` both do."""
    from .search import step_costs

    bare = step_costs(
        plan,
        layers,
        recompute,
        profile.with_links(overhead_s=0.0, compute_scale=1.0, receive_s=0.0),
    )

    def nominal(rank: int, chunk: int, op: Op) -> float:
        f, b, i, w = bare.overrides[(rank, chunk)]
        again = bare.recompute.get((rank, chunk), 0.0) if op in (Op.B, Op.I) else 0.0
        return {Op.F: f, Op.B: b, Op.I: i, Op.W: w}[op] + again

    cal = fit_links(got.records, nominal)
    if got.link is not None:
        cal = dataclasses.replace(cal, bandwidth=got.link[1])
    return cal


# ---- the table ------------------------------------------------------------------------------


def pct_error(predicted: float, measured: float) -> float:
    """Signed error of a prediction in percent of the measurement (``+``: predicted more).

    Example:
        >>> pct_error(110.0, 100.0), pct_error(90.0, 100.0)
        (10.0, -10.0)
    """
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return 100.0 * (predicted - measured) / measured


@dataclass
class VerifyRow:
    """One verified shape: its label (``#3`` or ``config``), description, predicted and
    measured step seconds, predicted and measured activation bytes per pipeline rank (the
    planner's activation term, the engine's meter), or the failure; ``contention_s``: the part
    of ``predicted_s`` that is the oversubscription term."""

    label: str
    shape: str
    predicted_s: float
    predicted_act: list[int]
    measured: Measured | None = None
    error: str | None = None
    #: the oversubscription term inside ``predicted_s`` (for the comparison without it)
    contention_s: float = 0.0

    @property
    def step_error(self) -> float | None:
        if self.measured is None:
            return None
        return pct_error(self.predicted_s, self.measured.step_s)

    @property
    def act_error(self) -> float | None:
        """Error of the heaviest rank's activation peak (predicted max vs measured max)."""
        if self.measured is None:
            return None
        return pct_error(max(self.predicted_act), max(self.measured.peak_saved))


def _kib(n: float) -> str:
    return f"{n / 1024:,.0f}"


def format_verify_table(rows: Sequence[VerifyRow]) -> str:
    """Predicted vs measured step time and heaviest-rank activation peak, with errors.

    Example:
        >>> row = VerifyRow("#1", "1x2x1 m=4 1f1b", 0.110, [3072, 2048],
        ...                 Measured(0.100, [0.100], [2048, 2048]))
        >>> print(format_verify_table([row]).splitlines()[2])
        #1  1x2x1 m=4 1f1b    110.0        100.0  +10.0%             3             2  +50.0%
    """
    head = (
        "#", "shape", "pred ms", "measured ms", "err", "pred act KiB", "meas act KiB", "err"
    )  # fmt: skip
    body: list[tuple[str, ...]] = []
    for r in rows:
        if r.measured is None:
            why = (r.error or "failed").strip().splitlines()
            body.append((r.label, r.shape, f"{r.predicted_s * 1e3:.1f}", "FAILED: " + why[-1]))
            continue
        body.append(
            (
                r.label,
                r.shape,
                f"{r.predicted_s * 1e3:.1f}",
                f"{r.measured.step_s * 1e3:.1f}",
                f"{r.step_error:+.1f}%",
                _kib(max(r.predicted_act)),
                _kib(max(r.measured.peak_saved)),
                f"{r.act_error:+.1f}%",
            )
        )
    widths = [max(len(x[i]) for x in [head, *body] if i < len(x)) for i in range(len(head))]

    def line(cells: tuple[str, ...]) -> str:
        out = []
        for i, c in enumerate(cells):
            if i == len(cells) - 1 and len(cells) < len(head):
                out.append(c)  # a failure message: free width
            elif i < 2:
                out.append(c.ljust(widths[i]))
            else:
                out.append(c.rjust(widths[i]))
        return "  ".join(out).rstrip()

    return "\n".join([line(head), "  ".join("-" * w for w in widths), *(line(b) for b in body)])

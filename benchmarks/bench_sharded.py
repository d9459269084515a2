"""Sharded data parallelism: lightning_pp's ``zero=1`` and ``fsdp`` against
``torch.distributed.pipelining`` + FSDP2, pp2 x dp2, in one process group, alternating.

Four processes (gloo, CPU, one thread each) form the job's ``DeviceMesh``
(``pipeline_parallel`` x ``data_parallel``, :func:`~lightning_pp.layout.topology.
build_process_groups`); every variant trains the same transformer blocks
(:class:`~benchmarks.workloads.Workload` ``transformer``, four blocks: two per pipeline rank) on
the same global batch, cut into the same microbatches, with the same AdamW step inside the timed
step. The variants (``--variants``):

===================  ==============================================================================
ours-1f1b            our engine, 1f1b, unsharded: ``DeferredGradSync`` (bucketed all-reduce started
                     at each chunk's last backward)
ours-1f1b-zero1      ``ShardedGradSync(zero=1)``: reduce-scatter per bucket at the chunk's last
                     backward, AdamW steps this rank's rows, all-gather after the step
ours-zbv-zero1       the same under our zbv (two chunks per rank, V placement)
ours-1f1b-zero1-     ``zero=1`` with ``overlap_param_gather``: the all-gathers left running after
overlap              the step, each bucket finished by the first forward that reads it
ours-1f1b-fsdp       ``lightning_pp.runtime.fsdp_chunks``: ``fully_shard`` per block and per chunk
ours-zbv-fsdp        over the dp mesh dim, ``FsdpGradSync`` (reduce-scatter per unit at the chunk's
                     last backward); measured only when that module imports and passes the check
torch-1f1b-fsdp      ``PipelineStage`` (pp group) + ``Schedule1F1B`` / ``ScheduleZBVZeroBubble``,
torch-zbv-fsdp       each stage's blocks and the stage ``fully_shard`` -ed over the dp mesh dim with
                     ``reshard_after_forward=False`` (as torchtitan does under PP); torch's stage
                     turns gradient sync off per microbatch and reduces every stage at the end
===================  ==============================================================================

**Correctness first.** Before any timing, every variant runs two steps on the global batches of
steps 0 and 1 and is compared with the single-process, unsharded reference (one
``nn.Sequential`` of the same blocks, the whole global batch, the same AdamW): the loss of step 0
(the forward), the global gradient norm of step 0 (from each rank's LOCAL gradient: a DTensor's
shard, ZeRO's rows; AdamW is invariant to a gradient's scale, so only the norm catches a
reduction that sums instead of averaging) and the loss of step 1 (after one update and the
parameters' all-gather). A variant off by more than ``--tol`` (relative) is reported and not
timed. FSDP2 asks gloo for a ``ReduceOp.AVG`` reduce-scatter, which gloo builds affected by
pytorch#162338 SUM; the torch variants therefore call ``set_force_sum_reduction_for_comms(True)``
on every FSDP module, so FSDP2 reduces with ``SUM`` and divides by dp itself afterwards
(``set_gradient_divide_factor(dp)`` would not do: a factor equal to the group size maps back to
``AVG``). ``--unfixed`` adds a check-only row without that fix: on torch 2.13.0+cpu it passes
(this gloo averages), so the fix costs one division of the shard and guards older builds.

**Timing.** ``--rounds`` rounds; in each every variant runs a block of warmup steps (2 in the
first round, 1 after) and ``--steps`` measured steps, the variants in forward order in even
rounds and reversed in odd ones (A B C .. C B A ..), so machine noise hits all alike. A step is
timed by :func:`benchmarks.harness.timed_step` (barrier, then max(end) - min(start) over ranks)
and holds: the pipeline's forwards and backwards, the data-parallel reduction, ``AdamW.step()``
(ZeRO: and the parameters' all-gather after it) and ``zero_grad()``. Each rank also stamps the
phases of its step: ``pipeline`` (our ``train_step`` / torch's ``schedule.step``, which includes
torch's end-of-step reduce-scatter; ours also split by the engine's record into the chunks' own
forward/backward calls, time blocked on point-to-point receives, and the launches of the
reductions), ``wait`` (ours: finishing the reductions), ``optimizer`` (AdamW), ``gather``
(ZeRO's all-gather, part of the optimizer call).

**What explains a difference.** After the rounds, three more (untimed) steps per variant run
with ``torch.distributed``'s collectives wrapped: each call's kind, size, and the time the call
took (synchronous calls: the collective itself; asynchronous ones: the launch); in these steps a
barrier on a side group of the two replicas (a group nothing else uses) before ours' ``wait``
and ZeRO's ``gather`` splits each into the skew (``*_skew``: one replica waiting for the other to
arrive, which on an oversubscribed host is scheduling, not communication) and its own cost. Then
the bare collectives alone, on this machine's dp groups, at the stage's parameter size: all-reduce,
reduce-scatter, all-gather (both dp groups at once, as in the run), and the rank-local work around
them one rank at a time (packing and unpacking the buckets, AdamW over all the parameters and over
1/dp of them). Per rank, after a step:
parameter, gradient and optimizer-state bytes measured from the tensors (a DTensor: its local
shard; each storage once).

Usage::

    nice -n 19 python benchmarks/bench_sharded.py                # ~5 min on 2 quiet cores
    python benchmarks/bench_sharded.py --smoke --out /tmp/s.json  # tiny model, seconds

Writes ``benchmarks/results/sharded.json`` (``--out``; every number and the command) and the
table beside it (``sharded.md``); prints the table.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_pp` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness import launch, machine_info, timed_step
from benchmarks.workloads import Workload
from lightning_pp.runtime.dtensor_state import local_part

PP, DP = 2, 2
WORLD = PP * DP
LR, EPS = 1e-3, 1e-8
PROFILED = 3  # untimed steps per variant with collectives wrapped and skew split off
BUCKET_CAP_MB = 25.0  # PipelineStrategy's default (strategy/engine_build.py)

#: model and batch per size: ``transformer`` blocks (4: two per pipeline rank), microbatches per
#: replica. "full": dim 512 -> 3.15 M parameters (12.6 MB fp32) per block, 50.4 MB in all,
#: 25.2 MB per pipeline rank; 2 sequences of 64 tokens per microbatch.
SIZES: dict[str, dict[str, Any]] = {
    "full": {"dim": 512, "heads": 8, "seq": 64, "mb_size": 2, "microbatches": 4},
    "smoke": {"dim": 32, "heads": 2, "seq": 8, "mb_size": 2, "microbatches": 4},
}


@dataclass(frozen=True)
class Variant:
    """One row: ``impl`` (ours | torch), ``schedule`` (1f1b | zbv), ``sharding`` (none | zero1 |
    fsdp), ``fix`` (torch only: force FSDP2's sum-then-divide, see the module docstring),
    ``timed`` (False: correctness check only)."""

    name: str
    impl: str
    schedule: str
    sharding: str
    fix: bool = True
    timed: bool = True

    @property
    def vpp(self) -> int:
        return 2 if self.schedule == "zbv" else 1


VARIANTS = {
    v.name: v
    for v in (
        Variant("ours-1f1b", "ours", "1f1b", "none"),
        Variant("ours-1f1b-zero1", "ours", "1f1b", "zero1"),
        Variant("ours-zbv-zero1", "ours", "zbv", "zero1"),
        Variant("ours-1f1b-zero1-overlap", "ours", "1f1b", "zero1-overlap"),
        Variant("ours-1f1b-fsdp", "ours", "1f1b", "fsdp"),
        Variant("ours-zbv-fsdp", "ours", "zbv", "fsdp"),
        Variant("torch-1f1b-fsdp", "torch", "1f1b", "fsdp"),
        Variant("torch-zbv-fsdp", "torch", "zbv", "fsdp"),
    )
}
#: check-only row without the gloo averaging fix (``--unfixed``): FSDP2's own ``ReduceOp.AVG``
UNFIXED = Variant("torch-1f1b-fsdp-unfixed", "torch", "1f1b", "fsdp", fix=False, timed=False)
TORCH_NAMES = {"1f1b": "Schedule1F1B", "zbv": "ScheduleZBVZeroBubble"}


@dataclass(frozen=True)
class Spec:
    """Everything a worker needs (picklable)."""

    workload: Workload
    microbatches: int
    variants: tuple[Variant, ...]
    reference: dict[str, float]
    rounds: int
    steps: int
    tol: float
    comm_iters: int


# --------------------------------------------------------------------------------------------
# The reference: one process, unsharded, unpipelined, the whole global batch
# --------------------------------------------------------------------------------------------


def global_batch(w: Workload, m: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``DP * m`` microbatches; replica ``d`` takes rows
    ``[d * m * mb, (d + 1) * m * mb)``."""
    return w.batch(DP * m, step=step)


def replica_batch(w: Workload, m: int, step: int, dp_rank: int) -> tuple[torch.Tensor, ...]:
    x, y = global_batch(w, m, step)
    n = m * w.mb_size
    return x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]


def reference(w: Workload, m: int) -> dict[str, float]:
    """Loss of step 0, gradient norm of step 0, loss of step 1 (after one AdamW step) of the
    whole model on the global batch: each microbatch's MSE has the same element count, so the
    mean over the batch is the mean of the microbatch means the pipelines compute."""
    torch.set_num_threads(1)
    model = nn.Sequential(*w.build_layers(PP))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    out: dict[str, float] = {}
    for s in range(2):
        x, y = global_batch(w, m, s)
        loss = Workload.loss_fn(model(x), y)
        loss.backward()
        out[f"loss{s}"] = loss.item()
        if s == 0:
            sq = sum(p.grad.double().pow(2).sum().item() for p in model.parameters())
            out["grad_norm0"] = math.sqrt(sq)
        opt.step()
        opt.zero_grad()
    return out


# --------------------------------------------------------------------------------------------
# Building the variants (inside the process group)
# --------------------------------------------------------------------------------------------


def _nbytes(tensors: list[torch.Tensor | None]) -> int:
    """Bytes of ``tensors`` (local shards), each (data pointer, size) counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = local_part(t)
        key = (t.data_ptr(), t.numel())
        if key not in seen and t.numel():
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


@dataclass
class Runner:
    """One built variant on this rank: ``step(x, y, probe)`` runs a whole training step and
    returns this replica's loss where this rank computes it (else ``None``); ``probe`` is
    called between the reduction and the optimizer step (gradient norm, bytes)."""

    variant: Variant
    step: Callable[..., float | None]
    params: list[nn.Parameter]  # the module's parameters (DTensor shards under FSDP)
    optimizer: torch.optim.Optimizer
    grad_sq: Callable[[], float]  # this rank's share of the global gradient norm's square
    grads: Callable[[], list[torch.Tensor | None]]  # every gradient tensor this rank holds
    phases: list[dict[str, float]] = field(default_factory=list)
    collectives: int = 0  # data-parallel reductions started per step (buckets, FSDP units)
    #: profiled steps only: a group of this rank's dp replicas on which nothing else runs; a
    #: barrier on it before a collective phase splits that phase into the replicas' skew
    #: (``*_skew``: waiting for the other replica to arrive) and the phase's own cost
    side_group: Any = None


def _phase_clock() -> tuple[dict[str, float], Callable[[str], None]]:
    stamps: dict[str, float] = {}
    last = [time.perf_counter()]

    def mark(name: str) -> None:
        now = time.perf_counter()
        stamps[name] = stamps.get(name, 0.0) + now - last[0]
        last[0] = now

    return stamps, mark


def build_ours(
    v: Variant, w: Workload, m: int, rank: int, device: torch.device, groups: Any
) -> Runner:
    from benchmarks.ours import STATIC_SHAPES, build_chunks
    from lightning_pp.runtime.distributed_optimizer import ShardedGradSync
    from lightning_pp.runtime.engine import PipelineEngine
    from lightning_pp.runtime.grad_sync import DeferredGradSync

    topo = groups.topology
    sched, chunks = build_chunks(w, v.schedule, PP, v.vpp, m, topo.pp_rank, device)
    chunk_params = [list(c.parameters()) for c in chunks]
    if v.sharding == "fsdp":
        from lightning_pp.runtime.fsdp_chunks import FsdpGradSync, shard_chunks

        chunks = shard_chunks(chunks, groups.mesh["data_parallel"], schedule=sched)
        sync: Any = FsdpGradSync(chunks)
    elif v.sharding.startswith("zero1"):
        sync = ShardedGradSync(
            chunk_params,
            groups.dp_group,
            DP,
            topo.dp_rank,
            zero=1,
            bucket_cap_mb=BUCKET_CAP_MB,
            overlap_param_gather=v.sharding == "zero1-overlap",
        )
    else:
        sync = DeferredGradSync(chunk_params, groups.dp_group, DP, BUCKET_CAP_MB)
    launch_s = [0.0]

    def on_ready(chunk: int) -> None:  # timed: packing and starting the chunk's reductions
        t0 = time.perf_counter()
        sync.on_chunk_grads_ready(chunk)
        launch_s[0] += time.perf_counter() - t0

    engine = PipelineEngine(
        chunks,
        sched,
        topo,
        groups,
        loss_fn=lambda out, mb: Workload.loss_fn(out, mb[1]),
        device=device,
        static_shapes=STATIC_SHAPES,
        on_chunk_grads_ready=on_ready,
    )
    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS)
    runner = Runner(v, None, params, opt, None, None)  # type: ignore[arg-type]
    if v.sharding.startswith("zero1"):
        sync.shard_optimizer(opt)
        if sync.overlap_param_gather:  # each bucket finished by the first forward reading it
            sync.install_gather_hooks(chunks)
        gather = sync.gather_params

        def timed_gather() -> None:  # the post-step hook looks the method up at each call
            t0 = time.perf_counter()
            if runner.side_group is not None:
                dist.barrier(group=runner.side_group)
                runner.phases[-1]["gather_skew"] = time.perf_counter() - t0
                t0 = time.perf_counter()
            gather()
            runner.phases[-1]["gather"] = time.perf_counter() - t0

        sync.gather_params = timed_gather
        main = list(sync.main.values())
        runner.grad_sq = lambda: sum(float(p.grad.double().pow(2).sum()) for p in main)
        runner.grads = lambda: [p.grad for p in params] + [p.grad for p in main]
    elif v.sharding == "fsdp":
        runner.grad_sq = lambda: sum(
            float(local_part(p.grad).double().pow(2).sum()) for p in params if p.grad is not None
        )
        runner.grads = lambda: [p.grad for p in params]
    else:
        # replicas hold the same averaged gradients: count them on dp rank 0 only
        runner.grad_sq = lambda: (
            sum(float(p.grad.double().pow(2).sum()) for p in params) if topo.dp_rank == 0 else 0.0
        )
        runner.grads = lambda: [p.grad for p in params]
    runner.collectives = sync.num_buckets

    def step(x: torch.Tensor, y: torch.Tensor, probe: Callable[[], None] | None = None) -> float:
        stamps, mark = _phase_clock()
        runner.phases.append(stamps)
        sync.enabled = True
        launch_s[0] = 0.0
        result = engine.train_step((x, y))
        mark("pipeline")
        # inside the pipeline phase, from the engine's record: the chunks' own computation,
        # time blocked on point-to-point receives, and the reductions' launches
        rec = result.record
        stamps["in_layers"] = sum(e.layers or 0.0 for e in rec.events)
        stamps["in_p2p_wait"] = rec.comm_wait
        stamps["in_launch"] = launch_s[0]
        if runner.side_group is not None:
            dist.barrier(group=runner.side_group)
            mark("wait_skew")
        sync.wait()
        mark("wait")
        if probe is not None:
            probe()
            mark("probe")
        opt.step()
        mark("optimizer")
        opt.zero_grad(set_to_none=True)
        mark("zero_grad")
        return float(result.loss)  # the replica's loss, on every pipeline rank

    runner.step = step
    return runner


def build_torch(
    v: Variant, w: Workload, m: int, rank: int, device: torch.device, groups: Any
) -> Runner:
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble

    from benchmarks.peer_torch import stage_layers, torch_stage

    pp_rank = groups.topology.pp_rank
    dp_mesh = groups.mesh["data_parallel"]
    layers = w.build_layers(PP)
    num_stages = PP * v.vpp
    mb_shape = w.sample_shape()
    first_in = torch.zeros(mb_shape, device=device)
    mid_in = torch.zeros(mb_shape, device=device, requires_grad=True)
    out_meta = torch.zeros(mb_shape, device=device, requires_grad=True)
    stages, modules = [], []
    for chunk in range(v.vpp):
        s = torch_stage(v.schedule, chunk, PP, pp_rank)
        module = nn.Sequential(*stage_layers(layers, s, num_stages)).to(device)
        # torchtitan's composition under PP: each block, then the stage, no reshard after
        # forward (the stage stays gathered until torch's end-of-step reduce)
        for block in module:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
        if v.fix:  # pytorch#162338: SUM on the wire, FSDP2 divides by dp itself afterwards
            for sub in module.modules():
                if isinstance(sub, FSDPModule):
                    sub.set_force_sum_reduction_for_comms(True)
        modules.append(module)
        stages.append(
            PipelineStage(
                module,
                s,
                num_stages,
                device,
                input_args=(first_in if s == 0 else mid_in,),
                output_args=(out_meta,),
                group=groups.pp_group,
            )
        )
    loss_fn = Workload.loss_fn
    if v.schedule == "1f1b":
        sched = Schedule1F1B(stages[0], m, loss_fn=loss_fn)
    else:
        sched = ScheduleZBVZeroBubble(stages, m, loss_fn=loss_fn)
    has_first = pp_rank == 0
    has_last = pp_rank == (0 if v.schedule == "zbv" else PP - 1)
    params = [p for mod in modules for p in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS)
    runner = Runner(v, None, params, opt, None, None)  # type: ignore[arg-type]
    runner.grad_sq = lambda: sum(
        float(local_part(p.grad).double().pow(2).sum()) for p in params if p.grad is not None
    )
    runner.grads = lambda: [p.grad for p in params]
    runner.collectives = sum(
        1 for mod in modules for sub in mod.modules() if _has_own_params(sub, FSDPModule)
    )

    def step(x: torch.Tensor, y: torch.Tensor, probe: Callable[[], None] | None = None):
        stamps, mark = _phase_clock()
        runner.phases.append(stamps)
        losses: list[torch.Tensor] = []
        args = (x,) if has_first else ()
        if has_last:
            sched.step(*args, target=y, losses=losses, return_outputs=False)
        else:
            sched.step(*args, return_outputs=False)
        mark("pipeline")
        if probe is not None:
            probe()
            mark("probe")
        opt.step()
        mark("optimizer")
        opt.zero_grad(set_to_none=True)
        mark("zero_grad")
        return float(torch.stack(losses).detach().mean()) if has_last else None

    runner.step = step
    return runner


def _has_own_params(module: nn.Module, fsdp_cls: type) -> bool:
    """An FSDP module holding parameters no nested FSDP module holds (one reduce-scatter)."""
    if not isinstance(module, fsdp_cls):
        return False
    nested = {
        id(p)
        for sub in module.modules()
        if sub is not module and isinstance(sub, fsdp_cls)
        for p in sub.parameters()
    }
    return any(id(p) not in nested for p in module.parameters())


def fsdp_chunks_available() -> str | None:
    """``None`` when ``lightning_pp.runtime.fsdp_chunks`` imports with what the benchmark uses,
    else why not (the same answer on every rank)."""
    try:
        from lightning_pp.runtime import fsdp_chunks

        for name in ("shard_chunks", "FsdpGradSync"):
            getattr(fsdp_chunks, name)
    except Exception as e:  # not written yet, or broken: reported, not measured
        return f"{type(e).__name__}: {e}"
    return None


# --------------------------------------------------------------------------------------------
# The worker: check, time, profile
# --------------------------------------------------------------------------------------------


def _world_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def _global_loss(local: float | None) -> float:
    """Mean over the replicas of the replica losses (each rank that computed one adds it)."""
    total, count = _world_sum([local or 0.0, 0.0 if local is None else 1.0])
    # ours: every pipeline rank of a replica holds its loss (count = pp * dp); torch: one
    return total / count


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-30)


def _bytes_probe(r: Runner, out: dict[str, Any]) -> Callable[[], None]:
    def probe() -> None:
        out["grad_sq"] = r.grad_sq()
        out["grad_bytes"] = _nbytes(r.grads())

    return probe


def _check(r: Runner, w: Workload, m: int, dp_rank: int, spec: Spec) -> dict[str, Any]:
    """Steps 0 and 1 against the reference; also the bytes held after a step (collective)."""
    seen: dict[str, Any] = {}
    x, y = replica_batch(w, m, 0, dp_rank)
    loss0 = _global_loss(r.step(x, y, _bytes_probe(r, seen)))
    grad_norm0 = math.sqrt(_world_sum([seen["grad_sq"]])[0])
    x, y = replica_batch(w, m, 1, dp_rank)
    loss1 = _global_loss(r.step(x, y, _bytes_probe(r, seen)))
    ref = spec.reference
    got = {"loss0": loss0, "grad_norm0": grad_norm0, "loss1": loss1}
    err = {k: _rel(got[k], ref[k]) for k in got}
    state = [t for s in r.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "got": got,
        "rel_err": err,
        "ok": all(e <= spec.tol for e in err.values()),
        "bytes": {
            "param": _nbytes(list(r.params)),
            "grad": seen["grad_bytes"],  # after the reduction, before the optimizer step
            "optimizer": _nbytes([t for t in state if t.dim() > 0]),
        },
    }


_COLLECTIVES = (
    "all_reduce",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "all_gather_single",
)


def _profiled_step(
    r: Runner, x: torch.Tensor, y: torch.Tensor, side_group: Any
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """One step with ``torch.distributed``'s collectives wrapped (kind, MB, async, call ms)
    and the replicas' skew split off the collective phases (``side_group``: see
    :class:`Runner`); returns the calls and the step's phases."""
    calls: list[dict[str, Any]] = []
    saved = {n: getattr(dist, n) for n in _COLLECTIVES}

    def wrap(name: str, fn: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            big = max((t.numel() * t.element_size() for t in tensors), default=0)
            calls.append(
                {
                    "op": name,
                    "mb": round(big / 1e6, 3),
                    "async": bool(kwargs.get("async_op", False)),
                    "call_ms": round((time.perf_counter() - t0) * 1e3, 3),
                }
            )
            return out

        return call

    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    r.side_group = side_group
    try:
        dist.barrier()
        r.step(x, y)
    finally:
        r.side_group = None
        for n, fn in saved.items():
            setattr(dist, n, fn)
    return calls, r.phases[-1]


def _bare_collectives(numel: int, dp_group: Any, iters: int) -> dict[str, float]:
    """Median ms of all-reduce, reduce-scatter and all-gather of ``numel`` fp32 values over this
    rank's dp group (both dp groups run at once, as in the steps)."""
    full = torch.randn(numel - numel % DP)
    shard = torch.empty(full.numel() // DP)
    ops = {
        "all_reduce": lambda: dist.all_reduce(full, group=dp_group),
        "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full, group=dp_group),
        "all_gather": lambda: dist.all_gather_single(full, shard, group=dp_group),
    }
    out = {}
    for name, op in ops.items():
        times = []
        for _ in range(iters + 1):
            dist.barrier()
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times[1:]) * 1e3
    return out


def _median_ms(fn: Callable[[], Any], iters: int) -> float:
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def _local_costs(w: Workload, dp_rank: int, iters: int) -> dict[str, float]:
    """Median ms of the rank-local work around the reductions, on one pipeline rank's
    parameters (two blocks), as the syncs do it: the unsharded launch (``torch.cat`` of the
    gradients, divide: ``DeferredGradSync``), the zero=1 launch (``BucketLayout.pack``: zeroed
    slots, copy, ``torch.cat``; the gradients zeroed; divide: ``ShardedGradSync``), the unpacking
    after the all-gather (pack this rank's rows, copy every rank's rows into the parameters), and
    AdamW (torch's default, single-tensor on CPU) over all the parameters and over this rank's
    rows. Run one rank at a time (the others wait at a barrier), so uncontended."""
    from lightning_pp.runtime.shard_layout import BucketLayout

    params = [p for layer in w.build_layers(PP)[: w.layers_per_rank] for p in layer.parameters()]
    grads = [torch.randn_like(p) for p in params]
    layout = BucketLayout.build(params, DP, dp_rank)

    def unsharded() -> None:
        torch.cat([g.reshape(-1) for g in grads]).div_(DP)

    def zero1() -> None:
        flat = layout.pack(grads)
        for g in grads:
            g.zero_()
        flat.div_(DP)

    flat = torch.randn(layout.numel)
    rows = [m.local_piece(m.param.data) for m in layout.members]

    def unpack() -> None:
        layout.pack_local(rows)
        with torch.no_grad():
            for m in layout.members:
                m.rows_view(m.param.data).copy_(layout.unpack_full(flat, m))

    def adamw(ps: list[torch.Tensor]) -> Callable[[], None]:
        ps = [nn.Parameter(p.detach().clone()) for p in ps]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(ps, lr=LR, eps=EPS)
        return opt.step

    full_step = adamw(params)
    half_step = adamw([m.local_piece(m.param.data) for m in layout.members if m.local_numel])
    return {
        "launch_unsharded": _median_ms(unsharded, iters),
        "launch_zero1": _median_ms(zero1, iters),
        "unpack_zero1": _median_ms(unpack, iters),
        "adamw_full": _median_ms(full_step, iters),
        "adamw_rows": _median_ms(half_step, iters),
    }


def _agree(ok: bool) -> bool:
    """True on every rank when it is on every rank (a collective)."""
    t = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(t)
    return t.item() == 0.0


def _worker(rank: int, world: int, device: torch.device, spec: Spec) -> dict[str, Any]:
    from lightning_pp.layout.topology import PipelineTopology, build_process_groups

    assert world == WORLD, world
    topo = PipelineTopology.from_world(world, rank, pp=PP)
    groups = build_process_groups(topo)
    w, m = spec.workload, spec.microbatches
    fsdp_missing = fsdp_chunks_available()
    runners: dict[str, Runner] = {}
    rows: dict[str, dict[str, Any]] = {}
    for v in spec.variants:
        row: dict[str, Any] = {"variant": asdict(v)}
        rows[v.name] = row
        if v.impl == "ours" and v.sharding == "fsdp" and fsdp_missing:
            row["status"] = f"not measured: lightning_pp.runtime.fsdp_chunks: {fsdp_missing}"
            continue
        build = build_ours if v.impl == "ours" else build_torch
        error = None
        try:
            r = build(v, w, m, rank, device, groups)
        except Exception:
            error = traceback.format_exc()
        if not _agree(error is None):
            row["status"] = "not measured: build failed"
            row["error"] = error
            continue
        try:
            row["check"] = _check(r, w, m, topo.dp_rank, spec)
        except Exception:
            # a failure inside a collective step may leave peers waiting: the launch's deadline
            # ends the world, naming the rank and this traceback
            raise RuntimeError(
                f"{v.name}: the check steps failed:\n{traceback.format_exc()}"
            ) from None
        ok = row["check"]["ok"]
        if not ok:
            row["status"] = "not timed: differs from the reference"
        elif not v.timed:
            row["status"] = "check only"
        else:
            row["status"] = "measured"
            runners[v.name] = r
    # ---- timing: alternating rounds
    names = list(runners)
    step_s: dict[str, list[float]] = {n: [] for n in names}
    phases: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    batches = [replica_batch(w, m, 2 + k, topo.dp_rank) for k in range(3)]
    count = 0
    for rnd in range(spec.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for n in order:
            r = runners[n]
            warm = 2 if rnd == 0 else 1
            for i in range(warm + spec.steps):
                x, y = batches[count % len(batches)]
                count += 1
                wall, _, _ = timed_step(functools.partial(r.step, x, y), device)
                if i >= warm:
                    step_s[n].append(wall)
                    phases[n].append(r.phases[-1])
    # ---- why: profiled steps per variant, then the bare collectives
    side = None
    for pp_rank in range(PP):  # every rank creates every group, in the same order
        g = dist.new_group([pp_rank * DP + d for d in range(DP)])
        if pp_rank == topo.pp_rank:
            side = g
    for n in names:
        profiled = [_profiled_step(runners[n], *batches[k % 3], side) for k in range(PROFILED)]
        rows[n]["collectives"] = [c for c, _ in profiled]
        rows[n]["profiled_phases_s"] = [ph for _, ph in profiled]
        rows[n]["reductions_per_step"] = runners[n].collectives
        rows[n]["step_s"] = step_s[n]
        rows[n]["phases_s"] = phases[n]
    stage_numel = _numel(w) // PP
    bare = _bare_collectives(stage_numel, groups.dp_group, spec.comm_iters)
    local: dict[str, float] = {}
    for k in range(world):
        if k == rank:
            local = _local_costs(w, topo.dp_rank, spec.comm_iters)
        dist.barrier()
    return {
        "rank": rank,
        "pp_rank": topo.pp_rank,
        "dp_rank": topo.dp_rank,
        "rows": rows,
        "bare_collectives_ms": bare,
        "local_costs_ms": local,
        "stage_numel": stage_numel,
    }


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


def _numel(w: Workload) -> int:
    """Parameters of the whole model."""
    return sum(p.numel() for layer in w.build_layers(PP) for p in layer.parameters())


def _med_ms(xs: list[float]) -> float | None:
    return statistics.median(xs) * 1e3 if xs else None


def summarize(ranks: list[dict[str, Any]], variants: list[Variant]) -> dict[str, Any]:
    """Per variant: status, check, median/IQR step, phase medians (the slowest rank's), bytes
    per rank; then the targets."""
    out: dict[str, Any] = {}
    for v in variants:
        per_rank = [r["rows"][v.name] for r in ranks]
        r0 = per_rank[0]
        rec: dict[str, Any] = {"status": r0["status"], "impl": v.impl, "schedule": v.schedule}
        rec["sharding"] = v.sharding
        if "error" in r0 or any("error" in p for p in per_rank):
            rec["error"] = next(p["error"] for p in per_rank if p.get("error"))
        if "check" in r0:
            rec["check"] = {"got": r0["check"]["got"], "rel_err": r0["check"]["rel_err"]}
            rec["bytes_per_rank"] = [p["check"]["bytes"] for p in per_rank]
        steps = r0.get("step_s") or []
        if steps:
            q = statistics.quantiles(steps, n=4) if len(steps) > 1 else steps * 3
            rec["step_ms"] = _med_ms(steps)
            rec["step_s"] = steps  # the whole pipeline's (timed_step), the same on every rank
            rec["iqr_ms"] = [q[0] * 1e3, q[-1] * 1e3]
            names = sorted({k for p in per_rank for ph in p["phases_s"] for k in ph})
            rec["phase_ms_per_rank"] = [
                {k: _med_ms([ph.get(k, 0.0) for ph in p["phases_s"]]) for k in names}
                for p in per_rank
            ]
            rec["profiled_phase_ms_per_rank"] = [
                {
                    k: _med_ms([ph.get(k, 0.0) for ph in p["profiled_phases_s"]])
                    for k in sorted({k for ph in p["profiled_phases_s"] for k in ph})
                }
                for p in per_rank
            ]
            # per rank, the last profiled step's collectives; and the time spent inside
            # synchronous collective calls (a blocking call: the collective itself)
            rec["collectives_per_rank"] = [p["collectives"][-1] for p in per_rank]
            rec["sync_collective_ms_per_rank"] = [
                statistics.median(
                    sum(c["call_ms"] for c in step if not c["async"]) for step in p["collectives"]
                )
                for p in per_rank
            ]
            rec["reductions_per_step"] = [p.get("reductions_per_step") for p in per_rank]
        out[v.name] = rec
    return out


def ratio_ci(a: list[float], b: list[float], n: int = 2000) -> list[float]:
    """5th and 95th percentiles of median(a) / median(b) over ``n`` bootstrap resamples of each
    list (with replacement, a fixed seed): how far the measured ratio could move by chance."""
    import random

    rng = random.Random(0)
    ratios = sorted(
        statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
        for _ in range(n)
    )
    return [ratios[int(0.05 * n)], ratios[int(0.95 * n) - 1]]


def targets(summary: dict[str, Any]) -> dict[str, Any]:
    """The issue's two targets, and (no target) FSDP against FSDP at the same memory; each with
    its bootstrap interval (:func:`ratio_ci`)."""

    def best(pick: Callable[[dict[str, Any]], bool]) -> str | None:
        names = [n for n, r in summary.items() if pick(r) and r.get("step_ms")]
        return min(names, key=lambda n: summary[n]["step_ms"]) if names else None

    def ratio(a: str | None, b: str | None, limit: float | None) -> dict[str, Any] | None:
        if a is None or b is None or a not in summary or b not in summary:
            return None
        ra, rb = summary[a], summary[b]
        if not (ra.get("step_ms") and rb.get("step_ms")):
            return None
        out: dict[str, Any] = {"value": ra["step_ms"] / rb["step_ms"], "a": a, "b": b}
        out["ci90"] = ratio_ci(ra["step_s"], rb["step_s"])
        if limit is not None:
            out["limit"], out["pass"] = limit, out["value"] <= limit
        return out

    ours_sharded = best(lambda r: r["impl"] == "ours" and r["sharding"] != "none")
    candidates = {
        "zero1_over_unsharded": ratio("ours-1f1b-zero1", "ours-1f1b", 1.05),
        "zero1_overlap_over_unsharded": ratio("ours-1f1b-zero1-overlap", "ours-1f1b", 1.05),
        "best_sharded_over_torch_best": ratio(
            ours_sharded, best(lambda r: r["impl"] == "torch"), 0.95
        ),
        "fsdp_over_torch_fsdp (no target)": ratio(
            best(lambda r: r["impl"] == "ours" and r["sharding"] == "fsdp"),
            best(lambda r: r["impl"] == "torch"),
            None,
        ),
    }
    return {k: v for k, v in candidates.items() if v is not None}


def _mb(x: int) -> str:
    return f"{x / 1e6:.1f}"


def to_markdown(result: dict[str, Any]) -> str:
    m, cfg, s = result["machine"], result["config"], result["summary"]
    end = result.get("machine_end", {})
    lines = [
        f"- model: {cfg['model']}; pp{PP} x dp{DP} on 4 CPU processes (gloo, one thread each); "
        f"{cfg['microbatches']} microbatches of {cfg['mb_size']} per replica (global batch "
        f"{cfg['global_batch']}); AdamW (lr {LR:g}) inside the timed step",
        f"- command: `{result['command']}`",
        f"- machine: {m['nproc']} x {m['cpu']}, torch {m['torch']}, lightning {m['lightning']}, "
        f"commit {m['commit']}; {m['date']}; load average at start {m['loadavg']}, at end "
        f"{end.get('loadavg')}; {cfg['rounds']} rounds x {cfg['steps']} measured steps per "
        f"variant, alternating",
        "",
        "| variant | schedule | sharding | step ms (median) | IQR ms | vs ours-1f1b | loss0 / "
        "grad-norm0 / loss1 rel. err | param MB per rank | grad MB per rank | optimizer MB per "
        "rank | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = s.get("ours-1f1b", {}).get("step_ms")
    for name, r in s.items():
        sched = TORCH_NAMES[r["schedule"]] if r["impl"] == "torch" else r["schedule"]
        step = r.get("step_ms")
        cells = [name, sched, r["sharding"]]
        cells.append(f"{step:.1f}" if step else "")
        cells.append(f"{r['iqr_ms'][0]:.1f}-{r['iqr_ms'][1]:.1f}" if step else "")
        cells.append(f"{step / base:.3f}" if step and base else "")
        if "check" in r:
            e = r["check"]["rel_err"]
            cells.append(f"{e['loss0']:.1e} / {e['grad_norm0']:.1e} / {e['loss1']:.1e}")
            b = r["bytes_per_rank"]
            for k in ("param", "grad", "optimizer"):
                cells.append(" / ".join(_mb(x[k]) for x in b))
        else:
            cells += ["", "", "", ""]
        cells.append(r["status"])
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| target | ratio of median steps | 90% bootstrap interval | verdict |",
        "|---|---|---|---|",
    ]
    labels = {
        "zero1_over_unsharded": "zero=1 / our unsharded",
        "zero1_overlap_over_unsharded": "zero=1 overlap_param_gather / our unsharded",
        "best_sharded_over_torch_best": "our best sharded / torch's best sharded",
        "fsdp_over_torch_fsdp (no target)": "our best FSDP / torch's best (same memory)",
    }
    for key, z in result["targets"].items():
        limit = f" <= {z['limit']}" if "limit" in z else ""
        verdict = ("PASS" if z["pass"] else "MISS") if "limit" in z else "no target"
        lines.append(
            f"| {labels.get(key, key)}{limit}: {z['a']} / {z['b']} | {z['value']:.3f} | "
            f"{z['ci90'][0]:.3f}-{z['ci90'][1]:.3f} | {verdict} |"
        )
    lines += [
        "",
        "Phases (median ms over the measured steps, slowest rank of each phase). Inside "
        "`pipeline`, ours only, from the engine's record: `in_layers` the chunks' own forward "
        "and backward calls, `in_p2p_wait` blocked on point-to-point receives, `in_launch` "
        "packing and starting the data-parallel reductions:",
        "",
    ]
    names = ["pipeline", "in_layers", "in_p2p_wait", "in_launch", "wait", "optimizer", "gather"]
    names += ["zero_grad"]
    lines += ["| variant | " + " | ".join(names) + " | reductions/step (rank 0) |"]
    lines += ["|---|" + "---|" * (len(names) + 1)]
    for name, r in s.items():
        ph = r.get("phase_ms_per_rank")
        if not ph:
            continue
        cells = []
        for k in names:
            vals = [p[k] for p in ph if p.get(k) is not None]
            cells.append(f"{max(vals):.1f}" if vals else "-")
        cells.append(str(r["reductions_per_step"][0]))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    names = ["pipeline", "wait_skew", "wait", "optimizer", "gather_skew", "gather"]
    lines += [
        "",
        f"Profiled steps (untimed, {PROFILED} per variant): the same phases, a barrier on a "
        "side group of the replicas before `wait` and before `gather` splitting off the skew "
        "(waiting for the other replica to arrive); median ms, slowest rank; the collectives "
        "each rank starts per step (kind x count, MB each, a = asynchronous); ms inside "
        "synchronous collective calls, slowest rank:",
        "",
        "| variant | " + " | ".join(names) + " | collectives per step (rank 0) | sync. "
        "collective ms |",
        "|---|" + "---|" * (len(names) + 2),
    ]
    for name, r in s.items():
        ph = r.get("profiled_phase_ms_per_rank")
        if not ph:
            continue
        cells = []
        for k in names:
            vals = [p[k] for p in ph if p.get(k) is not None]
            cells.append(f"{max(vals):.1f}" if vals else "-")
        kinds: dict[str, int] = {}
        for c in r["collectives_per_rank"][0]:
            key = f"{c['op']} {c['mb']:.1f}{' a' if c['async'] else ''}"
            kinds[key] = kinds.get(key, 0) + 1
        cells.append(", ".join(f"{k} x{n}" for k, n in kinds.items()))
        cells.append(f"{max(r['sync_collective_ms_per_rank']):.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    bare = result["bare_collectives_ms"]
    lines += [
        "",
        f"Bare collectives over a dp group, {result['stage_numel'] / 1e6:.2f} M fp32 values "
        f"(one pipeline rank's parameters, {_mb(4 * result['stage_numel'])} MB), both dp groups "
        f"at once, median ms per rank: "
        + "; ".join(f"{k} " + " / ".join(f"{r[k]:.1f}" for r in bare) for k in bare[0]),
    ]
    local = result["local_costs_ms"]
    lines += [
        "",
        "Rank-local work around the reductions, one rank at a time (uncontended), one pipeline "
        "rank's parameters, median ms per rank: "
        + "; ".join(f"{k} " + " / ".join(f"{r[k]:.1f}" for r in local) for k in local[0]),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model, check + one step each")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (8)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per block (2)")
    ap.add_argument("--tol", type=float, default=1e-5, help="relative, against the reference")
    ap.add_argument("--unfixed", action="store_true", help="add a check-only row: torch + "
                    "FSDP2 without the gloo averaging fix (pytorch#162338)")  # fmt: skip
    ap.add_argument("--out", default=None, help="JSON (default benchmarks/results/sharded.json)")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--render", metavar="JSON", help="rebuild the tables of an earlier run's "
                    "JSON from its raw records (no run; the JSON keeps its command)")  # fmt: skip
    a = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = a.out or os.path.join(root, "benchmarks", "results", "sharded.json")
    if a.render:
        with open(a.render) as f:
            result = json.load(f)
        everyone = {v.name: v for v in (*VARIANTS.values(), UNFIXED)}
        variants = [everyone[n] for n in result["summary"]]
        result["summary"] = summarize(result["raw"], variants)
        result["targets"] = targets(result["summary"])
        return _write(result, a.render if a.out is None else out)
    size = SIZES["smoke" if a.smoke else "full"]
    rounds = a.rounds or (1 if a.smoke else 8)
    steps = a.steps or (1 if a.smoke else 2)
    m = size["microbatches"]
    w = Workload(
        "transformer",
        dim=size["dim"],
        heads=size["heads"],
        seq=size["seq"],
        mb_size=size["mb_size"],
    )
    variants = [VARIANTS[n] for n in a.variants]
    if a.unfixed:
        variants.append(UNFIXED)
    command = " ".join(["python", "benchmarks/bench_sharded.py", *(argv or sys.argv[1:])])
    info = machine_info()
    ref = reference(w, m)
    spec = Spec(w, m, tuple(variants), ref, rounds, steps, a.tol, 3 if a.smoke else 7)
    t0 = time.time()
    ranks = launch(_worker, WORLD, spec, timeout=a.timeout)
    ranks = sorted(ranks, key=lambda r: r["rank"])
    summary = summarize(ranks, variants)
    params = _numel(w)
    result: dict[str, Any] = {
        "command": command,
        "machine": info,
        "machine_end": machine_info(),
        "seconds": round(time.time() - t0, 1),
        "config": {
            "model": f"{w.flops_note()}, {PP * w.layers_per_rank} blocks, "
            f"{params / 1e6:.2f} M parameters ({params * 4 / 1e6:.1f} MB fp32)",
            "workload": asdict(w),
            "pp": PP,
            "dp": DP,
            "microbatches": m,
            "mb_size": w.mb_size,
            "global_batch": DP * m * w.mb_size,
            "rounds": rounds,
            "steps": steps,
            "tol": a.tol,
            "bucket_cap_mb": BUCKET_CAP_MB,
            "optimizer": f"AdamW(lr={LR}, eps={EPS}), torch defaults otherwise",
        },
        "reference": ref,
        "summary": summary,
        "targets": targets(summary),
        "bare_collectives_ms": [r["bare_collectives_ms"] for r in ranks],
        "local_costs_ms": [r["local_costs_ms"] for r in ranks],
        "stage_numel": ranks[0]["stage_numel"],
        "ranks": [{k: r[k] for k in ("rank", "pp_rank", "dp_rank")} for r in ranks],
        "raw": [{"rank": r["rank"], "rows": r["rows"]} for r in ranks],
    }
    return _write(result, out)


def _write(result: dict[str, Any], out: str) -> dict[str, Any]:
    """The JSON at ``out`` and the markdown beside it (``.md``); exit non-zero when a variant
    differs from the reference."""
    md = to_markdown(result)
    result["markdown"] = md
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write("# Sharded data parallelism: lightning_pp vs torch.distributed.pipelining + "
                "FSDP2\n\n" + md + "\n")  # fmt: skip
    print(md)
    bad = [n for n, r in result["summary"].items() if r["status"].startswith("not timed")]
    if bad:
        raise SystemExit(f"variants differ from the reference: {bad}")
    return result


if __name__ == "__main__":
    main()

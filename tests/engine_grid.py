"""The engine-level equivalence grid: one case runner for every schedule, read by the engine
tests (gloo), the NCCL-emulated grid and ``benchmarks/gpu_check.py``.

A case is a dict (:func:`case`): schedule, ``pp``, ``vpp`` (``None``: the schedule's own), ``m``,
the model (``mlp``, ``tuple`` activations whose sequence length changes every step, ``tied``
first/last weight, ``unsplittable`` stages), the loss reduction, shape mode, output release,
receive lookahead, interleaved group size, and ``dp_sync`` (two replicas with the deferred
data-parallel all-reduce). :func:`run_case` trains it for ``steps`` steps on this rank next to
the unpipelined, single-process reference of the same model on the same data, and returns
plain numbers; :func:`case_problem` says what is wrong with them (``None``: equal within
:data:`TOL` on the loss of every step, every gradient of the first step, the eval loss).

No process is started here: the tests run the cases in their worlds (:mod:`worlds`).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
from engine_models import (
    NUM_LAYERS,
    grad_errors,
    mlp_batch,
    mlp_layers,
    mse_loss,
    run_reference,
    tied_batch,
    tied_layers,
    tuple_batch,
    tuple_input_fn,
    tuple_layers,
    unsplittable_layers,
)
from torch import nn

from lightning_pp.layout.partition import PipelineChunk, partition_layers
from lightning_pp.layout.topology import PipelineTopology, ProcessGroups, build_process_groups
from lightning_pp.runtime.engine import PipelineEngine
from lightning_pp.runtime.grad_sync import DeferredGradSync, TiedGroup, TiedParameterSync
from lightning_pp.schedules import Action, Costs, Op, Schedule, build_schedule

TOL = 1e-6
SEQ_LENS = [5, 7, 3, 6, 4]


def case(schedule: str, pp: int, m: int, vpp: int | None = None, **kw: Any) -> dict:
    """One grid case with its id (``mlp-interleaved-pp4-vpp2-m8``, options appended)."""
    c: dict[str, Any] = dict(schedule=schedule, pp=pp, vpp=vpp, m=m, model="mlp")
    c.update(reduction="mean", group=None, release=True, static=False, batch=10)
    c.update(lookahead=None, dp_sync=False, steps=5)
    c.update(kw)
    c["id"] = (
        f"{c['model']}-{schedule}-pp{pp}"
        + (f"-vpp{vpp}" if vpp is not None else "")
        + f"-m{m}"
        + ("-sum" if c["reduction"] == "sum" else "")
        + (f"-N{c['group']}" if c["group"] else "")
        + ("-static" if c["static"] else "")
        + ("" if c["release"] else "-norelease")
        + (f"-b{c['batch']}" if c["batch"] not in (8, 10) else "")
        + (f"-L{c['lookahead']}" if c["lookahead"] else "")
        + ("-dp2" if c["dp_sync"] else "")
        + ("-costs" + "-".join(f"{v:g}" for v in c["costs"].values()) if c.get("costs") else "")
    )
    return c


def v_schedule(pp: int, m: int) -> Schedule:
    """GPipe order over a V placement (rank r holds stages r and 2p-1-r): a schedule no
    generator builds, to run V placement without a split backward."""
    order = [Action(Op.F, mb, c) for c in (0, 1) for mb in range(m)]
    order += [Action(Op.B, mb, c) for c in (1, 0) for mb in range(m)]
    return Schedule("gpipe-v", pp, 2, m, tuple(tuple(order) for _ in range(pp)), placement="v")


def schedule_of(c: dict) -> Schedule:
    if c["schedule"] == "gpipe-v":
        return v_schedule(c["pp"], c["m"])
    kw: dict[str, Any] = {} if c["vpp"] is None else {"vpp": c["vpp"]}
    if c.get("costs"):  # zb-auto: the order is computed from these (Costs keyword arguments)
        kw["costs"] = Costs(**c["costs"])
    return build_schedule(
        c["schedule"], pp=c["pp"], microbatches=c["m"], group_size=c["group"], **kw
    )


def chunks_of(layers: list[nn.Module], schedule: Schedule, pp_rank: int) -> list[PipelineChunk]:
    """This rank's chunks from the schedule's placement, as copies of the reference layers.
    Tied layers keep sharing their weight inside one rank (one deepcopy of all local layers)."""
    ranges = partition_layers(len(layers), schedule.pp, schedule.vpp)
    stages = schedule.stages_of(pp_rank)
    local = copy.deepcopy([[layers[i] for i in ranges[s]] for s in stages])
    return [PipelineChunk(ls, ranges[s]) for ls, s in zip(local, stages)]


def hook_problems(calls: list, record: Any, actions: list) -> list[str]:
    """``on_chunk_grads_ready``: once per chunk, during the event of that chunk's LAST backward
    (``B``, or ``W`` under a split backward)."""
    last = {a.chunk: i for i, a in enumerate(actions) if a.op in (Op.B, Op.W)}
    problems = []
    if sorted(c for c, _ in calls) != sorted(last):
        problems.append(f"hook called for chunks {[c for c, _ in calls]}, expected {sorted(last)}")
    for c, t in calls:
        where = [i for i, ev in enumerate(record.events) if ev.start <= t <= ev.end]
        if where != [last.get(c)]:
            problems.append(f"hook for chunk {c} ran during {where}, expected {last.get(c)}")
    return problems


def _model(c: dict, seed: int) -> tuple[list[nn.Module], Any, Any]:
    """(layers, input_fn, make(dp_rank, step) -> batch) of the case's model."""
    model, n = c["model"], c["batch"]

    def data_seed(dp: int, s: int) -> int:
        return seed + 100 * dp + s

    if model == "tuple":

        def make(dp: int, s: int) -> Any:
            return tuple_batch(data_seed(dp, s), n, SEQ_LENS[s])

        return tuple_layers(seed), tuple_input_fn, make
    if model == "tied":
        return tied_layers(seed), None, lambda dp, s: tied_batch(data_seed(dp, s), n)
    layers = mlp_layers(seed) if model == "mlp" else unsplittable_layers(seed)
    return layers, None, lambda dp, s: mlp_batch(data_seed(dp, s), n)


def _loss_of(layers: list[nn.Module], batch: Any, loss_fn: Any, input_fn: Any) -> float:
    with torch.no_grad():
        x = input_fn(batch)
        for layer in layers:
            x = layer(x)
        return loss_fn(x, batch).item()


def run_case(
    rank: int,
    c: dict,
    groups: ProcessGroups,
    *,
    monitor: Any = None,
    device: torch.device | None = None,
) -> dict:
    """Train ``c`` for its steps on this rank and on the unpipelined reference; return the
    numbers :func:`case_problem` and the tests read. ``groups``: this case's process groups
    (``pp`` = ``c["pp"]`` over the default group's world); ``monitor``: a failure monitor of the
    case's own (the NCCL-emulated grid)."""
    pp = c["pp"]
    topo = PipelineTopology.from_world(dist.get_world_size(), rank, pp)
    schedule = schedule_of(c)
    device = device or torch.device("cpu")
    # the seed keeps microbatched fp32 summation within 1e-6 of the whole batch's
    layers, input_fn, make = _model(c, 1234)
    layers = [layer.to(device) for layer in layers]
    to = _to_device(device)
    batches = [to(make(topo.dp_rank, s)) for s in range(c["steps"])]
    loss_fn = mse_loss(c["reduction"])
    ref_layers = copy.deepcopy(layers)
    chunks = chunks_of(layers, schedule, topo.pp_rank)
    sync = None
    if c["dp_sync"]:
        sync = DeferredGradSync([list(ch.parameters()) for ch in chunks], groups.dp_group, topo.dp)
    calls: list[tuple[int, float]] = []

    def on_ready(chunk: int) -> None:
        calls.append((chunk, time.perf_counter()))
        if sync is not None:
            sync.on_chunk_grads_ready(chunk)

    engine = PipelineEngine(
        chunks,
        schedule,
        topo,
        groups,
        loss_fn=loss_fn,
        input_fn=input_fn,
        loss_reduction=c["reduction"],
        release_outputs=c["release"],
        static_shapes=c["static"],
        recv_lookahead=c["lookahead"],
        measure_memory=True,
        on_chunk_grads_ready=on_ready,
        failure_monitor=monitor,
    )
    params = list({id(p): p for ch in chunks for p in ch.parameters()}.values())
    ref_params = list({id(p): p for layer in ref_layers for p in layer.parameters()}.values())
    # A summed loss has batch*OUT times larger gradients: scale lr so training stays stable
    # (an unstable run amplifies fp32 rounding past any fixed tolerance).
    lr = 0.05 if c["reduction"] == "mean" else 0.05 / (c["batch"] * 3)
    trainable = [p for p in params if p.requires_grad] or [nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD(trainable, lr=lr, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ref_params if p.requires_grad], lr=lr, momentum=0.9)
    ref_input = input_fn or (lambda b: b[0])
    out: dict[str, Any] = dict(losses=[], refs=[], grad_err=0.0, worst="", hook=[], peak_stash=0)
    # the rank holding the last stage (rank 0 under V placement) computes loss and outputs
    out.update(pp_rank=topo.pp_rank, is_last=any(place.last for place in engine.places))
    # forward-only evaluation first, while both models hold the same initial weights
    res = engine.eval_step(batches[0], collect_outputs=True)
    with torch.no_grad():
        x = ref_input(batches[0])
        for layer in ref_layers:
            x = layer(x)
        out["eval"] = (res.loss.item(), loss_fn(x, batches[0]).item())
    if res.outputs is not None:
        out["eval_out_err"] = (torch.cat(res.outputs) - x).abs().max().item()
    tied = _tied_sync(c, schedule, topo, groups, chunks)
    for s, batch in enumerate(batches):
        calls.clear()
        res = engine.train_step(batch)
        if sync is not None:
            sync.wait()
        if tied is not None:
            tied.all_reduce_grads()
        if c["dp_sync"]:
            # the reference sees both replicas' data: a mean over the concatenated batch
            other = to(make(1 - topo.dp_rank, s))
            both = [batch, other] if topo.dp_rank == 0 else [other, batch]
            whole = tuple(torch.cat(p) for p in zip(*both))
            run_reference(ref_layers, whole, loss_fn, ref_input)
            out["refs"].append(_loss_of(ref_layers, batch, loss_fn, ref_input))  # this replica's
        else:
            out["refs"].append(run_reference(ref_layers, batch, loss_fn, ref_input).item())
        out["losses"].append(res.loss.item())
        if s == 0:
            # Gradients are compared where both models hold identical weights. Later steps
            # compare the loss: the weights then differ by fp32 rounding (order of summation),
            # which the optimizer carries forward.
            for name, e in grad_errors(chunks, ref_layers).items():
                if e > out["grad_err"]:
                    out["grad_err"], out["worst"] = e, f"layer {name}"
        actions = engine.schedule.ranks[topo.pp_rank]
        out["hook"] += [f"step {s}: {p}" for p in hook_problems(calls, res.record, actions)]
        out["posted_after"] = [ev.recv_posted_after for ev in res.record.events]
        out["peak_stash"] = max(out["peak_stash"], res.record.peak_stash_bytes)
        out["peak_saved"] = res.record.peak_saved_bytes
        out["peak_inflight"] = res.record.peak_inflight
        out["inflight"] = [ev.inflight for ev in res.record.events]
        # per local chunk: (holds stage 0, its I freed the graph)
        out["graph_free"] = [
            (engine.places[k].first, engine.graph_free[k]) for k in range(len(chunks))
        ]
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    out["lookahead"] = engine.recv_lookahead
    out["emulating"] = engine.comm.emulating_nccl
    out["batches"] = engine.comm._stream.batches if engine.comm._stream is not None else 0
    return out


def _tied_sync(
    c: dict, schedule: Schedule, topo: PipelineTopology, groups: ProcessGroups, chunks: list
) -> TiedParameterSync | None:
    """The strategy's tied-weight sync for the ``tied`` model under loop placement, where its
    first and last layer (one weight) sit on two ranks (pp=2: the pipeline group); under V
    placement both sit on rank 0 and share one Parameter."""
    if c["model"] != "tied" or schedule.placement != "loop":
        return None
    assert c["pp"] == 2, "the tied model's copies are on the pipeline group only at pp=2"
    w = chunks[0].layers[0].weight if topo.pp_rank == 0 else chunks[-1].layers[-1].weight
    ranks = topo.pipeline_ranks
    group = TiedGroup(("0.weight", f"{NUM_LAYERS - 1}.weight"), w, ranks[0], ranks, groups.pp_group)
    return TiedParameterSync([group])


def _to_device(device: torch.device) -> Any:
    def to(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if isinstance(x, (tuple, list)):
            return type(x)(to(t) for t in x)
        return x

    return to


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def case_problem(r: dict) -> str | None:
    """What is wrong with one rank's result of :func:`run_case` (``None``: it equals the
    unpipelined reference within :data:`TOL`, and the grad-ready hook fired where it should)."""
    if "error" in r:
        return r["error"]
    for step, (got, ref) in enumerate(zip(r["losses"], r["refs"])):
        if _rel(got, ref) > TOL:
            return f"step {step}: loss {got} != reference {ref}"
    if r["grad_err"] > TOL:
        return f"grad rel err {r['grad_err']:.3g} at {r['worst']}"
    if r["hook"]:
        return "; ".join(r["hook"])
    got, ref = r["eval"]
    if _rel(got, ref) > TOL:
        return f"eval loss {got} != reference {ref}"
    if r["is_last"] and r.get("eval_out_err", 0.0) > 1e-5:
        return f"eval outputs differ by {r['eval_out_err']:.3g}"
    return None


def groups_check(rank: int, world: int) -> dict:
    """pp outermost: world 4 / pp 2 has pipelines {0, 2}, {1, 3} and dp groups {0, 1}, {2, 3}."""
    topo = PipelineTopology.from_world(world, rank, 2)
    groups = build_process_groups(topo)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=groups.pp_group)
    u = torch.tensor([float(rank)])
    dist.all_reduce(u, group=groups.dp_group)
    return dict(pp_sum=t.item(), dp_sum=u.item(), pipeline=topo.pipeline_ranks, dp=topo.dp_ranks)


def run_cases(rank: int, world: int, cases: list[dict]) -> dict:
    """Every case in order on this rank (a world's case); groups built once per pp, in the same
    order on every rank. ``{case id: result, "seconds": ...}``."""
    cache: dict[int, ProcessGroups] = {}
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    for c in cases:
        pp = c["pp"]
        if pp not in cache:
            cache[pp] = build_process_groups(PipelineTopology.from_world(world, rank, pp))
        out[c["id"]] = run_case(rank, c, cache[pp])
    out["seconds"] = time.perf_counter() - t0
    return out

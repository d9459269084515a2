"""Enumerate pipeline shapes for a world size, predict each one's step time and memory from a
:class:`~lightning_pp.planner.profile.ModelProfile`, and rank them.

**What is enumerated** (every combination the plan's rules accept; :class:`SearchSpace`):
``dp x pp = world`` (``pp <= layers``, ``dp`` dividing the global batch); ``vpp`` in
``{1, 2, 4}`` where ``pp * vpp <= layers`` (``vpp > 1`` only for ``pp > 1``); microbatches
dividing the per-replica batch; the schedules (``gpipe``, ``1f1b``, ``zb-h1`` at ``vpp = 1``;
``gpipe``, ``interleaved``, ``zbv`` at ``vpp = 2``; ``gpipe``, ``interleaved`` at ``vpp = 4``;
only ``1f1b`` at ``pp = 1``, where every schedule runs the same actions); recompute ``None`` or
``"full"``; the layer split ``uniform`` or ``cost`` (balanced by measured ``t_f + t_i + t_w``;
dropped when it equals the uniform one). :class:`~lightning_pp.layout.plan.PipelinePlan` checks each
one: the planner states no rule of its own.

**Step time** = the simulator's makespan + a data-parallel all-reduce term. The simulator gets
per-(rank, chunk) costs: the sum of the chunk's layers' measured ``t_f``, ``t_i``, ``t_w`` at the
candidate's microbatch size (a fused ``B`` costs the measured fused backward ``t_b``; the first
stage's ``I`` is a no-op, its ``W`` runs the whole backward, as in the engine), times the
profile's ``compute_scale``, plus the per-action overhead on every action and the receive cost
``receive_s`` on every action that receives (``F`` past the first stage, ``B``/``I`` before the
last); full recompute adds the chunk's forward to each ``B``/``I``; every cross-rank dependency
costs ``latency - receive_s + boundary bytes / bandwidth`` (the largest boundary of the split;
the bubble monitor's expectation splits a hop the same way).
The all-reduce follows the ring model, ``2 (dp-1)/dp x grad bytes / bandwidth + 2 (dp-1) x
latency`` for the heaviest rank's gradients, added after the makespan (the engine overlaps it
with the last backwards, so this errs on the slow side). The optimizer step is not counted.
With ``cores`` given and more processes than cores, the pipeline's time is at least the whole
world's compute over the cores (:func:`oversubscribed_seconds`).

**Memory**: :func:`~lightning_pp.planner.memory.rank_memory` per pipeline rank; candidates whose
heaviest rank exceeds ``memory_per_device`` are dropped (kept aside for the error message).

**Order**: predicted step time, then peak memory, then a stable key of the shape, so a given
profile always gives the same ranking.

Example:
    >>> from lightning_pp.planner.profile import LayerCost, ModelProfile
    >>> layer = LayerCost(1e-3, 1e-3, 1e-3, saved_bytes=1000, param_bytes=400, params=100,
    ...                   boundary_bytes=100, input_bytes=100)
    >>> prof = ModelProfile({4: [layer] * 8}, overhead_s=0.0, latency_s=0.0)
    >>> result = search(prof, world=2, global_batch=16)
    >>> best = result.ranked[0].candidate
    >>> (best.dp, best.pp) in {(1, 2), (2, 1)}
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ..layout.partition import partition_layers
from ..layout.plan import PipelinePlan
from ..layout.recompute_spec import format_bytes
from ..layout.rules import (
    PreflightError,
    check_batch,
    check_layers,
    check_schedule_args,
    check_world,
)
from ..schedules import Action, Costs, Op, receives
from .fastsim import CompiledSchedule
from .memory import RankMemory, rank_memory
from .profile import LayerCost, ModelProfile
from .recompute import inflight_profile

__all__ = [
    "Candidate",
    "Prediction",
    "SearchError",
    "SearchResult",
    "SearchSpace",
    "allreduce_seconds",
    "describe_candidate",
    "describe_memory",
    "describe_shape",
    "make_candidate",
    "oversubscribed_seconds",
    "predict",
    "search",
]

#: schedules tried per chunks-per-rank (``vpp``); the order is also the tie-break order
SCHEDULES_BY_VPP: dict[int, tuple[str, ...]] = {
    1: ("1f1b", "zb-h1", "gpipe"),
    2: ("interleaved", "zbv", "gpipe"),
    4: ("interleaved", "gpipe"),
}
_SCHEDULE_ORDER = ("1f1b", "zb-h1", "interleaved", "zbv", "gpipe")


class SearchError(ValueError):
    """No candidate is left: none valid for the world size, or none fits in memory."""


@dataclass(frozen=True)
class SearchSpace:
    """What :func:`search` enumerates (see the module notes).

    Example:
        >>> SearchSpace(recomputes=(None,), splits=("uniform",)).vpps
        (1, 2, 4)
    """

    vpps: tuple[int, ...] = (1, 2, 4)
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
    recomputes: tuple[str | None, ...] = (None, "full")
    splits: tuple[str, ...] = ("uniform", "cost")
    max_microbatches: int | None = 64


@dataclass(frozen=True)
class Candidate:
    """One shape: ``dp x pp`` processes, ``vpp`` chunks per rank, ``microbatches`` per step,
    a schedule, a layer split (``counts``: layers per virtual stage) and a recompute setting."""

    dp: int
    pp: int
    vpp: int
    microbatches: int
    schedule: str
    split: str
    recompute: str | None
    counts: tuple[int, ...]
    batch_size: int  # per data-parallel replica

    @property
    def microbatch_size(self) -> float:
        return self.batch_size / self.microbatches

    @property
    def shape(self) -> str:
        return f"{self.dp}x{self.pp}x{self.vpp}"

    def key(self) -> tuple[object, ...]:
        """A stable total order for ties."""
        return (
            self.dp,
            self.pp,
            self.vpp,
            self.microbatches,
            _SCHEDULE_ORDER.index(self.schedule) if self.schedule in _SCHEDULE_ORDER else 99,
            self.split,
            self.recompute or "",
            self.counts,
        )

    def strategy_settings(self) -> dict[str, object]:
        """The ``strategy:`` keys of a run with this shape."""
        return {
            "pp": self.pp,
            "vpp": self.vpp,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "partition": list(self.counts),
            "recompute": self.recompute,
        }


@dataclass(frozen=True)
class Prediction:
    """A candidate's predicted step: seconds (simulated makespan + all-reduce), bubble (idle /
    compute), memory of every pipeline rank, throughput."""

    candidate: Candidate
    step_s: float
    makespan_s: float
    allreduce_s: float
    bubble: float
    memory: tuple[RankMemory, ...]
    samples_per_s: float
    tokens_per_s: float | None
    #: what the oversubscription term added to the makespan (0 unless more processes than cores)
    contention_s: float = 0.0

    @property
    def heaviest(self) -> RankMemory:
        return max(self.memory, key=lambda m: (m.total, -m.rank))

    @property
    def peak_bytes(self) -> int:
        return self.heaviest.total

    def sort_key(self) -> tuple[object, ...]:
        return (self.step_s, self.peak_bytes, self.candidate.key())


@dataclass
class SearchResult:
    """``ranked``: the candidates that fit, best first. ``over_memory``: those that do not,
    least memory first (their step time is not simulated). ``rejected``: shapes the plan
    refused, with its message. ``seconds`` / ``cpu_seconds``: the search's wall time and this
    process's CPU time (the work, whatever else the machine runs)."""

    ranked: list[Prediction]
    over_memory: list[Prediction] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    considered: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    @property
    def best(self) -> Prediction:
        return self.ranked[0]


def allreduce_seconds(nbytes: float, dp: int, latency_s: float, bandwidth: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``dp`` replicas: each sends and receives
    ``2 (dp-1)/dp`` of the buffer in ``2 (dp-1)`` steps."""
    if dp <= 1:
        return 0.0
    return 2 * (dp - 1) / dp * nbytes / bandwidth + 2 * (dp - 1) * latency_s


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _rank_chunks(plan: PipelinePlan, layers: Sequence[LayerCost]) -> list[list[list[LayerCost]]]:
    assert plan.layer_ranges is not None
    return [
        [[layers[i] for i in plan.layer_ranges[s]] for s in plan.schedule.stages_of(r)]
        for r in range(plan.pp)
    ]


def memory_of(
    plan: PipelinePlan,
    layers: Sequence[LayerCost],
    recompute: str | None,
    optimizer: str = "adam",
    inflight: Sequence[Sequence[tuple[tuple[int, int], ...]]] | None = None,
) -> tuple[RankMemory, ...]:
    """Every pipeline rank's predicted memory (``layers`` at the candidate's microbatch size;
    ``inflight[r]``: :func:`~lightning_pp.planner.recompute.inflight_profile` of rank r, when
    computed already)."""
    return tuple(
        rank_memory(
            plan.schedule,
            r,
            chunks,
            recompute=recompute,
            optimizer=optimizer,
            inflight=None if inflight is None else inflight[r],
        )
        for r, chunks in enumerate(_rank_chunks(plan, layers))
    )


def step_costs(
    plan: PipelinePlan,
    layers: Sequence[LayerCost],
    recompute: str | None,
    profile: ModelProfile,
    split: bool | None = None,
) -> Costs:
    """The simulator's cost model of a candidate (see the module notes). ``split``: whether
    the schedule splits backward, when known (finding out scans every action)."""
    oh, k, rx = profile.overhead_s, profile.compute_scale, profile.receive_s
    schedule = plan.schedule
    split = schedule.split_backward if split is None else split
    overrides: dict[tuple[int, int], tuple[float, ...]] = {}
    extra: dict[int | tuple[int, int], float] = {}
    for r, chunks in enumerate(_rank_chunks(plan, layers)):
        for c, chunk in enumerate(chunks):
            t_f = k * sum(x.t_f for x in chunk)
            t_i = k * sum(x.t_i for x in chunk)
            t_w = k * sum(x.t_w for x in chunk)
            t_b = k * sum(x.t_b for x in chunk)  # fused: cheaper than t_i + t_w
            stage = schedule.stage(r, c)
            if split and stage == 0:
                t_i, t_w = 0.0, t_i + t_w  # no input gradient: W runs the whole backward
            # an activation into F, a gradient into B or I (W receives nothing)
            f_rx = rx if receives(schedule, r, Action(Op.F, 0, c)) else 0.0
            b_rx = rx if receives(schedule, r, Action(Op.B, 0, c)) else 0.0
            overrides[(r, c)] = (t_f + oh + f_rx, t_b + oh + b_rx, t_i + oh + b_rx, t_w + oh)
            if recompute == "full":
                extra[(r, c)] = t_f
    latency = 0.0
    if plan.pp > 1:
        assert plan.layer_ranges is not None
        boundary = max(layers[rng[-1]].boundary_bytes for rng in plan.layer_ranges[:-1])
        # every receive already pays receive_s; the hop adds the rest of its measured delay
        latency = max(profile.latency_s - rx, 0.0) + boundary / profile.bandwidth
    return Costs(overrides=overrides, latency=latency, recompute=extra)


def predict(
    profile: ModelProfile,
    candidate: Candidate,
    plan: PipelinePlan,
    *,
    optimizer: str = "adam",
    memory: tuple[RankMemory, ...] | None = None,
    compiled: CompiledSchedule | None = None,
    layers: Sequence[LayerCost] | None = None,
    cores: int | None = None,
) -> Prediction:
    """Simulate one candidate (``plan``: its checked plan, layers split as ``counts``;
    ``compiled``: ``plan.schedule`` compiled, reused across candidates of one schedule;
    ``cores``: the CPU cores the processes share, see :func:`oversubscribed_seconds`)."""
    layers = profile.layers(candidate.microbatch_size) if layers is None else layers
    if memory is None:
        memory = memory_of(plan, layers, candidate.recompute, optimizer)
    compiled = compiled or CompiledSchedule(plan.schedule)
    costs = step_costs(plan, layers, candidate.recompute, profile, compiled.split_backward)
    makespan, busy = compiled.run(costs)
    if profile.receive_s:
        # a receive's cost is time blocked on it, not computing (the bubble counts it idle, and
        # it leaves the core free for another process)
        busy = [b - profile.receive_s * n for b, n in zip(busy, compiled.receives)]
    compute = sum(busy)
    bubble = (makespan * len(busy) - compute) / compute if compute > 0 else 0.0
    grads = max(m.grads for m in memory)
    ar = allreduce_seconds(grads, candidate.dp, profile.latency_s, profile.bandwidth)
    pipeline = oversubscribed_seconds(makespan, busy, candidate.dp, cores)
    step = pipeline + ar
    samples = candidate.batch_size * candidate.dp / step
    tokens = samples * profile.tokens_per_sample if profile.tokens_per_sample else None
    return Prediction(
        candidate, step, makespan, ar, bubble, memory, samples, tokens, pipeline - makespan
    )


def oversubscribed_seconds(
    makespan: float, busy: Sequence[float], dp: int, cores: int | None
) -> float:
    """The pipeline's time when ``dp x len(busy)`` processes share ``cores`` CPU cores.

    With more processes than cores the processes cannot all compute at once, so a step takes
    at least the whole world's compute spread over the cores: ``max(makespan, dp x sum(busy)
    / cores)`` (``busy``: each pipeline rank's compute, overheads included; every
    data-parallel replica computes as much). A lower bound, not a schedule: it assumes the
    cores are never idle while any process has work, and ignores the cost of switching.
    ``cores=None`` or enough cores: the makespan unchanged.

    Example:
        >>> oversubscribed_seconds(1.0, [0.8, 0.8], dp=2, cores=2)   # 3.2 s of work on 2 cores
        1.6
        >>> oversubscribed_seconds(1.0, [0.8, 0.8], dp=1, cores=2)
        1.0
    """
    if not cores or dp * len(busy) <= cores:
        return makespan
    return max(makespan, dp * sum(busy) / cores)


def _base_plans(
    profile: ModelProfile, world: int, global_batch: int, space: SearchSpace
) -> Iterator[tuple[int, PipelinePlan | None, str, str]]:
    """(dp, plan without layers or None, description, refusal) for every shape/schedule/m.

    The plan's own rules (:mod:`lightning_pp.layout.plan`: world, schedule, batch) judge each one;
    the plan is assembled from their results rather than with ``PipelinePlan.build``, which
    also simulates a warning text for every ``microbatches < pp`` (a search keeps those
    shapes and ranks them by their simulated bubble anyway)."""
    n = profile.num_layers
    for pp in _divisors(world):
        dp = world // pp
        where = f"dp={dp} x pp={pp}"
        if pp > n:
            yield dp, None, where, f"pp={pp} > {n} layers (every stage needs a layer)"
            continue
        if global_batch % dp:
            yield dp, None, where, f"global batch {global_batch} does not split over dp={dp}"
            continue
        per = global_batch // dp
        vpps = [1] if pp == 1 else [v for v in space.vpps if pp * v <= n]
        for vpp in vpps:
            names = ("1f1b",) if pp == 1 else SCHEDULES_BY_VPP.get(vpp, ("interleaved", "gpipe"))
            for name in (s for s in names if s in space.schedules):
                for m in _divisors(per):
                    if space.max_microbatches is not None and m > space.max_microbatches:
                        continue
                    what = f"{where} vpp={vpp} m={m} {name}"
                    try:
                        check_world(world, pp, dp)
                        plan = _checked_plan(world, pp, dp, per, name, m, vpp)
                    except PreflightError as err:
                        yield dp, None, what, str(err)
                        continue
                    yield dp, plan, what, ""


def _checked_plan(
    world: int, pp: int, dp: int, per: int, schedule: str, microbatches: int, vpp: int | None
) -> PipelinePlan:
    """The plan of one shape after the schedule's and the batch's rules (the world's is the
    caller's), without layers; raises :class:`PreflightError`."""
    sched = check_schedule_args(schedule, pp, microbatches, vpp, warn=False)
    check_batch(per, microbatches, dp)
    return PipelinePlan(
        pp=pp,
        vpp=sched.vpp,
        microbatches=microbatches,
        schedule=sched,
        world_size=world,
        dp=dp,
        batch_size=per,
    )


def _splits(
    layers: Sequence[LayerCost], plan: PipelinePlan, space: SearchSpace
) -> list[tuple[str, tuple[int, ...]]]:
    n, k = len(layers), plan.num_stages
    out: list[tuple[str, tuple[int, ...]]] = []
    for split in space.splits:
        if split == "uniform":
            ranges = partition_layers(n, plan.pp, plan.vpp, "uniform")
        else:
            weights = [c.t_f + c.t_b for c in layers]
            ranges = partition_layers(n, plan.pp, plan.vpp, "cost", layer_costs=weights)
        counts = tuple(len(r) for r in ranges)
        if len(counts) == k and all(counts != c for _, c in out):
            out.append((split, counts))
    return out


def search(
    profile: ModelProfile,
    world: int,
    global_batch: int,
    *,
    memory_per_device: int | None = None,
    space: SearchSpace | None = None,
    optimizer: str = "adam",
    cores: int | None = None,
) -> SearchResult:
    """Rank every valid candidate for ``world`` processes and a global batch of
    ``global_batch`` samples per optimizer step (``cores``: the CPU cores the processes share,
    when they are CPU processes: see :func:`oversubscribed_seconds`; ``None``: one device
    each).

    Raises:
        SearchError: no valid shape for ``world`` (naming why each ``pp`` failed and the nearest
            world size that has one), or none fits in ``memory_per_device`` (naming the
            least-memory candidate and its need).
    """
    space = space or SearchSpace()
    started, started_cpu = time.perf_counter(), time.process_time()
    fits: list[Prediction] = []
    over: list[Prediction] = []
    rejected: list[tuple[str, str]] = []
    considered = 0
    layers_at: dict[float, list[LayerCost]] = {}
    splits_of: dict[tuple[int, int, float], list[tuple[str, tuple[int, ...]]]] = {}
    for dp, plan, what, why in _base_plans(profile, world, global_batch, space):
        if plan is None:
            rejected.append((what, why))
            continue
        per = global_batch // dp
        size = per / plan.microbatches
        if size not in layers_at:  # scaling a profile costs a copy per layer: once per size
            layers_at[size] = profile.layers(size)
        layers = layers_at[size]
        shape = (plan.pp, plan.vpp, size)
        if shape not in splits_of:  # the cost split's exact balancing: once per shape and size
            splits_of[shape] = _splits(layers, plan, space)
        compiled: CompiledSchedule | None = None  # compiled on first use: over-memory skip it
        inflight = [inflight_profile(plan.schedule, r) for r in range(plan.pp)]
        for (split, counts), recompute in itertools.product(splits_of[shape], space.recomputes):
            considered += 1
            laid = _with_counts(plan, counts, profile.num_layers)
            cand = Candidate(
                dp,
                plan.pp,
                plan.vpp,
                plan.microbatches,
                plan.schedule.name,
                split,
                recompute,
                counts,
                per,
            )
            memory = memory_of(laid, layers, recompute, optimizer, inflight)
            if memory_per_device is not None and max(m.total for m in memory) > memory_per_device:
                over.append(Prediction(cand, math.inf, math.inf, 0.0, math.nan, memory, 0.0, None))
                continue
            compiled = compiled or CompiledSchedule(plan.schedule)
            fits.append(
                predict(
                    profile,
                    cand,
                    laid,
                    optimizer=optimizer,
                    memory=memory,
                    compiled=compiled,
                    cores=cores,
                )
            )
    fits.sort(key=Prediction.sort_key)
    over.sort(key=lambda p: (p.peak_bytes, p.candidate.key()))
    result = SearchResult(
        fits,
        over,
        rejected,
        considered,
        time.perf_counter() - started,
        time.process_time() - started_cpu,
    )
    if not fits:
        raise SearchError(
            _no_candidate_message(
                profile, world, global_batch, result, memory_per_device, space.max_microbatches
            )
        )
    return result


def make_candidate(
    profile: ModelProfile,
    world: int,
    global_batch: int,
    *,
    pp: int,
    vpp: int | None,
    microbatches: int,
    schedule: str,
    split: str | Sequence[int] = "uniform",
    recompute: str | None = None,
) -> tuple[Candidate, PipelinePlan]:
    """One given shape as a candidate and its checked plan (the plan's rules judge it, as in
    :func:`search`); ``split``: ``"uniform"``, ``"cost"`` (balanced as the search balances)
    or the layers of each virtual stage; ``vpp=None``: the schedule's own (2 for zbv, else 1).

    Raises:
        PreflightError: the plan refuses the shape (its message names the numbers).

    Example:
        >>> from lightning_pp.planner.profile import LayerCost, ModelProfile
        >>> prof = ModelProfile({4: [LayerCost(1e-3, 1e-3, 1e-3)] * 4})
        >>> cand, plan = make_candidate(prof, 2, 16, pp=2, vpp=1, microbatches=2,
        ...                             schedule="1f1b")
        >>> cand.counts, cand.dp, cand.batch_size
        ((2, 2), 1, 16)
    """
    dp = world // pp
    check_world(world, pp, dp)
    if global_batch % dp:
        raise PreflightError(f"global batch {global_batch} does not split over dp={dp}")
    per = global_batch // dp
    base = _checked_plan(world, pp, dp, per, schedule, microbatches, vpp)
    if isinstance(split, str):
        layers = profile.layers(per / microbatches)
        space = SearchSpace(splits=(split,))
        found = _splits(layers, base, space)
        if not found:
            raise PreflightError(f"split {split!r} gives no {base.num_stages}-stage partition")
        label, counts = found[0]
    else:
        label, counts = "explicit", tuple(int(c) for c in split)
    plan = _with_counts(base, counts, profile.num_layers)
    cand = Candidate(
        dp, pp, base.vpp, microbatches, base.schedule.name, label, recompute, counts, per
    )
    return cand, plan


def _with_counts(plan: PipelinePlan, counts: Sequence[int], num_layers: int) -> PipelinePlan:
    """``plan`` with its layers split as ``counts`` (the plan's layer rule checks it)."""
    ranges = check_layers(num_layers, plan.pp, plan.vpp, list(counts))
    return dataclasses.replace(plan, partition=tuple(counts), layer_ranges=tuple(ranges))


def describe_shape(c: Candidate) -> str:
    """``dp=2 x pp=2 x vpp=1, microbatches=4, schedule 1f1b, split cost (3 3), recompute none``"""
    return (
        f"dp={c.dp} x pp={c.pp} x vpp={c.vpp}, microbatches={c.microbatches}, schedule "
        f"{c.schedule}, split {c.split} ({' '.join(map(str, c.counts))}), recompute "
        f"{c.recompute or 'none'}"
    )


def describe_memory(m: RankMemory) -> str:
    """``1.20 MiB (1258291 bytes: params ..., buffers ...)``: one rank's peak by part."""
    return (
        f"{format_bytes(m.total)} ({m.total} bytes: params {format_bytes(m.params)}, grads "
        f"{format_bytes(m.grads)}, optimizer {format_bytes(m.optimizer)}, activations "
        f"{format_bytes(m.activations)}, buffers {format_bytes(m.buffers)})"
    )


def describe_candidate(p: Prediction) -> str:
    """The shape and what its heaviest pipeline rank needs (for error messages)."""
    heavy = p.heaviest
    return (
        f"{describe_shape(p.candidate)}: pipeline rank {heavy.rank} needs {describe_memory(heavy)}"
    )


def _valid_world(profile: ModelProfile, world: int, global_batch: int) -> str | None:
    """A valid dp x pp for ``world`` by the basic counts (layers, batch), or None."""
    for pp in _divisors(world):
        dp = world // pp
        if pp <= profile.num_layers and global_batch % dp == 0:
            return f"dp={dp} x pp={pp}"
    return None


def _no_candidate_message(
    profile: ModelProfile,
    world: int,
    global_batch: int,
    result: SearchResult,
    memory_per_device: int | None,
    space_max: int | None = None,
) -> str:
    if result.over_memory:
        assert memory_per_device is not None
        nearest = result.over_memory[0]
        return (
            f"no candidate fits in memory_per_device={format_bytes(memory_per_device)} "
            f"({memory_per_device} bytes) on world size {world}: all {len(result.over_memory)} "
            f"valid candidates need more. The nearest: {describe_candidate(nearest)}. Raise "
            f"--memory-per-device to at least {format_bytes(nearest.peak_bytes)}, or use more "
            f"devices (more pipeline stages hold fewer layers each)"
        )
    if not result.rejected and not result.considered:
        # nothing was refused: the search space itself is empty, another world would not help
        return (
            f"no candidate to consider for world size {world} and a global batch of "
            f"{global_batch}: the search space is empty (max_microbatches={space_max}); allow at "
            f"least 1 microbatch (--max-microbatches N with N >= 1)"
        )
    reasons = "; ".join(f"{w}: {why.splitlines()[0]}" for w, why in result.rejected[:6])
    near = None
    for delta in range(1, 2 * world + 1):
        for other in (world - delta, world + delta):
            if other >= 1 and near is None:
                shape = _valid_world(profile, other, global_batch)
                if shape is not None:
                    near = f"world size {other} ({shape})"
        if near is not None:
            break
    hint = f"; the nearest world size with a valid shape is {near}" if near else ""
    return (
        f"no valid pipeline shape for world size {world} with {profile.num_layers} layers and a "
        f"global batch of {global_batch}: {reasons}{hint}"
    )

"""Enumerate pipeline shapes for a world size, predict each one's step time and memory from a
:class:`~lightning_pp.planner.profile.ModelProfile`, and rank them.

**What is enumerated** (every combination the plan's rules accept; :class:`SearchSpace`):
``dp x pp = world`` (``pp <= layers``, ``dp`` dividing the global batch); ``vpp`` in
``{1, 2, 4}`` where ``pp * vpp <= layers`` (``vpp > 1`` only for ``pp > 1``); microbatches
dividing the per-replica batch; the schedules (``gpipe``, ``1f1b``, ``zb-h1``, ``zb-auto`` at
``vpp = 1``; ``gpipe``, ``interleaved``, ``zbv``, ``zb-auto`` at ``vpp = 2``, ``zb-auto`` built
for each candidate from that candidate's own simulated costs (:func:`costed_schedule`);
``gpipe``, ``interleaved`` at ``vpp = 4``;
only ``1f1b`` at ``pp = 1``, where every schedule runs the same actions); recompute ``None`` or
``"full"``; the layer split ``uniform`` or ``cost`` (balanced by measured ``t_f + t_i + t_w``;
dropped when it equals the uniform one); with ``dp > 1``, the data-parallel sharding: none,
``zero=1`` and ``fsdp`` (:attr:`SearchSpace.shardings`).
:class:`~lightning_pp.layout.plan.PipelinePlan` checks each one: the planner states no rule of
its own.

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
with the last backwards, so this errs on the slow side). A sharded candidate moves the same
volume (:func:`dp_comm_seconds`): ``zero`` reduce-scatters the gradients and all-gathers the
updated parameters, ``fsdp`` all-gathers the parameters once per step (before each chunk's
first forward, ``reshard_after_forward=False``) and reduce-scatters the gradients; each half is
``(dp-1)/dp x bytes / bandwidth + (dp-1) x latency``. So sharding changes the step time only
where parameters and gradients differ in size, and the ranking (time, then memory) puts a
sharded shape before the same shape unsharded. The optimizer step is not counted.
With ``cores`` given and more processes than cores, the pipeline's time is at least the whole
world's compute over the cores (:func:`oversubscribed_seconds`).

**Memory**: :func:`~lightning_pp.planner.memory.rank_memory` per pipeline rank (the training
states by :mod:`lightning_pp.planner.sharding`, at the step's peak; ``state_bytes``: the bytes
per parameter, e.g. bf16 parameters with fp32 Adam); candidates whose heaviest rank exceeds
``memory_per_device`` are dropped (kept aside for the error message).

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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..layout.partition import partition_layers
from ..layout.plan import PipelinePlan
from ..layout.recompute_spec import format_bytes
from ..layout.rules import (
    PreflightError,
    check_batch,
    check_layers,
    check_schedule_args,
    check_sharding,
    check_world,
)
from ..schedules import (
    Action,
    Costs,
    Op,
    Schedule,
    build_schedule,
    chunks_per_rank,
    receives,
    zb_auto,
)
from ..schedules.auto import POLICIES
from .fastsim import CompiledSchedule
from .memory import RankMemory, cost_tensors, profile_state_bytes, rank_memory, with_states
from .profile import LayerCost, ModelProfile
from .recompute import inflight_profile
from .sharding import (
    DEFAULT_BUCKET_CAP_MB,
    Sharding,
    StateBytes,
    allowed_shardings,
    rank_state_bytes,
)

if TYPE_CHECKING:
    from .tensor_parallel import TpLayer

__all__ = [
    "Candidate",
    "Prediction",
    "SearchError",
    "SearchResult",
    "SearchSpace",
    "allreduce_seconds",
    "collective_seconds",
    "describe_candidate",
    "describe_memory",
    "describe_shape",
    "dp_comm_seconds",
    "make_candidate",
    "memory_variants",
    "oversubscribed_seconds",
    "predict",
    "search",
]

#: schedules tried per chunks-per-rank (``vpp``); the order is also the tie-break order
SCHEDULES_BY_VPP: dict[int, tuple[str, ...]] = {
    1: ("1f1b", "zb-h1", "zb-auto", "gpipe"),
    2: ("interleaved", "zbv", "zb-auto", "gpipe"),
    4: ("interleaved", "gpipe"),
}
_SCHEDULE_ORDER = ("1f1b", "zb-h1", "interleaved", "zbv", "zb-auto", "gpipe")


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
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "zb-auto")
    recomputes: tuple[str | None, ...] = (None, "full")
    splits: tuple[str, ...] = ("uniform", "cost")
    max_microbatches: int | None = 64
    #: data-parallel shardings tried when ``dp > 1`` (:meth:`Sharding.parse` labels); a
    #: ``dp = 1`` shape has nothing to shard and runs unsharded
    shardings: tuple[str, ...] = ("none", "zero=1", "fsdp")
    #: the gradient bucket size the ``zero`` padding follows (PipelineStrategy's default)
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    #: tensor-parallel sizes tried (``tp > 1`` needs the layers' tp shares: ``search(...,
    #: tp_layers=...)``, :mod:`lightning_pp.planner.tensor_parallel`); ``world % (pp x tp)``
    #: must be 0
    tps: tuple[int, ...] = (1,)


@dataclass(frozen=True)
class Candidate:
    """One shape: ``dp x pp`` processes, ``vpp`` chunks per rank, ``microbatches`` per step,
    a schedule, a layer split (``counts``: layers per virtual stage), a recompute setting and
    the data-parallel sharding (``zero`` 0/1/2 or ``fsdp``)."""

    dp: int
    pp: int
    vpp: int
    microbatches: int
    schedule: str
    split: str
    recompute: str | None
    counts: tuple[int, ...]
    batch_size: int  # per data-parallel replica
    zero: int = 0
    fsdp: bool = False
    #: tensor-parallel ranks per stage (the world is dp x pp x tp)
    tp: int = 1

    @property
    def microbatch_size(self) -> float:
        return self.batch_size / self.microbatches

    @property
    def sharding_label(self) -> str:
        """``none``, ``zero=1``, ``zero=2`` or ``fsdp``."""
        return "fsdp" if self.fsdp else (f"zero={self.zero}" if self.zero else "none")

    def sharding(self, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> Sharding:
        """The candidate's :class:`~lightning_pp.planner.sharding.Sharding` over its ``dp``."""
        return Sharding(zero=self.zero, fsdp=self.fsdp, dp=self.dp, bucket_cap_mb=bucket_cap_mb)

    @property
    def shape(self) -> str:
        """``dp x pp x vpp`` (``2x2x1``), with ``tp2`` after it when ``tp > 1``."""
        return f"{self.dp}x{self.pp}x{self.vpp}" + (f" tp{self.tp}" if self.tp > 1 else "")

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
            self.fsdp,
            self.zero,
            self.tp,
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
            "zero": self.zero,
            "fsdp": self.fsdp,
            "tp": self.tp,
        }


@dataclass(frozen=True)
class Prediction:
    """A candidate's predicted step: seconds (simulated makespan + data-parallel
    communication, ``allreduce_s``: the all-reduce, or a sharding's reduce-scatter and
    all-gather), bubble (idle / compute), memory of every pipeline rank, throughput."""

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


def collective_seconds(nbytes: float, dp: int, latency_s: float, bandwidth: float) -> float:
    """Ring reduce-scatter or all-gather of a ``nbytes`` buffer over ``dp`` replicas: each
    sends and receives ``(dp-1)/dp`` of it in ``dp-1`` steps (half an all-reduce).

    Example:
        >>> collective_seconds(8e9, dp=4, latency_s=0.0, bandwidth=1e9)
        6.0
    """
    if dp <= 1:
        return 0.0
    return (dp - 1) / dp * nbytes / bandwidth + (dp - 1) * latency_s


def dp_comm_seconds(
    grad_bytes: float,
    param_bytes: float,
    sharding: Sharding,
    latency_s: float,
    bandwidth: float,
    *,
    microbatches: int = 1,
) -> float:
    """The data-parallel communication of one step over ``sharding.dp`` replicas, for a rank
    whose full gradients and parameters take ``grad_bytes`` and ``param_bytes``.

    - none: one all-reduce of the gradients (:func:`allreduce_seconds`);
    - ``zero=1``/``zero=2``: a reduce-scatter of the gradients (each replica gets its shard's
      sum) and an all-gather of the updated parameters after the step: together the volume of
      an all-reduce when parameters and gradients share a dtype;
    - ``fsdp``: an all-gather of the parameters before each chunk's first forward and a
      reduce-scatter of the gradients after its last backward (the step's update is local to
      the shard, so nothing is gathered after it); with ``reshard_after_forward=True``, one
      all-gather per forward and one per backward of every microbatch (``2 x microbatches``).

    Example:
        >>> z1 = dp_comm_seconds(8e9, 8e9, Sharding(zero=1, dp=4), 0.0, 1e9)
        >>> z1 == allreduce_seconds(8e9, 4, 0.0, 1e9) == 12.0
        True
    """
    dp = sharding.dp
    if not (sharding.zero or sharding.fsdp):
        return allreduce_seconds(grad_bytes, dp, latency_s, bandwidth)
    gathers = 2 * microbatches if sharding.fsdp and sharding.reshard_after_forward else 1
    reduce = collective_seconds(grad_bytes, dp, latency_s, bandwidth)
    return reduce + gathers * collective_seconds(param_bytes, dp, latency_s, bandwidth)


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
    *,
    sharding: Sharding | None = None,
    state_bytes: StateBytes | None = None,
) -> tuple[RankMemory, ...]:
    """Every pipeline rank's predicted memory (``layers`` at the candidate's microbatch size;
    ``inflight[r]``: :func:`~lightning_pp.planner.recompute.inflight_profile` of rank r, when
    computed already; ``sharding`` / ``state_bytes``: see
    :func:`~lightning_pp.planner.memory.rank_memory`)."""
    state_bytes = state_bytes or profile_state_bytes(layers, optimizer)
    return tuple(
        rank_memory(
            plan.schedule,
            r,
            chunks,
            recompute=recompute,
            optimizer=optimizer,
            inflight=None if inflight is None else inflight[r],
            sharding=sharding,
            state_bytes=state_bytes,
        )
        for r, chunks in enumerate(_rank_chunks(plan, layers))
    )


def memory_variants(
    plan: PipelinePlan,
    base: Sequence[RankMemory],
    layers: Sequence[LayerCost],
    shardings: Sequence[Sharding],
    state_bytes: StateBytes,
) -> list[tuple[RankMemory, ...]]:
    """``base`` (every rank's memory, from :func:`memory_of`) under each of ``shardings``: the
    activations and buffers stay, the training states are recomputed (cheap next to the
    activation analysis, which is done once per shape)."""
    chunks = _rank_chunks(plan, layers)
    tensors = [[[cost_tensors(c) for c in chunk] for chunk in rank] for rank in chunks]
    return [
        tuple(with_states(m, rank_state_bytes(t, s, state_bytes)) for m, t in zip(base, tensors))
        for s in shardings
    ]


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


@dataclass(frozen=True)
class _Timing:
    """The pipeline part of a prediction, shared by every sharding of one shape."""

    makespan: float
    bubble: float
    pipeline: float  # the makespan, or more under oversubscription


def costed_schedule(
    profile: ModelProfile, candidate: Candidate, plan: PipelinePlan, layers: Sequence[LayerCost]
) -> PipelinePlan:
    """``plan`` with its ``zb-auto`` schedule rebuilt from this candidate's own simulated costs
    (its layer split and recompute, the profile's per-action overhead, receive cost and hop
    latency: :func:`step_costs`), at the memory of 1F1B's peak; any other schedule unchanged.
    A computed schedule is a function of the costs, so each candidate gets its own."""
    if plan.schedule.name != "zb-auto":
        return plan
    costs = step_costs(plan, layers, candidate.recompute, profile, split=True)
    s = plan.schedule
    # The search ranks zb-h1 and zbv as candidates of their own, so the build skips its
    # handcrafted fallback, and runs the one policy that wins most often: a search builds one
    # schedule per candidate (hundreds), the strategy one per run (with every policy, from the
    # measured costs), so the prediction errs on the slow side.
    built = zb_auto(
        s.pp,
        s.microbatches,
        vpp=s.vpp,
        costs=costs,
        placement=s.placement,
        policies=POLICIES[:1],
        compare_handcrafted=False,
    )
    return dataclasses.replace(plan, schedule=built)


def _pipeline_timing(
    profile: ModelProfile,
    candidate: Candidate,
    plan: PipelinePlan,
    layers: Sequence[LayerCost],
    compiled: CompiledSchedule,
    cores: int | None,
) -> _Timing:
    costs = step_costs(plan, layers, candidate.recompute, profile, compiled.split_backward)
    makespan, busy = compiled.run(costs)
    if profile.receive_s:
        # a receive's cost is time blocked on it, not computing (the bubble counts it idle, and
        # it leaves the core free for another process)
        busy = [b - profile.receive_s * n for b, n in zip(busy, compiled.receives)]
    compute = sum(busy)
    bubble = (makespan * len(busy) - compute) / compute if compute > 0 else 0.0
    pipeline = oversubscribed_seconds(makespan, busy, candidate.dp * candidate.tp, cores)
    return _Timing(makespan, bubble, pipeline)


def _finish(
    profile: ModelProfile,
    candidate: Candidate,
    timing: _Timing,
    memory: tuple[RankMemory, ...],
    state_bytes: StateBytes,
) -> Prediction:
    """The prediction from the pipeline's timing and the heaviest rank's communication."""
    grads = max(m.grads for m in memory)  # every sharding holds the full gradients at the peak
    params = max(m.state.numel * state_bytes.param if m.state else m.params for m in memory)
    comm = dp_comm_seconds(
        grads,
        params,
        candidate.sharding(),
        profile.latency_s,
        profile.bandwidth,
        microbatches=candidate.microbatches,
    )
    step = timing.pipeline + comm
    samples = candidate.batch_size * candidate.dp / step
    tokens = samples * profile.tokens_per_sample if profile.tokens_per_sample else None
    return Prediction(
        candidate,
        step,
        timing.makespan,
        comm,
        timing.bubble,
        memory,
        samples,
        tokens,
        timing.pipeline - timing.makespan,
    )


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
    state_bytes: StateBytes | None = None,
) -> Prediction:
    """Simulate one candidate (``plan``: its checked plan, layers split as ``counts``;
    ``compiled``: ``plan.schedule`` compiled, reused across candidates of one schedule;
    ``cores``: the CPU cores the processes share, see :func:`oversubscribed_seconds`;
    ``state_bytes``: bytes per parameter of each training state, default as profiled)."""
    layers = profile.layers(candidate.microbatch_size) if layers is None else layers
    state_bytes = state_bytes or profile_state_bytes(layers, optimizer)
    if memory is None:
        memory = memory_of(
            plan,
            layers,
            candidate.recompute,
            optimizer,
            sharding=candidate.sharding(),
            state_bytes=state_bytes,
        )
    if compiled is None:
        plan = costed_schedule(profile, candidate, plan, layers)
        compiled = CompiledSchedule(plan.schedule)
    timing = _pipeline_timing(profile, candidate, plan, layers, compiled, cores)
    return _finish(profile, candidate, timing, memory, state_bytes)


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
    profile: ModelProfile, world: int, global_batch: int, space: SearchSpace, tp: int = 1
) -> Iterator[tuple[int, PipelinePlan | None, str, str]]:
    """(dp, plan without layers or None, description, refusal) for every shape/schedule/m.

    The plan's own rules (:mod:`lightning_pp.layout.plan`: world, schedule, batch) judge each one;
    the plan is assembled from their results rather than with ``PipelinePlan.build``, which
    also simulates a warning text for every ``microbatches < pp`` (a search keeps those
    shapes and ranks them by their simulated bubble anyway)."""
    n = profile.num_layers
    if world % tp:
        yield 0, None, f"tp={tp}", f"world {world} % tp {tp} = {world % tp}"
        return
    for pp in _divisors(world // tp):
        dp = world // (pp * tp)
        where = f"dp={dp} x pp={pp}" + (f" x tp={tp}" if tp > 1 else "")
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
                        check_world(world, pp, dp, tp=tp)
                        plan = _checked_plan(world, pp, dp, per, name, m, vpp, tp)
                    except PreflightError as err:
                        yield dp, None, what, str(err)
                        continue
                    yield dp, plan, what, ""


def _build_base_schedule(name: str, **shape: Any) -> Schedule:
    """:func:`build_schedule`, but ``zb-auto`` one-policy and without the handcrafted comparison.

    Each candidate gets its own zb-auto from its own costs (:func:`costed_schedule`), so the
    base plan needs only a valid order of the same shape and memory bound (zb-auto's default,
    as :func:`build_schedule` gives it). The full build (every policy, the handcrafted
    comparison, a simulation) was two thirds of a search's time."""
    if name != "zb-auto":
        return build_schedule(name, **shape)
    vpp = chunks_per_rank(name, shape["vpp"])
    return zb_auto(
        shape["pp"],
        shape["microbatches"],
        vpp=vpp,
        policies=POLICIES[:1],
        compare_handcrafted=False,
    )


def _checked_plan(
    world: int,
    pp: int,
    dp: int,
    per: int,
    schedule: str,
    microbatches: int,
    vpp: int | None,
    tp: int = 1,
) -> PipelinePlan:
    """The plan of one shape after the schedule's and the batch's rules (the world's is the
    caller's), without layers; raises :class:`PreflightError`."""
    sched = check_schedule_args(
        schedule, pp, microbatches, vpp, warn=False, build=_build_base_schedule
    )
    check_batch(per, microbatches, dp)
    return PipelinePlan(
        pp=pp,
        vpp=sched.vpp,
        microbatches=microbatches,
        schedule=sched,
        world_size=world,
        dp=dp,
        batch_size=per,
        tp=tp,
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


def _shardings(dp: int, space: SearchSpace) -> list[Sharding]:
    """The shardings of ``space`` tried for ``dp`` replicas
    (:func:`~lightning_pp.planner.sharding.allowed_shardings`)."""
    labels = allowed_shardings(space.shardings, dp)
    return [Sharding.parse(x, dp=dp, bucket_cap_mb=space.bucket_cap_mb) for x in labels]


def search(
    profile: ModelProfile,
    world: int,
    global_batch: int,
    *,
    memory_per_device: int | None = None,
    space: SearchSpace | None = None,
    optimizer: str = "adam",
    cores: int | None = None,
    state_bytes: StateBytes | None = None,
    tp_layers: Mapping[int, Sequence[TpLayer]] | None = None,
) -> SearchResult:
    """Rank every valid candidate for ``world`` processes and a global batch of
    ``global_batch`` samples per optimizer step (``cores``: the CPU cores the processes share,
    when they are CPU processes: see :func:`oversubscribed_seconds`; ``None``: one device
    each; ``state_bytes``: bytes per parameter of each training state, e.g.
    ``StateBytes.for_precision("bf16-true")``; default: the profile's dtype, no master
    weight, ``optimizer``'s state; ``tp_layers[tp]``: each layer's share on one of ``tp``
    tensor-parallel ranks, for every ``tp > 1`` of ``space.tps``, see
    :func:`~lightning_pp.planner.tensor_parallel.tp_layer_cost`).

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
    layers_at: dict[tuple[float, int], list[LayerCost]] = {}
    splits_of: dict[tuple[int, int, float, int], list[tuple[str, tuple[int, ...]]]] = {}
    tps = [t for t in space.tps if t == 1 or (tp_layers and t in tp_layers)]
    rejected += [
        (f"tp={t}", "no tensor-parallel shares of the layers (tp_layers)")
        for t in space.tps
        if t not in tps
    ]
    shapes = (
        (tp, *base) for tp in tps for base in _base_plans(profile, world, global_batch, space, tp)
    )
    for tp, dp, plan, what, why in shapes:
        if plan is None:
            rejected.append((what, why))
            continue
        per = global_batch // dp
        size = per / plan.microbatches
        if (size, tp) not in layers_at:  # scaling a profile copies every layer: once per size
            whole = profile.layers(size)
            if tp > 1:
                from .tensor_parallel import tp_layer_cost

                assert tp_layers is not None
                bw, lat = profile.bandwidth, profile.latency_s
                whole = [tp_layer_cost(c, t, size, lat, bw) for c, t in zip(whole, tp_layers[tp])]
            layers_at[(size, tp)] = whole
        layers = layers_at[(size, tp)]
        shape = (plan.pp, plan.vpp, size, tp)
        if shape not in splits_of:  # the cost split's exact balancing: once per shape and size
            splits_of[shape] = _splits(layers, plan, space)
        compiled: CompiledSchedule | None = None  # compiled on first use: over-memory skip it
        inflight = [inflight_profile(plan.schedule, r) for r in range(plan.pp)]
        states = state_bytes or profile_state_bytes(layers, optimizer)
        shardings = _shardings(dp, space)
        for (split, counts), recompute in itertools.product(splits_of[shape], space.recomputes):
            laid = _with_counts(plan, counts, profile.num_layers)
            base = memory_of(laid, layers, recompute, optimizer, inflight, state_bytes=states)
            timing: _Timing | None = None  # one simulation serves every sharding of the shape
            for sharding, memory in zip(
                shardings, memory_variants(laid, base, layers, shardings, states)
            ):
                considered += 1
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
                    zero=sharding.zero,
                    fsdp=sharding.fsdp,
                    tp=tp,
                )
                if memory_per_device is not None and max(m.total for m in memory) > (
                    memory_per_device
                ):
                    over.append(
                        Prediction(cand, math.inf, math.inf, 0.0, math.nan, memory, 0.0, None)
                    )
                    continue
                if timing is None:
                    if plan.schedule.name == "zb-auto":  # built from this candidate's costs
                        laid = costed_schedule(profile, cand, laid, layers)
                        compiled = CompiledSchedule(laid.schedule)
                    compiled = compiled or CompiledSchedule(plan.schedule)
                    timing = _pipeline_timing(profile, cand, laid, layers, compiled, cores)
                fits.append(_finish(profile, cand, timing, memory, states))
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
    zero: int = 0,
    fsdp: bool = False,
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
        dp,
        pp,
        base.vpp,
        microbatches,
        base.schedule.name,
        label,
        recompute,
        counts,
        per,
        zero=zero,
        fsdp=fsdp,
    )
    check_sharding(zero, fsdp, dp)  # the plan's rule: one sharding, and dp > 1 to shard over
    return cand, plan


def _with_counts(plan: PipelinePlan, counts: Sequence[int], num_layers: int) -> PipelinePlan:
    """``plan`` with its layers split as ``counts`` (the plan's layer rule checks it)."""
    ranges = check_layers(num_layers, plan.pp, plan.vpp, list(counts))
    return dataclasses.replace(plan, partition=tuple(counts), layer_ranges=tuple(ranges))


def describe_shape(c: Candidate) -> str:
    """``dp=2 x pp=2 x vpp=1, microbatches=4, schedule 1f1b, split cost (3 3), recompute none``
    (and ``, sharding zero=1`` for a sharded candidate)."""
    text = (
        f"dp={c.dp} x pp={c.pp} x vpp={c.vpp}{f' x tp={c.tp}' if c.tp > 1 else ''}, "
        f"microbatches={c.microbatches}, schedule "
        f"{c.schedule}, split {c.split} ({' '.join(map(str, c.counts))}), recompute "
        f"{c.recompute or 'none'}"
    )
    return text if c.sharding_label == "none" else f"{text}, sharding {c.sharding_label}"


def describe_memory(m: RankMemory) -> str:
    """``1.20 MiB (1258291 bytes: params ..., buffers ...)``: one rank's peak by part (master
    weights only when there are any)."""
    master = f", master weights {format_bytes(m.master)}" if m.master else ""
    return (
        f"{format_bytes(m.total)} ({m.total} bytes: params {format_bytes(m.params)}, grads "
        f"{format_bytes(m.grads)}{master}, optimizer {format_bytes(m.optimizer)}, activations "
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

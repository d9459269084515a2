"""``recompute="auto"``: per rank, the cheapest layers to recompute so that the schedule's peak
of saved activations fits a byte budget.

Three steps (:func:`plan_auto` runs them on every rank):

1. **Probe** (:meth:`PipelineEngine.probe_step
<lightning_pp.runtime.engine.PipelineEngine.probe_step>`):
   the forward of microbatch 0 through the whole pipeline, gradients on, each layer measured by
   :func:`~lightning_pp.runtime.recompute_probe.measure_chunk`: the storages its forward saves for
   backward (keyed as the engine's
   saved-bytes meter keys them), the tensor inputs a checkpoint of it would hold instead, and its
   forward time.
2. **Profile**: the schedule says how many microbatches of each local chunk hold their
   activations after every action (+1 on ``F``, -1 on ``B``, and on ``W`` after a split
   backward). Under a split backward a recomputed layer holds its inputs from ``F`` to ``I``
   and, once ``I`` has recomputed it (once, :class:`~lightning_pp.runtime.recompute.RecomputeOnce`),
   what its forward saved until ``W``: the profile counts the two spans apart.
3. **Choose** (:func:`plan_rank`): for each chunk, every subset of its layers (a greedy chain
   beyond :data:`EXACT_LAYERS` layers) gives the bytes one microbatch holds (the union of the
   storages of the layers kept, and of the inputs of the layers recomputed) and the forward time
   the recompute adds; the cheapest combination over the chunks whose peak
   ``max over actions of sum_c inflight_c * bytes_c`` fits the budget wins. Under 1F1B rank r
   holds p - r microbatches, so rank 0 recomputes the most and the last rank the least.

If some rank does not fit even with the least-memory choice, every rank raises
:class:`RecomputeBudgetError` before training, with the budget, the need and what would fit.

Example (the pure part: one rank, two layers, measured bytes as storage-key dicts)::

    probes = [[LayerProbe("layers.0", 0, {1: 100}, {0: 10}, 1e-3),
               LayerProbe("layers.1", 1, {2: 100}, {3: 10}, 2e-3)]]
    plan = plan_rank(build_schedule("1f1b", pp=2, microbatches=4), 0, probes, budget=300)
    plan.positions  # [[0]]: layer 0 is the cheaper one to recompute; 2 x (10 + 100) <= 300
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..layout.recompute_spec import format_bytes
from ..runtime.recompute_probe import LayerProbe
from ..schedules import Op, Schedule

if TYPE_CHECKING:
    from ..runtime.engine import PipelineEngine

__all__ = [
    "EXACT_LAYERS",
    "RankPlan",
    "RecomputeBudgetError",
    "RecomputePlan",
    "inflight_profile",
    "plan_auto",
    "plan_rank",
]

log = logging.getLogger("lightning_pp")

#: chunks with at most this many layers try every subset; longer ones a greedy chain
EXACT_LAYERS = 12
#: under a split backward, recomputed sets of at most this many layers also try every subset
#: of them recomputed again for W; larger sets try none or all
EXACT_AGAIN = 4


class RecomputeBudgetError(ValueError):
    """Even the least-memory recompute choice exceeds the activation budget on some rank."""


def chunk_bytes(
    probes: Sequence[LayerProbe],
    recomputed: Sequence[int] | set[int],
    *,
    refilled: bool = False,
    again: Sequence[int] | set[int] = (),
) -> int:
    """Bytes one microbatch of a chunk holds with the layers at ``recomputed`` positions
    recomputed: the storages the other layers save, and the inputs the recomputed ones hold
    (each storage once). ``refilled``: after a split backward's ``I`` recomputed them, when
    the recomputed layers hold what their forward saved as well, until ``W``; except those in
    ``again``, which drop it after ``I`` and recompute again for ``W``."""
    keys: dict[Any, int] = {}
    chosen, twice = set(recomputed), set(again)
    for i, p in enumerate(probes):
        if i in chosen:
            keys.update(p.inputs)
        if i not in chosen:
            # after I (refilled) a plain layer holds only what W needs of what it saved
            keys.update(p.kept_for_w if refilled else p.saved)
        elif refilled and i not in twice:
            keys.update(p.kept_for_w)
    return sum(keys.values())


def inflight_profile(schedule: Schedule, rank: int) -> list[tuple[tuple[int, int], ...]]:
    """Per action of ``rank`` (after it), for each local chunk, ``(before, after)``: the
    microbatches held between ``F`` and their backward (``B``, or ``I`` under a split
    backward), and those held between ``I`` and ``W``. The two differ for a recomputed region:
    before ``I`` it holds its inputs, from ``I`` (which recomputes it once) to ``W`` what its
    forward saved. Distinct states only."""
    before = [0] * schedule.vpp
    after = [0] * schedule.vpp
    out = []
    for a in schedule.ranks[rank]:
        if a.op is Op.F:
            before[a.chunk] += 1
        elif a.op is Op.B:
            before[a.chunk] -= 1
        elif a.op is Op.I:
            before[a.chunk] -= 1
            after[a.chunk] += 1
        elif a.op is Op.W:
            after[a.chunk] -= 1
        out.append(tuple(zip(before, after)))
    return sorted(set(out))


@dataclass(frozen=True)
class _Option:
    positions: tuple[int, ...]
    nbytes: int  # held per microbatch from F to its backward (or I)
    seconds: float
    refilled: int  # held per microbatch from I to W (a split backward's recompute at I)
    again: tuple[int, ...] = ()  # of positions: recomputed again for W (split backward only)


def _chunk_options(probes: Sequence[LayerProbe], *, again: bool = False) -> list[_Option]:
    """Candidate recompute choices of one chunk, Pareto-pruned on (forward seconds added, bytes
    held before ``I``, bytes held from ``I`` to ``W``). ``again`` (a split backward, not the
    first stage): a recomputed layer may also recompute a second time for ``W`` (holding only
    its inputs until ``W``, for twice the forward time)."""
    n = len(probes)
    if n <= EXACT_LAYERS:
        subsets: list[tuple[int, ...]] = [
            c for k in range(n + 1) for c in itertools.combinations(range(n), k)
        ]
    else:  # greedy chain: add the layer that frees the most bytes per second of forward
        subsets, chosen = [()], set()
        while len(chosen) < n:
            base = chunk_bytes(probes, chosen)

            gains = {
                i: (base - chunk_bytes(probes, chosen | {i})) / max(probes[i].forward_s, 1e-9)
                for i in range(n)
                if i not in chosen
            }
            chosen.add(max(gains, key=gains.__getitem__))
            subsets.append(tuple(sorted(chosen)))
    choices: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for sub in subsets:
        if not again:
            choices.append((sub, ()))
        elif len(sub) <= EXACT_AGAIN:
            choices += [
                (sub, a) for k in range(len(sub) + 1) for a in itertools.combinations(sub, k)
            ]
        else:
            choices += [(sub, ()), (sub, sub)]
    options = sorted(
        (
            _Option(
                sub,
                chunk_bytes(probes, sub),
                sum(probes[i].forward_s for i in sub) + sum(probes[i].forward_s for i in a),
                chunk_bytes(probes, sub, refilled=True, again=a),
                a,
            )
            for sub, a in choices
        ),
        key=lambda o: (o.seconds, o.nbytes, o.refilled, len(o.positions)),
    )
    frontier: list[_Option] = []
    for o in options:  # cheapest first: keep each that no cheaper kept one matches in bytes
        if not any(k.nbytes <= o.nbytes and k.refilled <= o.refilled for k in frontier):
            frontier.append(o)
    return frontier


@dataclass(frozen=True)
class RankPlan:
    """One rank's choice: ``positions[c]`` the recomputed layer positions of local chunk ``c``
    (``layers[c]`` their names or original indices; ``again[c]``, among them, those that
    recompute a second time for ``W`` under a split backward); ``predicted_peak`` the
    schedule's peak of saved bytes with it, ``none_peak``/``min_peak`` without recompute and
    with the least-memory choice; ``added_s`` the forward time it adds per step (all
    microbatches), ``again_s`` the part of it that the second forwards add to ``W``."""

    rank: int
    pp_rank: int
    budget: int
    positions: list[list[int]]
    layers: list[list[int | str]]
    predicted_peak: int
    none_peak: int
    min_peak: int
    added_s: float
    total_layers: int
    again: list[list[int]] = field(default_factory=list)
    again_s: float = 0.0  # of added_s: the second forwards, which run in W

    @property
    def fits(self) -> bool:
        return self.predicted_peak <= self.budget

    def describe(self) -> str:
        chosen = [x for c in self.layers for x in c]
        what = "none" if not chosen else ", ".join(str(x) for x in chosen)
        n_again = sum(len(c) for c in self.again)
        if n_again:
            what += f"; {n_again} of them again for W"
        return (
            f"rank {self.rank} (pp_rank {self.pp_rank}): recompute {len(chosen)}/"
            f"{self.total_layers} layers [{what}]; predicted peak "
            f"{format_bytes(self.predicted_peak)} of {format_bytes(self.budget)} (no recompute "
            f"{format_bytes(self.none_peak)}, least possible {format_bytes(self.min_peak)}); "
            f"adds {self.added_s * 1e3:.2f} ms forward per step"
        )


def plan_rank(
    schedule: Schedule,
    pp_rank: int,
    probes: Sequence[Sequence[LayerProbe]],
    budget: int,
    *,
    rank: int | None = None,
) -> RankPlan:
    """The cheapest recompute choice of one rank whose predicted peak fits ``budget``; if none
    fits, the least-memory choice (``fits`` is then false)."""
    profile = inflight_profile(schedule, pp_rank)
    # The first stage's I is a no-op (no input gradient): its W runs the whole backward, and
    # the recompute with it, so between I and W it still holds only what F kept.
    first = [schedule.stage(pp_rank, c) == 0 for c in range(schedule.vpp)]
    per_chunk = [
        _chunk_options(p, again=schedule.split_backward and not is_first)
        for p, is_first in zip(probes, first)
    ]

    def peak(combo: Sequence[_Option]) -> int:
        return max(
            (
                sum(
                    f * o.nbytes + w * (o.nbytes if is_first else o.refilled)
                    for (f, w), o, is_first in zip(state, combo, first)
                )
                for state in profile
            ),
            default=0,
        )

    best: tuple[float, int, tuple[_Option, ...]] | None = None
    least: tuple[int, float, tuple[_Option, ...]] | None = None
    for combo in itertools.product(*per_chunk):
        p = peak(combo)
        t = sum(o.seconds for o in combo)
        if least is None or (p, t) < least[:2]:
            least = (p, t, combo)
        if p <= budget and (best is None or (t, p) < best[:2]):
            best = (t, p, combo)
    assert least is not None
    none_peak = peak(tuple(opts[0] for opts in per_chunk))
    if best is not None:
        seconds, predicted, combo = best
    else:
        predicted, seconds, combo = least
    return RankPlan(
        rank=pp_rank if rank is None else rank,
        pp_rank=pp_rank,
        budget=budget,
        positions=[list(o.positions) for o in combo],
        again=[list(o.again) for o in combo],
        layers=[
            [
                probes[c][i].index if probes[c][i].index is not None else probes[c][i].name
                for i in o.positions
            ]
            for c, o in enumerate(combo)
        ],
        predicted_peak=predicted,
        none_peak=none_peak,
        min_peak=least[0],
        added_s=seconds * schedule.microbatches,
        total_layers=sum(len(p) for p in probes),
        again_s=schedule.microbatches
        * sum(probes[c][i].forward_s for c, o in enumerate(combo) for i in o.again),
    )


@dataclass(frozen=True)
class RecomputePlan:
    """Every rank's :class:`RankPlan` (global rank order) under one budget."""

    budget: int
    schedule: str
    ranks: list[RankPlan]

    def describe(self) -> list[str]:
        head = (
            f"recompute auto: activation budget {format_bytes(self.budget)} per rank, "
            f"schedule {self.schedule}"
        )
        return [head, *(f"  {r.describe()}" for r in self.ranks)]

    def mine(self, rank: int) -> RankPlan:
        return next(r for r in self.ranks if r.rank == rank)


def _budget_error(plan: RecomputePlan, schedule: Schedule) -> RecomputeBudgetError:
    bad = [r for r in plan.ranks if not r.fits]
    worst = max(bad, key=lambda r: r.min_peak)
    lines = [
        f"recompute='auto': activation_budget {format_bytes(plan.budget)} ({plan.budget} bytes) "
        f"does not fit on {len(bad)} rank(s) even with the least-memory recompute choice: "
        + "; ".join(
            f"rank {r.rank} (pp_rank {r.pp_rank}) needs at least {format_bytes(r.min_peak)} "
            f"({r.min_peak} bytes; {format_bytes(r.none_peak)} without recompute)"
            for r in bad
        ),
        f"what would fit: an activation_budget of at least {format_bytes(worst.min_peak)}; or "
        f"more microbatches (now {schedule.microbatches}: each holds a smaller share of the "
        f"batch); or more pipeline stages (now pp={schedule.pp}: fewer layers per rank); or a "
        f"schedule that holds fewer microbatches in flight (now '{schedule.name}'; 1f1b and "
        f"zb-h1 hold at most pp - rank, gpipe holds all {schedule.microbatches})",
    ]
    return RecomputeBudgetError("\n".join(lines))


def plan_auto(
    engine: PipelineEngine,
    batch: Any,
    budget: int,
    *,
    probes: list[list[LayerProbe]] | None = None,
) -> RecomputePlan:
    """Probe, plan every rank under ``budget``, check that every rank fits, and apply this
    rank's choice to ``engine``. Collective: every rank of the job calls it with the same batch
    shape it trains on. Logs the plan (logger ``lightning_pp``) on global rank 0. ``probes``:
    this rank's measurements from an earlier ``engine.probe_step`` (re-planning under another
    budget needs no new probe).

    Raises:
        RecomputeBudgetError: on every rank, when some rank does not fit.
    """
    if probes is None:
        probes = engine.probe_step(batch)
    mine = plan_rank(engine.schedule, engine.pp_rank, probes, budget, rank=engine.rank)
    plans = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        plans = list(gathered)
    plan = RecomputePlan(budget, engine.schedule.name, plans)
    if not all(r.fits for r in plans):
        raise _budget_error(plan, engine.schedule)
    engine.set_recompute_positions(mine.positions, mine.again)
    if engine.rank == 0:
        for line in plan.describe():
            log.info(line)
    return plan

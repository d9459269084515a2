"""zb-auto against the handcrafted schedules, in the simulator: the acceptance grid of issue 36.

Over p in {2, 4, 8}, m in {p, 2p, 4p}, the cost ratios t_f : t_i : t_w in {1:1:1, 1:1.5:0.5,
1:0.7:1.3, 1.5:1:1}, each with equal stages and with a heavy last stage, it builds ``zb-auto``
(one chunk per rank in loop placement, and two in V placement) and the handcrafted ``1f1b``,
``zb-h1`` and ``zbv`` and compares their simulated makespans at the same memory limit: 1F1B's
peak, ``p`` stages' worth of activations on every rank (``memory="1p"``), which is what all of
them hold. The interleaved 1F1B holds more (its rank 0: ``2(p-1) + p + 1`` chunks for ``v = 2``)
and is left out of the "same memory" comparison.

Heavy last stage: the model's head adds half a stage's work (of the ``vpp = 1`` split) to the
last virtual stage, whatever the layout: at ``vpp = 1`` rank ``p - 1`` costs 1.5x, in V placement
rank 0's chunk 1 costs twice a chunk. The same model, so the layouts compare.

Usage::

    python -m benchmarks.zb_auto_grid            # the markdown table (docs/schedules.md)
    python -m benchmarks.zb_auto_grid --timing   # also the build times at p=16/m=128, p=32/m=256
    python -m benchmarks.zb_auto_grid --memory 2p  # at twice 1F1B's peak: interleaved fits too

Nothing here is timed against a threshold; tests/test_zb_auto.py asserts the grid's claims.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_pp.schedules import (
    Costs,
    Op,
    Schedule,
    interleaved,
    memory_limits,
    one_f_one_b,
    peak_inflight,
    simulate,
    zb_h1,
    zbv,
)
from lightning_pp.schedules.auto import zb_auto

RATIOS: tuple[tuple[float, float, float], ...] = (
    (1, 1, 1),
    (1, 1.5, 0.5),
    (1, 0.7, 1.3),
    (1.5, 1, 1),
)
PPS = (2, 4, 8)
HEAVY = 1.5
#: the memory every schedule of the comparison keeps to: 1F1B's peak (see the module notes)
MEMORY = "1p"


def costs_for(
    ratio: tuple[float, float, float], pp: int, vpp: int, heavy: bool, placement: str = ""
) -> Costs:
    """The simulator's costs of one grid case for a layout with ``vpp`` chunks per rank
    (``placement``: ``"v"`` or ``"loop"``; default V for ``vpp = 2``, loop otherwise).

    ``t_f, t_i, t_w`` are one rank's whole share (each chunk costs ``t / vpp``); a heavy last
    stage adds ``(HEAVY - 1) * t`` (half a one-chunk stage) to the last virtual stage.

    Example:
        >>> costs_for((1, 1.5, 0.5), 2, 1, True).overrides
        {(1, 0): (1.5, 3.0, 2.25, 0.75)}
        >>> list(costs_for((1, 1.5, 0.5), 2, 2, True, "loop").overrides)
        [(1, 1)]
    """
    t_f, t_i, t_w = ratio
    overrides = {}
    if heavy:
        # the last virtual stage: rank p-1's last chunk (loop), or rank 0's chunk 1 (V)
        v = (placement or ("v" if vpp == 2 else "loop")) == "v"
        rank, chunk = (0, 1) if v else (pp - 1, vpp - 1)
        k = HEAVY - 1
        f, i, w = (t_f / vpp + k * t_f, t_i / vpp + k * t_i, t_w / vpp + k * t_w)
        overrides[(rank, chunk)] = (f, i + w, i, w)
    return Costs(t_f=t_f, t_b=t_i + t_w, t_i=t_i, t_w=t_w, overrides=overrides)


def lower_bound(
    costs: Costs, pp: int, m: int, vpp: int, memory: str | int | Sequence[int] | None = None
) -> float:
    """A makespan no schedule of this layout can beat (``vpp = 2``: V placement, else loop);
    with ``memory`` (:func:`~lightning_pp.schedules.auto.memory_limits`: ``"1p"``, an int, or
    one int per rank), none that keeps at most that many microbatch-chunks in flight per rank.

    Three facts hold for every schedule, whatever its order:

    * no work of virtual stage ``s`` can start before ``E_s``, the forward of microbatch 0
      through the stages before it (the sum of their ``F``);
    * no backward anywhere can start before the forward of microbatch 0 has crossed the last
      stage, which is after every ``E_s``. So before ``E_s`` a rank can only run forwards of
      its stages that start earlier, at most ``min(m * F_s', E_s - E_s')`` of each, and at most
      ``E_s`` minus its first start in all;
    * the last microbatch's backward crosses the stages one after another. Once a rank's
      lowest stage ``s`` has done it, the stages below still owe theirs in turn (each the
      cheaper of ``I`` and ``B``, stage 0 the cheaper of ``B`` and ``I + W``, plus the hops):
      the *tail* of ``s``. All the rank has left by then are ``W``'s still pending, each
      holding a microbatch-chunk in flight: at most ``memory``'s limit of them.

    Everything the rank owes (``m`` times ``F`` and the cheaper of ``B`` and ``I + W`` for each
    of its chunks) runs on that one rank, after ``E_s`` but for those early forwards: the bound
    is the largest ``E_s + owed`` over ranks and their stages, plus what the tail leaves idle
    where the pending ``W``'s cannot fill it (``tail - W's``, if positive). Communication
    latency only adds time. At the rank's first stage the first two facts give the plain "busy
    time plus start-up delay" bound; at a later stage they also count that the rank idles
    before its later chunk's inputs exist (V placement: rank 0 holds the first and the last
    stage). The tail counts the drain 1F1B-like orders end with, which only deferring more
    ``W``'s (more memory) can fill.
    """
    placement = "v" if vpp == 2 else "loop"
    shell = Schedule("lb", pp, vpp, m, tuple(() for _ in range(pp)), placement=placement)
    per = [[costs.chunk_costs(shell, r, c) for c in range(vpp)] for r in range(pp)]
    where = [shell.locate(s) for s in range(pp * vpp)]
    f_of_stage = [per[r][c][Op.F] for r, c in where]
    earliest = [sum(f_of_stage[:s]) for s in range(pp * vpp)]
    limits = None if memory is None else memory_limits(memory, pp, vpp)
    bound = 0.0
    for r in range(pp):
        owed = m * sum(
            per[r][c][Op.F] + min(per[r][c][Op.B], per[r][c][Op.I] + per[r][c][Op.W])
            for c in range(vpp)
        )
        mine = sorted(shell.stages_of(r), key=lambda s: earliest[s])
        first = earliest[mine[0]]
        # the drain below the rank's lowest stage, less the pending W's that can fill it
        idle_at_end = _tail(costs, per, where, min(mine)) - _deferrable_w(per[r], m, limits, r)
        lateness = max(0.0, idle_at_end)
        for s in mine:
            ahead = sum(
                min(m * f_of_stage[e], earliest[s] - earliest[e])
                for e in mine
                if earliest[e] < earliest[s]
            )
            bound = max(bound, earliest[s] + owed - min(ahead, earliest[s] - first) + lateness)
    return bound


def _tail(
    costs: Costs, per: list[list[dict[Op, float]]], where: list[tuple[int, int]], stage: int
) -> float:
    """The least time from the end of the last microbatch's backward at ``stage`` to the end of
    the whole backward: the stages below in turn (each the cheaper of ``I`` and ``B``; stage 0
    the cheaper of ``B`` and ``I + W``, its ``W`` being the step's last work there), plus a hop
    latency between stages on different ranks."""
    tail = 0.0
    for s in range(stage - 1, -1, -1):
        r, c = where[s]
        d = per[r][c]
        tail += min(d[Op.B], d[Op.I] + d[Op.W]) if s == 0 else min(d[Op.I], d[Op.B])
        if where[s + 1][0] != r:
            tail += costs.latency
    return tail


def _deferrable_w(
    per_rank: list[dict[Op, float]], m: int, limits: tuple[int, ...] | None, rank: int
) -> float:
    """The most ``W`` time a rank can still owe once its last backward has run: its pending
    ``W``'s, each a microbatch-chunk in flight, so at most the rank's memory limit of them (the
    longest ones); every ``W`` without a limit."""
    ws = sorted((d[Op.W] for d in per_rank for _ in range(m)), reverse=True)
    return sum(ws if limits is None else ws[: limits[rank]])


@dataclass(frozen=True)
class Case:
    """One grid case's simulated makespans (time units of the ratio)."""

    pp: int
    m: int
    ratio: tuple[float, float, float]
    heavy: bool
    hand: dict[str, float]  # handcrafted name -> makespan
    auto_loop: float
    auto_v: float
    bound: float  # the lower bound of the better layout at MEMORY (:func:`lower_bound`)

    @property
    def best_hand(self) -> tuple[str, float]:
        name = min(self.hand, key=lambda k: (self.hand[k], k))
        return name, self.hand[name]

    @property
    def auto(self) -> float:
        return min(self.auto_loop, self.auto_v)

    @property
    def ratio_to_best(self) -> float:
        return self.auto / self.best_hand[1]

    @property
    def unequal(self) -> bool:
        return self.heavy or len(set(self.ratio)) > 1


def run_case(
    pp: int, m: int, ratio: tuple[float, float, float], heavy: bool, memory: str = MEMORY
) -> Case:
    """Simulate the handcrafted schedules that fit ``memory`` and build zb-auto at ``memory``
    for one case. At ``"2p"`` the interleaved 1F1B fits too (two chunks per rank, loop
    placement) and so does zb-auto in that layout; it is compared as a third layout."""
    c1, c2 = costs_for(ratio, pp, 1, heavy), costs_for(ratio, pp, 2, heavy)
    hand = {
        "1f1b": simulate(one_f_one_b(pp, m), c1).makespan,
        "zb-h1": simulate(zb_h1(pp, m), c1).makespan,
        "zbv": simulate(zbv(pp, m), c2).makespan,
    }
    auto_loop = simulate(zb_auto(pp, m, vpp=1, costs=c1, memory=memory), c1).makespan
    auto_v = simulate(zb_auto(pp, m, vpp=2, costs=c2, memory=memory), c2).makespan
    if memory != MEMORY:
        loop2 = costs_for(ratio, pp, 2, heavy, "loop")
        inter = interleaved(pp, m, vpp=2)
        if all(a <= b for a, b in zip(peak_inflight(inter), memory_limits(memory, pp, 2))):
            hand["interleaved"] = simulate(inter, loop2).makespan
            auto = zb_auto(pp, m, vpp=2, costs=loop2, memory=memory, placement="loop")
            auto_loop = min(auto_loop, simulate(auto, loop2).makespan)
    bound = min(lower_bound(c1, pp, m, 1, memory), lower_bound(c2, pp, m, 2, memory))
    return Case(pp, m, ratio, heavy, hand, auto_loop, auto_v, bound)


def grid(memory: str = MEMORY) -> list[Case]:
    """Every case of the acceptance grid, at ``memory`` (1F1B's peak by default)."""
    return [
        run_case(p, m, ratio, heavy, memory)
        for heavy in (False, True)
        for ratio in RATIOS
        for p in PPS
        for m in (p, 2 * p, 4 * p)
    ]


def table(cases: list[Case]) -> str:
    """The markdown table of docs/schedules.md, then a summary line."""
    names = list(dict.fromkeys(k for c in cases for k in c.hand))
    lines = [
        "| t_f:t_i:t_w | last stage | p | m | "
        + " | ".join(names)
        + " | zb-auto loop | zb-auto V | zb-auto / best handcrafted "
        "| lower bound / best handcrafted |",
        "|---|---|---|---|" + "---|" * (len(names) + 4),
    ]
    for c in cases:
        ratio = ":".join(f"{x:g}" for x in c.ratio)
        name, _ = c.best_hand
        hand = " | ".join(f"{c.hand[k]:.2f}" if k in c.hand else "-" for k in names)
        lines.append(
            f"| {ratio} | {'x1.5' if c.heavy else 'equal'} | {c.pp} | {c.m} | {hand} "
            f"| {c.auto_loop:.2f} | {c.auto_v:.2f} | {c.ratio_to_best:.3f} (vs {name}) "
            f"| {c.bound / c.best_hand[1]:.3f} |"
        )
    unequal = [c for c in cases if c.unequal]
    better = [c for c in unequal if c.ratio_to_best <= 0.95]
    worst = max(c.ratio_to_best for c in cases)
    reachable = [c for c in unequal if c.bound / c.best_hand[1] <= 0.95]
    mean = sum(c.ratio_to_best for c in unequal) / len(unequal)
    lines.append("")
    lines.append(
        f"{len(cases)} cases; zb-auto <= best handcrafted in "
        f"{sum(c.ratio_to_best <= 1 + 1e-9 for c in cases)}; worst ratio {worst:.3f}; "
        f">= 5 % shorter in {len(better)} of {len(unequal)} unequal-cost cases; "
        f"mean ratio over unequal cases {mean:.3f}; "
        f"the lower bound leaves >= 5 % to win in {len(reachable)} of them"
    )
    return "\n".join(lines)


def build_times() -> list[tuple[int, int, float, float]]:
    """(p, m, wall seconds, CPU seconds) to build zb-auto (V placement, 1 : 1.5 : 0.5, heavy
    last stage) at p=16/m=128 and p=32/m=256. CPU time too: on a shared machine the wall time
    says more about the neighbours than about the build."""
    out = []
    for p, m in ((16, 128), (32, 256)):
        costs = costs_for((1, 1.5, 0.5), p, 2, True)
        t0, c0 = time.perf_counter(), time.process_time()
        zb_auto(p, m, vpp=2, costs=costs)
        out.append((p, m, time.perf_counter() - t0, time.process_time() - c0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timing", action="store_true", help="also time large builds")
    parser.add_argument(
        "--memory",
        default=MEMORY,
        choices=["1p", "2p"],
        help="the memory limit of every schedule compared (2p: the interleaved 1F1B fits too)",
    )
    args = parser.parse_args()
    print(table(grid(args.memory)))
    if args.timing:
        for p, m, wall, cpu in build_times():
            print(f"build zb-auto p={p} m={m} (V): {wall:.2f} s wall, {cpu:.2f} s CPU")


if __name__ == "__main__":
    main()

"""Check a schedule before anything runs: structure first, then a dry run of its dependencies.

The execution model (shared with the simulator, which times the same dry run):

* each rank runs its own action list strictly in order;
* ``F(mb, c)`` on rank r runs virtual stage ``s = c * pp + r`` and needs ``F(mb)`` of stage
  ``s - 1`` (nothing for ``s = 0``);
* ``B(mb, c)`` needs its own ``F(mb, c)`` and ``B(mb)`` of stage ``s + 1`` (nothing for the
  last stage, whose backward starts from the loss);
* sends are asynchronous and never block; only a receive (waiting for a dependency) blocks.

A schedule that cannot finish under these rules would hang a real pipeline, so it is rejected
here with the grid printed and the stuck step of every rank marked.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from .actions import Action, Op, Schedule

Timeline = list[list[tuple[Action, float, float]]]
"""Per rank, the actions it ran with their (start, end) times."""


class ScheduleError(ValueError):
    """A schedule that is malformed or would deadlock.

    The message names the rank and action (``rank 2: B mb=5 chunk=1 waits for ...``) and prints
    the schedule grid with the offending step of each rank marked ``[like.this]``.

    Example:
        >>> from lightning_pp.schedules import build_schedule, validate
        >>> validate(build_schedule("1f1b", pp=2, microbatches=4))  # fine: returns None
    """

    def __init__(self, message: str, marks: dict[int, int] | None = None) -> None:
        super().__init__(message)
        #: rank -> index of the offending (or stuck) step in that rank's list
        self.marks: dict[int, int] = dict(marks or {})


def format_grid(schedule: Schedule, marks: dict[int, int] | None = None) -> str:
    """The schedule as one line per rank, in list order, with ``marks[rank]`` bracketed.

    Ranks with a mark are flagged with ``>`` in the margin.

    Example:
        >>> from lightning_pp.schedules import build_schedule
        >>> print(format_grid(build_schedule("1f1b", pp=2, microbatches=2), {1: 1}))
          rank 0:  F0  F1  B0  B1
        > rank 1:  F0 [B0] F1  B1
    """
    marks = marks or {}
    show_chunk = schedule.vpp > 1
    lines = []
    for r, actions in enumerate(schedule.ranks):
        cells = []
        for i, a in enumerate(actions):
            label = a.short(show_chunk=show_chunk)
            cells.append(f"[{label}]" if marks.get(r) == i else f" {label} ")
        if marks.get(r) == len(actions):  # stuck past the end: nothing left to mark
            cells.append("[end]")
        flag = ">" if r in marks else " "
        lines.append(f"{flag} rank {r}: " + "".join(cells).rstrip())
    return "\n".join(lines)


def _error(schedule: Schedule, problems: list[str], marks: dict[int, int]) -> ScheduleError:
    head = "\n".join(problems)
    grid = format_grid(schedule, marks)
    return ScheduleError(
        f"invalid {schedule.name!r} schedule (pp={schedule.pp}, vpp={schedule.vpp}, "
        f"microbatches={schedule.microbatches}):\n{head}\n{grid}",
        marks,
    )


def check_structure(schedule: Schedule) -> None:
    """Every (microbatch, chunk) has exactly one F and one B on every rank, F before B.

    Also: one action list per rank, only F/B ops, indices in range. Raises :class:`ScheduleError`.
    """
    pp, vpp, m = schedule.pp, schedule.vpp, schedule.microbatches
    if len(schedule.ranks) != pp:
        raise ScheduleError(
            f"schedule {schedule.name!r} has {len(schedule.ranks)} rank lists but pp={pp}"
        )
    for r, actions in enumerate(schedule.ranks):
        first_f: dict[tuple[int, int], int] = {}
        seen_b: dict[tuple[int, int], int] = {}
        # The engine stashes (input, output) per chunk in a FIFO: a backward must take the oldest
        # forward of its chunk, or it would silently pair a gradient with the wrong activations.
        pending: dict[int, deque[int]] = {c: deque() for c in range(vpp)}
        for i, a in enumerate(actions):
            problem = None
            key = (a.mb, a.chunk)
            if a.op not in (Op.F, Op.B):
                problem = f"only F and B steps are supported, got {a.op}"
            elif not 0 <= a.mb < m:
                problem = f"microbatch {a.mb} out of range [0, {m})"
            elif not 0 <= a.chunk < vpp:
                problem = f"chunk {a.chunk} out of range [0, {vpp})"
            elif a.op is Op.F and key in first_f:
                problem = f"duplicated forward (first at step {first_f[key]})"
            elif a.op is Op.B and key in seen_b:
                problem = f"duplicated backward (first at step {seen_b[key]})"
            elif a.op is Op.B and key not in first_f:
                problem = "backward before its forward on this rank"
            elif a.op is Op.B and pending[a.chunk][0] != a.mb:
                problem = (
                    f"backwards of chunk {a.chunk} must follow its forwards in FIFO order: "
                    f"the oldest pending forward is mb={pending[a.chunk][0]}"
                )
            if problem:
                raise _error(schedule, [f"rank {r}: {a.describe()} (step {i}): {problem}"], {r: i})
            (first_f if a.op is Op.F else seen_b)[key] = i
            if a.op is Op.F:
                pending[a.chunk].append(a.mb)
            else:
                pending[a.chunk].popleft()
        for c in range(vpp):
            for mb in range(m):
                key = (mb, c)
                if key not in first_f:
                    raise _error(
                        schedule, [f"rank {r}: missing F mb={mb} chunk={c}"], {r: len(actions)}
                    )
                if key not in seen_b:
                    raise _error(
                        schedule,
                        [f"rank {r}: missing B mb={mb} chunk={c} (its F is step {first_f[key]})"],
                        {r: first_f[key]},
                    )


def dependencies(schedule: Schedule, rank: int, action: Action) -> list[tuple[int, Action]]:
    """The ``(rank, action)`` steps that must finish before ``action`` can start on ``rank``."""
    stage = schedule.stage(rank, action.chunk)
    deps: list[tuple[int, Action]] = []
    if action.op is Op.F:
        if stage > 0:
            src_rank, src_chunk = schedule.locate(stage - 1)
            deps.append((src_rank, Action(Op.F, action.mb, src_chunk)))
    else:
        deps.append((rank, Action(Op.F, action.mb, action.chunk)))
        if stage < schedule.num_stages - 1:
            src_rank, src_chunk = schedule.locate(stage + 1)
            deps.append((src_rank, Action(Op.B, action.mb, src_chunk)))
    return deps


def execute(
    schedule: Schedule,
    duration: Callable[[int, Action], float],
    latency: float = 0.0,
    start: Sequence[float] | None = None,
) -> Timeline:
    """Dry-run ``schedule``: when does each step start and end? Raises on deadlock.

    ``start[r]``: when rank r becomes free for its first step (default 0 for every rank; a
    measured step's ranks enter it at slightly different times).

    Each step starts at ``max(rank free, each dependency's end + latency)``; ``latency`` is
    charged only when the dependency ran on another rank (a real send/receive). Because a step's
    time depends only on its rank predecessor and its dependencies, repeatedly advancing every
    rank as far as its dependencies allow gives the event-driven timeline exactly.
    """
    check_structure(schedule)
    pp = schedule.pp
    end_of: dict[tuple[int, Action], float] = {}
    pos = [0] * pp
    free = [float(t) for t in start] if start is not None else [0.0] * pp
    if len(free) != pp:
        raise ValueError(f"start has {len(free)} entries for pp={pp} ranks")
    timeline: Timeline = [[] for _ in range(pp)]
    remaining = sum(len(a) for a in schedule.ranks)
    while remaining:
        progressed = False
        for r, actions in enumerate(schedule.ranks):
            while pos[r] < len(actions):
                a = actions[pos[r]]
                start = free[r]
                ready = True
                for dep in dependencies(schedule, r, a):
                    if dep not in end_of:
                        ready = False
                        break
                    start = max(start, end_of[dep] + (latency if dep[0] != r else 0.0))
                if not ready:
                    break
                end = start + duration(r, a)
                end_of[(r, a)] = end
                free[r] = end
                timeline[r].append((a, start, end))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise _deadlock(schedule, pos, end_of)
    return timeline


def _deadlock(
    schedule: Schedule, pos: list[int], end_of: dict[tuple[int, Action], float]
) -> ScheduleError:
    marks: dict[int, int] = {}
    problems = []
    for r, actions in enumerate(schedule.ranks):
        if pos[r] >= len(actions):
            continue
        a = actions[pos[r]]
        marks[r] = pos[r]
        waits = []
        for dep_rank, dep in dependencies(schedule, r, a):
            if (dep_rank, dep) in end_of:
                continue
            where = schedule.ranks[dep_rank].index(dep)
            waits.append(
                f"{dep.describe()} on rank {dep_rank} (its step {where}, "
                f"stage {schedule.stage(dep_rank, dep.chunk)})"
            )
        problems.append(f"rank {r}: {a.describe()} (step {pos[r]}) waits for {', '.join(waits)}")
    return _error(schedule, ["deadlock: no rank can make progress", *problems], marks)


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is well formed and cannot deadlock.

    Example:
        >>> from lightning_pp.schedules import Action, Op, Schedule
        >>> F, B = Op.F, Op.B
        >>> bad = Schedule("mine", pp=2, vpp=1, microbatches=1,
        ...                ranks=((Action(B, 0), Action(F, 0)), (Action(F, 0), Action(B, 0))))
        >>> try:
        ...     validate(bad)
        ... except ScheduleError as err:
        ...     print(err)
        invalid 'mine' schedule (pp=2, vpp=1, microbatches=1):
        rank 0: B mb=0 chunk=0 (step 0): backward before its forward on this rank
        > rank 0: [B0] F0
          rank 1:  F0  B0
    """
    execute(schedule, lambda rank, action: 1.0)

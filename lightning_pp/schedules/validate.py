"""Check a schedule before anything runs: structure first, then a dry run of its dependencies.

The execution model (shared with the simulator, which times the same dry run):

* each rank runs its own action list strictly in order;
* ``F(mb, c)`` on rank r runs virtual stage ``s = schedule.stage(r, c)`` (the schedule's
  placement: loop or V) and needs ``F(mb)`` of stage ``s - 1`` (nothing for ``s = 0``);
* ``B(mb, c)`` and ``I(mb, c)`` need their own ``F(mb, c)`` and the backward (``B`` or ``I``)
  of ``mb`` on stage ``s + 1`` (nothing for the last stage, whose backward starts from the
  loss); both send the input gradient to stage ``s - 1``;
* ``W(mb, c)`` needs only its own ``I(mb, c)``; it receives and sends nothing;
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
    """Every forward is paired with its backward(s) on its own rank, in an order the engine can
    run. Raises :class:`ScheduleError` naming the rank, the step and the rule.

    The rules:

    * one action list per rank; ops ``F``, ``B``, ``I``, ``W``; microbatch and chunk in range;
    * every ``(microbatch, chunk)`` of every rank has exactly one ``F``, and either exactly one
      ``B`` (fused backward) or exactly one ``I`` and one ``W`` (split backward);
    * ``B`` / ``I`` come after their ``F`` and take the **oldest** pending forward of their chunk
      (FIFO: the engine pops its per-chunk stash from the front);
    * ``W`` comes after its own ``I`` (same rank, microbatch and chunk), and a chunk's ``W``'s
      keep the order of its ``I``'s (FIFO too: what an ``I`` keeps for its ``W`` is queued per
      chunk).
    """
    pp, vpp, m = schedule.pp, schedule.vpp, schedule.microbatches
    if len(schedule.ranks) != pp:
        raise ScheduleError(
            f"schedule {schedule.name!r} has {len(schedule.ranks)} rank lists but pp={pp}"
        )
    for r, actions in enumerate(schedule.ranks):
        seen: dict[tuple[Op, int, int], int] = {}  # (op, mb, chunk) -> step index
        # The engine stashes (input, output) per chunk in a FIFO: a backward must take the oldest
        # forward of its chunk, or it would silently pair a gradient with the wrong activations.
        pending: dict[int, deque[int]] = {c: deque() for c in range(vpp)}
        # Likewise what an I keeps for its W waits in a per-chunk FIFO.
        awaiting_w: dict[int, deque[int]] = {c: deque() for c in range(vpp)}
        for i, a in enumerate(actions):
            problem = _step_problem(a, seen, pending, awaiting_w, m, vpp)
            if problem:
                raise _error(schedule, [f"rank {r}: {a.describe()} (step {i}): {problem}"], {r: i})
            seen[(a.op, a.mb, a.chunk)] = i
            if a.op is Op.F:
                pending[a.chunk].append(a.mb)
            elif a.op is Op.B:
                pending[a.chunk].popleft()
            elif a.op is Op.I:
                pending[a.chunk].popleft()
                awaiting_w[a.chunk].append(a.mb)
            else:
                awaiting_w[a.chunk].popleft()
        for c in range(vpp):
            for mb in range(m):
                problem, mark = _missing(seen, mb, c, len(actions))
                if problem:
                    raise _error(schedule, [f"rank {r}: {problem}"], {r: mark})


def _step_problem(
    a: Action,
    seen: dict[tuple[Op, int, int], int],
    pending: dict[int, deque[int]],
    awaiting_w: dict[int, deque[int]],
    m: int,
    vpp: int,
) -> str | None:
    """Why step ``a`` may not run here given the steps ``seen`` before it, or ``None``."""
    if not isinstance(a.op, Op):
        return f"unknown op {a.op!r}; steps are F, B, I or W"
    if not 0 <= a.mb < m:
        return f"microbatch {a.mb} out of range [0, {m})"
    if not 0 <= a.chunk < vpp:
        return f"chunk {a.chunk} out of range [0, {vpp})"

    def at(op: Op) -> int | None:
        return seen.get((op, a.mb, a.chunk))

    if at(a.op) is not None:
        kind = {Op.F: "forward", Op.B: "backward", Op.I: "input-gradient", Op.W: "weight-gradient"}
        return f"duplicated {kind[a.op]} step (first at step {at(a.op)})"
    if a.op is Op.F:
        return None
    if a.op is Op.W:
        if at(Op.B) is not None:
            return f"W of a microbatch whose backward is a fused B (step {at(Op.B)})"
        if at(Op.I) is None:
            return "W before its I on this rank (a W computes the weight gradients of an earlier I)"
        if awaiting_w[a.chunk][0] != a.mb:
            return (
                f"W's of chunk {a.chunk} must follow its I's in FIFO order: the oldest I "
                f"waiting for its W is mb={awaiting_w[a.chunk][0]}"
            )
        return None
    other = Op.I if a.op is Op.B else Op.B
    if at(other) is not None:
        return (
            f"microbatch has both a fused B and a split I (the {other} is step {at(other)}); "
            f"use one B, or one I and one W"
        )
    if at(Op.F) is None:
        return "backward before its forward on this rank"
    if pending[a.chunk][0] != a.mb:
        return (
            f"backwards of chunk {a.chunk} must follow its forwards in FIFO order: "
            f"the oldest pending forward is mb={pending[a.chunk][0]}"
        )
    return None


def _missing(
    seen: dict[tuple[Op, int, int], int], mb: int, c: int, n_steps: int
) -> tuple[str | None, int]:
    """What (mb, chunk) still lacks after a rank's whole list, and the step to mark."""
    f = seen.get((Op.F, mb, c))
    if f is None:
        return f"missing F mb={mb} chunk={c}", n_steps
    i = seen.get((Op.I, mb, c))
    if i is not None and (Op.W, mb, c) not in seen:
        return f"missing W mb={mb} chunk={c} (its I is step {i})", i
    if i is None and (Op.B, mb, c) not in seen:
        return f"missing B mb={mb} chunk={c} (its F is step {f}; or an I and a W)", f
    return None, 0


def _backward_ops(schedule: Schedule) -> dict[tuple[int, int, int], Op]:
    """``(rank, mb, chunk) -> B or I``: which op sends that stage's input gradient upstream."""
    return {
        (r, a.mb, a.chunk): a.op
        for r, actions in enumerate(schedule.ranks)
        for a in actions
        if a.op.is_backward
    }


def receives(schedule: Schedule, rank: int, action: Action) -> bool:
    """Whether ``action`` on ``rank`` takes data from another stage: an ``F`` past the first
    stage (an activation), a ``B`` or ``I`` before the last (a gradient); never a ``W``. The
    same cross-stage edges as :func:`dependencies`; what a per-receive cost is charged to.

    Example:
        >>> from lightning_pp.schedules import build_schedule
        >>> s = build_schedule("1f1b", pp=2, microbatches=2)
        >>> [receives(s, r, a) for r in (0, 1) for a in s.ranks[r][:2]]
        [False, False, True, False]
    """
    if action.op is Op.W:
        return False
    stage = schedule.stage(rank, action.chunk)
    if action.op is Op.F:
        return stage > 0
    return stage < schedule.num_stages - 1


def dependencies(
    schedule: Schedule,
    rank: int,
    action: Action,
    backward_ops: dict[tuple[int, int, int], Op] | None = None,
) -> list[tuple[int, Action]]:
    """The ``(rank, action)`` steps that must finish before ``action`` can start on ``rank``.

    * ``F`` of stage s: ``F`` of stage s - 1 (the activation it receives);
    * ``B`` / ``I`` of stage s: its own ``F`` and the backward (``B`` or ``I``, whichever that
      stage runs for this microbatch) of stage s + 1 (the gradient it receives);
    * ``W``: its own ``I``. It receives and sends nothing.

    Stages come from the schedule's placement (:meth:`Schedule.stage` / :meth:`Schedule.locate`).
    ``backward_ops`` is :func:`_backward_ops` of the schedule, computed when not given.
    """
    stage = schedule.stage(rank, action.chunk)
    deps: list[tuple[int, Action]] = []
    if action.op is Op.F:
        if stage > 0:
            src_rank, src_chunk = schedule.locate(stage - 1)
            deps.append((src_rank, Action(Op.F, action.mb, src_chunk)))
    elif action.op is Op.W:
        deps.append((rank, Action(Op.I, action.mb, action.chunk)))
    else:
        deps.append((rank, Action(Op.F, action.mb, action.chunk)))
        if stage < schedule.num_stages - 1:
            src_rank, src_chunk = schedule.locate(stage + 1)
            if backward_ops is None:  # callers in a loop pass it precomputed
                backward_ops = _backward_ops(schedule)
            op = backward_ops.get((src_rank, action.mb, src_chunk), Op.B)
            deps.append((src_rank, Action(op, action.mb, src_chunk)))
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
    backward_ops = _backward_ops(schedule)
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
                begin = free[r]
                ready = True
                for dep in dependencies(schedule, r, a, backward_ops):
                    if dep not in end_of:
                        ready = False
                        break
                    begin = max(begin, end_of[dep] + (latency if dep[0] != r else 0.0))
                if not ready:
                    break
                end = begin + duration(r, a)
                end_of[(r, a)] = end
                free[r] = end
                timeline[r].append((a, begin, end))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise _deadlock(schedule, pos, end_of, backward_ops)
    return timeline


def _deadlock(
    schedule: Schedule,
    pos: list[int],
    end_of: dict[tuple[int, Action], float],
    backward_ops: dict[tuple[int, int, int], Op],
) -> ScheduleError:
    marks: dict[int, int] = {}
    problems = []
    for r, actions in enumerate(schedule.ranks):
        if pos[r] >= len(actions):
            continue
        a = actions[pos[r]]
        marks[r] = pos[r]
        waits = []
        for dep_rank, dep in dependencies(schedule, r, a, backward_ops):
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

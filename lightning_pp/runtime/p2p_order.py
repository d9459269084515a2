"""One global order of a schedule's point-to-point messages: how ranks post under NCCL.

NCCL runs a rank's point-to-point operations on one stream, in posting order, and a send of a
large tensor completes only once its receive is running. Two ranks whose streams hold a pair's
messages in different orders therefore wait on each other forever, although every rank's
compute order is valid (each receive comes after its send). Example, GPipe with pp=2 and two
chunks per rank, receives posted one action ahead: rank 0 queues the sends of activations 1, 2
and 3 before its receive of rank 1's first chunk-1 input; rank 1 queues that send before its
receive of activation 2. Rank 0's stream waits in "send 2" for rank 1's "receive 2", which
waits behind rank 1's "send", which waits for rank 0's receive, queued behind "send 2".

The cure is an order both sides agree on. :func:`message_order` dry-runs the schedule (every
rank executes, round robin, each action whose input has been sent) and numbers the messages in
the order they are sent. Every rank then posts its operations in that order: its sends when
computed, and every receive whose number is smaller than its own next send's, before that send.
On every stream the operations then appear in increasing number, and the smallest unfinished
message always has both of its ends at the head of their streams, so everything completes.
(A receive needs no more than that: its data depends only on messages with smaller numbers.)

Messages: ``F`` on stage ``s`` sends the activation to stage ``s+1``; ``B``/``I`` on stage ``s``
send the input gradient to stage ``s-1``; ``W`` sends nothing. A message between two chunks of
the same rank is handed over in-process and has no number.

Example:
    >>> from lightning_pp.schedules import build_schedule
    >>> order = message_order(build_schedule("gpipe", pp=2, vpp=2, microbatches=2))
    >>> order[0].recv[:4], order[0].send[:4]   # rank 0: F0 F1 F0' F1' ...
    ([None, None, 1, 3], [0, 2, 4, 5])
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..schedules import Op, Schedule

__all__ = ["RankOrder", "message_order"]


@dataclass(frozen=True)
class RankOrder:
    """One rank's view of the global order: per action index, the number of the message it
    receives (``recv``) and of the message it sends (``send``); ``None``: none over the wire."""

    recv: list[int | None]
    send: list[int | None]

    def next_send(self, after: int) -> int | None:
        """The number of the first message this rank sends after action ``after``."""
        return next((s for s in self.send[after + 1 :] if s is not None), None)


def _backward(op: Op) -> bool:
    return op in (Op.B, Op.I)


@lru_cache(maxsize=64)
def message_order(schedule: Schedule) -> tuple[RankOrder, ...]:
    """Number every point-to-point message of ``schedule`` in one order all ranks agree on (see
    the module docstring); one :class:`RankOrder` per pp rank. Raises ``ValueError`` if the
    schedule cannot run (a receive whose message is never sent)."""
    pp, last = schedule.pp, schedule.num_stages - 1

    def message(rank: int, op: Op, chunk: int, mb: int, sending: bool) -> tuple | None:
        """(kind, receiving stage, mb) of the message the action sends or receives, or None
        when there is none or it stays on this rank."""
        stage = schedule.stage(rank, chunk)
        if op is Op.F:
            other = stage + 1 if sending else stage - 1
            key = ("act", stage + 1 if sending else stage, mb)
        elif _backward(op):
            other = stage - 1 if sending else stage + 1
            key = ("grad", stage - 1 if sending else stage, mb)
        else:
            return None
        if not 0 <= other <= last or schedule.locate(other)[0] == rank:
            return None
        return key

    number: dict[tuple, int] = {}
    recv = [[None] * len(a) for a in schedule.ranks]
    send = [[None] * len(a) for a in schedule.ranks]
    pos = [0] * pp
    while any(pos[r] < len(schedule.ranks[r]) for r in range(pp)):
        progressed = False
        for r, actions in enumerate(schedule.ranks):
            if pos[r] >= len(actions):
                continue
            i = pos[r]
            a = actions[i]
            needed = message(r, a.op, a.chunk, a.mb, sending=False)
            if needed is not None and needed not in number:
                continue
            if needed is not None:
                recv[r][i] = number[needed]
            produced = message(r, a.op, a.chunk, a.mb, sending=True)
            if produced is not None:
                send[r][i] = number[produced] = len(number)
            pos[r] += 1
            progressed = True
        if not progressed:
            stuck = {
                r: schedule.ranks[r][pos[r]].describe()
                for r in range(pp)
                if pos[r] < len(schedule.ranks[r])
            }
            raise ValueError(
                f"schedule '{schedule.name}' cannot run: every unfinished rank waits for a "
                f"message nobody sent (next actions: {stuck})"
            )
    return tuple(RankOrder(recv[r], send[r]) for r in range(pp))

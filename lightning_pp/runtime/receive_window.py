"""One step's receives, posted ahead in action order: the engine's view of its traffic.

The engine says "send these messages, and post the receives of the next k actions"
(:meth:`ReceiveWindow.exchange`), then "give me what action i received"
(:meth:`ReceiveWindow.wait`). The window talks to a :class:`Channel` (the
:class:`~lightning_pp.runtime.p2p.P2PCommunicator`), never to ``torch.distributed`` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..layout.topology import PipelineTopology
from .p2p_order import RankOrder
from .p2p_wire import Message, PendingRecv, PendingSend, RecvRequest

__all__ = ["Channel", "Needs", "ReceiveWindow"]


class Channel(Protocol):
    """What a :class:`ReceiveWindow` needs of its communicator."""

    topology: PipelineTopology

    def exchange(
        self, sends: Sequence[Message], recvs: Sequence[RecvRequest]
    ) -> tuple[PendingSend, list[PendingRecv]]: ...

    def exchange_ordered(
        self, sends: Sequence[Message], recvs: Sequence[RecvRequest]
    ) -> tuple[PendingSend, list[PendingRecv]]: ...

    def may_post_ahead(self, req: RecvRequest) -> bool: ...

    def receive(self, pending: PendingRecv) -> tuple[torch.Tensor, ...]: ...


Needs = Callable[[int, bool], "list[RecvRequest] | None"]
"""``needs(index, ahead)``: the receives action ``index`` needs; ``ahead`` says it is a later
action than the next one, and ``None`` then means its receives cannot be stated yet (a gradient
whose forward has not run has no shape)."""


class ReceiveWindow:
    """One step's receives, posted ahead in action order.

    After action ``i`` the engine calls :meth:`exchange` with that action's messages: they go out
    together with the receives of actions ``i+1 .. i+lookahead`` not posted yet. The next
    action's receives always go out; later ones while ``needs`` can state them and the channel
    allows (:meth:`P2PCommunicator.may_post_ahead`), stopping at the first that cannot (a
    channel's receives must be posted in order). An action that receives only an in-process
    hand-over not produced yet (the turn of a V) is passed over, not stopped at: it takes the
    hand-over when it runs. :meth:`wait` then hands over what an action received.

    Example (one rank's step)::

        window = comm.receive_window(len(actions), 8, needs)
        window.exchange([], after=-1)            # before the first action
        for i, action in enumerate(actions):
            received, waited = window.wait(i)
            sent = window.exchange(compute(action, received), after=i)
    """

    def __init__(
        self,
        comm: Channel,
        count: int,
        lookahead: int,
        needs: Needs,
        order: RankOrder | None = None,
    ) -> None:
        self.comm = comm
        self.count = count
        self.lookahead = lookahead
        self.order = order
        self._needs = needs
        self._posted: dict[int, list[PendingRecv]] = {}
        self.posted_after: dict[int, int] = {}  # action index -> index it was posted after
        self._upto = -1  # the last action whose receives were posted
        self._taken: set[int] = set()  # ordered posting: actions whose receives were posted
        # actions skipped by the scan ahead because all they receive is an in-process hand-over
        # not produced yet (the turn of a V): taken from the local queue when they run
        self._local_later: set[int] = set()
        self.current: list[PendingRecv] = []  # the receives taken by the last wait()

    def exchange(self, sends: Sequence[Message], *, after: int) -> PendingSend:
        """Post ``sends`` (of action ``after``; ``-1`` before the first), then the receives of
        the actions up to ``after + lookahead`` not posted yet."""
        if self.order is not None:
            return self._exchange_ordered(sends, after)
        # The sends go out first, on their own: a neighbour may be blocked waiting for them, and
        # stating the lookahead receives (and allocating their buffers) would delay its wake-up.
        # gloo matches by tag, so a separate batch changes nothing else (NCCL posts in order,
        # above).
        sent = self.comm.exchange(sends, [])[0]
        reqs: list[RecvRequest] = []
        counts: list[tuple[int, int]] = []
        j, last = self._upto + 1, min(after + self.lookahead, self.count - 1)
        rank = self.comm.topology.rank
        while j <= last:
            ahead = j > after + 1
            needs = self._needs(j, ahead)
            if needs is None:
                break
            if ahead and not all(map(self.comm.may_post_ahead, needs)):
                # An in-process hand-over goes on no wire, so the scan may pass it and post the
                # receives behind it (stopping here left the V's turn rank posting one or two
                # actions ahead: every remote receive after a turn waited for the turn to run).
                if not all(r.peer == rank for r in needs):
                    break
                self._local_later.add(j)
                j += 1
                continue
            reqs += needs
            counts.append((j, len(needs)))
            j += 1
        _, pendings = self.comm.exchange([], reqs)
        k = 0
        for index, n in counts:
            self._posted[index] = pendings[k : k + n]
            k += n
            if n:
                self.posted_after[index] = after
        self._upto = j - 1
        return sent

    def _exchange_ordered(self, sends: Sequence[Message], after: int) -> PendingSend:
        """Ordered posting (NCCL): with ``sends`` go the receives of every later action whose
        message comes before this rank's next send in the global order, in that order (and the
        next action's, e.g. an in-process hand-over)."""
        order = self.order
        assert order is not None
        bound = order.next_send(after)
        chosen = []
        for j in range(max(after + 1, 0), self.count):
            if j in self._taken:
                continue
            number = order.recv[j]
            if j == after + 1 or (number is not None and (bound is None or number < bound)):
                chosen.append((-1 if number is None else number, j))
        chosen.sort()
        reqs: list[RecvRequest] = []
        counts: list[tuple[int, int]] = []
        for _, j in chosen:
            needs = self._needs(j, j > after + 1)
            if needs is None:
                raise RuntimeError(
                    f"rank {self.comm.topology.rank}: ordered posting: the receive of action "
                    f"{j} is due after action {after} but its shape is not known yet"
                )
            reqs += needs
            counts.append((j, len(needs)))
        sent, pendings = self.comm.exchange_ordered(sends, reqs)
        k = 0
        for index, n in counts:
            self._posted[index] = pendings[k : k + n]
            self._taken.add(index)
            k += n
            if n:
                self.posted_after[index] = after
        return sent

    def outstanding(self) -> list[PendingRecv]:
        """Every receive posted and not yet consumed (a failed step's leftovers)."""
        return self.current + [p for posted in self._posted.values() for p in posted]

    def wait(self, index: int) -> tuple[list[PendingRecv], float]:
        """Block until every receive of action ``index`` has arrived; returns them (``tensors``
        holds the data) and the seconds spent blocked."""
        if index in self._local_later:
            self._local_later.discard(index)
            needs = self._needs(index, False)
            assert needs is not None  # the next action's receives can always be stated
            self._posted[index] = self.comm.exchange([], needs)[1]
            self.posted_after[index] = index - 1
        pending = self.current = self._posted.pop(index)
        for p in pending:
            self.comm.receive(p)
        return pending, sum(p.waited for p in pending)

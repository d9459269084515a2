"""NCCL's point-to-point rules on gloo: a test harness, not a product mode.

No GPU is available to this project's CI, yet every user trains over NCCL, which differs from
gloo exactly where a correct schedule turns into a hang or a silently wrong gradient. With
``LIGHTNING_PP_EMULATE_NCCL=1`` (read when a :class:`~lightning_pp.runtime.p2p.P2PCommunicator` is
built) or ``P2PCommunicator(..., emulate_nccl=True)``, a gloo run obeys NCCL's rules:

- **Matching by posting order.** NCCL ignores tags: the k-th send from rank a to rank b meets
  b's k-th receive from a. Every message travels on ONE gloo tag; a small envelope on a side
  tag carries the sender's intended tag and byte count, and the receiver checks them against
  what it posted before it posts its buffer. A mismatch is an error naming both sides' intent
  (under NCCL it would be a silently wrong tensor, or a hang when the sizes differ); gloo itself
  would abort the process on a size mismatch.
- **Coalescing.** A ``batch_isend_irecv`` returns ONE work for the whole batch: waiting for any
  receive of it waits for every send in it too.
- **One stream.** A rank's batches (and its collectives on the group) run one after another in
  posting order: batch k is not started before batch k-1 has completed. The host call returns
  at once with the batch's work; a per-communicator worker thread does the posting.
- **Rendezvous sends.** Inherited from gloo: a send completes only once its receive is posted.
  Real NCCL buffers small messages, but an activation is large; the emulation is the strict
  (worst) case.
- **First call.** The first operation on the group must be a collective (NCCL requires the
  first batched P2P call to involve every member); a P2P batch first is an error.

The engine then takes NCCL's defaults (``recv_lookahead=1``, the monitor polls
``is_completed()``, no landing marks) because :func:`lightning_pp.runtime.p2p.p2p_backend` says
``"nccl"``.

Example (what the communicator does under emulation)::

    stream = EmulatedStream(pp_group, rank=dist.get_rank(), describe=P2PCommunicator.describe_tag)
    work = stream.collective(lambda: dist.all_reduce(probe, group=pp_group, async_op=True))
    work.wait()
    work = stream.batch(ops)          # returns at once; ops post after earlier batches completed
    work.wait()                       # every op of the batch has completed
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ENV_VAR", "EmulatedStream", "EmulatedWork", "NcclOrderError", "emulation_enabled"]

ENV_VAR = "LIGHTNING_PP_EMULATE_NCCL"
_DATA_TAG = 0  # every emulated message: NCCL has no tags
_ENVELOPE_TAG = 1  # the harness's own check channel, in the same order as the data
_SENT = 0x4E43434C  # last envelope word: never the landing pattern below
_UNSET = -0x5A5A5A5A5A5A5A5B  # envelope's last word before it lands


def emulation_enabled() -> bool:
    """True when ``LIGHTNING_PP_EMULATE_NCCL`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


class NcclOrderError(RuntimeError):
    """A receive met a message its sender meant for another receive (order mismatch)."""


class EmulatedWork:
    """The one work of an emulated batch or collective: completes when all of it has."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._done = threading.Event()
        self._error: BaseException | None = None

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Any = None) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()


class EmulatedStream:
    """One rank's NCCL stream for one process group, emulated on gloo (see the module doc).

    Args:
        group: the gloo process group the operations run on.
        rank: this process's global rank (error messages).
        describe: ``tag -> text`` naming what a message with that tag carries (error messages).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        rank: int,
        describe: Callable[[int], str] = lambda tag: f"tag {tag}",
    ) -> None:
        self.group = group
        self.rank = rank
        self.describe = describe
        self.batches = 0  # P2P batches run (tests read it)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False  # a first operation was submitted
        self._broken: BaseException | None = None
        # Per peer, how many messages went each way: the position a mismatch is reported at.
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._thread = threading.Thread(target=self._run, name="lightning_pp-nccl-stream")
        self._thread.daemon = True
        self._thread.start()

    # -- host side (returns at once) -----------------------------------------------------------
    def collective(self, start: Callable[[], Any], what: str = "collective") -> EmulatedWork:
        """Queue a collective (``start()`` returns its async work) behind every earlier batch."""
        self._started = True
        work = EmulatedWork(what)
        self._jobs.put((work, start, None))
        return work

    def batch(self, ops: Sequence[dist.P2POp]) -> EmulatedWork:
        """Queue one ``batch_isend_irecv`` batch; its single work completes with all its ops."""
        if not self._started:
            raise RuntimeError(
                f"rank {self.rank}: NCCL emulation: the first operation on the pp group is a "
                f"point-to-point batch of {len(ops)} op(s); NCCL requires the first batched "
                f"P2P call on a group to involve every member (run a collective first)"
            )
        work = EmulatedWork(f"batch of {len(ops)} op(s)")
        self._jobs.put((work, None, list(ops)))
        return work

    # -- the stream ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            work, start, ops = self._jobs.get()
            if self._broken is not None:  # NCCL: an error poisons the communicator
                work._finish(
                    RuntimeError(
                        f"rank {self.rank}: NCCL emulation: stream unusable after an earlier "
                        f"error: {self._broken}"
                    )
                )
                continue
            try:
                if start is not None:
                    w = start()
                    if w is not None:
                        w.wait()
                else:
                    self._run_batch(ops)
                    self.batches += 1
            except BaseException as e:  # handed to whoever waits for this work
                self._broken = e
                work._finish(e)
            else:
                work._finish()

    def _run_batch(self, ops: list[dist.P2POp]) -> None:
        works: list[Any] = []
        keep: list[torch.Tensor] = []  # envelopes stay alive until their sends complete
        # Receives per peer, in posting order: (op, its envelope, the envelope's work).
        pending: dict[int, list[tuple[dist.P2POp, torch.Tensor, Any]]] = {}
        for op in ops:
            peer = op.peer
            if op.op is dist.isend:
                seq = self._sent.get(peer, 0)
                self._sent[peer] = seq + 1
                env = torch.tensor(
                    [_nbytes(op.tensor), op.tag, seq, _SENT], dtype=torch.int64, device="cpu"
                )
                keep.append(env)
                works.append(dist.isend(env, peer, group=self.group, tag=_ENVELOPE_TAG))
                works.append(dist.isend(op.tensor, peer, group=self.group, tag=_DATA_TAG))
            else:
                env = torch.full((4,), _UNSET, dtype=torch.int64)
                env_work = dist.irecv(env, peer, group=self.group, tag=_ENVELOPE_TAG)
                pending.setdefault(peer, []).append((op, env, env_work))
        # A receive's buffer is posted only once its envelope shows it matches; each peer's
        # receives stay in order. Envelopes of different peers are watched together, so a slow
        # peer does not hold back another peer's receive (NCCL posts a batch's receives at once).
        sleep = 2e-5
        while pending:
            progressed = False
            for peer in list(pending):
                queue_ = pending[peer]
                op, env, env_work = queue_[0]
                if len(pending) > 1 and int(env[-1]) == _UNSET:
                    continue  # not landed yet; look at the other peers
                env_work.wait()  # landed (or the only peer left): returns, or blocks until it is
                self._check(op, env)
                works.append(dist.irecv(op.tensor, peer, group=self.group, tag=_DATA_TAG))
                queue_.pop(0)
                if not queue_:
                    del pending[peer]
                progressed = True
            if not progressed:
                time.sleep(sleep)
                sleep = min(sleep * 2, 1e-3)
            else:
                sleep = 2e-5
        for w in works:
            w.wait()
        del keep

    def _check(self, op: dist.P2POp, env: torch.Tensor) -> None:
        peer = op.peer
        seq = self._received.get(peer, 0)
        self._received[peer] = seq + 1
        nbytes, tag, sent_seq, _ = env.tolist()
        want = _nbytes(op.tensor)
        if (nbytes, tag) == (want, op.tag):
            return
        raise NcclOrderError(
            f"rank {self.rank}: NCCL emulation: receive #{seq} from rank {peer} expects "
            f"{self.describe(op.tag)} ({want} bytes), but rank {peer}'s send #{sent_seq} to rank "
            f"{self.rank} in that position is {self.describe(tag)} ({nbytes} bytes). NCCL "
            f"matches messages between two ranks by posting order, not by tag: the two ranks "
            f"post this pair's messages in different orders"
            + (
                " (the sizes differ too: NCCL would hang or corrupt memory)"
                if nbytes != want
                else " (same size: NCCL would deliver the wrong tensor silently)"
            )
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

"""Run one rank's part of a pipeline schedule for one batch.

The executor is one loop over this rank's action list. Around each action it:

1. waits for the receives the action needs (posted at the end of an earlier action),
2. computes (F: forward through one local chunk; B: backward of the OLDEST stashed forward of
   that chunk),
3. posts the action's sends TOGETHER with the receives of the next action, and of later ones up
   to ``recv_lookahead`` ahead, in one batched call.

Sends are never waited for before the end of the step (a send keeps its buffer alive itself);
receives are waited for just before their data is needed. That is exactly the dry-run model of
the schedule validator (sends never block, receives do), so every schedule the validator accepts
runs here without deadlock.

Example (every rank of the pipeline runs the same code)::

    topo = PipelineTopology.from_world(dist.get_world_size(), dist.get_rank(), pp=2)
    groups = build_process_groups(topo)
    schedule = build_schedule("1f1b", pp=2, microbatches=4)
    ranges = partition_layers(len(layers), pp=2, vpp=1)
    chunks = [PipelineChunk([layers[i] for i in r], r)
              for r in local_layer_indices(ranges, topo.pp_rank, 2, 1)]
    engine = PipelineEngine(chunks, schedule, topo, groups,
                            loss_fn=lambda out, mb: F.cross_entropy(out, mb[1]))
    result = engine.train_step((x, y))   # grads accumulate into .grad; result.loss on all ranks
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .failure import DEFAULT_WATCHDOG_TIMEOUT, FailureMonitor, PipelineAborted, PipelineHang
from .microbatch import batch_size_of, split_microbatches
from .numerics import (
    NonFiniteError,
    all_finite,
    describe_nonfinite,
    first_nonfinite_layer,
    nonfinite_param_grads,
)
from .p2p import (
    ACT,
    GRAD,
    Message,
    P2PCommunicator,
    PendingRecv,
    PendingSend,
    RecvRequest,
    format_specs,
)
from .records import StepEvent, StepRecord
from .schedules import Action, Op, Schedule, check_positive
from .topology import PipelineTopology, ProcessGroups

# Pending transfers of failed steps, never released (see the end of _run_actions).
_ABANDONED: list[Any] = []


@dataclass
class _ReceiveWindow:
    """One step's posted receives: per action index, its pending receives and the index of
    the action after which they were posted; ``upto``: the last action posted for."""

    posted: dict[int, list[PendingRecv]] = field(default_factory=dict)
    posted_after: dict[int, int] = field(default_factory=dict)
    upto: int = -1


GLOO_RECV_LOOKAHEAD = 8
"""Default ``recv_lookahead`` on gloo. Measured on a 2-core machine (``benchmarks/``,
transformer, m=8): interleaved p=4 steps took 240 / 228 / 219 ms with lookahead 2 / 4 / 8
(torch.distributed.pipelining: 243 ms); p=2 and 1F1B were within noise of each other."""

__all__ = ["PipelineEngine", "PipelineStepError", "StepResult"]


class PipelineStepError(RuntimeError):
    """An action failed on this rank. The message names the rank and the action."""

    def __init__(self, message: str, rank: int, action: Action | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.action = action


@dataclass
class StepResult:
    """``loss``: detached fp32 full-batch loss (same on every pp rank). ``outputs``: per
    microbatch last-stage outputs (``eval_step(collect_outputs=True)`` on the last stage only)."""

    loss: torch.Tensor
    record: StepRecord
    outputs: list | None = None


@dataclass
class _Entry:
    """One stashed forward: what its backward needs."""

    mb: int
    inputs: tuple[torch.Tensor, ...]  # received leaves (or first-stage inputs)
    outputs: tuple[torch.Tensor, ...]  # outputs that take part in backward (or the scaled loss)
    grad_positions: list[int]  # index of each of ``outputs`` among the floating outputs
    out_specs: list[tuple[tuple[int, ...], torch.dtype]]  # every floating output's spec
    saved_bytes: int = 0


def _as_tuple(x: Any, what: str) -> tuple[tuple[torch.Tensor, ...], bool]:
    if isinstance(x, torch.Tensor):
        return (x,), False
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x), True
    raise TypeError(
        f"{what} must be a tensor or a tuple of tensors to cross a stage boundary, got "
        f"{type(x).__name__}"
        + (f" of {[type(t).__name__ for t in x]}" if isinstance(x, (tuple, list)) else "")
    )


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _storages(batch: Any) -> set[int]:
    """Data pointers of every tensor storage in a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        return {batch.untyped_storage().data_ptr()}
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (tuple, list)):
        return set().union(*(_storages(b) for b in batch)) if batch else set()
    return set()


def _format_grid(schedule: Schedule, rank: int, index: int) -> str:
    return _format_grid_marks(schedule, {rank: index})


def _format_grid_marks(schedule: Schedule, marks: dict[int, int]) -> str:
    try:  # the schedules package's grid marks the failing step; fall back to a plain list
        from .schedules.validate import format_grid

        return format_grid(schedule, marks)
    except Exception:  # pragma: no cover - only when the validator module is unavailable
        show = schedule.vpp > 1
        return "\n".join(
            f"rank {r}: " + " ".join(a.short(show) for a in acts)
            for r, acts in enumerate(schedule.ranks)
        )


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _default_input_fn(mb: Any) -> Any:
    return mb[0] if isinstance(mb, (tuple, list)) else mb


class PipelineEngine:
    """Executes a :class:`Schedule` on this rank's chunks with real point-to-point traffic.

    Args:
        chunks: this rank's local chunks, ``len(chunks) == schedule.vpp``; chunk ``c`` runs
            virtual stage ``c * pp + pp_rank``.
        schedule: the training schedule (eval uses ``schedule.forward_only()``).
        topology, groups: where this rank sits; ``groups`` may be ``None`` when ``pp == 1``.
        loss_fn: ``(last-stage output, microbatch) -> scalar loss`` of that microbatch.
        input_fn: ``microbatch -> first layer input``; default ``mb[0]`` for a tuple/list batch,
            else the microbatch itself.
        loss_reduction: ``"mean"`` (each microbatch loss is a mean: scaled by
            ``mb_size / batch_size``, exact for uneven splits) or ``"sum"`` (unscaled).
        release_outputs: drop the storage of sent outputs from the stash (only ``grad_fn`` is
            needed for backward) - Megatron's ``deallocate_output_tensor``.
        on_chunk_grads_ready: ``hook(chunk)`` right after the LAST backward of each local chunk in
            a step (deferred data-parallel gradient sync).
        device: where receive buffers live; default: the first chunk's parameter device.
        static_shapes: agree activation shapes once (see :mod:`lightning_pp.p2p`).
        measure_memory: record bytes saved for backward (``saved_tensors_hooks``; small cost).
        watchdog_timeout: seconds one point-to-point wait may block before the step fails with
            the hang report (:class:`~lightning_pp.failure.PipelineHang`); ``None`` disables it.
        abort_on_failure: publish this rank's failure on the job's c10d store and stop (raise
            :class:`~lightning_pp.failure.PipelineAborted`) as soon as another rank has failed.
        check_finite: raise :class:`~lightning_pp.numerics.NonFiniteError` where NaN/inf first
            appear (activations, loss, gradients; see :mod:`lightning_pp.numerics` for the cost).
        failure_monitor: use this monitor instead of one on the default store (tests, or
            several independent engines in one job).
        recv_lookahead: post the receives of up to this many upcoming actions (at least the
            next one). gloo only moves a message once its receive is posted, so a receive posted
            one action early lets the data arrive while this rank computes; posted just in time
            it costs a hop latency on every dependent action (0.1 ms idle, about 0.6 ms on a
            loaded 2-core machine). Each posted receive holds one boundary buffer, so this
            bounds the extra memory. ``None``: :data:`GLOO_RECV_LOOKAHEAD` on gloo with
            pp > 1, else 1 (NCCL queues a rank's P2P on one stream, so an early receive would
            hold back this rank's sends and can deadlock two neighbours that wait for each
            other).

    The batch given to ``train_step``/``eval_step`` must already be on ``device``; every rank of
    a pipeline gets the same batch (the first stage reads inputs, the last stage the targets).
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        schedule: Schedule,
        topology: PipelineTopology,
        groups: ProcessGroups | None,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        input_fn: Callable[[Any], Any] | None = None,
        loss_reduction: str = "mean",
        release_outputs: bool = True,
        on_chunk_grads_ready: Callable[[int], None] | None = None,
        device: torch.device | str | None = None,
        static_shapes: bool = False,
        measure_memory: bool = False,
        watchdog_timeout: float | None = DEFAULT_WATCHDOG_TIMEOUT,
        abort_on_failure: bool = True,
        check_finite: bool = False,
        failure_monitor: FailureMonitor | None = None,
        recv_lookahead: int | None = None,
    ) -> None:
        if schedule.pp != topology.pp:
            raise ValueError(
                f"schedule is for pp={schedule.pp} but the topology has pp={topology.pp}"
            )
        if len(chunks) != schedule.vpp:
            raise ValueError(
                f"rank {topology.rank}: got {len(chunks)} chunks but the schedule has "
                f"vpp={schedule.vpp} chunks per rank"
            )
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        ops = {a.op for a in schedule.ranks[topology.pp_rank]}
        if Op.W in ops:
            raise NotImplementedError("split backward (W steps) is not supported by this engine")
        self.chunks = list(chunks)
        self.schedule = schedule
        self.topology = topology
        self.groups = groups
        self.loss_fn = loss_fn
        self.input_fn = input_fn or _default_input_fn
        self.loss_reduction = loss_reduction
        self.release_outputs = release_outputs
        self.on_chunk_grads_ready = on_chunk_grads_ready
        self.measure_memory = measure_memory
        self.check_finite = check_finite
        self._steps = 0
        self.monitor: FailureMonitor | None = failure_monitor
        if self.monitor is None and abort_on_failure and dist.is_initialized():
            pipeline = topology.pipeline_ranks
            self.monitor = FailureMonitor.from_default_store(
                topology.rank, watchdog_timeout=watchdog_timeout, pipeline_ranks=pipeline
            )
        if device is None:
            params = [p for c in self.chunks for p in c.parameters()]
            device = params[0].device if params else torch.device("cpu")
        self.device = torch.device(device)
        pp_group = groups.pp_group if groups is not None else None
        self.comm = P2PCommunicator(
            topology,
            pp_group,
            device=self.device,
            static_shapes=static_shapes,
            monitor=self.monitor,
        )
        self.recv_lookahead = self._resolve_lookahead(recv_lookahead, pp_group)
        self._batch_storages: set[int] = set()  # the current step's input batch
        self._param_storages = {
            p.untyped_storage().data_ptr() for c in self.chunks for p in c.parameters()
        }

    def _resolve_lookahead(self, lookahead: int | None, pp_group: Any) -> int:
        if lookahead is not None:
            check_positive(recv_lookahead=lookahead)
        if self.pp == 1:
            return 1  # every message is in-process: a receive exists only once it was sent
        if lookahead is None:
            try:
                backend = dist.get_backend(pp_group)
            except Exception:  # no process group (single-rank unit tests)
                backend = "gloo"
            return 1 if backend == "nccl" else GLOO_RECV_LOOKAHEAD
        return lookahead

    # -- geometry ------------------------------------------------------------------------------
    @property
    def pp(self) -> int:
        return self.topology.pp

    @property
    def rank(self) -> int:
        return self.topology.rank

    def _stage(self, chunk: int) -> int:
        return chunk * self.pp + self.topology.pp_rank

    def _rank_of(self, stage: int) -> int:
        return self.topology.global_rank(stage % self.pp)

    def _last_backward_index(self, actions: Sequence[Action]) -> dict[int, int]:
        last: dict[int, int] = {}
        for i, a in enumerate(actions):
            if a.op is Op.B:
                last[a.chunk] = i
        return last

    # -- public steps --------------------------------------------------------------------------
    def train_step(self, batch: Any) -> StepResult:
        """Forward and backward over every microbatch; gradients ACCUMULATE into ``.grad``."""
        return self._run(self.schedule, batch, train=True, collect=False)

    @torch.no_grad()
    def eval_step(self, batch: Any, *, collect_outputs: bool = False) -> StepResult:
        """Forward only (``schedule.forward_only()``) under ``no_grad``; loss on every rank."""
        return self._run(self.schedule.forward_only(), batch, train=False, collect=collect_outputs)

    # -- the loop ------------------------------------------------------------------------------
    def _run(self, schedule: Schedule, batch: Any, *, train: bool, collect: bool) -> StepResult:
        self._steps += 1
        try:
            return self._run_actions(schedule, batch, train=train, collect=collect)
        except PipelineAborted:
            raise  # another rank failed first; it reports the cause
        except Exception as e:
            self._report(e)
            raise

    def _report(self, error: Exception) -> None:
        """Publish this rank's failure on the abort channel so the other ranks stop waiting."""
        if self.monitor is None:
            return
        where = ""
        if isinstance(error, PipelineStepError) and error.action is not None:
            where = error.action.describe()
        cause = error.__cause__ if isinstance(error, PipelineStepError) else None
        self.monitor.report_failure(where or "step", cause or error)

    def _run_actions(
        self, schedule: Schedule, batch: Any, *, train: bool, collect: bool
    ) -> StepResult:
        record = StepRecord(self.rank, self.topology.pp_rank, schedule, t0=time.perf_counter())
        actions = schedule.ranks[self.topology.pp_rank]
        self._mbs = split_microbatches(batch, schedule.microbatches)
        self._batch_size = batch_size_of(batch)
        self._batch_storages = _storages(batch) if self.measure_memory else set()
        self._stash: list[deque[_Entry]] = [deque() for _ in self.chunks]
        self._loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self._outputs: dict[int, Any] = {}
        self._collect = collect
        self._train = train
        sends: deque[PendingSend] = deque()
        send_bytes = 0  # held by the sends in ``sends`` (a running total: summing is O(n^2))
        last_b = self._last_backward_index(actions) if train else {}
        index, action = -1, None
        monitor = self.monitor
        ahead = self.recv_lookahead
        window = _ReceiveWindow()
        pending: list[PendingRecv] = []
        finished = False
        try:
            self._post(window, actions, [], after=-1, upto=ahead - 1)
            for index, action in enumerate(actions):
                if monitor is not None:  # attribute writes only: published if a wait blocks
                    monitor.set_context(
                        step=self._steps,
                        index=index,
                        action=action,
                        pp_rank=self.topology.pp_rank,
                    )
                start = time.perf_counter()
                pending = window.posted.pop(index)
                received = [p.wait() for p in pending]
                wait = sum(p.waited for p in pending)
                out_msgs = self._execute(action, received, pending)
                # Stamped before the sends are posted: the receiver's data arrival minus this
                # time is the real hop delay (posting, transfer, the receiver's wake-up).
                computed = time.perf_counter()
                sent = self._post(window, actions, out_msgs, after=index, upto=index + ahead)
                if sent.works:
                    sends.append(sent)
                    send_bytes += sent.nbytes
                if action.op is Op.F and train:
                    self._release(action)
                if train and last_b.get(action.chunk) == index:
                    if self.check_finite:
                        self._check_param_grads(action)
                    if self.on_chunk_grads_ready:
                        self.on_chunk_grads_ready(action.chunk)
                while sends and sends[0].done():  # completes in order (NCCL; gloo: at wait)
                    send_bytes -= sends.popleft().nbytes
                record.events.append(
                    self._event(
                        action,
                        window.posted_after.get(index),
                        start,
                        wait,
                        send_bytes,
                        computed,
                        bool(out_msgs),
                    )
                )
                self._update_peaks(record)
            index, action = len(actions), None
            if monitor is not None:
                monitor.set_context(
                    step=self._steps, index=index, action="end of step", pp_rank=self.pp_rank
                )
            if sends:
                PendingSend.combine(sends).wait()
            finished = True
        except (PipelineStepError, PipelineAborted):
            raise
        except PipelineHang as e:
            marks = {
                st["pp_rank"]: st["index"]
                for st in e.states.values()
                if st.get("step") == self._steps and st.get("pp_rank", -1) >= 0
            }
            marks[self.topology.pp_rank] = index
            raise PipelineStepError(
                f"{e}\nschedule '{schedule.name}' (each rank's step as it last reported, in "
                f"brackets; unmarked ranks reported nothing for this step):\n"
                f"{_format_grid_marks(schedule, marks)}",
                self.rank,
                action,
            ) from e
        except Exception as e:
            what = action.describe() if action is not None else "end of step"
            raise PipelineStepError(
                f"rank {self.rank} (pp_rank {self.topology.pp_rank}): {what}: "
                f"{type(e).__name__}: {e}\nschedule '{schedule.name}' "
                f"(this rank's failing step in brackets):\n"
                f"{_format_grid(schedule, self.topology.pp_rank, index)}",
                self.rank,
                action,
            ) from e
        finally:
            self._mbs = []
            self._batch_storages = set()
            if not finished:
                # Receives posted ahead (and sends) of a failed step never complete, and
                # destroying such a gloo work blocks for seconds wherever the garbage collector
                # happens to run. A process that carried on after failures stalled in unrelated
                # places (the fault suite's 36 failures in one world took 84-103 s instead of
                # 13-31 s). Keeping them for the process's lifetime costs only their buffers.
                _ABANDONED.append((window, pending, sends))
        leftover = sum(len(q) for q in self._stash)
        if leftover:
            raise PipelineStepError(
                f"rank {self.rank}: {leftover} forward(s) never went backward "
                f"(stash per chunk: {[[e.mb for e in q] for q in self._stash]})",
                self.rank,
                None,
            )
        loss = self._broadcast_loss()
        record.t1 = time.perf_counter()
        outputs = None
        if collect and self._is_last_stage_rank(schedule):
            outputs = [self._outputs[i] for i in sorted(self._outputs)]
        return StepResult(loss=loss, record=record, outputs=outputs)

    @property
    def pp_rank(self) -> int:
        return self.topology.pp_rank

    def _is_last_stage_rank(self, schedule: Schedule) -> bool:
        return self.topology.pp_rank == (schedule.num_stages - 1) % self.pp

    def _post(
        self,
        window: _ReceiveWindow,
        actions: Sequence[Action],
        out_msgs: list[Message],
        *,
        after: int,
        upto: int,
    ) -> PendingSend:
        """After action ``after``, send ``out_msgs`` with the receives of actions up to ``upto``
        (those not posted yet) in one batched call.

        The next action's receives are always posted; later ones only while they can be: a
        backward whose forward has not run yet has no gradient shape, and stops the scan
        (receives of one channel must be posted in schedule order).
        """
        reqs: list[RecvRequest] = []
        counts: list[tuple[int, int]] = []
        j, last = window.upto + 1, min(upto, len(actions) - 1)
        while j <= last:
            needs = self._needs(actions[j], ahead=j > after + 1)
            if needs is None:
                break
            reqs += needs
            counts.append((j, len(needs)))
            j += 1
        sent, pendings = self.comm.exchange(out_msgs, reqs)
        k = 0
        for idx, n in counts:
            window.posted[idx] = pendings[k : k + n]
            k += n
            if n:
                window.posted_after[idx] = after
        window.upto = j - 1
        return sent

    def _needs(self, action: Action, *, ahead: bool = False) -> list[RecvRequest] | None:
        """The receives ``action`` needs. ``ahead``: it is a LATER action than the next one;
        ``None`` then means they cannot be posted yet."""
        s = self._stage(action.chunk)
        if action.op is Op.F:
            if s == 0:
                return []
            reqs = [RecvRequest(ACT, self._rank_of(s - 1), s, action.mb)]
            if ahead and not self.comm.can_post_early(reqs[0]):
                return None
            return reqs
        if s == self.schedule.num_stages - 1:
            return []
        q = self._stash[action.chunk]
        if ahead:
            # Not necessarily the stash head: backwards before this one pop older entries
            # first (FIFO is checked when this backward runs).
            entry = next((e for e in q if e.mb == action.mb), None)
            if entry is None:
                return None
        else:
            entry = q[0] if q else None
            self._check_fifo(action, entry)
        if not entry.out_specs:  # no floating outputs: no gradient travels
            return []
        # the tag names the RECEIVING stage (this one), as the sender's Message does
        return [RecvRequest(GRAD, self._rank_of(s + 1), s, action.mb, specs=entry.out_specs)]

    def _check_fifo(self, action: Action, head: _Entry | None) -> None:
        if head is None or head.mb != action.mb:
            stashed = [e.mb for e in self._stash[action.chunk]]
            raise RuntimeError(
                f"rank {self.rank}: {action.describe()}: backward order does not match forward "
                f"order: the oldest stashed forward of chunk {action.chunk} is "
                f"{'none' if head is None else f'mb={head.mb}'} (stash {stashed}); backward "
                f"must pair FIFO with forward or the gradient would be silently wrong"
            )

    def _execute(self, action: Action, received, pending) -> list[Message]:
        if action.op is Op.F:
            return self._forward(action, received, pending)
        return self._backward(action, received)

    def _forward(self, action: Action, received, pending) -> list[Message]:
        c, mb = action.chunk, action.mb
        s = self._stage(c)
        last = s == self.schedule.num_stages - 1
        microbatch = self._mbs[mb]
        if s == 0:
            x = self.input_fn(microbatch)
            inputs, _ = _as_tuple(x, f"input_fn(microbatch {mb})") if self._train else ((), False)
        else:
            tensors, p = received[0], pending[0]
            inputs = tuple(
                t.requires_grad_(True) if self._train and t.is_floating_point() else t
                for t in tensors
            )
            x = inputs if p.is_tuple else inputs[0]
        saved: dict[int, int] = {}
        try:
            if self.measure_memory and self._train:
                with torch.autograd.graph.saved_tensors_hooks(self._pack(saved), lambda t: t):
                    out = self.chunks[c](x)
            else:
                out = self.chunks[c](x)
        except Exception as e:
            if s == 0:
                raise
            p = pending[0]
            raise RuntimeError(
                f"forward of chunk {c} (stage {s}) failed on the input received from rank "
                f"{p.request.peer} (stage {s - 1}) for mb={mb}: received "
                f"{'tuple ' if p.is_tuple else ''}{format_specs(p.specs)}: {type(e).__name__}: {e}"
            ) from e
        if self.check_finite:
            if s == 0 and not all_finite(_as_list(x)):
                self._nonfinite(action, "input (the batch itself)", _as_list(x), None)
            if not all_finite(_as_list(out)):
                self._nonfinite(action, "forward output", _as_list(out), x)
        if last:
            loss = self.loss_fn(out, microbatch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"loss_fn must return a scalar tensor, got {loss!r}")
            if self.check_finite and not all_finite([loss]):
                self._nonfinite(action, "loss (the model output is finite)", [loss], None)
            scale = 1.0
            if self.loss_reduction == "mean":
                scale = batch_size_of(microbatch) / self._batch_size
            scaled = loss.reshape(()) * scale
            self._loss += scaled.detach().float()
            if self._collect:
                self._outputs[mb] = out.detach() if isinstance(out, torch.Tensor) else out
            if self._train:
                self._stash[c].append(_Entry(mb, inputs, (scaled,), [0], [], sum(saved.values())))
            return []
        outs, is_tuple = _as_tuple(out, f"output of chunk {c} (stage {s})")
        if self._train:
            floating = [t for t in outs if t.is_floating_point()]
            grad_idx = [i for i, t in enumerate(floating) if t.requires_grad]
            entry = _Entry(
                mb,
                inputs,
                tuple(floating[i] for i in grad_idx),
                grad_idx,
                [(tuple(t.shape), t.dtype) for t in floating],
                sum(saved.values()),
            )
            self._stash[c].append(entry)
        return [Message(ACT, self._rank_of(s + 1), s + 1, mb, outs, is_tuple)]

    def _pack(self, saved: dict[Any, int]):
        params, batch = self._param_storages, self._batch_storages

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr in batch:
                # A view of the step's input batch (a tensor_split microbatch): the batch is
                # held by the caller anyway; backward keeps alive only what this view covers.
                key = (ptr, t.storage_offset(), tuple(t.shape), t.stride())
                saved[key] = t.numel() * t.element_size()
            elif ptr not in params:
                saved[ptr] = st.nbytes()
            # A detached alias, not ``t`` itself: autograd stores what pack returns, and output
            # release later swaps the storage of the very tensor object it was given.
            return t.detach()

        return pack

    def _release(self, action: Action) -> None:
        """Drop the stash's hold on the sent output storage (the send keeps its own alias).

        Only the output's ``grad_fn`` is needed for backward. Skipped for views (their storage
        belongs to another tensor) and for leaves (an input passed straight through).
        """
        if not self.release_outputs or self._stage(action.chunk) == self.schedule.num_stages - 1:
            return
        entry = self._stash[action.chunk][-1]
        input_ptrs = {t.data_ptr() for t in entry.inputs}
        for t in entry.outputs:
            if t._base is None and t.grad_fn is not None and t.data_ptr() not in input_ptrs:
                t.data = torch.empty(1, dtype=t.dtype, device=t.device)

    def _backward(self, action: Action, received) -> list[Message]:
        c, mb = action.chunk, action.mb
        s = self._stage(c)
        q = self._stash[c]
        self._check_fifo(action, q[0] if q else None)
        entry = q.popleft()
        if s == self.schedule.num_stages - 1:
            tensors = entry.outputs
            grads = tuple(torch.ones_like(t) for t in tensors)
        else:
            all_grads = received[0] if received else ()
            tensors = entry.outputs
            grads = tuple(all_grads[i] for i in entry.grad_positions)
        if tensors:
            # The autograd engine directly: torch.autograd.backward would reject a released
            # output whose storage no longer matches its gradient's shape.
            torch.autograd.Variable._execution_engine.run_backward(
                tensors, grads, False, False, (), True, True
            )
        if s == 0:
            return []
        in_grads = tuple(
            (t.grad if t.grad is not None else torch.zeros_like(t))
            for t in entry.inputs
            if t.is_floating_point()
        )
        if not in_grads:
            return []
        if self.check_finite and not all_finite(in_grads):
            self._nonfinite(
                action, "input gradient (the gradient it received was finite)", in_grads, None
            )
        return [Message(GRAD, self._rank_of(s - 1), s - 1, mb, in_grads, True)]

    # -- non-finite values -----------------------------------------------------------------------
    def _where(self, chunk: int) -> str:
        idx = getattr(self.chunks[chunk], "layer_indices", None)
        layers = f", layers {idx[0]}-{idx[-1]}" if idx else ""
        return f"virtual stage {self._stage(chunk)} (rank {self.rank}, chunk {chunk}{layers})"

    def _nonfinite(self, action: Action, what: str, tensors: Sequence[Any], x: Any) -> None:
        detail = describe_nonfinite(tensors) or "non-finite values"
        located = ""
        if x is not None:
            found = first_nonfinite_layer(self.chunks[action.chunk], x)
            located = (
                f"; first non-finite layer output: layer {found[0]} ({found[1]})"
                if found
                else "; re-running the chunk layer by layer gave finite outputs (a random layer "
                "such as dropout?)"
            )
        raise NonFiniteError(
            f"non-finite {what} of mb={action.mb} at {self._where(action.chunk)}: {detail}{located}"
        )

    def _check_param_grads(self, action: Action) -> None:
        bad = nonfinite_param_grads(self.chunks[action.chunk])
        if bad:
            raise NonFiniteError(
                f"non-finite parameter gradients at {self._where(action.chunk)} after its last "
                f"backward of the step (inputs and received gradients were finite): "
                + ", ".join(bad)
            )

    # -- bookkeeping ---------------------------------------------------------------------------
    def _event(
        self,
        action: Action,
        recv_posted_after: int | None,
        start: float,
        wait: float,
        send_bytes: int,
        computed: float,
        sent: bool,
    ) -> StepEvent:
        entries = [e for q in self._stash for e in q]
        stash = _tensor_bytes([t for e in entries for t in (*e.inputs, *e.outputs)])
        return StepEvent(
            action=action,
            start=start,
            end=time.perf_counter(),
            comm_wait=wait,
            stash_bytes=stash,
            saved_bytes=sum(e.saved_bytes for e in entries),
            send_bytes=send_bytes,
            inflight=len(entries),
            compute_end=computed,
            send_time=computed if sent else None,
            recv_posted_after=recv_posted_after,
        )

    @staticmethod
    def _update_peaks(record: StepRecord) -> None:
        ev = record.events[-1]
        record.peak_stash_bytes = max(record.peak_stash_bytes, ev.stash_bytes)
        record.peak_saved_bytes = max(record.peak_saved_bytes, ev.saved_bytes)
        record.peak_inflight = max(record.peak_inflight, ev.inflight)

    def _broadcast_loss(self) -> torch.Tensor:
        loss = self._loss
        if self.pp > 1:
            src = self.topology.global_rank(self.pp - 1)
            work = dist.broadcast(loss, src=src, group=self.groups.pp_group, async_op=True)
            self.comm._wait([work], f"waiting for the step's loss from rank {src}")
        return loss.detach()

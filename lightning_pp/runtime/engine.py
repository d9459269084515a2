"""Run one rank's part of a pipeline schedule for one batch.

The executor is one loop over this rank's action list. Around each action it:

1. waits for the receives the action needs (posted at the end of an earlier action),
2. computes (F: forward through one local chunk; B: backward of the OLDEST stashed forward of
   that chunk; I: its input gradient only, W: later, its weight gradients; see
   :mod:`lightning_pp.runtime.split_backward`),
3. posts the action's sends TOGETHER with the receives of the next action, and of later ones up
   to ``recv_lookahead`` ahead, in one batched call.

Sends are never waited for before the end of the step (a send keeps its buffer alive itself);
receives are waited for just before their data is needed. That is exactly the dry-run model of
the schedule validator (sends never block, receives do), so every schedule the validator accepts
runs here without deadlock.

:class:`PipelineEngine` keeps what lives across steps and puts the reliability around the loop
(watchdog context, abort channel, errors that show the schedule grid). One step's state is a
:class:`~lightning_pp.runtime.engine_step.StepRun`; its traffic goes through a
:class:`~lightning_pp.runtime.receive_window.ReceiveWindow` of the
:class:`~lightning_pp.runtime.p2p.P2PCommunicator`.

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

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..layout.recompute_spec import RecomputeSpec, parse_recompute
from ..layout.topology import PipelineTopology, ProcessGroups
from ..schedules import Action, Schedule, check_positive
from .engine_step import StepRun, place_chunks
from .failure import DEFAULT_WATCHDOG_TIMEOUT, FailureMonitor, PipelineAborted, PipelineHang
from .numerics import FiniteChecker
from .p2p import P2PCommunicator, p2p_backend
from .recompute import Targets, install_recompute, install_targets, select_positions
from .recompute_probe import LayerProbe
from .records import StepRecord

# The transfers of failed steps, never released (see the end of _run_actions).
_ABANDONED: list[object] = []

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
    outputs: list[Any] | None = None


def _format_grid(schedule: Schedule, rank: int, index: int) -> str:
    return _format_grid_marks(schedule, {rank: index})


def _format_grid_marks(schedule: Schedule, marks: dict[int, int]) -> str:
    try:  # the schedules package's grid marks the failing step; fall back to a plain list
        from ..schedules.validate import format_grid

        return format_grid(schedule, marks)
    except Exception:  # pragma: no cover - only when the validator module is unavailable
        show = schedule.vpp > 1
        return "\n".join(
            f"rank {r}: " + " ".join(a.short(show) for a in acts)
            for r, acts in enumerate(schedule.ranks)
        )


def _storage_ptr(p: torch.Tensor) -> int:
    """Where a parameter's data lives. A ``DTensor`` (an FSDP2 shard, see
    :mod:`~lightning_pp.runtime.fsdp_chunks`) has no storage of its own: its local shard's."""
    if isinstance(p, DTensor):
        with torch.no_grad():
            p = p.to_local()
    return p.untyped_storage().data_ptr()


def _default_input_fn(mb: Any) -> Any:
    return mb[0] if isinstance(mb, (tuple, list)) else mb


class PipelineEngine:
    """Executes a :class:`Schedule` on this rank's chunks with real point-to-point traffic.

    Args:
        chunks: this rank's local chunks, ``len(chunks) == schedule.vpp``; chunk ``c`` runs
            virtual stage ``schedule.stage(pp_rank, c)`` (the schedule states the placement).
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
            a step: its last ``B``, or its last ``W`` under a split backward (deferred
            data-parallel gradient sync).
        device: where receive buffers live; default: the first chunk's parameter device.
        static_shapes: agree activation shapes once (see :mod:`lightning_pp.runtime.p2p`).
        measure_memory: record bytes saved for backward (``saved_tensors_hooks``; small cost).
        watchdog_timeout: seconds one point-to-point wait may block before the step fails with
            the hang report (:class:`~lightning_pp.runtime.errors.PipelineHang`); ``None``
            disables it.
        abort_on_failure: publish this rank's failure on the job's c10d store and stop (raise
            :class:`~lightning_pp.runtime.errors.PipelineAborted`) as soon as another rank has
            failed.
        check_finite: raise :class:`~lightning_pp.runtime.numerics.NonFiniteError` where NaN/inf
        first
            appear (activations, loss, gradients; see :mod:`lightning_pp.runtime.numerics` for the
            cost).
        failure_monitor: use this monitor instead of one on the default store (tests, or
            several independent engines in one job).
        recv_lookahead: post the receives of up to this many upcoming actions (at least the
            next one). gloo only moves a message once its receive is posted, so a receive posted
            one action early lets the data arrive while this rank computes; posted just in time
            it costs a hop latency on every dependent action (0.1 ms idle, about 0.6 ms on a
            loaded 2-core machine). Each posted receive holds one boundary buffer, so this
            bounds the extra memory. ``None``: :data:`GLOO_RECV_LOOKAHEAD` on gloo with
            pp > 1, else 1. Not used on NCCL: there receives follow the schedule's global
            message order (:mod:`lightning_pp.runtime.p2p_order`), which one stream per rank needs.
        chunk_gets_microbatch: call ``chunk(x, microbatch)`` instead of ``chunk(x)``, so a
            chunk can read its microbatch (token ids, masks, labels) without those tensors
            travelling with the activation (a split model recomputes its side inputs from them;
            see :mod:`lightning_pp.autosplit`). ``input_fn`` may then return ``()``.
        recompute: activation recompute in training forwards (never in eval):
            ``None``, ``"full"``, layer indices, or a
            :class:`~lightning_pp.layout.recompute_spec.Selective` (see
            :mod:`lightning_pp.runtime.recompute`;
            ``"auto"`` is resolved by :func:`lightning_pp.planner.recompute.plan_auto`, which
            calls :meth:`set_recompute_positions`). Under a split backward (``I``/``W``) each
            recomputed region runs its forward again once, in ``I``, and keeps the result for
            ``W`` (:class:`~lightning_pp.runtime.recompute.RecomputeOnce`; torch's checkpoint would
            recompute a second time for ``W``).

    The batch given to ``train_step``/``eval_step`` must already be on ``device``; every rank of
    a pipeline gets the same batch (the first stage reads inputs, the last stage the targets).

    Besides the arguments, it holds what lives across steps: ``places`` (one
    :class:`~lightning_pp.runtime.engine_step.ChunkPlace` per local chunk, from the schedule's
    placement), ``comm`` (the :class:`~lightning_pp.runtime.p2p.P2PCommunicator`), ``monitor``,
    ``finite_checker`` (``None`` unless ``check_finite``) and ``param_storages``. Everything of
    one step lives in a :class:`~lightning_pp.runtime.engine_step.StepRun`.
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
        chunk_gets_microbatch: bool = False,
        recompute: RecomputeSpec = None,
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
        self.chunk_gets_microbatch = chunk_gets_microbatch
        self._steps = 0
        # Per local chunk: whether its latest split-backward I freed the graph (every layer W
        # runs is a Linear or a norm, captured: split_backward.backward_input(free_graph=True)).
        # Its forwards then skip the SavedForW hooks, which only serve to trim a RETAINED graph;
        # one whose graph turns out not to qualify is retained untrimmed, and the flag drops.
        self.graph_free: list[bool] = [False] * len(self.chunks)
        self.recompute = parse_recompute(recompute)
        self.recompute_targets: Targets = [[] for _ in self.chunks]
        self.recompute_again: list[nn.Module] = []
        if self.recompute not in (None, "auto"):
            self.recompute_targets = install_recompute(self.chunks, self.recompute)
        elif self.recompute == "auto":
            raise ValueError(
                f"rank {topology.rank}: PipelineEngine(recompute='auto') needs the planner: "
                "build the engine with recompute=None and call "
                "lightning_pp.planner.recompute.plan_auto(engine, batch, budget)"
            )
        # Where each local chunk sits, from the schedule's placement (eval's forward-only
        # schedule keeps it); the step loss comes from the rank holding the last stage.
        self.places = place_chunks(schedule, topology)
        self._loss_src = topology.global_rank(schedule.locate(schedule.num_stages - 1)[0])
        self.finite_checker = (
            FiniteChecker(self.chunks, [p.stage for p in self.places], topology.rank)
            if check_finite
            else None
        )
        pp_group = groups.pp_group if groups is not None else None
        # "nccl" also under the NCCL emulation (a test harness), so its defaults apply there.
        backend = p2p_backend(pp_group)
        self.monitor: FailureMonitor | None = failure_monitor
        if self.monitor is None and abort_on_failure and dist.is_initialized():
            self.monitor = FailureMonitor.from_default_store(
                topology.rank,
                watchdog_timeout=watchdog_timeout,
                pipeline_ranks=topology.pipeline_ranks,
                poll_works=backend == "nccl",
            )
        if device is None:
            params = [p for c in self.chunks for p in c.parameters()]
            device = params[0].device if params else torch.device("cpu")
        self.device = torch.device(device)
        self.comm = P2PCommunicator(
            topology,
            pp_group,
            device=self.device,
            static_shapes=static_shapes,
            monitor=self.monitor,
        )
        self.recv_lookahead = self._resolve_lookahead(recv_lookahead, backend)
        # Parameters are excluded from ``saved_bytes`` (they are not activation memory).
        self.param_storages = {_storage_ptr(p) for c in self.chunks for p in c.parameters()}

    def _resolve_lookahead(self, lookahead: int | None, backend: str) -> int:
        if lookahead is not None:
            check_positive(recv_lookahead=lookahead)
        if self.pp == 1:
            return 1  # every message is in-process: a receive exists only once it was sent
        if lookahead is None:
            return 1 if backend == "nccl" else GLOO_RECV_LOOKAHEAD
        return lookahead

    @property
    def check_finite(self) -> bool:
        return self.finite_checker is not None

    @property
    def pp(self) -> int:
        return self.topology.pp

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def pp_rank(self) -> int:
        return self.topology.pp_rank

    def set_recompute_positions(
        self,
        positions: Sequence[Sequence[int]],
        again: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Recompute the layers at these positions of each local chunk (the planner's choice;
        positions index :func:`~lightning_pp.runtime.recompute.layer_names` of each chunk).
        ``again``:
        under a split backward, those (among ``positions``) that recompute again for ``W``
        instead of keeping ``I``'s recompute."""
        self.recompute_targets = install_targets(select_positions(self.chunks, positions))
        twice = select_positions(self.chunks, again or [[] for _ in self.chunks])
        self.recompute_again = [m for picked in twice for _, m in picked]
        self.recompute = "auto"

    def recomputes(self, chunk: int) -> bool:
        """Whether local ``chunk`` recomputes anything in training forwards."""
        return bool(self.recompute_targets[chunk])

    # -- public steps --------------------------------------------------------------------------
    def train_step(self, batch: Any, *, loss_weights: Sequence[float] | None = None) -> StepResult:
        """Forward and backward over every microbatch; gradients ACCUMULATE into ``.grad``.

        ``loss_weights``: one factor per microbatch that replaces the ``loss_reduction`` scaling
        (e.g. ``count_i * dp / global_count`` for a loss that means over valid tokens, see
        :mod:`lightning_pp.runtime.loss_weights`); it must be known before the step starts,
        since 1F1B runs the first backward before the last forward. A microbatch of weight 0
        (no valid target: a token mean is 0/0 there) adds nothing, not NaN.

        Example::

            counts = [int((mb[1] != -100).sum()) for mb in split_microbatches(batch, m)]
            engine.train_step(batch, loss_weights=token_weights(counts, dp_group, dp))
        """
        return self._run(self.schedule, batch, train=True, collect=False, weights=loss_weights)

    def probe_step(self, batch: Any) -> list[list[LayerProbe]]:
        """Forward of microbatch 0 only (every rank, the schedule's order), with gradients
        enabled and each layer measured: what it saves for backward, the inputs a checkpoint
        would hold, its forward time (per local chunk, per layer). No backward, no stash: each
        layer's graph is freed once measured. All ranks of the pipeline must call it."""
        fo = self.schedule.forward_only()
        probe_schedule = dataclasses.replace(
            fo,
            name=f"{self.schedule.name}-probe",
            ranks=tuple(tuple(a for a in r if a.mb == 0) for r in fo.ranks),
        )
        probes: list[list[LayerProbe]] = [[] for _ in self.chunks]
        self._steps += 1
        try:
            self._run_actions(probe_schedule, batch, train=False, collect=False, probes=probes)
        except PipelineAborted:
            raise
        except Exception as e:
            self._report(e)
            raise
        return probes

    @torch.no_grad()
    def eval_step(self, batch: Any, *, collect_outputs: bool = False) -> StepResult:
        """Forward only (``schedule.forward_only()``) under ``no_grad``; loss on every rank."""
        return self._run(self.schedule.forward_only(), batch, train=False, collect=collect_outputs)

    # -- the loop ------------------------------------------------------------------------------
    def _run(
        self,
        schedule: Schedule,
        batch: Any,
        *,
        train: bool,
        collect: bool,
        weights: Sequence[float] | None = None,
    ) -> StepResult:
        self._steps += 1
        try:
            return self._run_actions(
                schedule, batch, train=train, collect=collect, loss_weights=weights
            )
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
        self,
        schedule: Schedule,
        batch: Any,
        *,
        train: bool,
        collect: bool,
        probes: list[list[LayerProbe]] | None = None,
        loss_weights: Sequence[float] | None = None,
    ) -> StepResult:
        step = StepRun(
            self,
            schedule,
            batch,
            train=train,
            collect=collect,
            probes=probes,
            loss_weights=loss_weights,
        )
        index, action = -1, None
        finished = False
        try:
            step.window.exchange([], after=-1)  # the first actions' receives
            for index, action in enumerate(step.actions):
                self._watch(index, action)
                start = time.perf_counter()
                received, waited = step.window.wait(index)
                messages = step.execute(action, received)
                # Stamped before the sends are posted: the receiver's data arrival minus this
                # time is the real hop delay (posting, transfer, the receiver's wake-up).
                computed = time.perf_counter()
                step.post(index, action, messages)  # with the lookahead receives
                step.record(index, action, start, waited, computed, sent=bool(messages))
            index, action = len(step.actions), None
            self._watch(index, "end of step")
            step.sends.wait()
            finished = True
        except (PipelineStepError, PipelineAborted):
            raise
        except PipelineHang as e:
            raise self._hang_error(e, schedule, index, action) from e
        except Exception as e:
            raise self._step_error(e, schedule, index, action) from e
        finally:
            if not finished:
                # Receives posted ahead (and sends) of a failed step never complete, and
                # destroying such a gloo work blocks for seconds wherever the garbage collector
                # happens to run. A process that carried on after failures stalled in unrelated
                # places (the fault suite's 36 failures in one world took 84-103 s instead of
                # 13-31 s). Keeping them for the process's lifetime costs only their buffers.
                # Only the transfers: the step's stash and batch may go.
                _ABANDONED.append((step.window.outstanding(), step.sends))
        leftover = step.stash.inflight
        if leftover:
            raise PipelineStepError(
                f"rank {self.rank}: {leftover} forward(s) never went backward "
                f"(stash per chunk: {[[e.mb for e in q] for q in step.stash.queues]})",
                self.rank,
                None,
            )
        loss = self._broadcast_loss(step.loss)
        record = step.recorder.finish()
        outputs = None
        if collect and any(p.last for p in self.places):
            outputs = [step.outputs[i] for i in sorted(step.outputs)]
        return StepResult(loss=loss, record=record, outputs=outputs)

    def _watch(self, index: int, action: Action | str) -> None:
        """Tell the monitor where this rank is (attribute writes only: published if a wait
        blocks, and read by the other ranks' hang reports)."""
        if self.monitor is not None:
            self.monitor.set_context(
                step=self._steps, index=index, action=action, pp_rank=self.pp_rank
            )

    def _hang_error(
        self, error: PipelineHang, schedule: Schedule, index: int, action: Action | None
    ) -> PipelineStepError:
        """The hang report, with every rank's position (as it last reported) in the grid."""
        marks = {
            st["pp_rank"]: st["index"]
            for st in error.states.values()
            if st.get("step") == self._steps and st.get("pp_rank", -1) >= 0
        }
        marks[self.pp_rank] = index
        return PipelineStepError(
            f"{error}\nschedule '{schedule.name}' (each rank's step as it last reported, in "
            f"brackets; unmarked ranks reported nothing for this step):\n"
            f"{_format_grid_marks(schedule, marks)}",
            self.rank,
            action,
        )

    def _step_error(
        self, error: Exception, schedule: Schedule, index: int, action: Action | None
    ) -> PipelineStepError:
        what = action.describe() if action is not None else "end of step"
        return PipelineStepError(
            f"rank {self.rank} (pp_rank {self.pp_rank}): {what}: "
            f"{type(error).__name__}: {error}\nschedule '{schedule.name}' "
            f"(this rank's failing step in brackets):\n"
            f"{_format_grid(schedule, self.pp_rank, index)}",
            self.rank,
            action,
        )

    def _broadcast_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.pp > 1:
            src = self._loss_src
            self.comm.broadcast(loss, src, f"waiting for the step's loss from rank {src}")
        return loss.detach()

"""PipelinePlan: one pipeline shape, checked, with every default, in one frozen object.

A plan is built from what is known (sizes, schedule, partition, then the world size, then the
model's layers, then each batch) and refuses anything that cannot run, with a
:class:`~lightning_pp.layout.rules.PreflightError` that names the numbers and the fix. The
strategy, ``lightning-pp fit``, ``lightning-pp plan`` and ``lightning-pp schedule`` all build
one; the rules it applies live in :mod:`lightning_pp.layout.rules` and nowhere else.

This module imports nothing heavier than the schedules at import time (``lightning-pp
schedule`` starts without torch); the partition imports torch when used.

Example:
    >>> plan = PipelinePlan.build(world_size=8, pp=4, vpp=2, microbatches=8, num_layers=16)
    >>> (plan.dp, plan.schedule.name, plan.split_text)
    (2, 'interleaved', 's0=2 s1=2 s2=2 s3=2 s4=2 s5=2 s6=2 s7=2')
    >>> plan.stage_layers(0)
    [range(0, 2), range(8, 10)]
    >>> PipelinePlan.build(pp=4, world_size=6)
    Traceback (most recent call last):
    ...
    lightning_pp.layout.rules.PreflightError: world size 6 is not divisible by pp=4 ...
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..schedules import Schedule, simulate
from .rules import (
    PipelineWarning,
    PreflightError,
    _format_split,
    _positive,
    check_batch,
    check_layers,
    check_reshard,
    check_schedule_args,
    check_settings,
    check_sharding,
    check_world,
)

__all__ = ["PipelinePlan", "format_count"]


# ------------------------------------------------------------------------------------ the plan


def _layer_span(rng: range) -> str:
    return f"{rng.start}" if len(rng) == 1 else f"{rng.start}-{rng.stop - 1}"


def _layer_kinds(rng: range, names: Sequence[str]) -> str:
    """``Embedding, Block x2`` for a run of layer class names."""
    kinds: list[list[Any]] = []
    for i in rng:
        if kinds and kinds[-1][0] == names[i]:
            kinds[-1][1] += 1
        else:
            kinds.append([names[i], 1])
    return ", ".join(n if c == 1 else f"{n} x{c}" for n, c in kinds)


def format_count(n: float) -> str:
    """``1.07B``, ``52.40K``: a parameter count for humans."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


@dataclass(frozen=True)
class PipelinePlan:
    """One pipeline shape, checked: sizes, the schedule (which owns placement), the world and
    data-parallel size, the layer split, and the warnings it raised.

    Build it with :meth:`build`, then refine it as facts arrive (:meth:`with_world`,
    :meth:`with_layers`); every step returns a new plan or raises :class:`PreflightError`.

    Example:
        >>> plan = PipelinePlan.build(pp=2, microbatches=4)          # at Strategy.__init__
        >>> plan = plan.with_world(4).with_layers(6)                 # world, then the module
        >>> plan.check_batch(32)                                     # every batch
        >>> print("\\n".join(plan.describe()[:2]))
        pipeline: pp=2 x dp=2 (world 4), vpp=1: 2 virtual stages, one stage per rank
        schedule: 1f1b, 4 microbatches; simulated bubble 0.250 of ideal compute (t_b = 2 t_f)
    """

    pp: int
    vpp: int
    microbatches: int
    schedule: Schedule
    world_size: int | None = None
    dp: int | None = None
    partition: str | tuple[int, ...] = "uniform"
    group_size: int | None = None
    layer_ranges: tuple[range, ...] | None = None
    warnings: tuple[str, ...] = ()
    # Settings checked by build() and reported by describe(); None means "not given".
    batch_size: int | None = None
    global_batch_size: int | None = None
    accumulate_grad_batches: int = 1
    recv_lookahead: int | None = None
    bucket_cap_mb: float | None = None
    watchdog_timeout: float | None = None
    #: data-parallel sharding: 0 none, 1 optimizer state, 2 optimizer state and gradients
    zero: int = 0
    #: FSDP2 per chunk over the dp replicas (parameters, gradients and optimizer state)
    fsdp: bool = False
    #: with ``fsdp``: free gathered parameters after every forward
    reshard_after_forward: bool = False
    #: tensor-parallel ranks per stage (the innermost mesh dim); the world is pp x dp x tp
    tp: int = 1
    _layer_params: tuple[int, ...] | None = dataclasses.field(default=None, repr=False)
    _layer_costs: tuple[float, ...] | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        *,
        pp: int | None = None,
        vpp: int | None = None,
        microbatches: int | None = None,
        schedule: str | None = None,
        group_size: int | None = None,
        world_size: int | None = None,
        dp: int | None = None,
        partition: str | Sequence[int] = "uniform",
        num_layers: int | None = None,
        layer_params: Sequence[int] | None = None,
        layer_costs: Sequence[float] | None = None,
        batch_size: int | None = None,
        global_batch_size: int | None = None,
        accumulate_grad_batches: int = 1,
        recv_lookahead: int | None = None,
        bucket_cap_mb: float | None = None,
        watchdog_timeout: float | None = None,
        zero: int = 0,
        fsdp: bool = False,
        reshard_after_forward: bool = False,
        tp: int = 1,
        warn: bool = True,
    ) -> PipelinePlan:
        """Check everything whose inputs are given and return the plan.

        ``pp=None`` means one pipeline over the whole world (needs ``world_size``). Order:
        settings (sizes, partition name, limits) -> schedule -> world -> layers -> batch; the
        first failing rule raises a :class:`PreflightError`. ``warn`` also emits the plan's
        warnings (they are kept in :attr:`warnings` either way).
        """
        check_settings(
            vpp=vpp,
            microbatches=microbatches,
            partition=partition,
            group_size=group_size,
            recv_lookahead=recv_lookahead,
            bucket_cap_mb=bucket_cap_mb,
            watchdog_timeout=watchdog_timeout,
            accumulate_grad_batches=accumulate_grad_batches,
            zero=zero,
            fsdp=fsdp,
            tp=tp,
        )
        if pp is None:
            if world_size is None:
                raise PreflightError(
                    "pp=None means one pipeline over the whole world, but the world size is not "
                    "known yet: give world_size, or set pp",
                    key="pp",
                )
            _positive(world_size=world_size)
            if world_size % tp:
                raise PreflightError(
                    f"pp=None puts every process of a tensor-parallel group in one pipeline: "
                    f"the world size {world_size} must be a multiple of tp={tp}",
                    key="tp",
                )
            pp = world_size // tp
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PipelineWarning)
            built = check_schedule_args(schedule, pp, microbatches, vpp, group_size, warn=True)
        texts = tuple(str(w.message) for w in caught if issubclass(w.category, PipelineWarning))
        check_reshard(reshard_after_forward, fsdp, built)
        if not isinstance(partition, str) and len(partition) != pp * built.vpp:
            # known at construction (no model needed): refused here, not after spawn
            k = pp * built.vpp
            raise PreflightError(
                f"partition={list(partition)}: explicit split has {len(partition)} entries but "
                f"pp({pp}) * vpp({built.vpp}) = {k} virtual stages; give {k} per-stage layer "
                f"counts (one per virtual stage, summing to the model's layer count), or use "
                f"partition='uniform'",
                key="partition",
            )
        if warn:
            for text in texts:
                warnings.warn(text, PipelineWarning, stacklevel=2)
        plan = cls(
            pp=pp,
            # the schedule's chunk count: vpp when given, else its own (zbv 2, others 1)
            vpp=built.vpp,
            microbatches=built.microbatches,
            schedule=built,
            partition=partition if isinstance(partition, str) else tuple(partition),
            group_size=group_size,
            warnings=texts,
            batch_size=batch_size,
            global_batch_size=global_batch_size,
            accumulate_grad_batches=accumulate_grad_batches,
            recv_lookahead=recv_lookahead,
            bucket_cap_mb=bucket_cap_mb,
            watchdog_timeout=watchdog_timeout,
            zero=zero,
            fsdp=fsdp,
            reshard_after_forward=reshard_after_forward,
            tp=tp,
        )
        if world_size is not None:
            plan = plan.with_world(world_size, dp=dp)
        elif dp is not None:
            _positive(dp=dp)
            check_sharding(zero, fsdp, dp)
            plan = dataclasses.replace(plan, dp=dp)
        if num_layers is not None:
            plan = plan.with_layers(num_layers, layer_params=layer_params, layer_costs=layer_costs)
        if batch_size is not None or global_batch_size is not None:
            check_batch(
                batch_size, plan.microbatches, plan.dp or 1, global_batch_size=global_batch_size
            )
        return plan

    def with_world(self, world_size: int, *, dp: int | None = None) -> PipelinePlan:
        """The plan on ``world_size`` processes: checks ``pp`` divides it and sets ``dp``."""
        dp = check_world(world_size, self.pp, self.dp if dp is None else dp, tp=self.tp)
        check_sharding(self.zero, self.fsdp, dp)
        return dataclasses.replace(self, world_size=world_size, dp=dp)

    def on_trainer_world(
        self, world_size: int, *, pp: int | None, num_nodes: int, devices: int
    ) -> PipelinePlan:
        """:meth:`with_world` for the strategy: the error names the strategy's ``pp`` and the
        Trainer's ``num_nodes x devices`` that made the world."""
        try:
            return self.with_world(world_size)
        except PreflightError as e:
            if e.key not in ("pp", "dp", "tp"):
                raise  # e.g. zero=1 with dp=1: its own message says it
            raise PreflightError(
                f"PipelineStrategy(pp={pp}) does not divide the world size {world_size} "
                f"(num_nodes={num_nodes} x devices={devices}): {e}",
                key=e.key,
            ) from None

    def with_layers(
        self,
        num_layers: int,
        *,
        layer_params: Sequence[int] | None = None,
        layer_costs: Sequence[float] | None = None,
    ) -> PipelinePlan:
        """The plan for a module of ``num_layers`` pipeline layers: cuts them into stages.

        ``layer_params`` / ``layer_costs`` (one number per layer) feed the ``"parameters"`` and
        ``"cost"`` partitions; :meth:`describe` shows parameter counts when they are given.
        """
        ranges = check_layers(
            num_layers,
            self.pp,
            self.vpp,
            self.partition,
            layer_params=layer_params,
            layer_costs=layer_costs,
        )
        return dataclasses.replace(
            self,
            layer_ranges=tuple(ranges),
            _layer_params=None if layer_params is None else tuple(layer_params),
            _layer_costs=None if layer_costs is None else tuple(layer_costs),
        )

    def check_batch(self, batch_size: int | None) -> None:
        """A batch of ``batch_size`` samples (per data-parallel replica) can be split into
        :attr:`microbatches` non-empty microbatches (not necessarily equal ones)."""
        check_batch(batch_size, self.microbatches, self.dp or 1)

    def check_batch_on_rank(self, size: int | None, rank: int) -> None:
        """:meth:`check_batch` for the batch global rank ``rank`` received (``size`` samples,
        ``None`` for a batch without a batch dimension, which passes: the engine reports it
        with the action).

        Every rank of a pipeline sees the same batch, so a batch too small for the microbatches
        (a short last batch too) raises the same error on all of them, before any communication,
        instead of one rank failing and the rest waiting."""
        if size is None:
            return
        try:
            self.check_batch(size)
        except PreflightError as e:
            raise PreflightError(f"rank {rank}: {e}", key=e.key) from None

    @property
    def num_stages(self) -> int:
        """Virtual stages: ``pp * vpp``."""
        return self.pp * self.vpp

    @property
    def num_layers(self) -> int | None:
        return None if self.layer_ranges is None else sum(len(r) for r in self.layer_ranges)

    @property
    def split_text(self) -> str | None:
        """``s0=2 s1=3 ...``: layers per virtual stage, once the layers are known."""
        if self.layer_ranges is None:
            return None
        return _format_split([len(r) for r in self.layer_ranges])

    def stage_layers(self, pp_rank: int) -> list[range]:
        """The layer ranges ``pp_rank`` holds, one per local chunk, in local chunk order (the
        schedule's placement decides which virtual stage each chunk runs)."""
        if self.layer_ranges is None:
            raise PreflightError(
                "the layers are not known yet: call with_layers(num_layers) first",
                key="num_layers",
            )
        if not 0 <= pp_rank < self.pp:
            raise ValueError(f"pp_rank({pp_rank}) must lie in [0, pp({self.pp}))")
        return [self.layer_ranges[s] for s in self.schedule.stages_of(pp_rank)]

    def microbatch_sizes(self, batch_size: int) -> list[int]:
        """Samples per microbatch for a batch of ``batch_size`` (``torch.tensor_split``'s rule:
        the first ``batch_size % microbatches`` microbatches hold one sample more)."""
        self.check_batch(batch_size)
        base, rem = divmod(batch_size, self.microbatches)
        return [base + 1 if i < rem else base for i in range(self.microbatches)]

    def describe(
        self,
        *,
        layer_names: Sequence[str] | None = None,
        layer_params: Sequence[int] | None = None,
    ) -> list[str]:
        """Human lines for logs and the ``lightning-pp plan`` report: the shape, placement,
        schedule and its simulated bubble, the partition per rank (with layer class names and
        parameter counts when given), the batch split and the communication settings."""
        dp = "?" if self.dp is None else str(self.dp)
        world = f"world {self.world_size}" if self.world_size else "world decided at run time"
        placement = {
            "loop": "loop placement (rank r holds stages r, r+pp, ...)",
            "v": "V placement (rank r holds stages r and 2*pp-1-r)",
        }.get(self.schedule.placement, f"{self.schedule.placement} placement")
        if self.vpp == 1:
            placement = "one stage per rank"
        lines = [
            f"pipeline: pp={self.pp} x dp={dp}{f' x tp={self.tp}' if self.tp > 1 else ''} "
            f"({world}), vpp={self.vpp}: "
            f"{self.num_stages} virtual stages, {placement}",
        ]
        group = f", group size {self.schedule.group_size}" if self.schedule.group_size else ""
        bubble = simulate(self.schedule).bubble_ratio
        lines.append(
            f"schedule: {self.schedule.name}, {self.microbatches} microbatches{group}; simulated "
            f"bubble {bubble:.3f} of ideal compute (t_b = 2 t_f)"
        )
        lines += [f"warning: {w}" for w in self.warnings]
        if self.layer_ranges is not None:
            method = self.partition if isinstance(self.partition, str) else "explicit"
            lines.append(f"partition: {method}, {self.num_layers} layers: {self.split_text}")
            params = layer_params if layer_params is not None else self._layer_params
            for r in range(self.pp):
                total = 0
                for c, stage in enumerate(self.schedule.stages_of(r)):
                    rng = self.layer_ranges[stage]
                    text = f"layers {_layer_span(rng)}"
                    if layer_names is not None:
                        text += f" ({_layer_kinds(rng, layer_names)})"
                    if params is not None:
                        n = sum(params[i] for i in rng)
                        total += n
                        text += f"  {n:,} params"
                    lines.append(f"  rank {r} chunk {c} (stage {stage}): {text}")
                if params is not None:
                    lines.append(
                        f"  rank {r} total: {total:,} params ({format_count(total)}); fp32 "
                        f"weights + grads + AdamW states between steps ~ "
                        f"{self._state_bytes_per_param() * total / 2**30:.2f} GiB"
                        f"{self._state_note()} (activations not included)"
                    )
        if self.batch_size is not None:
            sizes = sorted(set(self.microbatch_sizes(self.batch_size)))
            each = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
            line = (
                f"batch: {self.batch_size} per data-parallel replica = {self.microbatches} "
                f"microbatches of {each}"
            )
            if self.dp is not None:
                per_step = self.batch_size * self.dp * self.accumulate_grad_batches
                line += f"; global batch per optimizer step {per_step}"
                if self.accumulate_grad_batches > 1:
                    line += f" (x accumulate_grad_batches={self.accumulate_grad_batches})"
            lines.append(line)
        comm = [
            f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"
            for name, value in (
                ("recv_lookahead", self.recv_lookahead),
                ("bucket_cap_mb", self.bucket_cap_mb),
                ("watchdog_timeout", self.watchdog_timeout),
            )
            if value is not None
        ]
        if comm:
            lines.append("communication: " + " ".join(comm))
        if self.zero or self.fsdp:
            lines.append(f"data-parallel sharding: {self.sharding_text}")
        return lines

    def _state_bytes_per_param(self) -> float:
        """fp32 weights (4) + grads (4) + AdamW moments (8) one replica holds between steps,
        after the data-parallel sharding: ``zero`` cuts the moments, ``zero=2`` the gradients
        too, ``fsdp`` all three by ``dp``."""
        dp = self.dp or 1
        if self.fsdp:
            return 16 / dp
        return 4 + (4 / dp if self.zero == 2 else 4) + (8 / dp if self.zero else 8)

    def _state_note(self) -> str:
        if self.tp > 1:  # the counts are the whole layers; the per-tp-rank tables shard them
            return f" for the whole layers, before tp={self.tp} cuts them (per tp rank: below)"
        if not (self.zero or self.fsdp):
            return ""
        what = "fsdp" if self.fsdp else f"zero={self.zero}"
        return f" with {what} over dp={self.dp or '?'}"

    @property
    def sharding_text(self) -> str:
        """What is sharded over the data-parallel replicas, in words."""
        over = f"over dp={self.dp}" if self.dp is not None else "over the dp replicas"
        if self.fsdp:
            when = "every forward" if self.reshard_after_forward else "each chunk's last backward"
            return (
                f"fsdp (FSDP2 per chunk): parameters, gradients and optimizer state {over}; "
                f"gathered parameters freed after {when}"
            )
        if self.zero == 2:
            return f"zero=2: optimizer state, master weights and gradients {over}"
        if self.zero == 1:
            return f"zero=1: optimizer state and master weights {over}"
        return "none (every replica holds its stage's full state)"

"""Preflight: every check that can run before any process talks to another.

Pure functions (no process group, no model built): the strategy calls them from ``__init__``
(what is known then), from ``setup_environment`` (world size) and around ``configure_model`` (the
module); the config validator calls them on a YAML file before anything starts. A bad setting
thus fails on every rank alike, with an error that names the numbers and the fix, instead of a
rank blocking on a message that never comes.

Schedule rules live in :mod:`lightning_pp.schedules.generators` (one place); preflight calls the
generators and lets their errors through unchanged.

Example:
    >>> plan = preflight(world_size=8, pp=4, vpp=2, microbatches=8, num_layers=16, batch_size=8)
    >>> (plan.dp, plan.schedule.name, plan.split_text)
    (2, 'interleaved', 's0=2 s1=2 s2=2 s3=2 s4=2 s5=2 s6=2 s7=2')
    >>> check_world(world_size=6, pp=4)
    Traceback (most recent call last):
    ...
    lightning_pp.preflight.PreflightError: world size 6 is not divisible by pp=4 ...
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .partition import format_split, partition_layers
from .schedules import Schedule, build_schedule, check_positive, check_schedule_name, simulate

__all__ = [
    "PipelinePlan",
    "PipelineWarning",
    "PreflightError",
    "bubble_warning",
    "check_batch",
    "check_layers",
    "check_module",
    "check_schedule_args",
    "check_world",
    "preflight",
]


class PreflightError(ValueError):
    """A pipeline setting that cannot work; the message names the numbers and the fix."""


class PipelineWarning(UserWarning):
    """A setting that works but wastes most of the hardware (e.g. ``microbatches < pp``)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive(**values: Any) -> None:
    check_positive(PreflightError, **values)


def check_world(world_size: int, pp: int, dp: int | None = None) -> int:
    """Check ``world_size == pp * dp`` (``dp`` inferred when ``None``); return ``dp``.

    ``world_size`` is ``num_nodes * devices`` (every process of the job).
    """
    _positive(world_size=world_size, pp=pp)
    if dp is not None:
        _positive(dp=dp)
        if pp * dp != world_size:
            raise PreflightError(
                f"pp({pp}) * dp({dp}) = {pp * dp} != world size {world_size} "
                f"(num_nodes x devices): set dp={world_size // pp if world_size % pp == 0 else '?'}"
                f" or leave dp unset so it is inferred as world_size / pp"
            )
        return dp
    if pp > world_size:
        raise PreflightError(
            f"pp={pp} pipeline stages need at least {pp} processes but the world size is "
            f"{world_size} (num_nodes x devices); lower pp to a divisor of {world_size} "
            f"({_divisors(world_size)}) or start {pp} processes"
        )
    if world_size % pp:
        raise PreflightError(
            f"world size {world_size} is not divisible by pp={pp} (world_size % pp = "
            f"{world_size % pp}): dp = world_size / pp must be whole; use pp in "
            f"{_divisors(world_size)} or a world size that is a multiple of {pp}"
        )
    return world_size // pp


def bubble_warning(schedule: Schedule) -> str | None:
    """Text of the warning for ``microbatches < pp`` (accepted, as in Megatron), else ``None``.

    With fewer microbatches than stages the pipeline never fills: each rank idles
    ``(pp - 1) / m`` times its compute (``(pp - 1) / (vpp * m)`` interleaved), i.e. more than
    it works.
    """
    p, m, v = schedule.pp, schedule.microbatches, schedule.vpp
    if p < 2 or m >= p:
        return None
    simulated = simulate(schedule).bubble_ratio
    better = simulate(build_schedule(schedule.name, p, 2 * p, vpp=v)).bubble_ratio
    formula = f"(pp-1)/m = {p - 1}/{m}" if v == 1 else f"(pp-1)/(vpp*m) = {p - 1}/{v * m}"
    return (
        f"microbatches={m} < pp={p}: the pipeline never fills; each rank idles "
        f"{simulated:.2f}x its compute time per step (bubble {formula}). Accepted (Megatron "
        f"allows it too), but raise microbatches to at least {p} (microbatches={2 * p} gives "
        f"{better:.2f}x)."
    )


def check_schedule_args(
    schedule: str | None,
    pp: int,
    microbatches: int | None = None,
    vpp: int = 1,
    group_size: int | None = None,
    *,
    warn: bool = True,
) -> Schedule:
    """Build the schedule the strategy would run (its generator's rules, unchanged).

    ``schedule=None`` picks ``"1f1b"`` for ``vpp == 1`` and ``"interleaved"`` otherwise;
    ``microbatches=None`` means ``pp``. Emits a :class:`PipelineWarning` for ``microbatches <
    pp`` (see :func:`bubble_warning`).

    Raises:
        PreflightError: bad sizes or an unknown schedule name (with a did-you-mean).
        ValueError: the generator's own rules (e.g. interleaved group sizes), unchanged.
    """
    _positive(pp=pp, vpp=vpp)
    m = pp if microbatches is None else microbatches
    _positive(microbatches=m)
    name = schedule if schedule is not None else ("1f1b" if vpp == 1 else "interleaved")
    try:
        check_schedule_name(name)
    except ValueError as e:
        raise PreflightError(str(e)) from None
    if name == "1f1b" and vpp > 1:
        raise PreflightError(
            f"schedule '1f1b' cannot interleave: it runs one chunk per rank but vpp={vpp}; use "
            f"schedule='interleaved' (pp={pp}, vpp={vpp}) or 'gpipe', or set vpp=1"
        )
    built = build_schedule(name, pp=pp, microbatches=m, vpp=vpp, group_size=group_size)
    if warn:
        text = bubble_warning(built)
        if text:
            warnings.warn(text, PipelineWarning, stacklevel=2)
    return built


def check_layers(
    num_layers: int,
    pp: int,
    vpp: int = 1,
    partition: str | Sequence[int] = "uniform",
    *,
    layer_params: Sequence[int] | None = None,
    layer_costs: Sequence[float] | None = None,
) -> list[range]:
    """Cut ``num_layers`` into ``pp * vpp`` chunks; errors show the split that would result."""
    _positive(pp=pp, vpp=vpp)
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 0:
        raise PreflightError(f"num_layers must be a non-negative integer, got {num_layers!r}")
    if num_layers == 0:
        raise PreflightError(
            "the module has no pipeline layers (PipelineLayers with 0 layers); build "
            "self.layers = PipelineLayers([...]) with at least pp * vpp layers in configure_model()"
        )
    k = pp * vpp
    if isinstance(partition, str) and num_layers < k:
        base, rem = divmod(num_layers, k)
        empty = [base + (1 if s >= k - rem else 0) for s in range(k)]
        fits = [v for v in range(1, vpp + 1) if pp * v <= num_layers]
        hint = f"use vpp={fits[-1]} (pp*vpp={pp * fits[-1]})" if fits else f"use pp <= {num_layers}"
        raise PreflightError(
            f"cannot cut num_layers={num_layers} into pp({pp}) * vpp({vpp}) = {k} non-empty "
            f"chunks: the split would be {format_split(empty)} (empty stages); {hint}, or use a "
            f"model with at least {k} layers"
        )
    try:
        return partition_layers(
            num_layers, pp, vpp, partition, layer_params=layer_params, layer_costs=layer_costs
        )
    except ValueError as e:
        raise PreflightError(str(e)) from None


def check_batch(
    batch_size: int | None,
    microbatches: int,
    dp: int = 1,
    *,
    global_batch_size: int | None = None,
) -> None:
    """Every microbatch needs at least one sample, on every data-parallel replica.

    ``batch_size`` is what one process's DataLoader yields (per dp replica; every stage of a
    pipeline sees the same batch). ``global_batch_size`` (optional) must split evenly over dp.
    """
    _positive(microbatches=microbatches, dp=dp)
    if global_batch_size is not None:
        _positive(global_batch_size=global_batch_size)
        if global_batch_size % dp:
            raise PreflightError(
                f"global batch size {global_batch_size} does not split over dp={dp} replicas "
                f"(remainder {global_batch_size % dp}); use a multiple of {dp}"
            )
        per = global_batch_size // dp
        if batch_size is not None and batch_size != per:
            raise PreflightError(
                f"global batch size {global_batch_size} / dp({dp}) = {per} per replica, but the "
                f"per-replica batch_size is {batch_size}"
            )
        batch_size = per
    if batch_size is None:
        return
    _positive(batch_size=batch_size)
    if batch_size < microbatches:
        src = (
            f"global batch {global_batch_size} / dp({dp}) = {batch_size}"
            if global_batch_size is not None
            else f"batch size {batch_size}"
        )
        raise PreflightError(
            f"{src} per replica is smaller than microbatches={microbatches}: every microbatch "
            f"needs at least one sample; lower microbatches to <= {batch_size} or raise the "
            f"batch size to >= {microbatches}"
            + (f" (global batch >= {microbatches * dp})" if dp > 1 else "")
        )


_HOOKS = ("pipeline_layers", "pipeline_input", "pipeline_loss")


def check_module(module: Any, *, configured: bool = True) -> None:
    """The module can be cut: pipeline hooks implemented, layers built where the strategy expects.

    ``configured=False`` (before ``configure_model`` ran): the module must either define
    ``configure_model`` (the place to build its :class:`~lightning_pp.model.PipelineLayers`, so
    each rank materialises only its own layers) or already hold them.
    ``configured=True``: ``pipeline_layers()`` must return a non-empty ``PipelineLayers``.
    """
    from .model import PipelineLayers, PipelineMixin

    name = type(module).__name__
    missing = [h for h in _HOOKS if not callable(getattr(module, h, None))]
    if missing:
        raise PreflightError(
            f"{name} lacks {', '.join(h + '()' for h in missing)}: the pipeline cannot cut it. "
            f"Subclass lightning_pp.PipelineMixin, build self.layers = PipelineLayers([...]) in "
            f"configure_model(), and implement pipeline_input(batch) and "
            f"pipeline_loss(output, batch)"
        )
    for hook in ("pipeline_input", "pipeline_loss"):
        if getattr(type(module), hook, None) is getattr(PipelineMixin, hook):
            args = "batch" if hook == "pipeline_input" else "output, batch"
            raise PreflightError(f"{name} must implement {hook}({args}) for the pipeline")
    if not configured:
        layers = getattr(module, "layers", None)
        own_configure = "configure_model" in {
            k
            for klass in type(module).__mro__
            if klass.__module__.split(".")[0] != "lightning"
            for k in vars(klass)
        }
        custom_layers = type(module).pipeline_layers is not PipelineMixin.pipeline_layers
        if not own_configure and not isinstance(layers, PipelineLayers) and not custom_layers:
            raise PreflightError(
                f"{name} defines no configure_model() and holds no PipelineLayers: the strategy "
                f"builds each rank's layers inside configure_model(); add\n"
                f"    def configure_model(self):\n"
                f"        self.layers = PipelineLayers([lambda: Block() for _ in range(n)])"
            )
        return
    try:
        layers = module.pipeline_layers()
    except (TypeError, AttributeError) as e:
        raise PreflightError(f"{name} has no pipeline layers after configure_model(): {e}") from e
    if not isinstance(layers, PipelineLayers):
        raise PreflightError(
            f"{name}.pipeline_layers() returned {type(layers).__name__}, not PipelineLayers"
        )
    if layers.num_layers == 0:  # pragma: no cover - PipelineLayers rejects 0 builders itself
        raise PreflightError(f"{name} has a PipelineLayers with no layers")


@dataclass
class PipelinePlan:
    """Everything preflight resolved: sizes, the schedule, the layer split, warnings."""

    pp: int
    vpp: int
    microbatches: int
    schedule: Schedule
    world_size: int | None = None
    dp: int | None = None
    split: list[range] | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def split_text(self) -> str | None:
        return format_split([len(r) for r in self.split]) if self.split is not None else None


def preflight(
    *,
    pp: int,
    vpp: int = 1,
    microbatches: int | None = None,
    schedule: str | None = None,
    group_size: int | None = None,
    world_size: int | None = None,
    dp: int | None = None,
    num_layers: int | None = None,
    partition: str | Sequence[int] = "uniform",
    layer_params: Sequence[int] | None = None,
    layer_costs: Sequence[float] | None = None,
    batch_size: int | None = None,
    global_batch_size: int | None = None,
    module: Any = None,
    configured: bool = True,
    warn: bool = True,
) -> PipelinePlan:
    """Run every check whose inputs are given; return the resolved :class:`PipelinePlan`.

    Order: schedule name and shape, world size, layers, batch, module. The first failing check
    raises (a :class:`PreflightError`, or the schedule generator's ``ValueError``).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PipelineWarning)
        built = check_schedule_args(schedule, pp, microbatches, vpp, group_size, warn=True)
    texts = [str(w.message) for w in caught if issubclass(w.category, PipelineWarning)]
    if warn:
        for text in texts:
            warnings.warn(text, PipelineWarning, stacklevel=2)
    plan = PipelinePlan(pp, vpp, built.microbatches, built, warnings=texts)
    if world_size is not None:
        plan.world_size = world_size
        plan.dp = check_world(world_size, pp, dp)
    if module is not None:
        check_module(module, configured=configured)
    if num_layers is not None:
        plan.split = check_layers(
            num_layers,
            pp,
            vpp,
            partition,
            layer_params=layer_params,
            layer_costs=layer_costs,
        )
    if batch_size is not None or global_batch_size is not None:
        check_batch(
            batch_size, built.microbatches, plan.dp or 1, global_batch_size=global_batch_size
        )
    return plan

"""PipelinePlan: every default and every validity rule of a pipeline shape, in one place.

A plan is built from what is known (sizes, schedule, partition, then the world size, then the
model's layers, then each batch) and refuses anything that cannot run, with a
:class:`PreflightError` that names the numbers and the fix. The strategy, ``lightning-pp fit``,
``lightning-pp plan`` and ``lightning-pp schedule`` all build one; nothing else states a rule.
Every check is pure (no process group, no model weights), so a bad setting fails on every rank
alike, before any rank talks to another, instead of one rank blocking on a message that never
comes.

Schedule rules live in :mod:`lightning_pp.schedules.generators`; the plan calls the generators
and lets their messages through (as a :class:`PreflightError`). The defaults written here and
only here: ``schedule`` is ``"1f1b"`` when ``vpp == 1`` and ``"interleaved"`` otherwise;
``microbatches`` is ``pp``; ``pp=None`` means one pipeline over the whole world.

This module imports nothing heavier than the schedules at import time (``lightning-pp
schedule`` starts without torch); the partition and module checks import torch when used.

Example:
    >>> plan = PipelinePlan.build(world_size=8, pp=4, vpp=2, microbatches=8, num_layers=16)
    >>> (plan.dp, plan.schedule.name, plan.split_text)
    (2, 'interleaved', 's0=2 s1=2 s2=2 s3=2 s4=2 s5=2 s6=2 s7=2')
    >>> plan.stage_layers(0)
    [range(0, 2), range(8, 10)]
    >>> PipelinePlan.build(pp=4, world_size=6)
    Traceback (most recent call last):
    ...
    lightning_pp.plan.PreflightError: world size 6 is not divisible by pp=4 ...
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .schedules import Schedule, build_schedule, check_positive, check_schedule_name, simulate

__all__ = [
    "PARTITION_METHODS",
    "STRATEGY_STEPS",
    "PipelinePlan",
    "PipelineWarning",
    "PreflightError",
    "bubble_warning",
    "check_batch",
    "check_built_module",
    "check_layers",
    "check_module",
    "check_no_scaler",
    "check_pipeline_hooks",
    "check_schedule_args",
    "check_settings",
    "check_world",
    "default_schedule",
    "format_count",
    "ignored_step_overrides",
    "ignored_steps_message",
]

#: the partition methods by name (an explicit per-stage list of layer counts is the other form)
PARTITION_METHODS: tuple[str, ...] = ("uniform", "parameters", "cost")


class PreflightError(ValueError):
    """A pipeline setting that cannot work; the message names the numbers and the fix.

    ``key`` names the :meth:`PipelinePlan.build` argument at fault (``"microbatches"``,
    ``"world_size"``, ...) when one is, so that a front end can point at its own spelling of it
    (the CLI says ``strategy.microbatches`` and where that value came from).

    Example:
        >>> try:
        ...     PipelinePlan.build(pp=2, microbatches=0)
        ... except PreflightError as e:
        ...     (e.key, str(e))
        ('microbatches', 'microbatches must be a positive integer, got 0')
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class PipelineWarning(UserWarning):
    """A setting that works but wastes most of the hardware (e.g. ``microbatches < pp``)."""


def default_schedule(vpp: int) -> str:
    """The schedule used when none is named: ``"1f1b"``, or ``"interleaved"`` for ``vpp > 1``."""
    return "1f1b" if vpp == 1 else "interleaved"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive(**values: Any) -> None:
    # One check per value so that the error knows which argument it is about.
    for name, value in values.items():
        try:
            check_positive(PreflightError, **{name: value})
        except PreflightError as e:
            raise PreflightError(str(e), key=name) from None


def _positive_number(name: str, value: Any, unit: str, none_means: str | None = None) -> None:
    """A positive, finite real; ``None`` passes (not given), and the message offers it only
    where it means something to the user (``none_means``)."""
    if value is None:
        return
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )
    if not ok:
        alt = f" or None ({none_means})" if none_means is not None else ""
        raise PreflightError(
            f"{name} must be a positive number of {unit}{alt}, got {value!r}", key=name
        )


# ------------------------------------------------------------------------------------ the rules


def check_recompute(
    recompute: Any, activation_budget: Any, *, split: str | None = None
) -> tuple[Any, int | None]:
    """The recompute rules: a valid ``recompute`` (see :mod:`lightning_pp.recompute`), an
    ``activation_budget`` exactly when ``recompute="auto"``, and no ``"auto"`` with ``split``
    (the strategy's ``split=``, whose stages the planner cannot measure yet). Returns
    ``(recompute in normal form, budget in bytes or None)``; errors name the key.

    >>> check_recompute("auto", "1MiB")
    ('auto', 1048576)
    """
    from .recompute import parse_bytes, parse_recompute

    spec = parse_recompute(recompute, key="recompute")
    budget = None if activation_budget is None else parse_bytes(activation_budget)
    if spec == "auto" and budget is None:
        raise ValueError(
            "recompute='auto' needs activation_budget: the bytes of saved activations each rank "
            "may hold (e.g. activation_budget='6GiB')"
        )
    if spec != "auto" and budget is not None:
        raise ValueError(
            f"activation_budget={activation_budget!r} is only used with recompute='auto' "
            f"(recompute is {recompute!r})"
        )
    if spec == "auto" and split:
        raise ValueError(
            "recompute='auto' is not supported with split= yet: use recompute='full' or a "
            "list of layer indices"
        )
    return spec, budget


def check_settings(
    *,
    vpp: int = 1,
    microbatches: int | None = None,
    partition: str | Sequence[int] = "uniform",
    group_size: int | None = None,
    recv_lookahead: int | None = None,
    bucket_cap_mb: float | None = None,
    watchdog_timeout: float | None = None,
    accumulate_grad_batches: int = 1,
) -> None:
    """The rules that need no pipeline size: positive counts, a known partition, sane limits.

    :meth:`PipelinePlan.build` runs them first; a front end that cannot know ``pp`` yet (``pp``
    left to the world size, the world decided at run time) runs them alone.
    """
    sizes = {
        "vpp": vpp,
        "microbatches": microbatches,
        "group_size": group_size,
        "recv_lookahead": recv_lookahead,
        "accumulate_grad_batches": accumulate_grad_batches,
    }
    _positive(**{k: v for k, v in sizes.items() if v is not None})
    _positive_number("bucket_cap_mb", bucket_cap_mb, "megabytes")
    _positive_number("watchdog_timeout", watchdog_timeout, "seconds", none_means="disabled")
    if isinstance(partition, str):
        if partition not in PARTITION_METHODS:
            close = difflib.get_close_matches(partition, PARTITION_METHODS, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise PreflightError(
                f"unknown partition {partition!r}; use one of {list(PARTITION_METHODS)} or a "
                f"list of per-stage layer counts (one per virtual stage, pp * vpp of them).{hint}",
                key="partition",
            )
    elif not all(isinstance(c, int) and not isinstance(c, bool) for c in partition):
        raise PreflightError(
            f"an explicit partition is a list of per-stage layer counts (integers), got "
            f"{list(partition)!r}",
            key="partition",
        )


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
                f" or leave dp unset so it is inferred as world_size / pp",
                key="dp",
            )
        return dp
    if pp > world_size:
        raise PreflightError(
            f"pp={pp} pipeline stages need at least {pp} processes but the world size is "
            f"{world_size} (num_nodes x devices); lower pp to a divisor of {world_size} "
            f"({_divisors(world_size)}) or start {pp} processes",
            key="pp",
        )
    if world_size % pp:
        raise PreflightError(
            f"world size {world_size} is not divisible by pp={pp} (world_size % pp = "
            f"{world_size % pp}): dp = world_size / pp must be whole; use pp in "
            f"{_divisors(world_size)} or a world size that is a multiple of {pp}",
            key="pp",
        )
    return world_size // pp


def bubble_warning(schedule: Schedule) -> str | None:
    """Text of the warning for ``microbatches < pp`` (accepted, as in Megatron), else ``None``.

    With fewer microbatches than stages the pipeline never fills: each rank idles
    ``(pp - 1) / m`` times its compute (``(pp - 1) / (vpp * m)`` interleaved), i.e. more than
    it works.
    """
    p, m, v = schedule.pp, schedule.microbatches, schedule.vpp
    if schedule.name == "zbv" and p >= 2 and p <= m < 2 * p:
        simulated = simulate(schedule).bubble_ratio
        better = simulate(build_schedule("zbv", p, 2 * p)).bubble_ratio
        return (
            f"schedule 'zbv' with microbatches={m} < 2*pp={2 * p}: ZB-V's bubble is near zero "
            f"only from microbatches >= 2*pp; simulated bubble {simulated:.3f} of ideal compute "
            f"(t_f = t_i = t_w), {better:.3f} with microbatches={2 * p}. Accepted; raise "
            f"microbatches to {2 * p} or more."
        )
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

    ``schedule=None`` picks :func:`default_schedule`; ``microbatches=None`` means ``pp``. Emits
    a :class:`PipelineWarning` for ``microbatches < pp`` (see :func:`bubble_warning`).

    Raises:
        PreflightError: bad sizes, an unknown schedule name (with a did-you-mean), or the
            generator's own rules (e.g. interleaved group sizes) in the generator's words.
    """
    _positive(pp=pp, vpp=vpp)
    m = pp if microbatches is None else microbatches
    _positive(microbatches=m)
    name = schedule if schedule is not None else default_schedule(vpp)
    try:
        check_schedule_name(name)
    except ValueError as e:
        raise PreflightError(str(e), key="schedule") from None
    if name == "1f1b" and vpp > 1:
        raise PreflightError(
            f"schedule '1f1b' cannot interleave: it runs one chunk per rank but vpp={vpp}; use "
            f"schedule='interleaved' (pp={pp}, vpp={vpp}) or 'gpipe', or set vpp=1",
            key="schedule",
        )
    try:
        built = build_schedule(name, pp=pp, microbatches=m, vpp=vpp, group_size=group_size)
    except PreflightError:
        raise
    except ValueError as e:
        raise PreflightError(str(e), key="schedule") from None
    if warn:
        text = bubble_warning(built)
        if text:
            warnings.warn(text, PipelineWarning, stacklevel=2)
    return built


def _format_split(counts: Sequence[int | float]) -> str:
    from .partition import format_split

    return format_split(counts)


def check_layers(
    num_layers: int,
    pp: int,
    vpp: int = 1,
    partition: str | Sequence[int] = "uniform",
    *,
    layer_params: Sequence[int] | None = None,
    layer_costs: Sequence[float] | None = None,
) -> list[range]:
    """Cut ``num_layers`` into ``pp * vpp`` chunks (one range per virtual stage, in stage order);
    errors show the split that would result."""
    from .partition import partition_layers

    _positive(pp=pp, vpp=vpp)
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 0:
        raise PreflightError(
            f"num_layers must be a non-negative integer, got {num_layers!r}", key="num_layers"
        )
    if num_layers == 0:
        raise PreflightError(
            "the module has no pipeline layers (PipelineLayers with 0 layers); build self.layers "
            "= PipelineLayers([...]) with at least pp * vpp layers in configure_model()",
            key="num_layers",
        )
    k = pp * vpp
    if isinstance(partition, str) and num_layers < k:
        base, rem = divmod(num_layers, k)
        empty = [base + (1 if s >= k - rem else 0) for s in range(k)]
        fits = [v for v in range(1, vpp + 1) if pp * v <= num_layers]
        hint = f"use vpp={fits[-1]} (pp*vpp={pp * fits[-1]})" if fits else f"use pp <= {num_layers}"
        raise PreflightError(
            f"cannot cut num_layers={num_layers} into pp({pp}) * vpp({vpp}) = {k} non-empty "
            f"chunks: the split would be {_format_split(empty)} (empty stages); {hint}, or use a "
            f"model with at least {k} layers",
            key="num_layers",
        )
    try:
        return partition_layers(
            num_layers, pp, vpp, partition, layer_params=layer_params, layer_costs=layer_costs
        )
    except ValueError as e:
        raise PreflightError(str(e), key="partition") from None


def check_batch(
    batch_size: int | None,
    microbatches: int,
    dp: int = 1,
    *,
    global_batch_size: int | None = None,
) -> None:
    """Every microbatch needs at least one sample, on every data-parallel replica.

    ``batch_size`` is what one process's DataLoader yields (per dp replica; every stage of a
    pipeline sees the same batch). It need not be a multiple of ``microbatches``: the engine
    splits unevenly and weights each microbatch's loss by its size. ``global_batch_size``
    (optional) must split evenly over dp.
    """
    _positive(microbatches=microbatches, dp=dp)
    if global_batch_size is not None:
        _positive(global_batch_size=global_batch_size)
        if global_batch_size % dp:
            raise PreflightError(
                f"global batch size {global_batch_size} does not split over dp={dp} replicas "
                f"(remainder {global_batch_size % dp}); use a multiple of {dp}",
                key="global_batch_size",
            )
        per = global_batch_size // dp
        if batch_size is not None and batch_size != per:
            raise PreflightError(
                f"global batch size {global_batch_size} / dp({dp}) = {per} per replica, but the "
                f"per-replica batch_size is {batch_size}",
                key="batch_size",
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
            + (f" (global batch >= {microbatches * dp})" if dp > 1 else ""),
            key="global_batch_size" if global_batch_size is not None else "batch_size",
        )


_HOOKS = ("pipeline_layers", "pipeline_input", "pipeline_loss")


def check_module(module: Any, *, configured: bool = True) -> None:
    """The module can be cut: pipeline hooks implemented, layers built where the strategy expects.

    ``configured=False`` (before ``configure_model`` ran): the module must either define
    ``configure_model`` (the place to build its :class:`~lightning_pp.model.PipelineLayers`, so
    each rank materialises only its own layers) or already hold them.
    ``configured=True``: ``pipeline_layers()`` must return a non-empty ``PipelineLayers``.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden

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
        if not is_overridden(hook, module, parent=PipelineMixin):
            args = "batch" if hook == "pipeline_input" else "output, batch"
            raise PreflightError(f"{name} must implement {hook}({args}) for the pipeline")
    if not configured:
        layers = getattr(module, "layers", None)
        own_configure = is_overridden("configure_model", module, parent=pl.LightningModule)
        custom_layers = is_overridden("pipeline_layers", module, parent=PipelineMixin)
        if not own_configure and not isinstance(layers, PipelineLayers) and not custom_layers:
            raise PreflightError(
                f"{name} defines no configure_model() and holds no PipelineLayers: the strategy "
                f"builds each rank's layers inside configure_model(); add\n"
                f"    def configure_model(self):\n"
                f"        if getattr(self, 'layers', None) is not None:\n"
                f"            return  # built already: Lightning calls this in every fit/validate\n"
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


def check_pipeline_hooks(module: Any) -> None:
    """At the strategy's setup: the module has the hooks the explicit-layers path calls."""
    for hook in _HOOKS:
        if not callable(getattr(module, hook, None)):
            raise TypeError(
                f"{type(module).__name__} lacks {hook}(); subclass "
                f"lightning_pp.PipelineMixin, or pass PipelineStrategy(split=...)"
            )


def check_built_module(module: Any, layers: Any, precision_plugin: Any) -> None:
    """After ``configure_model``: every parameter lies in a layer (the pipeline trains only
    those), and no gradient scaler is in use."""
    inside = {id(p) for p in layers.parameters()}
    outside = [n for n, p in module.named_parameters() if id(p) not in inside]
    if outside:
        raise ValueError(
            f"parameters outside the PipelineLayers would never be trained by the pipeline: "
            f"{outside[:5]}{' ...' if len(outside) > 5 else ''}; move them into a layer"
        )
    check_no_scaler(precision_plugin)


def check_no_scaler(precision_plugin: Any) -> None:
    """A gradient scaler (``precision='16-mixed'``) would need its inf checks and loss scale
    agreed across stages; the strategy does not do that, so it refuses one."""
    if getattr(precision_plugin, "scaler", None) is not None:
        raise ValueError(
            "PipelineStrategy does not support a gradient scaler (precision='16-mixed'); "
            "use precision='bf16-mixed' or '32-true'"
        )


#: LightningModule steps the strategy never calls (it runs the pipeline itself), and what it calls
#: instead. A module's own override of one of them is silently skipped under the strategy.
STRATEGY_STEPS = {
    "training_step": "pipeline_loss(output, batch) for the loss (and pipeline_log_train_loss(loss)"
    " to log it)",
    "validation_step": "pipeline_eval_step(output, batch, split) for metrics (what it returns or"
    " self.log()s reaches every rank)",
    "test_step": "pipeline_eval_step(output, batch, split) (split='test')",
    "predict_step": "nothing: trainer.predict returns the last layer's output per batch; "
    "post-process the returned predictions",
}


def ignored_step_overrides(module: Any) -> list[str]:
    """The step methods in :data:`STRATEGY_STEPS` that ``module`` defines itself.

    :class:`~lightning_pp.model.PipelineMixin` supplies these steps for the plain path; only a
    module's own override (of the mixin's, or of Lightning's when the module does not use the
    mixin) is reported. A torchmetrics ``Metric`` updated in such a ``validation_step`` would stay
    at its initial value under the strategy, without any error.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from .model import PipelineMixin

    parent = PipelineMixin if isinstance(module, PipelineMixin) else pl.LightningModule
    return [step for step in STRATEGY_STEPS if is_overridden(step, module, parent=parent)]


def ignored_steps_message(module: Any, steps: Sequence[str]) -> str:
    """The warning for :func:`ignored_step_overrides`: each step and the hook to use instead."""
    lines = [f"  {step}: use {STRATEGY_STEPS[step]}" for step in steps]
    return (
        f"{type(module).__name__} overrides {', '.join(steps)}, which PipelineStrategy does not "
        f"call (it runs the pipeline and calls the pipeline_* hooks instead); code there, e.g. a "
        f"torchmetrics Metric update, never runs under the strategy:\n" + "\n".join(lines)
    )


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
    _layer_params: tuple[int, ...] | None = dataclasses.field(default=None, repr=False)
    _layer_costs: tuple[float, ...] | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        *,
        pp: int | None = None,
        vpp: int = 1,
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
        )
        if pp is None:
            if world_size is None:
                raise PreflightError(
                    "pp=None means one pipeline over the whole world, but the world size is not "
                    "known yet: give world_size, or set pp",
                    key="pp",
                )
            _positive(world_size=world_size)
            pp = world_size
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PipelineWarning)
            built = check_schedule_args(schedule, pp, microbatches, vpp, group_size, warn=True)
        texts = tuple(str(w.message) for w in caught if issubclass(w.category, PipelineWarning))
        if warn:
            for text in texts:
                warnings.warn(text, PipelineWarning, stacklevel=2)
        plan = cls(
            pp=pp,
            # the schedule's own chunk count: zbv runs 2 chunks per rank when vpp is unset (1)
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
        )
        if world_size is not None:
            plan = plan.with_world(world_size, dp=dp)
        elif dp is not None:
            _positive(dp=dp)
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
        dp = check_world(world_size, self.pp, self.dp if dp is None else dp)
        return dataclasses.replace(self, world_size=world_size, dp=dp)

    def on_trainer_world(
        self, world_size: int, *, pp: int | None, num_nodes: int, devices: int
    ) -> PipelinePlan:
        """:meth:`with_world` for the strategy: the error names the strategy's ``pp`` and the
        Trainer's ``num_nodes x devices`` that made the world."""
        try:
            return self.with_world(world_size)
        except PreflightError as e:
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

    def check_batch_of(self, batch: Any, rank: int) -> None:
        """:meth:`check_batch` for a batch as the DataLoader yields it, on global rank ``rank``.

        Every rank of a pipeline sees the same batch, so a batch too small for the microbatches
        (a short last batch too) raises the same error on all of them, before any communication,
        instead of one rank failing and the rest waiting. A batch without a batch dimension
        passes: the engine reports it with the action."""
        from .microbatch import batch_size_of  # torch, imported on use

        try:
            size = batch_size_of(batch)
        except ValueError:
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
            f"pipeline: pp={self.pp} x dp={dp} ({world}), vpp={self.vpp}: "
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
                        f"weights + grads + AdamW states ~ {16 * total / 2**30:.2f} GiB "
                        f"(activations not included)"
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
        return lines

"""Every validity rule of a pipeline shape, each with a message that names the numbers and the fix.

A rule is pure: no process group, no model weights, so a bad setting fails on every rank alike,
before any rank talks to another. :class:`~lightning_pp.layout.plan.PipelinePlan` applies them
in order (settings -> schedule -> world -> layers -> batch); a front end that knows only part of
the shape (``pp`` left to the world size) calls the rules it can.

Schedule rules live in :mod:`lightning_pp.schedules.generators`; :func:`check_schedule_args`
calls the generators and lets their messages through as a :class:`PreflightError`. The defaults
written here and only here: ``schedule`` is ``"1f1b"`` when ``vpp == 1`` and ``"interleaved"``
otherwise; ``microbatches`` is ``pp``; ``vpp`` unset (``None``) is the schedule's own chunk count
(2 for ``zbv``, else 1), and a ``vpp`` given explicitly is never replaced: one the schedule cannot
run is refused (:func:`check_schedule_vpp`).

Example:
    >>> check_world(8, pp=4)
    2
    >>> check_world(6, pp=4)
    Traceback (most recent call last):
    ...
    lightning_pp.layout.rules.PreflightError: world size 6 is not divisible by pp=4 ...
"""

from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..schedules import Schedule, build_schedule, check_positive, check_schedule_name, simulate

#: the partition methods by name (an explicit per-stage list of layer counts is the other form)
PARTITION_METHODS: tuple[str, ...] = ("uniform", "parameters", "cost")


class PreflightError(ValueError):
    """A pipeline setting that cannot work; the message names the numbers and the fix.

    ``key`` names the :meth:`~lightning_pp.layout.plan.PipelinePlan.build` argument at fault
    (``"microbatches"``,
    ``"world_size"``, ...) when one is, so that a front end can point at its own spelling of it
    (the CLI says ``strategy.microbatches`` and where that value came from).

    Example:
        >>> try:
        ...     check_settings(microbatches=0)
        ... except PreflightError as e:
        ...     (e.key, str(e))
        ('microbatches', 'microbatches must be a positive integer, got 0')
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class PipelineWarning(UserWarning):
    """A setting that works but wastes most of the hardware (e.g. ``microbatches < pp``)."""


def default_schedule(vpp: int | None) -> str:
    """The schedule used when none is named: ``"1f1b"`` (``vpp`` unset or 1), or
    ``"interleaved"`` for ``vpp > 1``."""
    return "1f1b" if vpp is None or vpp == 1 else "interleaved"


def check_schedule_vpp(schedule: str, vpp: int | None, pp: int | None = None) -> None:
    """Refuse a ``vpp`` given explicitly that ``schedule`` cannot run; ``None`` (unset) passes.
    ``pp`` (when known) sharpens the suggested fix.

    Why a rule of its own: ``zbv`` runs exactly 2 chunks per rank, and until ``vpp`` defaulted
    to ``None`` an explicit ``vpp=1`` could not be told from the default, so it was silently
    replaced by 2. The message names the value given and the values that would work.

    >>> try:
    ...     check_schedule_vpp("zbv", 1)
    ... except PreflightError as e:
    ...     (e.key, str(e)[:79])
    ('vpp', "schedule 'zbv' runs exactly 2 chunks per rank (V placement) but vpp=1 was given")
    """
    if vpp is None:
        return
    if schedule == "zbv" and vpp != 2:
        other = "'zb-h1' (its one-chunk zero-bubble sibling)" if vpp == 1 else "'interleaved'"
        raise PreflightError(
            f"schedule 'zbv' runs exactly 2 chunks per rank (V placement) but vpp={vpp} was "
            f"given: zbv cannot run {vpp} chunk{'s' if vpp != 1 else ''} per rank. Set vpp=2 or "
            f"leave vpp unset (zbv's own 2), or use schedule={other} for vpp={vpp}",
            key="vpp",
        )
    if schedule in ("1f1b", "zb-h1") and vpp != 1:
        shape = f" (pp={pp}, vpp={vpp})" if pp is not None else ""
        other = "'zbv' (vpp=2)" if schedule == "zb-h1" else f"'interleaved'{shape} or 'gpipe'"
        raise PreflightError(
            f"schedule {schedule!r} cannot interleave: it runs one chunk per rank but "
            f"vpp={vpp} was given; use schedule={other}, or set vpp=1 or leave it unset",
            key="schedule" if schedule == "1f1b" else "vpp",
        )


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


def check_settings(
    *,
    vpp: int | None = None,
    microbatches: int | None = None,
    partition: str | Sequence[int] = "uniform",
    group_size: int | None = None,
    recv_lookahead: int | None = None,
    bucket_cap_mb: float | None = None,
    watchdog_timeout: float | None = None,
    accumulate_grad_batches: int = 1,
    zero: int = 0,
    fsdp: bool = False,
    reshard_after_forward: bool = False,
    tp: int = 1,
) -> None:
    """The rules that need no pipeline size: positive counts, a known partition, sane limits,
    and a data-parallel sharding that exists (:func:`check_sharding`, :func:`check_reshard`
    without the schedule).

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
    check_sharding(zero, fsdp)
    check_reshard(reshard_after_forward, fsdp)
    _positive(tp=tp)  # every data-parallel sharding composes with it (zero, fsdp)
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


def check_tp_sizes(tp: int, **sizes: int | None) -> None:
    """Every size that tensor parallelism cuts divides by ``tp``: the attention heads
    (``heads``) and KV heads (``kv_heads``: each tp rank computes whole heads), the hidden and
    FFN widths (``hidden``, ``ffn``: equal column/row shards) and the vocabulary (``vocab``:
    the vocabulary-parallel embedding and head). ``None`` sizes are not checked. The error
    names every size that does not divide and, for the vocabulary, the padded size.

    Example:
        >>> check_tp_sizes(4, heads=64, kv_heads=8, hidden=8192, ffn=28672, vocab=32000)
        >>> try:
        ...     check_tp_sizes(8, heads=12, hidden=768, vocab=50257)
        ... except PreflightError as e:
        ...     print(e.key, str(e).split(":")[0])
        tp tp=8 does not divide the model's heads=12, vocab=50257
    """
    _positive(tp=tp)
    if tp == 1:
        return
    bad = {k: v for k, v in sizes.items() if isinstance(v, int) and v % tp}
    if not bad:
        return
    named = ", ".join(f"{k}={v}" for k, v in bad.items())
    fixes = []
    if set(bad) - {"vocab"}:
        shared = [v for k, v in sizes.items() if isinstance(v, int) and k != "vocab"]
        ok = [t for t in (1, 2, 4, 8, 16) if all(v % t == 0 for v in shared)]
        fixes.append(f"use a tp that divides them ({ok})")
    if "vocab" in bad:
        padded = -(-bad["vocab"] // tp) * tp
        fixes.append(
            f"pad the vocabulary to a multiple of {tp} (vocab {bad['vocab']} -> {padded}: "
            f"the extra rows are never a target)"
        )
    raise PreflightError(
        f"tp={tp} does not divide the model's {named}: tensor parallelism gives every tp "
        f"rank whole heads and an equal share of the hidden, FFN and vocabulary sizes; "
        + " or ".join(fixes),
        key="tp",
    )


def check_sharding(zero: Any, fsdp: Any, dp: int | None = None) -> None:
    """``zero`` is 0, 1 or 2 and ``fsdp`` a bool, not both at once; with ``dp`` known, there is
    more than one replica to shard over.

    ``zero=1`` shards the optimizer state (and fp32 master weights) over the data-parallel
    replicas, ``zero=2`` the gradients too; ``fsdp=True`` shards the parameters as well
    (ZeRO-3, by FSDP2), so it includes what ``zero`` would do.
    """
    if isinstance(zero, bool) or zero not in (0, 1, 2):
        hint = " (ZeRO-3, sharded parameters, is fsdp=True)" if zero == 3 else ""
        raise PreflightError(
            f"zero must be 0 (no sharding), 1 (optimizer state) or 2 (optimizer state and "
            f"gradients), got {zero!r}{hint}",
            key="zero",
        )
    if not isinstance(fsdp, bool):
        raise PreflightError(f"fsdp must be True or False, got {fsdp!r}", key="fsdp")
    if fsdp and zero:
        raise PreflightError(
            f"fsdp=True with zero={zero}: FSDP2 already shards parameters, gradients and "
            f"optimizer state (ZeRO-3); use fsdp=True with zero=0, or zero={zero} alone",
            key="zero",
        )
    if dp is not None and dp == 1 and (zero or fsdp):
        what = "fsdp=True" if fsdp else f"zero={zero}"
        raise PreflightError(
            f"{what} shards over the data-parallel replicas, but dp=1 (every process is a "
            f"pipeline stage): there is nothing to shard over; drop {what} or start more "
            f"processes (world size = pp x dp with dp >= 2)",
            key="fsdp" if fsdp else "zero",
        )


def check_reshard(reshard_after_forward: Any, fsdp: bool, schedule: Schedule | None = None) -> None:
    """``reshard_after_forward`` is a bool, set only with ``fsdp=True`` (it is FSDP2's), and not
    under a split backward: a later microbatch's forward would free the parameters an earlier
    one's ``W`` still reads (FSDP2 gathers them again only in ``I``)."""
    if not isinstance(reshard_after_forward, bool):
        raise PreflightError(
            f"reshard_after_forward must be True or False, got {reshard_after_forward!r}",
            key="reshard_after_forward",
        )
    if reshard_after_forward and not fsdp:
        raise PreflightError(
            "reshard_after_forward=True is an FSDP2 setting, but fsdp=False: set fsdp=True "
            "to shard the parameters, or drop reshard_after_forward",
            key="reshard_after_forward",
        )
    if reshard_after_forward and schedule is not None and schedule.split_backward:
        raise PreflightError(
            f"reshard_after_forward=True with schedule {schedule.name!r} (pp={schedule.pp}, "
            f"microbatches={schedule.microbatches}): its split backward runs a microbatch's W "
            f"after later forwards freed the gathered parameters; use "
            f"reshard_after_forward=False, or a schedule without W (gpipe, 1f1b, interleaved)",
            key="reshard_after_forward",
        )


def split_cost_partition_message(
    split: str, pp: int, vpp: int, num_blocks: int | None = None
) -> str:
    """Why ``partition="cost"`` cannot cut a ``split=`` model, and what to use instead (for
    whichever check finds it first: it needs no model, the block count only sharpens the fix).

    ``"cost"`` balances measured per-layer costs, which a model written for the pipeline gives
    through ``PipelineMixin.pipeline_layer_costs()``; an unmodified model has no such hook and
    the strategy does not measure its blocks, so the partition's own request (``layer_costs``)
    would name an argument the user cannot pass.
    """
    k = pp * vpp
    blocks = "the blocks'" if num_blocks is None else f"the {num_blocks} blocks'"
    if num_blocks is not None and num_blocks >= k:
        base, rem = divmod(num_blocks, k)
        example = f"such as {[base + (1 if s >= k - rem else 0) for s in range(k)]}"
    else:
        example = "(one per stage)"
    return (
        f"partition='cost' with split={split!r}: the cost partition balances measured costs per "
        f"layer (PipelineMixin.pipeline_layer_costs()), which an unmodified model split by "
        f"name does not provide. Fix: partition='parameters' (balances {blocks} parameter "
        f"counts over pp({pp}) * vpp({vpp}) = {k} stages), partition='uniform', or {k} explicit "
        f"block counts {example}"
    )


def check_split_settings(
    split: str | None,
    split_placement: Any = None,
    partition: str | Sequence[int] = "uniform",
    pp: int | None = None,
    vpp: int | None = None,
) -> None:
    """The ``split=`` settings that need no model: ``split_placement`` only with ``split``, a
    ``{module name: "first" | "last"}`` mapping, and no ``partition="cost"`` (its per-layer
    costs come from a ``PipelineLayers`` model's ``pipeline_layer_costs()``, which a split
    model does not have). The model-dependent rules (the container, the names) are
    :func:`lightning_pp.strategy.preflight.check_module`'s.

    >>> try:
    ...     check_split_settings(None, {"lm_head": "last"})
    ... except PreflightError as e:
    ...     e.key
    'split_placement'
    """
    if split is None or split == "":
        if split_placement:
            raise PreflightError(
                f"split_placement={split_placement!r} is only used with split= (it places "
                f"modules beside the split blocks); set split to the dotted name of the "
                f"ModuleList of blocks (e.g. split='model.transformer.h'), or remove "
                f"split_placement",
                key="split_placement",
            )
        return
    if split_placement is not None:
        if not isinstance(split_placement, Mapping):
            raise PreflightError(
                f"split_placement must map module names to 'first' or 'last' (e.g. "
                f"{{'lm_head': 'last'}}), got {type(split_placement).__name__} "
                f"{split_placement!r}",
                key="split_placement",
            )
        bad = {k: v for k, v in split_placement.items() if v not in ("first", "last")}
        if bad:
            raise PreflightError(
                f"split_placement values must be 'first' or 'last' (the stage the module runs "
                f"on), got {bad!r}",
                key="split_placement",
            )
    if partition == "cost":
        raise PreflightError(
            split_cost_partition_message(split, pp or 1, vpp or 1)
            if pp is not None
            else "partition='cost' needs per-layer costs from a PipelineLayers model "
            "(pipeline_layer_costs()), which a split= model does not have; use "
            "partition='uniform' (equal block counts), 'parameters' (balance parameter counts) "
            "or a list of per-stage block counts",
            key="partition",
        )


def check_world(world_size: int, pp: int, dp: int | None = None, tp: int = 1) -> int:
    """Check ``world_size == pp * dp * tp`` (``dp`` inferred when ``None``); return ``dp``.

    ``world_size`` is ``num_nodes * devices`` (every process of the job).
    """
    _positive(world_size=world_size, pp=pp, tp=tp)
    if tp > 1:
        if dp is not None:
            _positive(dp=dp)
        if world_size % (pp * tp) or (dp is not None and pp * dp * tp != world_size):
            given = f" * dp({dp})" if dp is not None else ""
            fits = [d for d in _divisors(world_size) if world_size % (d * tp) == 0]
            raise PreflightError(
                f"pp({pp}){given} * tp({tp}) does not divide the world size {world_size} "
                f"(num_nodes x devices): the world is pp x dp x tp; with tp={tp}, pp must be "
                f"one of {fits} (world % (pp * tp) = {world_size % (pp * tp)})",
                key="tp",
            )
        return world_size // (pp * tp)
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
    simulated = _bubble(schedule.name, p, m, v)
    better = _bubble(schedule.name, p, 2 * p, v)
    # One unit throughout (idle time as a multiple of compute time), and a closed form only
    # where it is this schedule's exact bubble: (pp-1)/(vpp*m) is interleaved 1F1B's, not
    # ZB-V's or ZB-H1's (at pp=2, m=1 ZB-V idles 0.67x, not 1/2), so those show the simulator's.
    formula = _closed_form(schedule.name, p, m, v)
    how = f"= {formula}" if formula else f"simulated for schedule '{schedule.name}'"
    return (
        f"microbatches={m} < pp={p}: the pipeline never fills; each rank idles "
        f"{simulated:.2f}x its compute time per step (bubble {how}). Accepted (Megatron "
        f"allows it too), but raise microbatches to at least {p} (microbatches={2 * p} gives "
        f"{better:.2f}x)."
    )


def _closed_form(name: str, p: int, m: int, v: int) -> str | None:
    """The textbook bubble of ``name`` as text where it is exact (the cases :func:`_bubble`
    computes without the simulator), else ``None``."""
    if name in ("gpipe", "1f1b") and v == 1:
        return f"(pp-1)/m = {p - 1}/{m}"
    if name == "interleaved" and m % p == 0:
        return f"(pp-1)/(vpp*m) = {p - 1}/{v * m}"
    return None


def _bubble(name: str, p: int, m: int, v: int) -> float:
    """The simulated bubble ratio at the default costs: the closed form where it is exact
    ((p-1)/m for gpipe and 1f1b, (p-1)/(v m) for interleaved with m a multiple of p, both
    checked against the simulator in tests/test_simulator.py), else the simulator's. At pp=64 a
    simulation of m=2p microbatches costs a second; the closed form nothing."""
    if name in ("gpipe", "1f1b") and v == 1:
        return (p - 1) / m
    if name == "interleaved" and m % p == 0:
        return (p - 1) / (v * m)
    return simulate(build_schedule(name, p, m, vpp=v)).bubble_ratio


def check_schedule_args(
    schedule: str | None,
    pp: int,
    microbatches: int | None = None,
    vpp: int | None = None,
    group_size: int | None = None,
    *,
    warn: bool = True,
    build: Callable[..., Schedule] = build_schedule,
) -> Schedule:
    """Build the schedule the strategy would run (its generator's rules, unchanged).

    ``schedule=None`` picks :func:`default_schedule`; ``microbatches=None`` means ``pp``;
    ``vpp=None`` the schedule's own chunk count (an explicit one it cannot run is refused by
    :func:`check_schedule_vpp`); ``build``: :func:`build_schedule`'s signature, for a caller
    that builds ``zb-auto`` its own way (the planner's search). Emits
    a :class:`PipelineWarning` for ``microbatches < pp`` (see :func:`bubble_warning`).

    Raises:
        PreflightError: bad sizes, an unknown schedule name (with a did-you-mean), or the
            generator's own rules (e.g. interleaved group sizes) in the generator's words.
    """
    _positive(pp=pp)
    if vpp is not None:
        _positive(vpp=vpp)
    m = pp if microbatches is None else microbatches
    _positive(microbatches=m)
    name = schedule if schedule is not None else default_schedule(vpp)
    try:
        check_schedule_name(name)
    except ValueError as e:
        raise PreflightError(str(e), key="schedule") from None
    check_schedule_vpp(name, vpp, pp)
    try:
        built = build(name, pp=pp, microbatches=m, vpp=vpp, group_size=group_size)
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

"""The module-dependent rules of a pipeline run, shared by ``lightning-pp plan``/``fit`` (on the
meta build, before any process starts) and the strategy (on each rank, at build time).

:func:`check_module` takes the LightningModule (real or built on the meta device) and the plan
of the run (world and settings already checked, see :class:`~lightning_pp.layout.plan.
PipelinePlan`) and applies every rule that needs the model: the layer or block count against
``pp * vpp`` and ``partition``, the ``split=`` container and ``split_placement`` names, and the
``recompute`` targets (layer indices below the layer count, a ``selective:`` pattern that
matches at least one module). Being one function is what makes ``plan`` and ``fit`` agree: the
CLI calls it where the strategy would, with the same arguments, so what the strategy would
refuse after spawn is refused before.

Example::

    plan = PipelinePlan.build(world_size=4, pp=2)
    plan = check_module(meta_module, plan, recompute=[99])   # PreflightError: key "recompute"
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterable, Sequence
from typing import Any

from torch import nn

from ..autosplit.split import SplitError, SplitLayout
from ..layout.plan import PipelinePlan
from ..layout.recompute_spec import Selective, parse_recompute
from ..layout.rules import PreflightError
from ..runtime.recompute import selective_matches
from .model import PipelineLayers, PipelineMixin

__all__ = [
    "check_module",
    "check_recompute_targets",
    "meta_view",
    "split_layout",
    "split_mixin_message",
]

# The most candidate names an error lists (a 1B model has thousands of submodules).
_MAX_CANDIDATES = 24


def split_layout(
    model: nn.Module,
    split: str,
    placement: dict[str, str] | None,
    plan: PipelinePlan,
    owner: str | None = None,
) -> tuple[SplitLayout, PipelinePlan]:
    """Cut ``model``'s ``split`` container as ``plan`` says: the block count against
    ``pp * vpp`` and the partition (the plan's rules), then the placement of the modules beside
    the blocks. Raises :class:`SplitError` (the container, the names) or
    :class:`~lightning_pp.layout.rules.PreflightError` (the counts). ``owner``: the
    LightningModule's class name for messages (``model`` may be a stand-in holding its
    children)."""
    try:
        blocks = model.get_submodule(split)
    except AttributeError as e:
        raise SplitError(
            f"split={split!r}: {owner or type(model).__name__} has no such module (the name is "
            f"relative to the LightningModule, e.g. 'model.transformer.h'; modules holding blocks: "
            f"{_containers(model)})"
        ) from e
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        hint = ""
        if type(blocks).__name__ == "PipelineLayers":
            hint = (
                " (a PipelineLayers model is cut by the strategy without split=: leave split unset)"
            )
        raise SplitError(
            f"split={split!r} is a {type(blocks).__name__}; it must name the ModuleList (or "
            f"Sequential) of repeated blocks{hint}; candidates: {_containers(model)}"
        )
    params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    plan = plan.with_layers(len(blocks), layer_params=params)
    assert plan.layer_ranges is not None
    layout = SplitLayout.discover(
        model, split, plan.num_stages, placement=placement, ranges=plan.layer_ranges
    )
    return layout, plan


def split_mixin_message(split: str, module: Any) -> str | None:
    """Why ``split=`` cannot run a ``PipelineMixin`` whose ``layers`` is not a
    ``PipelineLayers`` and which keeps the mixin's steps, else ``None``.

    ``split=`` runs the module's own ``training_step``; the mixin's runs
    ``self.pipeline_layers()``, which needs a ``PipelineLayers``. Left alone this ended in the
    mixin's ``TypeError`` telling the user to create ``PipelineLayers`` in ``configure_model()``,
    which is a fix for the other path (without ``split=``), not for this one.
    """
    if not isinstance(module, PipelineMixin):
        return None
    if isinstance(getattr(module, "layers", None), PipelineLayers):
        return None  # the explicit-layers model: not this message's case
    if type(module).training_step is not PipelineMixin.training_step:
        return None  # its own training_step runs under split=
    name = type(module).__name__
    kind = type(getattr(module, "layers", None)).__name__
    return (
        f"split={split!r}: {name} is a PipelineMixin whose layers is a {kind}, not "
        f"PipelineLayers, and it keeps the mixin's training_step, which runs "
        f"self.pipeline_layers() (a PipelineLayers); split= runs the module's own training_step. "
        f"Fix: either drop split= and build self.layers = PipelineLayers([...]) in "
        f"configure_model() (the PipelineMixin path), or keep split={split!r} and define "
        f"{name} as a plain LightningModule (without PipelineMixin) with its own training_step"
    )


def _containers(model: nn.Module) -> str:
    """The ModuleList/Sequential submodules of ``model``: what ``split=`` may name."""
    names = [
        n for n, m in model.named_modules() if n and isinstance(m, (nn.ModuleList, nn.Sequential))
    ]
    # the outermost ones first: nested containers are rarely the blocks
    names.sort(key=lambda n: (n.count("."), n))
    return _listing(names) if names else "none (the model has no ModuleList or Sequential)"


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MAX_CANDIDATES])
    more = len(names) - _MAX_CANDIDATES
    return shown + (f" and {more} more" if more > 0 else "")


def check_recompute_targets(
    recompute: Any, num_layers: int, units: Iterable[tuple[str, nn.Module]]
) -> None:
    """``recompute`` selects something: layer indices below ``num_layers``; a ``Selective``
    matches at least one module inside ``units`` (each pipeline layer, or each split block and
    placed module, with its name), by the same walk the engine uses
    (:func:`~lightning_pp.runtime.recompute.selective_matches`)."""
    spec = parse_recompute(recompute)
    if isinstance(spec, tuple):
        bad = [i for i in spec if i >= num_layers]
        if bad:
            raise PreflightError(
                f"recompute={list(spec)} names layer(s) {bad}, but the model has {num_layers} "
                f"pipeline layers (0..{num_layers - 1}); use indices below {num_layers}, or "
                f"'full'",
                key="recompute",
            )
    elif isinstance(spec, Selective):
        units = list(units)
        if any(selective_matches(unit, spec) for _, unit in units):
            return
        if spec.pattern is None:
            raise PreflightError(
                "recompute=Selective(predicate=...) selects no module inside any pipeline layer "
                "(the predicate is false for every one); check the predicate",
                key="recompute",
            )
        names = sorted({n for _, unit in units for n, _ in unit.named_modules() if n})
        raise PreflightError(
            f"recompute='selective:{spec.pattern}' matches no module inside any pipeline layer "
            f"(names are relative to a layer, fnmatch patterns such as 'attn' or 'mlp.*'); "
            f"candidates: {_listing(names) if names else 'none (the layers have no submodules)'}",
            key="recompute",
        )


def _layers_on_meta(module: Any) -> list[tuple[str, nn.Module]]:
    """Every pipeline layer of a PipelineLayers model; a layer not built here is built alone,
    on the meta device (no memory), as ``plan`` counts its parameters."""
    import torch

    layers = module.pipeline_layers()
    out = []
    for i in range(layers.num_layers):
        layer = layers[i] if i in layers else None
        if layer is None:
            with torch.device("meta"):
                layer = layers._builders[i]()
        out.append((str(i), layer))
    return out


def check_module(
    module: Any,
    plan: PipelinePlan,
    *,
    split: str | None = None,
    split_placement: dict[str, str] | None = None,
    recompute: Any = None,
) -> PipelinePlan:
    """Every rule that needs the model (see the module docstring); returns the plan cut to the
    model's layers (or blocks). ``module``: the whole LightningModule, real or on the meta
    device."""
    if split:
        mixin = split_mixin_message(split, module)
        if mixin is not None:
            raise SplitError(mixin)
        layout, plan = split_layout(module, split, split_placement, plan)
        names = [*layout.blocks, *layout.units]
        units = [(n, module.get_submodule(n)) for n in names]
    else:
        units = _layers_on_meta(module)
        if plan.layer_ranges is None:
            plan = plan.with_layers(len(units))
    assert plan.layer_ranges is not None
    check_recompute_targets(recompute, plan.layer_ranges[-1].stop, units)
    return plan


@contextlib.contextmanager
def meta_view(module: Any) -> Generator[Any, None, None]:
    """``module`` with its model built on the meta device (``configure_model`` run under
    ``torch.device("meta")``; a ``PipelineLayers`` builds none of its layers, which
    :func:`check_module` builds one by one on meta), for the checks only: afterwards the
    module's attributes, children, parameters and buffers are what they were, so Lightning's
    own ``configure_model`` call later builds it as if nothing happened."""
    import torch

    from .model import select_layers

    saved = dict(module.__dict__)
    for key in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
        if key in saved:
            saved[key] = type(saved[key])(saved[key])
    configure = getattr(module, "configure_model", None)
    try:
        with torch.device("meta"), select_layers(lambda layers: []):
            if callable(configure):
                configure()
        yield module
    finally:
        module.__dict__.clear()
        module.__dict__.update(saved)

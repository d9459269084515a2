"""Activation recompute: which modules of a rank's chunks run under ``torch.utils.checkpoint``.

A recomputed module keeps only its inputs during forward and runs its forward again in backward
(non-reentrant ``torch.utils.checkpoint``). What to recompute (:func:`parse_recompute`):

* ``None``: nothing (default);
* ``"full"``: every pipeline layer (each layer of a :class:`~lightning_pp.partition.
  PipelineChunk`; a chunk of another kind as one unit);
* a list of layer indices (original indices, e.g. ``[0, 1, 5]``): those layers where held;
* :class:`Selective` (a name pattern or predicate for modules INSIDE layers, e.g. only the
  attention: ``Selective("attn")``), also given as the string ``"selective:attn"``;
* ``"auto"``: the planner (:mod:`lightning_pp.recompute_plan`) picks layers per rank from a
  memory budget; the engine then receives the chosen layer indices.

How it is applied: :func:`install_recompute` replaces the ``forward`` of each selected module
with a wrapper (an instance attribute, so parameter names and ``state_dict`` keys stay the same
and the module trains unchanged elsewhere). The wrapper checkpoints ONLY while the engine runs a
training forward with this module in its active set (:func:`recompute_active`), so eval,
forward-only steps, plain (unpipelined) runs and another engine over the same modules run the
plain forward.

Dropout and other RNG: ``preserve_rng_state=True`` makes checkpoint save the CPU RNG state (and
the state of every device the inputs live on) before the forward and restore it around the
recompute, so the recomputed forward draws exactly the same numbers: the dropout masks are
bitwise those of the original forward, and the gradients bitwise those of a run without
recompute (tested in ``tests/test_recompute.py``). The recompute forks the RNG, so the state the
rest of the step sees is untouched.

The memory meter: the checkpoint frame holds the module's tensor inputs until backward. It saves
top-level tensor arguments through the saved-tensor hooks active outside (the engine's meter
sees them), but keeps other arguments by plain reference; so a tuple activation is passed to
checkpoint as separate tensor arguments and re-packed inside.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_pp.partition import PipelineChunk
    >>> chunk = PipelineChunk([nn.Linear(4, 4), nn.Tanh()], indices=[3, 4])
    >>> targets = install_recompute([chunk], [4])
    >>> [[name for name, _ in t] for t in targets]
    [['layers.1']]
    >>> with recompute_active(targets):
    ...     y = chunk(torch.randn(2, 4, requires_grad=True))
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "RecomputeSpec",
    "Selective",
    "install_recompute",
    "install_targets",
    "layer_names",
    "parse_bytes",
    "parse_recompute",
    "recompute_active",
    "select_positions",
    "select_targets",
]


@dataclass(frozen=True)
class Selective:
    """Recompute only the modules inside each pipeline layer whose name (relative to the layer,
    e.g. ``"attn"``, ``"mlp.fc"``) matches ``pattern`` (``fnmatch``: ``"attn*"``, ``"*.drop"``),
    or for which ``predicate(name, module)`` is true. A module inside one already selected is
    not selected again (one checkpoint frame covers it).

    Example:
        >>> Selective("attn").matches("attn", nn.Identity())
        True
        >>> Selective(predicate=lambda n, m: isinstance(m, nn.Dropout)).matches("x", nn.Dropout())
        True
    """

    pattern: str | None = None
    predicate: Callable[[str, nn.Module], bool] | None = None

    def __post_init__(self) -> None:
        if (self.pattern is None) == (self.predicate is None):
            raise ValueError("Selective needs exactly one of pattern= or predicate=")

    def matches(self, name: str, module: nn.Module) -> bool:
        if self.predicate is not None:
            return bool(self.predicate(name, module))
        assert self.pattern is not None
        return fnmatch.fnmatchcase(name, self.pattern)


RecomputeSpec = None | str | Sequence[int] | Selective
"""What to recompute: ``None``, ``"full"``, ``"auto"``, ``"selective:<pattern>"``, layer indices,
or a :class:`Selective`."""


def parse_recompute(
    value: Any, *, key: str = "recompute"
) -> None | str | tuple[int, ...] | Selective:
    """Validate a recompute setting; the normal form is ``None``, ``"full"``, ``"auto"``, a sorted
    tuple of layer indices, or a :class:`Selective`. Errors name ``key``.

    Example:
        >>> parse_recompute("selective:attn")
        Selective(pattern='attn', predicate=None)
        >>> parse_recompute([3, 1])
        (1, 3)
    """
    if value is None or isinstance(value, Selective):
        return value
    if isinstance(value, str):
        v = value.strip()
        if v.lower() in ("none", "null", ""):
            return None
        if v in ("full", "auto"):
            return v
        if v.startswith("selective:") and v[len("selective:") :]:
            return Selective(v[len("selective:") :])
        raise ValueError(
            f"{key}={value!r} is not valid: use None, 'full', 'auto', 'selective:<module name "
            f"pattern>' (e.g. 'selective:attn'), or a list of layer indices"
        )
    if isinstance(value, Sequence) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        bad = [i for i in value if i < 0]
        if bad:
            raise ValueError(f"{key}: layer indices must be >= 0, got {bad}")
        return tuple(sorted(set(value)))
    raise ValueError(
        f"{key} must be None, 'full', 'auto', 'selective:<pattern>', a list of layer indices or "
        f"a Selective, got {type(value).__name__} {value!r}"
    )


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(value: Any, *, key: str = "activation_budget") -> int:
    """Bytes from an int or a string such as ``"6GiB"``, ``"512 MiB"``, ``"1.5e9"``.

    >>> parse_bytes("6GiB"), parse_bytes(1024), parse_bytes("1.5 kB")
    (6442450944, 1024, 1500)
    """
    if isinstance(value, bool):
        raise ValueError(f"{key} must be a byte count or a string like '6GiB', got {value!r}")
    if isinstance(value, (int, float)):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{key}={value!r} is not a size: use bytes (e.g. 6442450944) or a number with "
                f"a unit among B, kB, MB, GB, KiB, MiB, GiB, TiB (e.g. '6GiB')"
            )
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    else:
        raise ValueError(f"{key} must be a byte count or a string like '6GiB', got {value!r}")
    if n <= 0:
        raise ValueError(f"{key} must be positive, got {value!r}")
    return int(n)


# -- the targets ---------------------------------------------------------------------------
Targets = list[list[tuple[str, nn.Module]]]  # per chunk: (name inside the chunk, module)


def _layers_of(chunk: nn.Module) -> list[tuple[str, int | None, nn.Module]]:
    """``(name, original layer index or None, layer)`` of each pipeline layer of a chunk."""
    layers = getattr(chunk, "layers", None)
    indices = getattr(chunk, "layer_indices", None)
    if isinstance(layers, nn.ModuleList) and indices is not None:
        return [(f"layers.{i}", idx, m) for i, (idx, m) in enumerate(zip(indices, layers))]
    return [("", None, chunk)]  # an opaque chunk: one unit


def select_targets(chunks: Sequence[nn.Module], spec: Any) -> Targets:
    """The modules of each chunk that ``spec`` selects (``"auto"`` must be resolved first)."""
    spec = parse_recompute(spec)
    if spec == "auto":
        raise ValueError(
            "recompute='auto' must be resolved to layer indices by the planner "
            "(lightning_pp.recompute_plan) before the engine applies it"
        )
    out: Targets = []
    for chunk in chunks:
        picked: list[tuple[str, nn.Module]] = []
        for name, index, layer in _layers_of(chunk):
            if spec is None:
                continue
            if spec == "full" or (isinstance(spec, tuple) and index in spec):
                picked.append((name, layer))
            elif isinstance(spec, Selective):
                taken: list[str] = []
                for sub_name, sub in layer.named_modules():
                    if not sub_name or any(sub_name.startswith(t + ".") for t in taken):
                        continue
                    if spec.matches(sub_name, sub):
                        taken.append(sub_name)
                        picked.append((f"{name}.{sub_name}" if name else sub_name, sub))
        out.append(picked)
    return out


def layer_names(chunk: nn.Module) -> list[tuple[str, int | None]]:
    """``(name inside the chunk, original layer index or None)`` of each pipeline layer of a
    chunk, in order: the positions :func:`select_positions` takes."""
    return [(name, index) for name, index, _ in _layers_of(chunk)]


def select_positions(chunks: Sequence[nn.Module], positions: Sequence[Sequence[int]]) -> Targets:
    """The layers at the given positions (within each chunk's layer list): the planner's form."""
    out: Targets = []
    for chunk, chosen in zip(chunks, positions, strict=True):
        layers = _layers_of(chunk)
        out.append([(layers[i][0], layers[i][2]) for i in sorted(set(chosen))])
    return out


def install_recompute(chunks: Sequence[nn.Module], spec: Any) -> Targets:
    """Select the modules ``spec`` names in each chunk and give each the checkpointing forward
    wrapper (idempotent). Returns the targets; the wrapper checkpoints only inside
    :func:`recompute_active` with them."""
    return install_targets(select_targets(chunks, spec))


def install_targets(targets: Targets) -> Targets:
    """Give each target module the checkpointing forward wrapper (idempotent)."""
    for picked in targets:
        for _, module in picked:
            if not isinstance(module.__dict__.get("forward"), _CheckpointedForward):
                module.forward = _CheckpointedForward(module)  # type: ignore[method-assign]
    return targets


# The modules (by id) that checkpoint in the current training forward.
_ACTIVE: ContextVar[frozenset[int]] = ContextVar("lightning_pp_recompute", default=frozenset())


@contextlib.contextmanager
def recompute_active(targets: Sequence[Sequence[tuple[str, nn.Module]]]) -> Iterator[None]:
    """Inside: the modules in ``targets`` checkpoint (the engine enters it for training
    forwards only)."""
    token = _ACTIVE.set(frozenset(id(m) for picked in targets for _, m in picked))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class _CheckpointedForward:
    """A module's ``forward`` that runs under non-reentrant checkpoint when active."""

    def __init__(self, module: nn.Module) -> None:
        # The class's forward, bound: the instance attribute shadows it, so call it explicitly.
        self._forward = type(module).forward.__get__(module)
        self._id = id(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._id not in _ACTIVE.get() or not torch.is_grad_enabled():
            return self._forward(*args, **kwargs)
        if len(args) == 1 and not kwargs and isinstance(args[0], (tuple, list)):
            # A tuple activation: its tensors as top-level arguments, so the frame saves them
            # through the saved-tensor hooks (the meter sees them) instead of by reference.
            kind, items = type(args[0]), list(args[0])
            return checkpoint(
                self._call_packed,
                kind,
                *items,
                use_reentrant=False,
                preserve_rng_state=True,
            )
        return checkpoint(
            self._forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs
        )

    def _call_packed(self, kind: type, *items: Any) -> Any:
        return self._forward(kind(items))

"""What a recompute setting means: ``recompute=`` and ``activation_budget=`` as the user writes
them, in normal form, with the rules that tie them together. Pure Python (no torch).

The mechanism that applies a spec lives in :mod:`lightning_pp.runtime.recompute`; the
``"auto"`` planner in :mod:`lightning_pp.planner.recompute`.

Example:
    >>> check_recompute("auto", "1MiB")
    ('auto', 1048576)
    >>> parse_recompute("selective:attn")
    Selective(pattern='attn', predicate=None)
    >>> format_bytes(3 * 2**20)
    '3.00 MiB'
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Selective:
    """Recompute only the modules inside each pipeline layer whose name (relative to the layer,
    e.g. ``"attn"``, ``"mlp.fc"``) matches ``pattern`` (``fnmatch``: ``"attn*"``, ``"*.drop"``),
    or for which ``predicate(name, module)`` is true. A module inside one already selected is
    not selected again (one checkpoint frame covers it).

    Example:
        >>> from torch import nn
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
        # a sign is parsed so that '-1GiB' is told it must be positive, not that it is no size
        m = re.fullmatch(r"\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{key}={value!r} is not a size: use bytes (e.g. 6442450944) or a number with "
                f"a unit among B, kB, MB, GB, KiB, MiB, GiB, TiB (e.g. '6GiB')"
            )
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    else:
        raise ValueError(f"{key} must be a byte count or a string like '6GiB', got {value!r}")
    if n <= 0:
        raise ValueError(
            f"{key}={value!r}: a size must be positive; use bytes (e.g. 6442450944) or a "
            f"positive number with a unit (e.g. '6GiB', '512MiB')"
        )
    return int(n)


def format_bytes(n: float) -> str:
    """``1.50 MiB``-style size."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"  # pragma: no cover


def check_recompute(
    recompute: Any, activation_budget: Any, *, split: str | None = None
) -> tuple[Any, int | None]:
    """The recompute rules: a valid ``recompute`` (see :mod:`lightning_pp.runtime.recompute`), an
    ``activation_budget`` exactly when ``recompute="auto"``, and neither ``"auto"`` nor layer
    indices with ``split`` (the strategy's ``split=``: the planner cannot measure its stages yet,
    and a split stage has no per-layer forward to wrap). Returns
    ``(recompute in normal form, budget in bytes or None)``; errors name the key.

    >>> check_recompute("auto", "1MiB")
    ('auto', 1048576)
    """
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
            "recompute='auto' is not supported with split= yet (the planner measures "
            "PipelineLayers models only): use recompute='full' (every stage) or "
            "'selective:<pattern>' (modules inside the blocks, e.g. 'selective:attn')"
        )
    if isinstance(spec, tuple) and split:
        # A split= stage runs the user's step as one unit, so there is no per-layer forward to
        # wrap: refused instead of silently recomputing nothing.
        raise ValueError(
            f"recompute={list(spec)} (layer indices) is not supported with split=: a split "
            f"stage is recomputed whole; use recompute='full' or 'selective:<pattern>' "
            f"(modules inside the blocks, e.g. 'selective:attn')"
        )
    return spec, budget

"""After a split backward's ``I``, keep only the saved tensors that ``W`` will unpack again.

A zero-bubble schedule runs ``I`` (input gradient) now and ``W`` (weight gradients) later, with
the graph retained in between. Autograd would keep everything the forward saved until ``W``;
but ``W`` runs only the nodes that lead to weights (a Linear's ``AddmmBackward``, a
``NativeLayerNormBackward``: :meth:`WeightWork.nodes
<lightning_pp.runtime.split_backward.WeightWork.nodes>`), so what only input-path nodes read (a
GELU's input, attention probabilities, dropout masks) is dead once ``I`` is done. On the
transformer block of ``benchmarks/`` that is about 40 % of a microbatch's saved bytes, held for
every microbatch whose ``W`` lags behind its ``I`` (zb-h1's last rank: up to pp of them).

How: during the chunk's forward, ``saved_tensors_hooks`` put each saved tensor in a
:class:`_Held` (what autograd stores instead); its unpack notes the node that unpacked it
(``torch._C._current_autograd_node()``, by ``id``: a node object held here would make a
cycle through the graph's saved variables that outlives ``W``; the ids are unique while ``I``
runs because the :class:`~lightning_pp.runtime.split_backward.WeightWork` holds every node of the
graph
until ``W``). After ``I``, :meth:`SavedForW.trim` empties each
holder that only nodes outside ``W`` unpacked. A holder no node unpacked yet (saved by a
weight-only node below the input path) is kept. Holders are referenced weakly here, so a graph
freed by a fused backward frees them too.

Example:
    >>> import torch
    >>> from lightning_pp.runtime.split_backward import backward_input
    >>> lin = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> kept = SavedForW()
    >>> with kept.hooks():
    ...     y = torch.nn.functional.gelu(lin(x))
    >>> dx, work = backward_input((y,), (torch.ones_like(y),), (x,))
    >>> kept.trim(work.nodes())  # the GELU's input: only I's GeluBackward read it
    1
    >>> work.run(); lin.weight.grad.shape
    torch.Size([4, 4])
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["SavedForW", "drop_unread_by_w", "pinned_unpacks"]

_pinning = [0]


@contextlib.contextmanager
def pinned_unpacks() -> Iterator[None]:
    """Unpacks inside this block pin their holder (never trimmed): a recomputed region reads
    its saved inputs from inside ``I`` (while some input-path node runs), yet needs them again
    when ``W`` recomputes (:class:`~lightning_pp.runtime.recompute.RecomputeOnce`)."""
    _pinning[0] += 1
    try:
        yield
    finally:
        _pinning[0] -= 1


class _Held:
    """One saved tensor, as autograd stores it: ``value`` until trimmed, the ``users`` (nodes)
    (ids) that unpacked it, and the meter's ``counted`` (storage key, bytes), if any."""

    __slots__ = ("__weakref__", "counted", "pinned", "users", "value")

    def __init__(self, value: torch.Tensor, counted: tuple[Any, int] | None) -> None:
        self.value: torch.Tensor | None = value
        self.counted = counted
        self.users: list[Any] = []
        self.pinned = False


def drop_unread_by_w(holders: Iterable[weakref.ReferenceType[Any]], weight_nodes: set[Any]) -> int:
    """The trim rule, for any holders with ``value`` and ``users`` (node ids; an optional
    ``pinned``): empty each live holder that some node unpacked, none of them in
    ``weight_nodes``; forget the users recorded so far. Returns how many
    were emptied."""
    ids = {id(n) for n in weight_nodes}
    dropped = 0
    for ref in holders:
        held = ref()
        if held is None:
            continue
        users, held.users = held.users, []
        if held.value is None or getattr(held, "pinned", False) or not users:
            continue
        if ids.isdisjoint(users):
            held.value = None
            dropped += 1
    return dropped


class SavedForW:
    """The saved tensors of one forward of one chunk under a split backward.

    ``key_fn`` keys a tensor for the memory meter (``(key, bytes)`` or ``None``: not counted),
    as :meth:`counted` reports them; without it nothing is counted.
    """

    def __init__(self, key_fn: Callable[[torch.Tensor], tuple[Any, int] | None] | None = None):
        self.key_fn = key_fn
        self._held: list[weakref.ReferenceType[_Held]] = []

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> _Held:
        counted = self.key_fn(t) if self.key_fn is not None else None
        # A detached alias, not ``t`` itself: output release later swaps the storage of the
        # very tensor object the forward returned.
        held = _Held(t.detach(), counted)
        self._held.append(weakref.ref(held))
        return held

    def _unpack(self, held: _Held) -> torch.Tensor:
        if held.value is None:
            raise RuntimeError(
                "lightning_pp split backward: W unpacked a saved tensor that was freed after I "
                "because no node of W was expected to read it; please report this with the "
                "model (workaround: a fused-backward schedule such as 1f1b or interleaved)"
            )
        if _pinning[0]:
            held.pinned = True
        else:
            node = torch._C._current_autograd_node()
            if node is not None:
                held.users.append(id(node))
        return held.value

    def trim(self, weight_nodes: set[Any]) -> int:
        """Empty the holders that only nodes outside ``weight_nodes`` unpacked; return how
        many."""
        return drop_unread_by_w(self._held, weight_nodes)

    def counted(self) -> dict[Any, int]:
        """The meter's storages still held (each key once): bytes."""
        out: dict[Any, int] = {}
        for ref in self._held:
            held = ref()
            if held is not None and held.value is not None and held.counted is not None:
                out[held.counted[0]] = held.counted[1]
        return out

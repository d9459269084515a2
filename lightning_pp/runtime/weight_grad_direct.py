"""``W`` for a Linear or a LayerNorm without the autograd graph: captured at ``I``, run later.

Why: a split backward keeps the graph from ``I`` to ``W`` so that ``W`` can run the engine from
the gradients ``I`` kept. That costs twice: ``I`` cannot free what the forward saved as it runs
(the forward needs ``SavedForW`` hooks to trim it afterwards), and ``W`` makes one engine call
per layer. When every layer ``W`` would run is one of the kinds below, ``I`` instead captures
what their weight gradients read (:func:`capture`), runs with the graph freed as it goes, and
``W`` computes each gradient with the operator the engine would have run (:class:`DirectJob`).
Measured on the benchmark transformer stage (``benchmarks/split_backward_cost.py``): ``(t_i +
t_w) / t_b`` 1.22 -> 1.10-1.11, the forward 6 % cheaper (no hooks).

Which layers: the intermediate ``W`` starts at (the node whose weight edges leave the input
path) is one of

* ``AddmmBackward0`` (``nn.Linear`` with bias, on any input: a 3-D input is flattened first):
  ``dW = g^T @ mat1`` -- what ``mm_mat2_backward`` computes for the column-major ``mat2 = W^T``,
  then ``TBackward0``'s transpose -- and ``db = g`` summed to the bias shape (the engine's
  ``sum_to`` of a broadcast input);
* ``MmBackward0`` (``nn.Linear`` without bias): ``dW = g^T @ self``;
* ``NativeLayerNormBackward0``: ``native_layer_norm_backward`` asked for the weight and bias
  gradients only (the engine's own call, with the input gradient masked off);
* ``MulBackward0`` with a parameter as one factor (an RMSNorm's scale, ``weight * x``):
  ``dW = g * x`` summed to the weight's shape.

Each weight edge must be the parameter's accumulator, possibly behind one ``ToCopyBackward0``
(autocast's cast of an fp32 weight: the gradient is cast back to the weight's dtype, as that
node does), and for a matmul behind a ``TBackward0``. The operators and their arguments are the
engine's, so the gradients are bitwise those of an engine call (tested).

Anything else, or anything this module cannot vouch for, keeps the retained graph and the
engine's ``W``:
a parameter with a tensor hook (``register_hook``, ``register_post_accumulate_grad_hook``) or a
subclass (a DTensor), a non-contiguous parameter (the engine's layout contract would clone),
``alpha``/``beta`` other than 1, autocast or anomaly mode on at ``I``, or edges other than the
layer's usual ones (:func:`weight_slots`: a weight behind its input edge, a bias computed from
parameters). ``W`` turns autocast off around its operators (the graph is gone by then: there is
no engine to fall back to), and moves a gradient to its parameter's device and dtype, as the
engine does. Not detectable from Python, so not honoured: a hook registered on the accumulator
NODE itself (``AccumulateGrad.register_hook``, which ``DistributedDataParallel``'s reducer uses;
the pipeline strategy syncs gradients after the chunk's last ``W`` and installs none).

Example:
    >>> lin = torch.nn.Linear(3, 2)
    >>> x = torch.randn(4, 3, requires_grad=True)
    >>> y = lin(x)
    >>> node = y.grad_fn  # AddmmBackward0
    >>> job = capture(DIRECT_KINDS[type(node).__name__], node, lin.weight, lin.bias)
    >>> with torch.no_grad():
    ...     job.run(torch.ones(4, 2))
    >>> torch.equal(lin.bias.grad, torch.full((2,), 4.0))
    True
    >>> torch.equal(lin.weight.grad, x.detach().sum(0).expand(2, 3))
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import Node

__all__ = ["DIRECT_KINDS", "NONE", "DirectJob", "capture", "direct_allowed", "weight_slots"]

ADDMM, MM, LAYER_NORM, MUL = "addmm", "mm", "layer_norm", "mul"

DIRECT_KINDS: dict[str, str] = {
    "AddmmBackward0": ADDMM,
    "MmBackward0": MM,
    "NativeLayerNormBackward0": LAYER_NORM,
    "MulBackward0": MUL,
}
"""Node class name -> the kind :func:`capture` handles."""

_ACC, _TO_COPY, _T = "AccumulateGrad", "ToCopyBackward0", "TBackward0"
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_layer_norm_backward = torch.ops.aten.native_layer_norm_backward.default


def direct_allowed() -> bool:
    """Whether the thread's state lets a direct ``W`` stand in for the engine's: autocast around
    ``W`` would change the dtype of a direct matmul (the engine's nodes run with the state the
    graph recorded), and anomaly mode checks each node's outputs."""
    return not torch._C._is_any_autocast_enabled() and not torch.is_anomaly_enabled()


# -- where the weights are: decided once per graph shape, from node types and edges ---------------

NONE = -1  # a slot without a weight (a frozen bias, a bias-free Linear)


def _acc_below(
    k: int, types: Sequence[type], kids: Sequence[tuple[int, ...]], transposed: bool
) -> int | None:
    """The accumulator position behind node ``k``: ``AccumulateGrad``, or
    ``ToCopyBackward0`` -> ``AccumulateGrad`` (autocast's cast of the weight), behind one
    ``TBackward0`` if ``transposed``; ``None`` for any other shape."""
    if transposed:
        if types[k].__name__ != _T or len(kids[k]) != 1:
            return None
        k = kids[k][0]
    if types[k].__name__ == _TO_COPY:
        if len(kids[k]) != 1:
            return None
        k = kids[k][0]
    return k if types[k].__name__ == _ACC and not kids[k] else None


def weight_slots(
    kind: str,
    root: int,
    types: Sequence[type],
    kids: Sequence[tuple[int, ...]],
    reach_in: Sequence[bool],
) -> tuple[int, int] | None:
    """``(weight, bias)`` accumulator positions (:data:`NONE` where absent) of an intermediate
    of ``kind``, from the graph's signature (the node types and, per node, its children in edge
    order, ``None`` edges left out); ``None`` where the edges are not the layer's usual ones.

    * addmm ``(bias, mat1, mat2)``: three children ``[bias chain, input, T chain]``, or two:
      ``[input, T chain]`` (no trainable bias) or ``[bias chain, input]`` (a frozen weight);
    * mm ``(self, mat2)``: ``[input, T chain]``;
    * layer norm ``(input, weight, bias)``: ``[input, weight chain, bias chain]``; with two
      children the one chain is the weight or the bias, which only the node's saved weight
      tells (:func:`capture` asks it): returned as ``(chain, chain)``;
    * mul ``(self, other)``: one child the input, the other the weight's accumulator itself
      (which factor it is, :func:`capture` asks the node's saved ``self``).
    """
    ks = kids[root]

    def chain(k: int, transposed: bool = False) -> int | None:
        return None if reach_in[k] else _acc_below(k, types, kids, transposed)

    if kind == ADDMM:
        if len(ks) == 3 and reach_in[ks[1]]:
            b, w = chain(ks[0]), chain(ks[2], True)
            return None if b is None or w is None else (w, b)
        if len(ks) == 2 and reach_in[ks[0]]:
            w = chain(ks[1], True)
            return None if w is None else (w, NONE)
        if len(ks) == 2 and reach_in[ks[1]]:
            b = chain(ks[0])
            return None if b is None else (NONE, b)
        return None
    if kind == MM:
        if len(ks) == 2 and reach_in[ks[0]]:
            w = chain(ks[1], True)
            return None if w is None else (w, NONE)
        return None
    if kind == MUL and len(ks) == 2:
        # weight * x (an RMSNorm's scale) or x * weight; the weight straight from its
        # accumulator (a cast would put the engine's rounding to the cast dtype in between)
        for mine, theirs in ((ks[0], ks[1]), (ks[1], ks[0])):
            if reach_in[theirs] and chain(mine) == mine:
                return mine, NONE
        return None
    if kind == LAYER_NORM and ks and reach_in[ks[0]]:
        found = [chain(k) for k in ks[1:]]
        if not found or any(a is None for a in found):
            return None
        if len(found) == 2:
            return found[0], found[1]  # type: ignore[return-value]
        if len(found) == 1:
            return found[0], found[0]  # type: ignore[return-value]
    return None


# -- the job -----------------------------------------------------------------------------------


def _plain(p: torch.Tensor) -> bool:
    """A parameter whose accumulation this module reproduces exactly."""
    return (
        type(p) in _PLAIN
        and not p._backward_hooks
        and not getattr(p, "_post_accumulate_grad_hooks", None)
        and p.is_contiguous()
    )


def _accumulate(p: torch.Tensor, d: torch.Tensor) -> None:
    """What ``AccumulateGrad`` does with grad mode off: the first gradient is taken as is
    (contiguous, like its parameter: the layout contract holds), a later one added in place."""
    if d.dtype != p.dtype or d.device != p.device:
        # ToCopyBackward0: back to the weight's dtype; the engine moves a gradient to the
        # device of the tensor it is for
        d = d.to(device=p.device, dtype=p.dtype)
    if p.grad is None:
        p.grad = d
    else:
        p.grad.add_(d)


def _released(kind: str, saved: tuple[int, ...], grad: tuple[int, ...]) -> str:
    return (
        f"lightning_pp split backward: W of a {kind} layer found its saved input with shape "
        f"{list(saved)} for a gradient of shape {list(grad)}: the tensor was changed after the "
        "forward. The usual cause is output release: a chunk output that a Linear or norm of "
        "the same chunk also reads had its storage freed once sent. Construct the strategy or "
        "engine with release_outputs=False for such a chunk."
    )


class DirectJob:
    """One layer's ``W``, captured from its node: the parameters and the saved tensors the
    weight gradient reads (detached aliases: holding them keeps their memory, not the graph).

    ``run(g)`` accumulates the weight gradients for the gradient ``g`` that flowed into the
    node. Built by :func:`capture`; the node itself is not kept, so a job outlives its graph
    (what lets ``I`` free the graph as it goes: ``backward_input(free_graph=True)`` in
    :mod:`lightning_pp.runtime.split_backward`).
    """

    __slots__ = ("bias", "kind", "saved", "weight")

    def __init__(
        self,
        kind: str,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        saved: tuple[Any, ...],
    ) -> None:
        self.kind, self.weight, self.bias, self.saved = kind, weight, bias, saved

    def held(self) -> list[torch.Tensor]:
        """The saved tensors this job keeps alive until it runs (for the memory meter)."""
        return [t for t in self.saved if isinstance(t, torch.Tensor)]

    def run(self, g: torch.Tensor) -> None:
        """Accumulate the weight gradients for ``g``; call with grad mode off."""
        weight, bias = self.weight, self.bias
        if self.kind == LAYER_NORM:
            x, shape, mean, rstd, w, b = self.saved
            if x.shape != g.shape:
                raise RuntimeError(_released(self.kind, tuple(x.shape), tuple(g.shape)))
            _, d_weight, d_bias = _layer_norm_backward(
                g, x, shape, mean, rstd, w, b, [False, weight is not None, bias is not None]
            )
            if weight is not None:
                _accumulate(weight, d_weight)
            if bias is not None:
                _accumulate(bias, d_bias)
            return
        if self.kind == MUL:
            (x,) = self.saved  # the other factor
            if x.shape != g.shape:
                raise RuntimeError(_released(self.kind, tuple(x.shape), tuple(g.shape)))
            assert weight is not None  # a scale's capture always has its weight
            _accumulate(weight, (g * x).sum_to_size(weight.shape))
            return
        if bias is not None:
            _accumulate(bias, g.sum_to_size(bias.shape))
        if weight is not None:
            (x,) = self.saved  # addmm's mat1 / mm's self: the layer's (flattened) input
            if x.dim() != 2 or x.shape[0] != g.shape[0]:
                raise RuntimeError(_released(self.kind, tuple(x.shape), tuple(g.shape)))
            _accumulate(weight, g.t().mm(x))


def capture(
    kind: str, node: Node, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> DirectJob | None:
    """The :class:`DirectJob` for ``node``, an intermediate of ``kind`` whose weight and bias
    are the parameters at its :func:`weight_slots` (``None`` where absent; for a norm with one
    affine parameter pass it as both), or ``None`` where this module cannot vouch for the
    result (the caller keeps the engine's way). Reads the node's saved tensors (through any
    saved-tensor hooks), so call it while they are alive."""
    n: Any = node
    if kind == LAYER_NORM:
        if weight is bias and weight is not None:  # one affine parameter: which one?
            if n._saved_weight is weight:
                bias = None
            elif n._saved_bias is bias:
                weight = None
            else:
                return None
    elif kind == ADDMM:
        if n._saved_alpha != 1 or n._saved_beta != 1:
            return None
    if (weight is not None and not _plain(weight)) or (bias is not None and not _plain(bias)):
        return None
    if kind == MUL:
        # the engine's grad for the weight is grad * (the other factor), summed to the weight's
        # shape; only where that factor has the product's shape (not itself broadcast)
        x = n._saved_other if n._saved_self is weight else n._saved_self
        if x is None or tuple(x.shape) != tuple(n._input_metadata[0].shape):
            return None
        return DirectJob(kind, weight, None, (x.detach(),))
    if kind == LAYER_NORM:
        saved = (
            n._saved_input.detach(),
            n._saved_normalized_shape,
            n._saved_result1.detach(),
            n._saved_result2.detach(),
            n._saved_weight,
            n._saved_bias,
        )
        return DirectJob(kind, weight, bias, saved)
    if weight is None:  # the input is saved only for the weight's gradient
        return DirectJob(kind, None, bias, ())
    x = n._saved_mat1 if kind == ADDMM else n._saved_self
    return DirectJob(kind, weight, bias, (x.detach(),))

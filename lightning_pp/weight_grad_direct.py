"""``W`` for a Linear or a LayerNorm without the autograd engine: the weight gradient by one call.

Why: a split backward's ``W`` (:meth:`WeightWork.run
<lightning_pp.split_backward.WeightWork.run>`) makes one engine call per layer. On the
benchmark transformer stage (2 blocks, 12 calls) the calls took 4.1 ms against 3.4 ms of the
operators inside them: every call builds a graph task, computes which nodes to execute and
walks the graph, for a layer whose weight gradient is one matmul. That ~70 µs per call is what
kept ``t_i + t_w`` at about 1.19 x the fused backward (issue 14's target: 1.10). Computing the
gradient of such a layer directly, with the operator the engine would run, removes it.

Which layers: the intermediate ``W`` starts at (the node whose weight edges leave the input
path) is one of

* ``AddmmBackward0`` (``nn.Linear`` with bias, on any input: a 3-D input is flattened first):
  ``dW = g^T @ mat1`` -- what ``mm_mat2_backward`` computes for the column-major ``mat2 = W^T``,
  then ``TBackward0``'s transpose -- and ``db = g`` summed to the bias shape (the engine's
  ``sum_to`` of a broadcast input);
* ``MmBackward0`` (``nn.Linear`` without bias): ``dW = g^T @ self``;
* ``NativeLayerNormBackward0``: ``native_layer_norm_backward`` asked for the weight and bias
  gradients only (the engine's own call, with the input gradient masked off).

Each weight edge must be the parameter's accumulator, possibly behind one ``ToCopyBackward0``
(autocast's cast of an fp32 weight: the gradient is cast back to the weight's dtype, as that
node does), and for a matmul behind a ``TBackward0``. The operators and their arguments are the
engine's, so the gradients are bitwise those of an engine call (tested).

Anything else, or anything this module cannot vouch for, goes through the engine as before:
a parameter with a tensor hook (``register_hook``, ``register_post_accumulate_grad_hook``) or a
subclass (a DTensor), a non-contiguous parameter (the engine's layout contract would clone), a
gradient on another device, ``alpha``/``beta`` other than 1, autocast enabled around ``W``,
anomaly mode, or weights that differ from the ones the engine call would reach. Not detectable
from Python, so not honoured: a hook registered on the accumulator NODE itself
(``AccumulateGrad.register_hook``, which ``DistributedDataParallel``'s reducer uses; the
pipeline strategy syncs gradients after the chunk's last ``W`` and installs none).

Example:
    >>> lin = torch.nn.Linear(3, 2)
    >>> x = torch.randn(4, 3, requires_grad=True)
    >>> y = lin(x)
    >>> node = y.grad_fn  # AddmmBackward0
    >>> kind = DIRECT_KINDS[type(node).__name__]
    >>> with torch.no_grad():
    ...     run_direct(kind, node, torch.ones(4, 2), [lin.bias, lin.weight])
    True
    >>> torch.equal(lin.bias.grad, torch.full((2,), 4.0))
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import Node

__all__ = ["DIRECT_KINDS", "DirectJob", "capture", "direct_allowed", "run_direct"]

ADDMM, MM, LAYER_NORM = "addmm", "mm", "layer_norm"

DIRECT_KINDS: dict[str, str] = {
    "AddmmBackward0": ADDMM,
    "MmBackward0": MM,
    "NativeLayerNormBackward0": LAYER_NORM,
}
"""Node class name -> the kind :func:`run_direct` computes for it."""

_ACC, _TO_COPY, _T = "AccumulateGrad", "ToCopyBackward0", "TBackward0"
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_layer_norm_backward = torch.ops.aten.native_layer_norm_backward.default


def direct_allowed() -> bool:
    """Whether the thread's state lets :func:`run_direct` stand in for the engine at all:
    autocast around ``W`` would change the dtype of a direct matmul (the engine's nodes run with
    the state the graph recorded), and anomaly mode checks each node's outputs."""
    return not torch._C._is_any_autocast_enabled() and not torch.is_anomaly_enabled()


def _weight(node: Node | None) -> torch.Tensor | None:
    """The parameter behind an accumulator, or behind ``ToCopyBackward0`` -> accumulator;
    ``None`` for anything else."""
    if node is None:
        return None
    name = type(node).__name__
    if name == _TO_COPY:
        (child, _), *rest = node.next_functions
        if rest or child is None or type(child).__name__ != _ACC:
            return None
        node = child
    elif name != _ACC:
        return None
    return node.variable  # type: ignore[attr-defined]


def _transposed_weight(node: Node | None) -> torch.Tensor | None:
    """The parameter behind ``TBackward0`` -> (``ToCopyBackward0`` ->) accumulator."""
    if node is None or type(node).__name__ != _T:
        return None
    (child, _), *rest = node.next_functions
    return None if rest else _weight(child)


def _plain(p: torch.Tensor, device: torch.device) -> bool:
    """A parameter whose accumulation this module reproduces exactly."""
    return (
        type(p) in _PLAIN
        and not p._backward_hooks
        and not getattr(p, "_post_accumulate_grad_hooks", None)
        and p.is_contiguous()
        and p.device == device
    )


def _accumulate(p: torch.Tensor, d: torch.Tensor) -> None:
    """What ``AccumulateGrad`` does with grad mode off: the first gradient is taken as is
    (contiguous, like its parameter: the layout contract holds), a later one added in place."""
    if d.dtype != p.dtype:
        d = d.to(p.dtype)  # ToCopyBackward0: back to the weight's dtype
    if p.grad is None:
        p.grad = d
    else:
        p.grad.add_(d)


def _matches(found: Sequence[torch.Tensor | None], weights: Sequence[torch.Tensor]) -> bool:
    """The direct call reaches exactly the weights the engine call would. What decides it: a
    leaf in the INPUT slot (the stage input itself) is not one of them, and a weight behind any
    slot in an unexpected way (a Linear applied as ``W @ x``, a bias computed from parameters)
    makes the sets differ."""
    got = [p for p in found if p is not None]
    return len(got) == len(weights) and all(any(p is w for w in weights) for p in got)


class DirectJob:
    """One layer's ``W``, captured from its node: the parameters and the saved tensors the
    weight gradient reads (detached aliases: holding them keeps their memory, not the graph).

    ``run(g)`` accumulates the weight gradients for the gradient ``g`` that flowed into the
    node. Built by :func:`capture`; the node itself is not kept, so a job outlives its graph
    (what lets ``I`` free the graph as it goes: ``backward_input(free_graph=True)`` in
    :mod:`lightning_pp.split_backward`).
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
        (x,) = self.saved  # addmm's mat1 / mm's self: the layer's (flattened) input
        if x.dim() != 2 or x.shape[0] != g.shape[0]:
            raise RuntimeError(_released(self.kind, tuple(x.shape), tuple(g.shape)))
        if bias is not None:
            _accumulate(bias, g.sum_to_size(bias.shape))
        if weight is not None:
            _accumulate(weight, g.t().mm(x))


def _released(kind: str, saved: tuple[int, ...], grad: tuple[int, ...]) -> str:
    return (
        f"lightning_pp split backward: W of a {kind} layer found its saved input with shape "
        f"{list(saved)} for a gradient of shape {list(grad)}: the tensor was changed after the "
        "forward. The usual cause is output release: a chunk output that a Linear or norm of "
        "the same chunk also reads had its storage freed once sent. Construct the strategy or "
        "engine with release_outputs=False for such a chunk."
    )


def capture(kind: str, node: Node, weights: Sequence[torch.Tensor]) -> DirectJob | None:
    """The :class:`DirectJob` for ``node`` (one of :data:`DIRECT_KINDS`), or ``None`` where the
    layer is not one this module reproduces (the caller then keeps the engine's way);
    ``weights``: the ones the engine call would reach. Reads the node's saved tensors (through
    any saved-tensor hooks), so call it while they are alive."""
    n: Any = node
    nf = node.next_functions
    if kind == ADDMM:
        if len(nf) != 3:
            return None
        bias, weight = _weight(nf[0][0]), _transposed_weight(nf[2][0])
        if not _matches((bias, weight), weights) or n._saved_alpha != 1 or n._saved_beta != 1:
            return None
        x = n._saved_mat1
    elif kind == MM:
        if len(nf) != 2:
            return None
        bias, weight = None, _transposed_weight(nf[1][0])
        if weight is None or not _matches((weight,), weights):
            return None
        x = n._saved_self
    elif kind == LAYER_NORM:
        if len(nf) != 3:
            return None
        weight, bias = _weight(nf[1][0]), _weight(nf[2][0])
        if not _matches((weight, bias), weights):
            return None
        x = n._saved_input
        if any(p is not None and not _plain(p, x.device) for p in (weight, bias)):
            return None
        saved = (
            x.detach(),
            n._saved_normalized_shape,
            n._saved_result1.detach(),
            n._saved_result2.detach(),
            n._saved_weight,
            n._saved_bias,
        )
        return DirectJob(kind, weight, bias, saved)
    else:
        return None
    if any(p is not None and not _plain(p, x.device) for p in (weight, bias)):
        return None
    return DirectJob(kind, weight, bias, (x.detach(),))


def run_direct(kind: str, node: Node, g: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Accumulate the weight gradients of ``node`` (one of :data:`DIRECT_KINDS`) for the
    gradient ``g`` that flowed into it, without the engine; ``weights``: the ones the engine call
    would reach. Returns ``False``, having changed nothing, where the layer is not one this
    module reproduces (the caller then runs the engine). Call with grad mode off."""
    job = capture(kind, node, weights)
    if job is None:
        return False
    job.run(g)
    return True

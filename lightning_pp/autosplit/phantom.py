"""Phantom tensors: shape, dtype and device without values.

A stage of a split model runs the model's own ``forward`` from the start, so the prologue
(position ids, attention masks, rotary tables) is recomputed from the microbatch on every stage.
Modules that live on another stage (the token embedding on a middle stage, say) are replaced by
stand-ins whose output is a :class:`Phantom`: it carries the shape, dtype and device the real
output would have, and nothing else. Operations on phantoms run on the meta device and give
phantoms again, so code that only looks at ``.shape``/``.dtype``/``.device`` (mask builders,
rotary embeddings) works unchanged, while any value computed FROM a phantom stays a phantom.

That makes the split safe by construction: a value that depends on another stage's module can
never silently enter this stage's computation. Where the stage would need it (a block argument,
the loss, a Python ``bool``/``item`` of it) the run stops with :class:`PhantomValueError`, which
names the module the value came from.

Example::

    >>> import torch
    >>> p = Phantom(torch.empty(2, 3, device="meta"), torch.device("cpu"), "wte")
    >>> q = (p * 2).sum(-1)
    >>> type(q).__name__, tuple(q.shape), q.device.type, q.origin
    ('Phantom', (2,), 'cpu', 'wte')
    >>> bool(q[0] > 0)
    Traceback (most recent call last):
    ...
    lightning_pp.autosplit.phantom.PhantomValueError: the value of an output of `wte` ...
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["Phantom", "PhantomValueError", "origins_of"]

aten = torch.ops.aten

# Ops that need a tensor's values in Python (control flow on data): never answerable.
_DATA_OPS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
}


class PhantomValueError(RuntimeError):
    """A value produced by a module of another stage was needed on this stage."""


class Phantom(Tensor):
    """A tensor with metadata only; ``origin`` names the module whose output it stands for."""

    _meta: Tensor
    origin: str

    @staticmethod
    def __new__(cls, meta: Tensor, device: torch.device, origin: str) -> Phantom:
        r = Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride(),
            storage_offset=meta.storage_offset(),
            dtype=meta.dtype,
            device=device,
            requires_grad=meta.requires_grad,
        )
        r._meta = meta
        r.origin = origin
        return r

    def __init__(self, meta: Tensor, device: torch.device, origin: str) -> None:
        super().__init__()

    def __repr__(self) -> str:  # never touches values
        return f"Phantom(shape={tuple(self.shape)}, dtype={self.dtype}, origin={self.origin!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        phantoms = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Phantom)]
        origin = " + ".join(dict.fromkeys(p.origin for p in phantoms))
        device = phantoms[0].device
        if func in _DATA_OPS:
            raise PhantomValueError(
                f"the value of an output of `{origin}` is needed here ({func.__name__}, e.g. "
                f"`if`/`bool()`/`.item()` on it), but `{origin}` runs on another pipeline stage: "
                f"data-dependent control flow on values from across the cut cannot be split"
            )

        def to_meta(x: Any) -> Any:
            if isinstance(x, Phantom):
                return x._meta
            if isinstance(x, Tensor):
                return x.to("meta")
            if isinstance(x, torch.device):
                return torch.device("meta")
            return x

        try:
            out = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        except (NotImplementedError, RuntimeError) as e:
            raise PhantomValueError(
                f"`{func.__name__}` on an output of `{origin}` (which runs on another pipeline "
                f"stage) cannot be evaluated without its values: {e}"
            ) from e
        if func._schema.is_mutable:
            # in-place: the (meta) target was updated; hand back the original argument object
            mutated = args[0]
            if not isinstance(mutated, Phantom):
                raise PhantomValueError(
                    f"in-place `{func.__name__}` writes a value computed from `{origin}` (another "
                    f"pipeline stage) into a real tensor"
                )
            return mutated
        return tree_map(
            lambda t: cls(t, device, origin) if isinstance(t, Tensor) else t,
            out,
        )


def origins_of(tree: Any) -> list[str]:
    """Origins of every phantom in a (nested) structure, first appearance first."""
    leaves = tree_flatten(tree)[0]
    return list(dict.fromkeys(t.origin for t in leaves if isinstance(t, Phantom)))

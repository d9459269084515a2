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
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["LenientMeta", "Phantom", "PhantomValueError", "meta_call", "origins_of"]

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
            if isinstance(x, DTensor):  # a tensor-parallel weight: its whole shape, no mesh
                return torch.empty(x.shape, dtype=x.dtype, device="meta")
            if isinstance(x, Tensor):
                return x.to("meta")
            if isinstance(x, torch.device):
                return torch.device("meta")
            return x

        try:
            out = meta_call(func, tree_map(to_meta, args), tree_map(to_meta, kwargs))
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


def _floating(x: Any) -> bool:
    return isinstance(x, Tensor) and x.is_floating_point() and x.dtype != torch.bfloat16


def meta_call(func: Any, args: Any, kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` on meta tensors, tolerating meta kernels stricter than the CPU
    kernels about dtypes.

    Some meta kernels mirror the CUDA kernel's checks rather than the CPU kernel's: torch's
    ``_grouped_mm`` meta kernel (the Hugging Face mixture-of-experts ``grouped_mm`` path) accepts
    bfloat16 only, while the CPU kernel computes in float32. A meta computation has no values,
    so when such a kernel refuses a float32/float16 input, the call is repeated with the
    floating inputs cast to bfloat16 and the floating outputs cast back to the inputs' dtype:
    only the shapes matter here, and those do not depend on the dtype.

    Example:
        >>> a = torch.empty(6, 8, device="meta")
        >>> b = torch.empty(2, 8, 8, device="meta")
        >>> offs = torch.empty(2, dtype=torch.int32, device="meta")
        >>> meta_call(torch.ops.aten._grouped_mm.default, (a, b), {"offs": offs}).dtype
        torch.float32
    """
    try:
        return func(*args, **kwargs)
    except RuntimeError:
        floats = [t for t in tree_flatten((args, kwargs))[0] if _floating(t) and t.is_meta]
        if not floats:
            raise
        dtype = floats[0].dtype

        def down(x: Any) -> Any:
            return x.to(torch.bfloat16) if _floating(x) and x.is_meta else x

        out = func(*tree_map(down, args), **tree_map(down, kwargs))  # a second refusal raises
        return tree_map(
            lambda t: t.to(dtype) if isinstance(t, Tensor) and t.dtype == torch.bfloat16 else t,
            out,
        )


class LenientMeta(TorchDispatchMode):
    """Run a module on meta tensors with every op through :func:`meta_call` (the meta twin of
    a block of another stage, whose output structure a stage needs; see
    :mod:`lightning_pp.autosplit.split`).

    Example:
        >>> with LenientMeta():
        ...     y = torch.nn.functional.grouped_mm(
        ...         torch.empty(6, 8, device="meta"), torch.empty(2, 8, 8, device="meta"),
        ...         offs=torch.empty(2, dtype=torch.int32, device="meta"))
        >>> y.shape, y.dtype
        (torch.Size([6, 8]), torch.float32)
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        return meta_call(func, args, kwargs or {})


def origins_of(tree: Any) -> list[str]:
    """Origins of every phantom in a (nested) structure, first appearance first."""
    leaves = tree_flatten(tree)[0]
    return list(dict.fromkeys(t.origin for t in leaves if isinstance(t, Phantom)))

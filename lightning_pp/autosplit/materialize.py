"""Build only this rank's part of a model, with the weights a plain build would give it.

Two builds of the user's own constructor (``model_fn``), no second definition of the model:

1. **Shape build** on the meta device: costs no memory; gives every parameter's name, shape and
   tie, and the order in which the constructor registers parameters and buffers.
2. **Replay build** on CPU under the same seed: every parameter or buffer that is NOT kept is
   swapped for a meta tensor at the moment the constructor registers it, so it never holds
   memory for longer than its own construction. Random initialisation still runs for it: an
   in-place random op (``normal_``, ``uniform_``, ...) on such a meta tensor is carried out on a
   scratch CPU tensor of the same shape, dtype and strides and thrown away. The CPU generator
   therefore advances exactly as in the plain build, and every KEPT tensor receives exactly the
   values ``torch.manual_seed(seed); model_fn()`` gives it (the tests check bit equality).

Cost: the replay draws every random number of the whole model (time, not memory: peak extra
memory is the largest single tensor). For a 7B model that is about as long as a plain CPU
initialisation; loading a checkpoint instead skips it (``seed=None`` and load afterwards).

Why not a per-module seed (``seed ^ hash(name)``) and the module's ``reset_parameters``: the
weights would then differ from the plain model's, and init written inline in a constructor
(nanoGPT's scaled ``c_proj`` loop, Hugging Face ``post_init``) would be lost or need a hook.

Example::

    model_fn = lambda: GPT2LMHeadModel(config)
    shape = meta_build(model_fn)
    keep = {n for n, _ in shape.model.named_parameters() if n.startswith("transformer.h.0.")}
    local = replay_build(model_fn, shape, keep=lambda name: name in keep, seed=0)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["ReplayError", "ShapeBuild", "meta_build", "meta_twin", "replay_build"]


class ReplayError(RuntimeError):
    """The replay build could not reproduce the shape build (non-deterministic constructor)."""


@dataclass
class ShapeBuild:
    """The meta-device build: ``model`` and ``registrations``, the tensor registered at each
    parameter/buffer registration call of the constructor, in order (``None`` entries kept)."""

    model: nn.Module
    registrations: list[Tensor | None] = field(default_factory=list)

    def names_of(self) -> dict[int, list[str]]:
        """id(tensor) -> every name (parameters and buffers, ties included) it ends up under."""
        names: dict[int, list[str]] = {}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        for n, b in self.model.named_buffers(remove_duplicate=False):
            names.setdefault(id(b), []).append(n)
        return names


@contextlib.contextmanager
def _registration_hooks(
    on_param: Callable[[nn.Module, str, Any], Any], on_buffer: Callable[[nn.Module, str, Any], Any]
) -> Iterator[None]:
    handles = [
        register_module_parameter_registration_hook(on_param),
        register_module_buffer_registration_hook(on_buffer),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def meta_build(model_fn: Callable[[], nn.Module]) -> ShapeBuild:
    """Run ``model_fn`` on the meta device, recording the registration order."""
    regs: list[Tensor | None] = []

    def record(module: nn.Module, name: str, value: Any) -> None:
        regs.append(value)

    with _registration_hooks(record, record), torch.device("meta"):
        model = model_fn()
    return ShapeBuild(model, regs)


class _ScratchRandom(TorchDispatchMode):
    """Random ops on meta tensors draw from the CPU generator into a scratch tensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            leaves = tree_flatten((args, kwargs))[0]
            if any(isinstance(t, Tensor) and t.is_meta for t in leaves):

                def scratch(x: Any) -> Any:
                    if isinstance(x, Tensor) and x.is_meta:
                        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
                    return x

                out = func(*tree_map(scratch, args), **tree_map(scratch, kwargs))
                if func._schema.is_mutable:
                    return args[0]
                return tree_map(lambda t: t.to("meta") if isinstance(t, Tensor) else t, out)
        return func(*args, **kwargs)


def _to_meta(value: Tensor) -> Tensor:
    meta = torch.empty_like(value, device="meta")
    if isinstance(value, nn.Parameter):
        meta = nn.Parameter(meta, requires_grad=value.requires_grad)
        meta.__dict__.update(value.__dict__)  # e.g. Hugging Face's ``_is_hf_initialized``
    return meta


def replay_build(
    model_fn: Callable[[], nn.Module],
    shape: ShapeBuild,
    keep: Callable[[str], bool],
    seed: int | None,
) -> nn.Module:
    """Build ``model_fn()`` on CPU holding real storage only for tensors with a kept name.

    A tensor is kept when ANY of its names is (a tied weight is kept where any of its users is).
    The kept tensors equal those of ``torch.manual_seed(seed); model_fn()``; the caller's RNG
    state is then restored. ``seed=None``: those of a plain build from the current RNG state,
    and the generator is left where a plain build leaves it (what comes next, e.g. a shuffling
    sampler's seed, draws the same numbers as in an unpipelined run).

    Raises:
        ReplayError: the constructor registered different tensors than in the shape build.
    """
    names = shape.names_of()
    plan = [
        None if t is None else any(keep(n) for n in names.get(id(t), []))
        for t in shape.registrations
    ]
    seen: dict[int, Tensor] = {}  # id(original) -> what was registered instead
    originals: list[Tensor] = []  # keeps ids unique while building
    count = [0]

    def swap(module: nn.Module, name: str, value: Any) -> Any:
        i = count[0]
        count[0] += 1
        if value is None:
            return None
        if id(value) in seen:  # re-registration of the same object (a tie)
            return seen[id(value)]
        if i >= len(plan) or plan[i] is None:
            raise ReplayError(
                f"registration #{i} ({type(module).__name__}.{name}) has no counterpart in the "
                f"meta-device build: the model's constructor must register the same tensors in "
                f"the same order on every build"
            )
        out = value if plan[i] else _to_meta(value)
        seen[id(value)] = out
        originals.append(value)
        return out

    rng = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with rng:
        if seed is not None:
            torch.manual_seed(seed)
        with _registration_hooks(swap, swap), _ScratchRandom():
            model = model_fn()
    if count[0] != len(plan):
        raise ReplayError(
            f"the constructor made {count[0]} parameter/buffer registrations on the replay build "
            f"but {len(plan)} on the meta-device build"
        )
    got = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    want = [n for n, _ in shape.model.named_parameters(remove_duplicate=False)]
    if got != want:
        raise ReplayError(f"parameter names differ between builds: {got} != {want}")
    shape_params = dict(shape.model.named_parameters(remove_duplicate=False))
    for n, p in model.named_parameters(remove_duplicate=False):
        real = any(keep(m) for m in names.get(id(shape_params[n]), []))
        if p.is_meta == real:
            raise ReplayError(
                f"parameter `{n}` is {'meta' if p.is_meta else 'materialised'} after the replay "
                f"build, expected the opposite (was it re-created outside its registration?)"
            )
    return model


def meta_twin(model: nn.Module) -> ShapeBuild:
    """A meta-device copy of an already built ``model`` (same names and ties, no storage): the
    shape build for a model that exists already (``StagedModel.assemble``). Only module
    objects are copied; every parameter and buffer becomes a meta tensor of its shape."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo.setdefault(id(p), _to_meta(p))
    for b in model.buffers():
        memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    return ShapeBuild(copy.deepcopy(model, memo))

"""A model's per-layer bytes measured on PyTorch's ``meta`` device: what a dry run can know.

``lightning-pp plan`` (without ``--search``) builds the model on the meta device, where
tensors have shapes and dtypes but no storage, so it cannot time anything; it can still run
each pipeline layer's forward on a meta input of one microbatch and record, as the profiler
does (:func:`~lightning_pp.runtime.recompute_probe.measure_chunk`, parameters excluded, each
storage once), what autograd saves for backward, and each layer's input and output bytes.
That is every byte the memory model (:mod:`lightning_pp.planner.memory`) needs, for a
70B-parameter model in about a second and no memory.

Two things differ from a run on a device:

- **Storage identity.** Every meta tensor's ``data_ptr()`` is 0, so storages are keyed by the
  storage object's own handle (``UntypedStorage._cdata``), each kept alive until the end so
  that a handle is never reused.
- **Attention.** On meta, ``F.scaled_dot_product_attention`` falls back to the math kernel,
  which saves the ``T x T`` attention matrix (4 GiB per layer at 4096 tokens and 64 heads in
  fp32). A run on a GPU (and on a CPU) takes the flash kernel, which saves the query, key,
  value, output and the row log-sum-exp. :class:`FlashAttentionOnMeta` stands in for it while
  measuring, so the measurement counts what the flash kernel saves.

Example:
    >>> import torch
    >>> from torch import nn
    >>> with torch.device("meta"):
    ...     layers = [nn.Linear(1024, 1024) for _ in range(2)]
    >>> costs = meta_layer_costs(layers, torch.empty(8, 1024, device="meta"))
    >>> [(c.params, c.saved_bytes, c.boundary_bytes) for c in costs]   # a Linear saves its input
    [(1049600, 32768, 32768), (1049600, 32768, 32768)]
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..layout.partition import PipelineChunk
from ..runtime.recompute_probe import measure_chunk
from .profile import LayerCost
from .profiler import _nbytes, _repeat_to, _tensors, tied_group_of
from .sharding import TiedTensor

__all__ = [
    "FlashAttentionOnMeta",
    "example_input",
    "layer_tensor_shapes",
    "layers_tensor_shapes",
    "tied_groups",
    "meta_layer_costs",
    "meta_layers",
]


class _FlashAttention(torch.autograd.Function):
    """Attention's shapes, saving what the flash kernel saves: query, key, value, output, the
    fp32 log-sum-exp of each query row (and a mask, which the memory-efficient kernel keeps)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> Any:
        # (..., T, heads, D) memory seen as (..., heads, T, D), as the flash kernels lay out
        # their output: the usual ``transpose(1, 2).contiguous()`` after attention is then free
        # (no second copy), on a device as here
        *lead, heads, t, _ = q.shape
        out = q.new_empty((*lead, t, heads, v.shape[-1])).transpose(-3, -2)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        saved = (q, k, v, out, lse) + ((mask,) if isinstance(mask, torch.Tensor) else ())
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


class FlashAttentionOnMeta(TorchFunctionMode):
    """Inside the block, ``F.scaled_dot_product_attention`` on meta tensors saves what the flash
    kernel saves, not the math fallback's attention matrix (see the module notes); on any
    other device it runs unchanged.

    Example:
        >>> q = torch.empty(1, 2, 4096, 64, device="meta", requires_grad=True)
        >>> with FlashAttentionOnMeta():
        ...     F.scaled_dot_product_attention(q, q, q, is_causal=True).shape
        torch.Size([1, 2, 4096, 64])
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and args[0].device.type == "meta":
            q, k, v = args[:3]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            return _FlashAttention.apply(q, k, v, mask)
        return func(*args, **kwargs)


def meta_layers(module: nn.Module) -> list[nn.Module]:
    """The pipeline layers of a :class:`~lightning_pp.strategy.model.PipelineMixin` module
    built on the meta device: those it holds, and the others built alone from their builders,
    still on meta (as ``lightning-pp plan`` counts their parameters)."""
    pipeline = module.pipeline_layers()  # type: ignore[operator]
    out = []
    for i in range(pipeline.num_layers):
        layer = pipeline[i] if i in pipeline else None
        if layer is None:
            with torch.device("meta"):
                layer = pipeline._builders[i]()
        out.append(layer)
    return out


def layer_tensor_shapes(layer: nn.Module) -> list[tuple[int, ...]]:
    """Each trainable parameter's shape, in parameter order (the gradient buckets' order; the
    shards are whole rows of the first dim)."""
    return [tuple(p.shape) for p in layer.parameters() if p.requires_grad]


def layers_tensor_shapes(
    layers: Sequence[nn.Module], tied: Sequence[Sequence[str]] = ()
) -> list[list[tuple[int, ...] | TiedTensor]]:
    """:func:`layer_tensor_shapes` of every layer, each member of a ``tied`` group
    (``PipelineLayers.tied``: names like ``"0.wte.weight"``) as a
    :class:`~lightning_pp.planner.sharding.TiedTensor` of that group, so that a rank holding
    two members (V placement's embedding and head) counts the tensor once.

    Example:
        >>> layers = [nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)]
        >>> layers_tensor_shapes(layers, [("0.weight", "1.weight")])[1]
        [TiedTensor(spec=(4, 2), group=0)]
    """
    group_of = tied_group_of(tied)
    out: list[list[tuple[int, ...] | TiedTensor]] = []
    for i, layer in enumerate(layers):
        specs: list[tuple[int, ...] | TiedTensor] = []
        for name, p in layer.named_parameters():
            if not p.requires_grad:
                continue
            g = group_of.get((i, name))
            specs.append(tuple(p.shape) if g is None else TiedTensor(tuple(p.shape), g))
        out.append(specs)
    return out


def tied_groups(module: Any) -> list[tuple[str, ...]]:
    """The tied parameter groups of a ``PipelineLayers`` model (none for another)."""
    pipeline = (
        module.pipeline_layers() if callable(getattr(module, "pipeline_layers", None)) else None
    )
    return [tuple(g) for g in getattr(pipeline, "tied", ())]


def _meta_key() -> tuple[Callable[[torch.Tensor], tuple[Any, int] | None], Callable[..., Any]]:
    """A storage key for meta tensors (``_cdata``; parameters excluded once registered) and
    the function that registers parameters."""
    alive: list[Any] = []
    params: set[int] = set()

    def key(t: torch.Tensor) -> tuple[Any, int] | None:
        st = t.untyped_storage()
        if st._cdata in params:
            return None
        alive.append(st)  # a freed storage's handle could be reused by the next one
        return st._cdata, st.nbytes()

    def exclude(layers: Sequence[nn.Module]) -> None:
        for layer in layers:
            for p in layer.parameters():
                alive.append(p.untyped_storage())
                params.add(p.untyped_storage()._cdata)

    return key, exclude


def _fresh_meta(x: Any) -> Any:
    """``x`` as a received stage input: detached, floating tensors requiring grad."""

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.requires_grad_(True) if t.is_floating_point() else t

    if isinstance(x, torch.Tensor):
        return one(x)
    if isinstance(x, (tuple, list)):
        return type(x)(one(t) if isinstance(t, torch.Tensor) else t for t in x)
    return x


def _held(x: Any, key: Callable[[torch.Tensor], tuple[Any, int] | None]) -> dict[Any, int]:
    """A layer input's tensors by storage key (parameters left out): what a checkpoint of the
    layer holds."""
    out = {}
    for t in _tensors(x):
        k = key(t)
        if k is not None:
            out[k[0]] = _nbytes(t)
    return out


def meta_layer_costs(layers: Sequence[nn.Module], x0: Any) -> list[LayerCost]:
    """One :class:`~lightning_pp.planner.profile.LayerCost` per layer (bytes and parameter
    counts; no times) from one forward of ``layers`` on ``x0``, the first layer's input on the
    meta device (one microbatch). ``param_bytes`` counts the layers' own dtypes; cast the
    layers first (``layer.to(torch.bfloat16)``) to measure a 16-bit run."""
    key, exclude = _meta_key()
    exclude(layers)
    inputs: list[Any] = []
    hooks = [m.register_forward_pre_hook(lambda _m, a: inputs.append(a[0])) for m in layers]
    try:
        with FlashAttentionOnMeta(), torch.enable_grad():
            out, probes = measure_chunk(PipelineChunk(list(layers)), (_fresh_meta(x0),), key)
    finally:
        for h in hooks:
            h.remove()
    held = [_held(a, key) for a in inputs]
    outputs = inputs[1:] + [out]
    costs = []
    for i, (layer, probe) in enumerate(zip(layers, probes)):
        prev_saved = probes[i - 1].saved if i else {}
        prev_held = held[i - 1] if i else {}
        costs.append(
            LayerCost(
                t_f=0.0,
                t_i=0.0,
                t_w=0.0,
                saved_bytes=sum(probe.saved.values()),
                shared_bytes=sum(b for k, b in probe.saved.items() if k in prev_saved),
                params=sum(p.numel() for p in layer.parameters() if p.requires_grad),
                param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
                input_bytes=_nbytes(inputs[i]),
                boundary_bytes=_nbytes(outputs[i]),
                input_shared_bytes=sum(b for k, b in held[i].items() if k in prev_held),
                input_saved_bytes=sum(
                    b for k, b in held[i].items() if k in probe.saved or k in prev_saved
                ),
                input_self_saved_bytes=sum(b for k, b in held[i].items() if k in probe.saved),
            )
        )
    return costs


def example_input(
    module: nn.Module, data_spec: Any, samples: int, instantiate: Callable[[Any], Any]
) -> Any:
    """The first pipeline layer's input for a microbatch of ``samples`` samples, on the meta
    device: one sample of the configured data module (``instantiate(data_spec)``, ``setup
    ("fit")``, ``train_dataloader().dataset[0]``; the loader's next batch when its dataset
    cannot be indexed), through ``module.pipeline_input``, repeated to ``samples``.

    ``prepare_data`` is not called (a dry run downloads nothing): a data module that needs it
    first raises, and the caller reports the activations as not measured."""
    from torch.utils.data import default_collate

    dm = instantiate(data_spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "4 workers > 2 CPUs": no worker is started here
        setup = getattr(dm, "setup", None)
        if callable(setup):
            setup("fit")
        loader = dm.train_dataloader()
        dataset = getattr(loader, "dataset", None)
        try:
            batch = default_collate([dataset[0]])  # type: ignore[index]
        except (TypeError, NotImplementedError, IndexError, KeyError):
            batch = next(iter(loader))
    x = _repeat_to(module.pipeline_input(batch), samples)  # type: ignore[operator]
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    return type(x)(t.to("meta") if isinstance(t, torch.Tensor) else t for t in x)

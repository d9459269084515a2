"""What one tensor-parallel rank holds: its layers' local shapes, bytes and collectives.

The planner reads the model's own tensor-parallel plan (no rule of its own): the
:meth:`~lightning_pp.strategy.model.PipelineMixin.pipeline_tensor_parallel` hook is called on
each meta layer with a stand-in mesh of ``tp`` ranks, and the ``parallelize_module`` plan it
would apply is recorded instead of applied (:func:`record_tp_styles`). From the styles:

============================  ======================================  ====================
style (module)                what a tp rank holds                    collectives per pass
============================  ======================================  ====================
``ColwiseParallel`` Linear    ``weight`` and ``bias`` rows ``/ tp``   backward: all-reduce
                                                                      of the input gradient;
                                                                      gathered output
                                                                      (``Replicate``): a
                                                                      forward all-gather
``RowwiseParallel`` Linear    ``weight`` columns ``/ tp``, bias whole forward: all-reduce of
                                                                      the output
``RowwiseParallel`` Embedding ``weight`` rows (vocabulary) ``/ tp``   forward: all-reduce
``ColwiseParallel`` Embedding ``weight`` columns ``/ tp``             forward: all-gather
anything else                 whole (norms, position embedding)       none
============================  ======================================  ====================

:func:`local_layer` makes a meta copy of a layer with those local shapes, so the planner's
meta measurement (:func:`~lightning_pp.planner.meta_profile.meta_layer_costs`) gives one tp
rank's parameters and saved activations exactly: the sharded intermediates (q, k, v and the
attention of ``heads / tp`` heads, the MLP's ``ffn / tp`` hidden units) shrink, what a
row-wise layer all-reduces (the block's output, the stage boundary) stays whole: there is no
sequence parallelism.

Example:
    >>> import torch
    >>> from lightning_pp.models.decoder import DecoderLM
    >>> with torch.device("meta"):
    ...     model = DecoderLM(vocab_size=64, n_layer=2, n_head=4, n_embd=32, block_size=8)
    ...     model.configure_model()
    >>> model_tp_sizes(model)
    TpSizes(heads=4, kv_heads=4, hidden=32, ffn=128, vocab=64)
    >>> from lightning_pp.planner.meta_profile import meta_layers
    >>> layers = meta_layers(model)
    >>> styles = record_tp_styles(model, layers, tp=2)
    >>> {n: s.kind for n, s in sorted(styles[1].items())}  # doctest: +NORMALIZE_WHITESPACE
    {'fc': 'colwise', 'fc_proj': 'rowwise', 'k': 'colwise', 'proj': 'rowwise',
     'q': 'colwise', 'v': 'colwise'}
    >>> block = local_layer(layers[1], styles[1], 2)
    >>> tuple(block.q.weight.shape), tuple(block.proj.weight.shape), tuple(block.ln_1.weight.shape)
    ((16, 32), (32, 16), (32,))
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..layout.rules import PreflightError, check_tp_sizes
from .profile import LayerCost

__all__ = [
    "TP_CANDIDATES",
    "TpLayer",
    "TpSizes",
    "TpStyle",
    "check_model_tp",
    "local_layer",
    "local_layers",
    "model_tp_sizes",
    "record_tp_styles",
    "tp_layer_cost",
    "tp_layers",
    "tp_options",
]

#: the tensor-parallel sizes ``plan`` reports and ``plan --search`` tries
TP_CANDIDATES: tuple[int, ...] = (1, 2, 4, 8)


@dataclass(frozen=True)
class TpSizes:
    """The sizes tensor parallelism divides (``None``: the model does not say)."""

    heads: int | None = None
    kv_heads: int | None = None
    hidden: int | None = None
    ffn: int | None = None
    vocab: int | None = None

    def check(self, tp: int) -> None:
        """:func:`~lightning_pp.layout.rules.check_tp_sizes` on these sizes."""
        check_tp_sizes(
            tp,
            heads=self.heads,
            kv_heads=self.kv_heads,
            hidden=self.hidden,
            ffn=self.ffn,
            vocab=self.vocab,
        )


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def model_tp_sizes(module: Any) -> TpSizes:
    """The sizes of ``module``: a Hugging Face config (``num_attention_heads``,
    ``num_key_value_heads``, ``hidden_size``, ``intermediate_size``, ``vocab_size``) on the
    module or on a module inside it, else the project's GPT hyperparameters (``n_head``,
    ``n_embd``, a ``4 x n_embd`` MLP, ``vocab_size``)."""
    config = getattr(module, "config", None)
    if config is None and isinstance(module, nn.Module):
        config = next(
            (
                m.config
                for m in module.modules()
                if getattr(getattr(m, "config", None), "num_attention_heads", None)
            ),
            None,
        )
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if config is not None and _int(getattr(config, "num_attention_heads", None)):
        heads = _int(config.num_attention_heads)
        return TpSizes(
            heads=heads,
            kv_heads=_int(getattr(config, "num_key_value_heads", None)) or heads,
            hidden=_int(getattr(config, "hidden_size", None)),
            ffn=_int(getattr(config, "intermediate_size", None)),
            vocab=_int(getattr(config, "vocab_size", None)),
        )
    h = getattr(module, "hparams", None) or {}
    heads, hidden = _int(h.get("n_head")), _int(h.get("n_embd"))
    return TpSizes(
        heads=heads,
        kv_heads=heads,
        hidden=hidden,
        ffn=4 * hidden if hidden else None,
        vocab=_int(h.get("vocab_size")),
    )


@dataclass(frozen=True)
class TpStyle:
    """One module's tensor-parallel style: ``colwise``, ``rowwise``, ``sequence`` (a norm
    under sequence parallelism: torch's ``SequenceParallel``) or ``rows`` (an output with no
    batch dim, a position table's, cut by rows to the rank's positions: its gradient is
    all-gathered in backward, once per microbatch whatever its size); ``gathered``: a column-wise
    output all-gathered back to whole (``output_layouts=Replicate()``); ``seq_out``: a
    row-wise output reduce-scattered along the sequence (``output_layouts=Shard(1)``), so what
    leaves it holds ``T / tp`` positions."""

    kind: str
    gathered: bool = False
    seq_out: bool = False
    #: a column-wise Linear that saves only ``T / tp`` of its input for backward and gathers
    #: it again there (``lightning_pp.models.sequence_parallel.ColwiseFromSequence``)
    keeps_part: bool = False


class _StandInMesh:
    """What a ``pipeline_tensor_parallel`` hook reads of its mesh before ``parallelize_module``
    (its size); the recorder never hands it to torch."""

    def __init__(self, tp: int) -> None:
        self._tp = tp
        self.ndim = 1

    def size(self, dim: int | None = None) -> int:
        return self._tp


def _style_of(style: Any) -> TpStyle | None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    layouts = getattr(style, "output_layouts", ())
    layouts = layouts if isinstance(layouts, (tuple, list)) else (layouts,)
    if isinstance(style, ColwiseParallel):
        gathered = any(isinstance(p, Replicate) for p in layouts)
        return TpStyle("colwise", gathered, keeps_part=getattr(style, "keeps_sequence_part", False))
    if isinstance(style, RowwiseParallel):
        return TpStyle("rowwise", seq_out=any(isinstance(p, Shard) and p.dim == 1 for p in layouts))
    if isinstance(style, SequenceParallel):
        return TpStyle("sequence")
    if isinstance(style, PrepareModuleOutput):
        wanted = getattr(style, "desired_output_layouts", ())
        if any(isinstance(p, Shard) and p.dim == 0 for p in wanted if p is not None):
            return TpStyle("rows")  # a batch-free output (a position table's) cut by rows
    return None


@contextmanager
def _recording(calls: list[tuple[nn.Module, Any]]):
    import torch.distributed.tensor.parallel as tp_api

    original = tp_api.parallelize_module

    def record(module: nn.Module, device_mesh: Any = None, parallelize_plan: Any = None, **_: Any):
        calls.append((module, parallelize_plan))
        return module

    tp_api.parallelize_module = record  # type: ignore[assignment]
    try:
        yield
    finally:
        tp_api.parallelize_module = original  # type: ignore[assignment]


def record_tp_styles(
    module: Any, layers: Sequence[nn.Module], tp: int
) -> list[dict[str, TpStyle]] | None:
    """Each layer's ``{submodule name: style}`` as ``module.pipeline_tensor_parallel`` would
    apply it at ``tp`` (``""``: the layer itself); ``None`` when the model has no such hook (or
    its hook does not go through ``torch.distributed.tensor.parallel.parallelize_module``).
    Raises :class:`~lightning_pp.layout.rules.PreflightError` when the hook refuses ``tp``."""
    hook = getattr(module, "pipeline_tensor_parallel", None)
    if not callable(hook):
        return None
    out: list[dict[str, TpStyle]] = []
    for index, layer in enumerate(layers):
        calls: list[tuple[nn.Module, Any]] = []
        with _recording(calls):
            try:
                hook(layer, index, _StandInMesh(tp))
            except NotImplementedError:
                return None
            except (ValueError, TypeError) as err:
                raise PreflightError(f"layer {index}: {err}", key="tp") from None
        styles: dict[str, TpStyle] = {}
        for target, plan in calls:
            prefix = next((n for n, m in layer.named_modules() if m is target), None)
            if prefix is None:
                continue
            items = plan.items() if isinstance(plan, Mapping) else [("", plan)]
            names = [n for n, _ in layer.named_modules()]
            for pattern, style in items:
                kind = _style_of(style)
                if kind is None:
                    continue
                full = f"{prefix}.{pattern}" if prefix and pattern else prefix or pattern
                for name in names:
                    if fnmatch.fnmatchcase(name, full):
                        styles[name] = kind
        out.append(styles)
    if not any(out):
        return None
    return out


def _shard_dims(module: nn.Module, style: TpStyle) -> dict[str, int]:
    """Which parameter of ``module`` is cut on which dim under ``style``."""
    if style.kind not in ("colwise", "rowwise"):
        return {}  # a norm's or a cut output's style leaves the weights whole
    if isinstance(module, nn.Linear):
        return {"weight": 0, "bias": 0} if style.kind == "colwise" else {"weight": 1}
    if isinstance(module, nn.Embedding):
        return {"weight": 1} if style.kind == "colwise" else {"weight": 0}
    return {}


def local_layer(layer: nn.Module, styles: Mapping[str, TpStyle], tp: int) -> nn.Module:
    """A meta copy of ``layer`` as one of ``tp`` ranks holds it: every styled Linear and
    Embedding cut to its local shard (raises
    :class:`~lightning_pp.layout.rules.PreflightError` naming a dim ``tp`` does not divide)."""
    if tp == 1 or not styles:
        return layer
    with torch.device("meta"):
        local = copy.deepcopy(layer).to("meta")
    for name, style in styles.items():
        mod = local.get_submodule(name)
        for pname, dim in _shard_dims(mod, style).items():
            p = getattr(mod, pname, None)
            if p is None:
                continue
            if p.shape[dim] % tp:
                raise PreflightError(
                    f"{name}.{pname} of shape {tuple(p.shape)} is cut {style.kind} on dim {dim} "
                    f"(size {p.shape[dim]}) over tp={tp}, which does not divide it",
                    key="tp",
                )
            shape = list(p.shape)
            shape[dim] //= tp
            empty = torch.empty(shape, device="meta", dtype=p.dtype)
            setattr(mod, pname, nn.Parameter(empty, requires_grad=p.requires_grad))
        if isinstance(mod, nn.Linear):
            mod.out_features, mod.in_features = mod.weight.shape
        elif isinstance(mod, nn.Embedding):
            mod.num_embeddings, mod.embedding_dim = mod.weight.shape
    return local


def local_layers(
    layers: Sequence[nn.Module], styles: Sequence[Mapping[str, TpStyle]] | None, tp: int
) -> list[nn.Module]:
    """:func:`local_layer` of every layer (``styles`` ``None`` or ``tp = 1``: the layers)."""
    if tp == 1 or styles is None:
        return list(layers)
    return [local_layer(layer, s, tp) for layer, s in zip(layers, styles)]


def check_model_tp(module: Any, layers: Sequence[nn.Module] | None, tp: int) -> str | None:
    """Refuse ``tp`` for ``module`` with the numbers named (sizes it does not divide, a hook
    that refuses it); return a note when the tp bytes cannot be predicted (no hook), else
    ``None``. ``tp = 1``: nothing to check."""
    if tp == 1:
        return None
    model_tp_sizes(module).check(tp)
    if layers is None:
        return None
    if record_tp_styles(module, layers, tp) is None:
        return (
            f"{type(module).__name__} has no pipeline_tensor_parallel hook that calls "
            f"parallelize_module: the strategy cannot shard it at tp={tp} (DecoderLM, "
            f"lightning_pp.models.decoder, can)"
        )
    return None


def tp_options(
    module: Any, layers: Sequence[nn.Module] | None, world: int | None, pp: int
) -> list[tuple[int, str | None]]:
    """(tp, why not) for each of :data:`TP_CANDIDATES`: ``None`` where ``tp`` is possible for
    ``pp`` pipeline ranks on ``world`` processes and the model's sizes."""
    out: list[tuple[int, str | None]] = []
    for tp in TP_CANDIDATES:
        if world is not None and world % (pp * tp):
            out.append((tp, f"world {world} % (pp {pp} x tp {tp}) = {world % (pp * tp)}"))
            continue
        try:
            note = check_model_tp(module, layers, tp)
        except PreflightError as err:
            out.append((tp, str(err)))
            continue
        out.append((tp, note))
    return out


# --------------------------------------------------------------------------------------------
# The search: a tp rank's share of a profiled layer
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TpLayer:
    """One layer at ``tp``, relative to the whole layer, from the meta model (one sample):
    ``params`` / ``full_params`` its trainable elements on one tp rank and whole;
    ``saved_ratio`` its saved activations on one tp rank over whole; the bytes per sample of
    each collective of one forward and backward, whole size: ``fwd_all_reduce`` (a row-wise
    output's partial sums), ``bwd_all_reduce`` (a column-wise input gradient's partial sums),
    ``all_gather`` (forward: a gathered column-wise output; under sequence parallelism also a
    norm's gathered output and a row-wise output's reduce-scatter, which costs the same),
    ``bwd_all_gather`` (backward, sequence parallelism: the reduce-scatter of a norm's
    gathered input gradient, the all-gather of a row-wise output's gradient, the regather of
    a ``keeps_part`` input), ``bwd_all_gather_fixed`` (the same for a ``rows`` output: bytes
    per microbatch)."""

    tp: int
    params: int
    full_params: int
    saved_ratio: float = 1.0
    fwd_all_reduce: tuple[int, ...] = ()
    bwd_all_reduce: tuple[int, ...] = ()
    all_gather: tuple[int, ...] = ()
    bwd_all_gather: tuple[int, ...] = ()
    #: backward all-gathers of a ``rows`` output: whole bytes per microbatch, not per sample
    bwd_all_gather_fixed: tuple[int, ...] = ()
    #: sequence parallelism: the layer's input / output holds ``T / tp`` positions (see
    #: :func:`sequence_cuts`)
    input_cut: bool = False
    output_cut: bool = False
    #: ``(group, elements on one tp rank)`` of each tied member the layer holds (see
    #: ``LayerCost.tied``)
    tied: tuple[tuple[int, int], ...] = ()

    @property
    def param_ratio(self) -> float:
        return self.params / self.full_params if self.full_params else 1.0

    def comm_seconds(
        self, samples: float, latency_s: float, bandwidth: float
    ) -> tuple[float, float]:
        """(forward, backward) seconds of the layer's collectives over ``tp`` ranks for a
        microbatch of ``samples``, ring model: an all-reduce ``2 (tp-1)/tp x bytes /
        bandwidth + 2 (tp-1) x latency``, an all-gather half that."""
        if self.tp == 1:
            return 0.0, 0.0
        k, n = (self.tp - 1) / self.tp, self.tp - 1

        def reduce(b: int) -> float:
            return 2 * k * b * samples / bandwidth + 2 * n * latency_s

        def gather(b: int) -> float:
            return k * b * samples / bandwidth + n * latency_s

        fwd = sum(map(reduce, self.fwd_all_reduce)) + sum(map(gather, self.all_gather))
        bwd = sum(map(reduce, self.bwd_all_reduce)) + sum(map(gather, self.bwd_all_gather))
        bwd += sum(k * b / bandwidth + n * latency_s for b in self.bwd_all_gather_fixed)
        return fwd, bwd


def _collective_bytes(
    layer: nn.Module, styles: Mapping[str, TpStyle], args: tuple[Any, ...]
) -> tuple[tuple[int, ...], ...]:
    """(forward all-reduce, backward all-reduce, forward all-gather, backward all-gather,
    backward all-gather per microbatch) bytes (:class:`TpLayer`'s fields) of one forward and
    backward of the whole ``layer`` on ``args`` (meta), read from the styled modules' inputs
    and outputs.

    Under sequence parallelism (a ``sequence``-styled norm in the layer) the all-reduces
    become halves: a norm's output is all-gathered (its input gradient reduce-scattered), a
    row-wise output reduce-scattered (its gradient all-gathered), the projections' input
    gradients are summed as partial sums and leave through the norm's reduce-scatter, and a
    ``keeps_part`` input is all-gathered again in backward, once per norm output (q, k and v
    share it): per block 2 + 2 forward and 4 + 2 backward, as ``tests/
    test_sequence_parallel_saving.py`` counts them on a real block."""
    from .meta_profile import FlashAttentionOnMeta

    fwd: list[int] = []
    bwd: list[int] = []
    gather: list[int] = []
    bwd_gather: list[int] = []
    fixed: list[int] = []
    sequence = any(st.kind == "sequence" for st in styles.values())
    regathered: list[torch.Tensor] = []  # held: an id alone could be a freed one's, reused

    def nbytes(t: Any) -> int:
        t = t[0] if isinstance(t, (tuple, list)) else t
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    def hook_for(mod: nn.Module, style: TpStyle) -> Any:
        def hook(_m: nn.Module, inputs: Any, out: Any) -> None:
            if style.kind == "rows":  # cut locally; its gradient gathered whole
                fixed.append(nbytes(out))
                return
            if style.kind == "sequence":  # its output gathered whole, its gradient scattered
                gather.append(nbytes(out))
                bwd_gather.append(nbytes(out))
                return
            if style.kind == "rowwise":
                if style.seq_out:  # partial sums reduce-scattered; the gradient gathered
                    gather.append(nbytes(out))
                    bwd_gather.append(nbytes(out))
                else:
                    fwd.append(nbytes(out))  # partial sums -> whole
                return
            if isinstance(mod, nn.Embedding):
                gather.append(nbytes(out))
                return
            x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
            if x is not None and x.is_floating_point():
                if not sequence:
                    bwd.append(nbytes(x))  # the input gradient's partial sums
                elif style.keeps_part and not any(x is t for t in regathered):
                    regathered.append(x)
                    bwd_gather.append(nbytes(x))  # the kept part gathered again
            if style.gathered:
                gather.append(nbytes(out))

        return hook

    handles = [
        layer.get_submodule(n).register_forward_hook(hook_for(layer.get_submodule(n), s))
        for n, s in styles.items()
    ]
    try:
        with torch.no_grad(), FlashAttentionOnMeta():
            layer(*args)
    finally:
        for h in handles:
            h.remove()
    return tuple(fwd), tuple(bwd), tuple(gather), tuple(bwd_gather), tuple(fixed)


def tp_layers(
    layers: Sequence[nn.Module],
    styles: Sequence[Mapping[str, TpStyle]],
    x0: Any,
    tp: int,
    tied: Sequence[Sequence[str]] = (),
) -> list[TpLayer]:
    """Every layer's :class:`TpLayer` at ``tp``, measured on the meta device from ``x0`` (the
    first layer's input for ONE sample, on meta); ``tied``: the model's tied groups
    (``PipelineLayers.tied``), whose members' local elements each layer records."""
    from .meta_profile import FlashAttentionOnMeta, meta_layer_costs
    from .profiler import tied_members

    whole = meta_layer_costs(list(layers), x0)
    cut = local_layers(layers, styles, tp)
    local = meta_layer_costs(cut, x0) if tp > 1 else whole
    members = tied_members(cut, tied)
    inputs: list[tuple[Any, ...]] = []
    hooks = [m.register_forward_pre_hook(lambda _m, a: inputs.append(a)) for m in layers]
    try:
        with torch.no_grad(), FlashAttentionOnMeta():
            x = x0
            for layer in layers:
                x = layer(x)
    finally:
        for h in hooks:
            h.remove()
    out = []
    cuts = sequence_cuts(styles)
    norms = sequence_saved_bytes(cut, styles, x0) if tp > 1 else [0] * len(cut)
    for i, (layer, s, w, loc, args, seq) in enumerate(
        zip(layers, styles, whole, local, inputs, cuts)
    ):
        comm = _collective_bytes(layer, s, args) if tp > 1 else ((),) * 5
        # sequence parallelism: the norms save T / tp positions (see cut_along_sequence)
        saved = loc.saved_bytes - _norm_saving(norms[i], tp)
        ratio = saved / w.saved_bytes if w.saved_bytes else 1.0
        out.append(TpLayer(tp, loc.params, w.params, ratio, *comm, *seq, members.get(i, ())))
    return out


def sequence_cuts(styles: Sequence[Mapping[str, TpStyle]]) -> list[tuple[bool, bool]]:
    """Per layer, whether its (input, output) holds ``T / tp`` positions under sequence
    parallelism: its output does when one of its row-wise layers reduce-scatters along the
    sequence (``TpStyle.seq_out``; the head, whose logits are gathered whole, has none); its
    input does when the previous layer's output does (the first layer's are the tokens).

    Example:
        >>> row, seq = TpStyle("rowwise", seq_out=True), TpStyle("sequence")
        >>> sequence_cuts([{"wte": row}, {"ln_1": seq, "proj": row}, {"ln_f": seq}])
        [(False, True), (True, True), (True, False)]
    """
    outs = [any(st.seq_out for st in s.values()) for s in styles]
    return [(i > 0 and outs[i - 1], out) for i, out in enumerate(outs)]


def cut_along_sequence(
    costs: Sequence[LayerCost],
    styles: Sequence[Mapping[str, TpStyle]],
    tp: int,
    norm_saved: Sequence[int] | None = None,
) -> list[LayerCost]:
    """``costs`` (one tp rank's layers, measured with whole sequences) with what sequence
    parallelism cuts at ``1 / tp``: the inputs and outputs :func:`sequence_cuts` names (the
    stage boundary, every P2P message and the stashed stage inputs, and the part of an input
    the layer saves), and, given ``norm_saved`` (:func:`sequence_saved_bytes`), what the norms
    save for backward (their inputs and statistics hold ``T / tp`` positions; what ``W``
    keeps of them too, a norm's weight gradient reads both). Without ``norm_saved`` the saved
    activations inside a layer are left as measured, an upper bound."""
    out = []
    for i, (cost, cut) in enumerate(zip(costs, sequence_cuts(styles))):
        local = _cut(cost, tp, *cut)
        if norm_saved is not None and norm_saved[i]:
            less = _norm_saving(norm_saved[i], tp)

            def minus(x: int | None, less: int = less) -> int | None:
                return None if x is None else max(0, x - less)

            local = dataclasses.replace(
                local,
                saved_bytes=max(0, local.saved_bytes - less),
                w_saved_bytes=minus(local.w_saved_bytes),
            )
        out.append(local)
    return out


def local_layer_costs(
    local: Sequence[nn.Module], styles: Sequence[Mapping[str, TpStyle]], tp: int, x0: Any
) -> list[LayerCost]:
    """The bytes of one tp rank's layers (``local``: :func:`local_layers`) for a microbatch
    whose first input is ``x0`` (meta): measured on the meta device, then cut where sequence
    parallelism cuts them (:func:`cut_along_sequence` with :func:`sequence_saved_bytes`);
    ``styles`` empty or ``tp = 1``: as measured."""
    from .meta_profile import meta_layer_costs

    costs = meta_layer_costs(local, x0)
    if tp == 1 or not styles:
        return costs
    return cut_along_sequence(costs, styles, tp, sequence_saved_bytes(local, styles, x0))


def sequence_saved_bytes(
    layers: Sequence[nn.Module], styles: Sequence[Mapping[str, TpStyle]], x0: Any
) -> list[int]:
    """Per layer, the bytes saved for backward that sequence parallelism keeps at ``T / tp``
    positions inside it, measured on the meta device from ``x0`` (the first layer's input,
    whole sequences): what its ``sequence``-styled modules (the norms) save, and the input a
    ``keeps_part`` column-wise Linear saves (a norm's gathered output, of which it keeps the
    rank's part). Parameters are not counted; a storage once.

    Example:
        >>> norm = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)).to("meta")
        >>> x = torch.zeros(2, 3, 4, device="meta")
        >>> sequence_saved_bytes([norm], [{"0": TpStyle("sequence")}], x)  # input + mean + rstd
        [144]
        >>> both = {"0": TpStyle("sequence"), "1": TpStyle("colwise", keeps_part=True)}
        >>> sequence_saved_bytes([norm], [both], x)  # ... + the Linear's input
        [240]
    """
    from .meta_profile import FlashAttentionOnMeta, _fresh_meta, _meta_key

    if not any(st.kind == "sequence" for s in styles for st in s.values()):
        return [0] * len(layers)  # no norm is sequence-parallel: no meta pass
    key, exclude = _meta_key()
    exclude(layers)
    out: list[int] = []
    x = _fresh_meta(x0)
    for layer, style in zip(layers, styles):
        inside = [0]  # inside a norm: everything it saves counts
        parts: list[Any] = []  # inside a keeps_part Linear: the storage of its input
        seen: dict[Any, int] = {}

        def pack(t: torch.Tensor, inside=inside, parts=parts, seen=seen) -> None:
            k = key(t) if inside[0] or parts else None
            if k is not None and (inside[0] or k[0] == parts[-1]):
                seen[k[0]] = k[1]
            return None  # no backward runs: keeping ``t`` (an output) would leak the graph

        def enter(_m: nn.Module, args: Any, parts: list[Any] = parts) -> None:
            k = key(args[0])
            parts.append(None if k is None else k[0])

        handles = []
        for name, st in style.items():
            mod = layer.get_submodule(name)
            if st.kind == "sequence":
                handles.append(mod.register_forward_pre_hook(lambda *_a, c=inside: _step(c, 1)))
                handles.append(mod.register_forward_hook(lambda *_a, c=inside: _step(c, -1)))
            elif st.keeps_part:
                handles.append(mod.register_forward_pre_hook(enter))
                handles.append(mod.register_forward_hook(lambda *_a, p=parts: _leave(p)))
        try:
            with FlashAttentionOnMeta(), torch.enable_grad():
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    x = layer(x)
        finally:
            for h in handles:
                h.remove()
        out.append(sum(seen.values()))
        x = _fresh_meta(x)
    return out


def _leave(parts: list[Any]) -> None:
    parts.pop()  # (a forward hook that returned the popped key would replace the output)


def _step(counter: list[int], by: int) -> None:
    counter[0] += by


def _norm_saving(norm_bytes: int, tp: int) -> int:
    """What sequence parallelism saves of ``norm_bytes`` a layer's norms save whole: all but
    the ``ceil(1 / tp)`` part a rank keeps."""
    return norm_bytes - -(-norm_bytes // tp)


def _cut(cost: LayerCost, tp: int, cut_in: bool, cut_out: bool) -> LayerCost:
    """``cost`` with its input (``cut_in``; with it the part of the input the layer or the
    previous one saves) and output (``cut_out``) at ``ceil(1 / tp)``."""

    def cut(x: Any, yes: bool) -> Any:
        return None if x is None else (-(-x // tp) if yes else x)

    return dataclasses.replace(
        cost,
        boundary_bytes=cut(cost.boundary_bytes, cut_out),
        **{
            name: cut(getattr(cost, name), cut_in)
            for name in (
                "input_bytes",
                "input_shared_bytes",
                "input_saved_bytes",
                "input_self_saved_bytes",
                "input_w_saved_bytes",
                "input_self_w_saved_bytes",
            )
        },
    )


def tp_layer_cost(
    cost: LayerCost, t: TpLayer, samples: float, latency_s: float, bandwidth: float
) -> LayerCost:
    """``cost`` (a profiled layer at ``samples`` per microbatch, measured whole) on one of
    ``t.tp`` ranks: parameters as held there; saved activations times the measured ratio (the
    layer's input and output, the stage boundary, stay whole, but for ``1 / tp`` of them where
    sequence parallelism cuts them: ``t.input_cut``, ``t.output_cut``); compute times the parameter
    ratio (the sharded matmuls and attention dominate a transformer layer; the norms and
    residuals, which do not shrink, are counted as if they did, so this errs fast); plus the
    layer's tp collectives, forward ones on ``t_f``, backward ones on ``t_i`` and the fused
    backward."""
    if t.tp == 1:
        return cost
    r, s = t.param_ratio, t.saved_ratio
    fwd, bwd = t.comm_seconds(samples, latency_s, bandwidth)

    def scaled(x: int | None) -> int | None:
        return None if x is None else round(x * s)

    local = dataclasses.replace(
        cost,
        t_f=cost.t_f * r + fwd,
        t_i=cost.t_i * r + bwd,
        t_w=cost.t_w * r,
        t_fused=None if cost.t_fused is None else cost.t_fused * r + bwd,
        params=t.params,
        tied=t.tied,  # the members' local elements (none recorded: counted per layer)
        param_bytes=round(cost.param_bytes * r),
        saved_bytes=round(cost.saved_bytes * s),
        shared_bytes=round(cost.shared_bytes * s),
        w_saved_bytes=scaled(cost.w_saved_bytes),
        w_shared_bytes=scaled(cost.w_shared_bytes),
    )
    return _cut(local, t.tp, t.input_cut, t.output_cut)

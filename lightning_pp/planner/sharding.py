"""Training-state bytes of one pipeline rank under data-parallel sharding (``zero``, ``fsdp``).

One pipeline rank, replicated over ``dp`` data-parallel ranks, holds four training states per
parameter: the parameter, its gradient, an fp32 master copy (only when the parameters are of
lower precision) and the optimizer state. Notation, per pipeline rank and data-parallel rank
``d``:

- ``N``: the elements of the rank's parameters (every local chunk; a tied parameter held by two
  pipeline ranks counts on both, as in the unsharded model, and once on a rank that holds it
  in two chunks, V placement's embedding and head: :class:`TiedTensor`; FSDP2 leaves that one
  whole, so under ``fsdp`` it counts whole in ``S`` and is never gathered);
- ``p``, ``g``, ``w``, ``o``: bytes per element of a parameter, a gradient, a master weight and
  the optimizer state (:class:`StateBytes`: fp32 params ``4, 4, 0, 8`` with Adam; bf16 params
  ``2, 2, 4, 8``: 16 bytes per parameter either way); ``m``: the element the optimizer steps
  (``w`` when there is a master weight, else ``p``);
- ``S``: replica ``d``'s shard, ``sum_t rows_d(t) x row_numel(t)``. Every parameter ``t`` is cut
  along its first dim by ``torch.chunk``'s rule (:func:`shard_rows`: ``c = ceil(rows / dp)``
  rows for each replica in turn, the last ones shorter or empty), which is the runtime's layout
  for ``zero`` (``runtime.shard_layout``) and FSDP2's ``Shard(0)`` for ``fsdp``. Replica 0 holds
  ``c`` rows of every parameter, the most: ``N / dp <= S_0 < N / dp + sum_t row_numel(t)``.
  The reduce-scatter's flat bucket buffer pads every parameter to ``c x dp`` rows
  (:attr:`ShardedState.padding`), so each bucket's flat size is a multiple of ``dp``; the buffer
  lives only while it is reduced;
- ``C``: the elements of the rank's largest chunk.

A layer's parameters can be given as one count (one 1-D tensor: rows of one element, so the
padding is under one element per tensor and replica) or tensor by tensor, each a count or a
shape (whole rows: the runtime's exact shard).

Peak (during forward and backward) and at the optimizer step (gradients reduced, activations
freed), in bytes:

============  ===============  =========  ===========  =========  ============  ===============
sharding      params           grads      master       optimizer  params @step  grads @step
============  ===============  =========  ===========  =========  ============  ===============
none          ``N p``          ``N g``    ``N w``      ``N o``    ``N p``       ``N g``
zero=1        ``N p``          ``N g``    ``S w``      ``S o``    ``N p``       ``N g + S m``
zero=2        ``N p``          ``N g``    ``S w``      ``S o``    ``N p``       ``S m``
fsdp          ``S p + N p``    ``N g``    ``S w``      ``S o``    ``S p``       ``S g``
============  ===============  =========  ===========  =========  ============  ===============

Why:

- ``zero`` at the step: the optimizer steps ``S`` rows of each parameter (views of the rows for
  fp32 parameters, fp32 copies for lower precision), and their gradients (``S m``) arrive from
  the reduce-scatter; ``zero=1`` keeps the full-size gradients allocated as well (zeroed, for
  the next step), ``zero=2`` freed each bucket's once it was reduce-scattered.
- ``zero=2``'s peak still holds full gradients: a chunk's gradients accumulate over every
  microbatch of the step until its last backward, so during the backward phase they are all
  there (exact with one chunk per rank; an upper bound with ``vpp > 1``, where a chunk that
  finished early holds only its rows). ``zero=2`` lowers the optimizer step's memory, not the
  step's peak.
- ``fsdp`` (FSDP2 ``fully_shard`` per chunk, ``reshard_after_forward=False``): each chunk is
  all-gathered at its first forward and stays gathered until its last backward, and in a
  pipeline step every chunk of a rank is in flight at once, so the peak holds the shards *and*
  the full parameters (``S p + N p``); with ``reshard_after_forward=True`` only the chunk
  computing is gathered (``S p + C p``; FSDP's prefetch of the next chunk is not counted).
  Gradients accumulate unsharded with sync off until the chunk's last backward, so the peak
  holds ``N g`` as with ``zero=2``. With FSDP2's ``MixedPrecisionPolicy`` (fp32 shards, bf16
  compute) the fp32 shard is the master weight: pass ``param_bytes=4, master_bytes=0``; the
  total at rest is the same.

Example:
    >>> state = StateBytes(param=2, grad=2, master=4, optimizer=8)        # bf16, fp32 Adam
    >>> s = rank_state_bytes([[10, 7]], Sharding(zero=1, dp=4), state)   # one chunk, 2 layers
    >>> (s.numel, s.shard_numel, s.params, s.grads, s.master, s.optimizer)   # rows 3 + 2
    (17, 5, 34, 34, 20, 40)
    >>> rank_state_bytes([[10, 7]], Sharding(fsdp=True, dp=4), state).params  # (3 + 2 + 17) x 2
    44
    >>> rank_state_bytes([[[(10, 7)]]], Sharding(zero=1, dp=4), state, dp_rank=3).shard_numel
    7
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..layout.plan import PipelinePlan

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "OPTIMIZER_STATES",
    "SHARDINGS",
    "ShardedState",
    "Sharding",
    "StateBytes",
    "allowed_shardings",
    "bucket_numels",
    "padded_shard",
    "precision_param_bytes",
    "rank_state_bytes",
    "shard_rows",
    "sharded_state_bytes",
    "TiedTensor",
]

#: PipelineStrategy's default gradient bucket size (MiB)
DEFAULT_BUCKET_CAP_MB = 25.0

#: optimizer state elements per parameter (fp32 each: see :meth:`StateBytes.for_precision`)
OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}

#: one parameter tensor: its element count (a 1-D tensor) or its shape
TensorSpec = int | tuple[int, ...]


@dataclass(frozen=True)
class TiedTensor:
    """A parameter tensor that several layers hold as one (a tied embedding and head):
    ``spec`` its count or shape, ``group`` the tied group's index (the same for every member).
    A rank holding two members holds one tensor (:func:`rank_state_bytes` counts it once);
    ranks holding one member each hold a copy each.

    Example:
        >>> emb, head = [TiedTensor((16, 4), 0)], [TiedTensor((16, 4), 0), 4]
        >>> rank_state_bytes([[emb], [head]]).numel   # V placement: both chunks on one rank
        68
    """

    spec: TensorSpec
    group: int


#: one layer's parameters: their element count (one 1-D tensor), or each tensor in order
LayerTensors = int | Sequence[TensorSpec | TiedTensor]


def precision_param_bytes(precision: str | int | None) -> int:
    """Bytes of one parameter element under a Lightning ``Trainer(precision=...)``: 2 for
    ``"bf16-true"`` / ``"16-true"`` (the parameters themselves are 16-bit), 8 for
    ``"64-true"``, else 4 (fp32 parameters; the ``-mixed`` precisions autocast the compute
    but keep fp32 parameters).

    Example:
        >>> [precision_param_bytes(p) for p in ("bf16-true", "bf16-mixed", None, 64)]
        [2, 4, 4, 8]
    """
    text = str(precision).lower() if precision is not None else "32-true"
    if text in ("bf16-true", "16-true", "bf16", "16", "half"):
        return 2
    if text in ("64-true", "64", "double"):
        return 8
    return 4


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter element of each training state.

    ``param`` / ``grad``: the parameter's and its gradient's element size (the gradient has
    the parameter's dtype). ``master``: an fp32 copy the optimizer steps when the parameters
    are of lower precision (0 when the parameter is already fp32: the master weight *is* the
    parameter). ``optimizer``: the optimizer's state (Adam/AdamW: two fp32 moments, 8).

    Example:
        >>> StateBytes.for_precision("bf16-true")
        StateBytes(param=2, grad=2, master=4, optimizer=8)
        >>> StateBytes.for_precision("32-true").per_param
        16
    """

    param: int = 4
    grad: int = 4
    master: int = 0
    optimizer: int = 8

    @property
    def per_param(self) -> int:
        """Bytes per parameter with nothing sharded."""
        return self.param + self.grad + self.master + self.optimizer

    @classmethod
    def for_precision(cls, precision: str | int | None, optimizer: str = "adam") -> StateBytes:
        """The states of a run at ``precision`` with ``optimizer``: parameters and gradients in
        the parameter dtype; an fp32 master weight and fp32 optimizer states when the
        parameters are 16-bit (Megatron's mixed-precision recipe: bf16 parameters, fp32 Adam:
        16 bytes per parameter); states in the parameter dtype when it is wider than fp32."""
        if optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATES)}")
        p = precision_param_bytes(precision)
        state = max(p, 4)  # fp32 states, or the parameter's own dtype when wider
        return cls(
            param=p,
            grad=p,
            master=4 if p < 4 else 0,
            optimizer=OPTIMIZER_STATES[optimizer] * state,
        )


@dataclass(frozen=True)
class Sharding:
    """How the data-parallel replicas share the state: ``zero`` 0/1/2 or ``fsdp``, over ``dp``
    replicas, with ``bucket_cap_mb`` gradient buckets (``zero``) and FSDP's
    ``reshard_after_forward``.

    Example:
        >>> Sharding(zero=1, dp=8).label, Sharding(fsdp=True, dp=8).label, Sharding().label
        ('zero=1', 'fsdp', 'none')
    """

    zero: int = 0
    fsdp: bool = False
    dp: int = 1
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    reshard_after_forward: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2):
            raise ValueError(f"zero must be 0, 1 or 2, got {self.zero!r}")
        if self.fsdp and self.zero:
            raise ValueError(f"fsdp=True already shards everything; got zero={self.zero} too")
        if self.dp < 1:
            raise ValueError(f"dp must be >= 1, got {self.dp}")
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")

    @property
    def label(self) -> str:
        """``none``, ``zero=1``, ``zero=2``, ``fsdp`` (``fsdp+reshard`` when resharding)."""
        if self.fsdp:
            return "fsdp+reshard" if self.reshard_after_forward else "fsdp"
        return f"zero={self.zero}" if self.zero else "none"

    @classmethod
    def parse(cls, label: str, **kw: Any) -> Sharding:
        """The inverse of :attr:`label` (other fields from ``kw``).

        Example:
            >>> Sharding.parse("zero=2", dp=4)
            Sharding(zero=2, fsdp=False, dp=4, bucket_cap_mb=25.0, reshard_after_forward=False)
        """
        known: dict[str, dict[str, Any]] = {
            "none": {},
            "zero=1": {"zero": 1},
            "zero=2": {"zero": 2},
            "fsdp": {"fsdp": True},
            "fsdp+reshard": {"fsdp": True, "reshard_after_forward": True},
        }
        if label not in known:
            raise ValueError(f"unknown sharding {label!r}; known: {list(known)}")
        return cls(**{**kw, **known[label]})


#: the labels :meth:`Sharding.parse` knows, in the order reports list them
SHARDINGS: tuple[str, ...] = ("none", "zero=1", "zero=2", "fsdp")


def allowed_shardings(labels: Sequence[str], dp: int) -> list[str]:
    """Those of ``labels`` (:meth:`Sharding.parse` labels) a shape of ``dp`` replicas can run:
    only ``"none"`` for one replica. Tensor parallelism does not narrow them: ``zero`` and
    ``fsdp`` both cut each tp rank's local tensors, so the state formulas hold on the tp
    shares' shapes as they stand.

    Example:
        >>> allowed_shardings(SHARDINGS, dp=4), allowed_shardings(SHARDINGS, dp=1)
        (['none', 'zero=1', 'zero=2', 'fsdp'], ['none'])
    """
    return list(labels) if dp > 1 else ["none"]


def padded_shard(numel: int, dp: int) -> int:
    """``ceil(numel / dp)``: replica 0's share of ``numel`` rows (the most any replica holds).

    Example:
        >>> padded_shard(10, 4), padded_shard(12, 4), padded_shard(0, 4)
        (3, 3, 0)
    """
    return -(-numel // dp)


def shard_rows(rows: int, dp: int, dp_rank: int) -> int:
    """Replica ``dp_rank``'s rows of a tensor with ``rows`` rows, by ``torch.chunk``'s rule:
    ``ceil(rows / dp)`` rows each in turn, the last replicas fewer or none.

    Example:
        >>> [shard_rows(10, 4, d) for d in range(4)], [shard_rows(5, 4, d) for d in range(4)]
        ([3, 3, 3, 1], [2, 2, 1, 0])
    """
    c = padded_shard(rows, dp)
    return max(0, min((dp_rank + 1) * c, rows) - min(dp_rank * c, rows))


def bucket_numels(tensor_numels: Sequence[int], cap_bytes: int, elem_bytes: int) -> list[int]:
    """The flat sizes of the gradient buckets of one chunk whose tensors (in parameter order)
    have ``tensor_numels`` elements of ``elem_bytes`` each: greedy, a bucket closes when the
    next tensor would take it past ``cap_bytes``, so a tensor larger than the cap gets a bucket
    of its own. The rule of ``runtime.grad_sync._buckets`` (one dtype and device per chunk).

    Example:
        >>> bucket_numels([3, 3, 3, 10, 1], cap_bytes=32, elem_bytes=4)   # 8 elements per bucket
        [6, 3, 10, 1]
    """
    out: list[int] = []
    current = 0
    for n in tensor_numels:
        if current and (current + n) * elem_bytes > cap_bytes:
            out.append(current)
            current = 0
        current += n
    if current:
        out.append(current)
    return out


def _shape(t: TensorSpec) -> tuple[int, int]:
    """(rows, elements per row) of a tensor given as a count (1-D) or a shape (a scalar: one
    row of one element)."""
    if isinstance(t, int):
        return t, 1
    shape = tuple(int(n) for n in t)
    if not shape:
        return 1, 1
    rest = 1
    for n in shape[1:]:
        rest *= n
    return shape[0], rest


def _tensors(layer: LayerTensors) -> list[tuple[int, int]]:
    """A layer's tensors as (rows, elements per row); an int: one 1-D tensor."""
    if isinstance(layer, int):
        return [_shape(int(layer))]
    return [_shape(t.spec if isinstance(t, TiedTensor) else t) for t in layer]


def _held_once(
    chunks: Sequence[Sequence[LayerTensors]], leave_whole: bool
) -> tuple[list[list[LayerTensors]], int]:
    """``chunks`` with every tied group's tensor kept at its first member only (the rank holds
    one tensor). With ``leave_whole`` (fsdp), a group the rank holds in two or more chunks is
    taken out and its elements returned: FSDP2 leaves such a tensor whole
    (``runtime.fsdp_chunks.shared_parameters``)."""
    chunks_of: dict[int, set[int]] = {}
    for c, chunk in enumerate(chunks):
        for layer in chunk:
            for t in () if isinstance(layer, int) else layer:
                if isinstance(t, TiedTensor):
                    chunks_of.setdefault(t.group, set()).add(c)
    whole_groups = {g for g, cs in chunks_of.items() if leave_whole and len(cs) > 1}
    seen: set[int] = set()
    whole = 0
    out: list[list[LayerTensors]] = []
    for chunk in chunks:
        kept_chunk: list[LayerTensors] = []
        for layer in chunk:
            if isinstance(layer, int):
                kept_chunk.append(layer)
                continue
            kept = []
            for t in layer:
                if isinstance(t, TiedTensor):
                    if t.group in seen:
                        continue
                    seen.add(t.group)
                    if t.group in whole_groups:
                        rows, per_row = _shape(t.spec)
                        whole += rows * per_row
                        continue
                kept.append(t)
            kept_chunk.append(kept)
        out.append(kept_chunk)
    return out, whole


@dataclass(frozen=True)
class ShardedState:
    """One replica's parameter, gradient, master-weight and optimizer-state bytes on one
    pipeline rank (see the module notes for every formula).

    ``params``, ``grads``, ``master``, ``optimizer``: at the step's peak (forward/backward);
    ``params_at_step``, ``grads_at_step``: at the optimizer step. ``numel``: ``N``, the
    rank's parameter elements; ``shard_numel``: the elements whose master weight and optimizer
    state this replica holds (``N`` unsharded, else ``S``); ``buckets``: gradient buckets
    (``zero``); ``padding``: the elements the flat bucket buffers add to make every parameter
    split into ``dp`` equal slots (``zero`` and ``fsdp``: ``sum_t (c x dp - rows) x
    row_numel``; it lives only in the buffers).
    """

    numel: int
    shard_numel: int
    buckets: int
    padding: int
    params: int
    grads: int
    master: int
    optimizer: int
    params_at_step: int
    grads_at_step: int

    @property
    def total(self) -> int:
        """The states' bytes at the step's peak."""
        return self.params + self.grads + self.master + self.optimizer

    @property
    def total_at_step(self) -> int:
        """The states' bytes at the optimizer step."""
        return self.params_at_step + self.grads_at_step + self.master + self.optimizer


def _bucket_count(chunks: Sequence[Sequence[LayerTensors]], s: Sharding, elem: int) -> int:
    """How many gradient buckets the rank's chunks make (``runtime.grad_sync``'s rule)."""
    cap = max(1, int(s.bucket_cap_mb * 1024 * 1024))
    count = 0
    for chunk in chunks:
        numels = [r * n for layer in chunk for r, n in _tensors(layer)]
        count += len(bucket_numels(numels, cap, elem))
    return count


def rank_state_bytes(
    chunks: Sequence[Sequence[LayerTensors]],
    sharding: Sharding | None = None,
    state: StateBytes | None = None,
    *,
    dp_rank: int = 0,
) -> ShardedState:
    """The training-state bytes of replica ``dp_rank`` of a pipeline rank holding ``chunks``
    (per local chunk, per layer: its parameter count, or its tensors in parameter order, each
    a count or a shape). Replica 0 (the default) holds the most.

    Example:
        >>> s = rank_state_bytes([[[8, 8]], [[(5, 2)]]], Sharding(zero=2, dp=4))   # fp32, Adam
        >>> (s.shard_numel, s.padding, s.grads, s.grads_at_step, s.optimizer)  # 2 + 2 + 2 x 2
        (8, 6, 104, 32, 64)
    """
    s = sharding or Sharding()
    b = state or StateBytes()
    if not 0 <= dp_rank < s.dp:
        raise ValueError(f"dp_rank must lie in [0, dp={s.dp}), got {dp_rank}")
    chunks, whole = _held_once(chunks, leave_whole=s.fsdp)
    shapes = [[t for layer in chunk for t in _tensors(layer)] for chunk in chunks]
    numel = sum(r * n for chunk in shapes for r, n in chunk) + whole
    largest = max((sum(r * n for r, n in chunk) for chunk in shapes), default=0)
    sharded = bool(s.fsdp or s.zero)
    if sharded:
        shard = sum(shard_rows(r, s.dp, dp_rank) * n for chunk in shapes for r, n in chunk)
        padding = sum((padded_shard(r, s.dp) * s.dp - r) * n for chunk in shapes for r, n in chunk)
        shard += whole
    else:
        shard, padding = numel, 0
    stepped = b.master or b.param  # the element the optimizer steps: master copy, or the row
    full_p, full_g = numel * b.param, numel * b.grad
    if s.fsdp:
        gathered = largest if s.reshard_after_forward else numel - whole
        params, params_at_step = (shard + gathered) * b.param, shard * b.param
        grads_at_step = shard * b.grad
    else:
        params = params_at_step = full_p
        grads_at_step = {0: full_g, 1: full_g + shard * stepped, 2: shard * stepped}[s.zero]
    return ShardedState(
        numel=numel,
        shard_numel=shard,
        buckets=_bucket_count(chunks, s, b.grad) if s.zero else 0,
        padding=padding,
        params=params,
        grads=full_g,  # see the module notes: every sharding holds full gradients at the peak
        master=shard * b.master,
        optimizer=shard * b.optimizer,
        params_at_step=params_at_step,
        grads_at_step=grads_at_step,
    )


def sharded_state_bytes(
    plan: PipelinePlan,
    layer_param_counts: Sequence[LayerTensors],
    rank: int,
    *,
    dp_rank: int = 0,
    zero: int | None = None,
    fsdp: bool | None = None,
    dp: int | None = None,
    bucket_cap_mb: float | None = None,
    reshard_after_forward: bool | None = None,
    param_bytes: int = 4,
    grad_bytes: int | None = None,
    master_bytes: int | None = None,
    optimizer_bytes: int = 8,
) -> ShardedState:
    """The prediction to compare a run's measured state bytes with: pipeline rank ``rank`` of
    ``plan`` (its layers split by the plan), data-parallel replica ``dp_rank``.

    ``layer_param_counts[i]``: layer ``i``'s parameter count, or its tensors in parameter order
    (counts, or shapes for the runtime's exact rows). ``zero`` / ``fsdp`` / ``dp`` /
    ``bucket_cap_mb`` / ``reshard_after_forward``: the plan's unless given. ``grad_bytes``:
    ``param_bytes`` unless given; ``master_bytes``: 4 for 16-bit parameters, else 0, unless
    given (pass 0 for an optimizer that steps 16-bit parameters directly); ``optimizer_bytes``
    per element (Adam's two fp32 moments: 8).

    Example:
        >>> from lightning_pp.layout.plan import PipelinePlan
        >>> plan = PipelinePlan.build(pp=2, microbatches=4, world_size=8, num_layers=4)
        >>> s = sharded_state_bytes(plan, [100, 100, 100, 101], 1, zero=1, param_bytes=2)
        >>> (s.numel, s.shard_numel, s.master, s.optimizer)   # rows 25 + 26 on replica 0
        (201, 51, 204, 408)
        >>> sharded_state_bytes(plan, [100, 100, 100, 101], 1, zero=1, dp_rank=3).shard_numel
        48
        >>> # replica 3: 25 of the first layer's 100 rows, 23 of the second's 101 (26, 26, 26, 23)
    """
    dp = plan.dp if dp is None else dp
    if dp is None:
        raise ValueError("the plan's dp is not known yet: give dp= or plan.with_world(...)")
    cap = plan.bucket_cap_mb if bucket_cap_mb is None else bucket_cap_mb
    sharding = Sharding(
        zero=plan.zero if zero is None else zero,
        fsdp=plan.fsdp if fsdp is None else fsdp,
        dp=dp,
        bucket_cap_mb=DEFAULT_BUCKET_CAP_MB if cap is None else cap,
        reshard_after_forward=(
            getattr(plan, "reshard_after_forward", False)
            if reshard_after_forward is None
            else reshard_after_forward
        ),
    )
    state = StateBytes(
        param=param_bytes,
        grad=param_bytes if grad_bytes is None else grad_bytes,
        master=(4 if param_bytes < 4 else 0) if master_bytes is None else master_bytes,
        optimizer=optimizer_bytes,
    )
    chunks = [[layer_param_counts[i] for i in rng] for rng in plan.stage_layers(rank)]
    return rank_state_bytes(chunks, sharding, state, dp_rank=dp_rank)

"""Split a model you did not write for pipelining, keeping its own forward, loss and keys.

How a stage runs: every stage calls the user's own step (``model(input_ids=x, labels=y).loss``)
on the microbatch, with the model's modules answering according to where they live:

- the repeated blocks (``split="transformer.h"``) before this stage's first block return their
  input unchanged (in the structure the real block returns); the first local block gets the
  activation received from the previous stage in place of its hidden-state argument; the run
  stops where the forward calls the NEXT stage's first block, and that call's hidden-state
  argument is what the stage sends on (so code between two blocks runs exactly once);
- the model's other parameterised submodules (embeddings, final norm, head) are placed on the
  first stage (registered before the blocks) or the last stage (registered after them); on every
  other stage a stand-in returns a :class:`~lightning_pp.autosplit.phantom.Phantom`, a tensor with
  the right shape, dtype and device and no values;
- modules without parameters (rotary tables, dropout) and the prologue's own code run for real
  on every stage, so attention masks, position ids and rotary tables are RECOMPUTED from the
  microbatch on each stage, exactly as the unpipelined model computes them, for any sequence
  length. Nothing but the hidden state crosses the cut.

A value that depends on another stage's module stays a phantom, so it cannot enter a real
computation unnoticed: reaching a local block, a local module or the loss, or being used for
control flow, raises :class:`~lightning_pp.autosplit.phantom.PhantomValueError` naming the
module (see docs/bring_your_own_model.md for the limits).

Example (one rank, its stages ``[0, 4]`` of 8; see :class:`StagedModel`)::

    staged = StagedModel.build(lambda: GPT2LMHeadModel(config), split="transformer.h",
                               stages=[0, 4], num_stages=8, seed=0)
    staged.model.state_dict().keys()   # this rank's keys, exactly as GPT2LMHeadModel names them
    loss_or_hidden = staged.run(0, None, microbatch, step)   # step(model, microbatch) -> loss
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..layout.partition import partition_layers
from .materialize import ShapeBuild, meta_build, replay_build
from .phantom import LenientMeta, Phantom, PhantomValueError, origins_of

__all__ = ["SplitError", "SplitLayout", "StagedModel", "TiedParameter"]


class SplitError(RuntimeError):
    """The model cannot be split as asked (the message names the module and the reason)."""


# -- where everything lives ---------------------------------------------------------------------


@dataclass(frozen=True)
class SplitLayout:
    """Which module runs on which stage, found from the model's structure alone.

    ``blocks``: the names of the repeated blocks in call order; ``ranges``: the block indices of
    each virtual stage; ``units``: every other parameterised submodule -> its stage (first or
    last); ``shared``: modules without parameters that hold buffers (rotary tables), real on
    every rank; ``aliases``: another name the model holds a block under (``model.last`` for
    ``model.layers.7``) -> the block's name.
    """

    split: str
    blocks: tuple[str, ...]
    ranges: tuple[range, ...]
    units: dict[str, int]
    shared: tuple[str, ...]
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    @classmethod
    def discover(
        cls,
        model: nn.Module,
        split: str,
        num_stages: int,
        *,
        placement: dict[str, str] | None = None,
        ranges: Sequence[range] | None = None,
    ) -> SplitLayout:
        """Cut ``model`` (usually the meta build) between the children of ``split``.

        Args:
            split: dotted name of the container of repeated blocks (``ModuleList``/``Sequential``).
            placement: ``{module name: "first" | "last"}`` overrides for modules whose
                registration order does not tell where they run (default: registered before the
                container -> first stage, after it -> last stage).
            ranges: explicit block ranges per stage (default: uniform, as ``partition_layers``).
        """
        try:
            container = model.get_submodule(split)
        except AttributeError as e:
            raise SplitError(f"split={split!r}: {type(model).__name__} has no such module") from e
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            raise SplitError(
                f"split={split!r} is a {type(container).__name__}; it must name the ModuleList "
                f"(or Sequential) of repeated blocks, e.g. 'transformer.h' or 'model.layers'"
            )
        blocks = tuple(f"{split}.{n}" for n, _ in container.named_children())
        _refuse_router_aux_loss(model)
        if ranges is None:
            if len(blocks) < num_stages:
                raise SplitError(
                    f"split={split!r} has {len(blocks)} blocks, fewer than the {num_stages} "
                    f"virtual stages (pp * vpp) to fill"
                )
            ranges = partition_layers(len(blocks), num_stages, 1)
        ranges = tuple(ranges)
        if len(ranges) != num_stages or [i for r in ranges for i in r] != list(range(len(blocks))):
            raise SplitError(f"ranges {list(ranges)} do not cover {len(blocks)} blocks in order")
        placement = dict(placement or {})
        order = _call_order(model, split, blocks)
        block_of = {id(m): f"{split}.{n}" for n, m in container.named_children()}
        aliases: dict[str, str] = {}
        units: dict[str, int] = {}
        shared: list[str] = []
        path = split.split(".")
        for depth in range(len(path)):
            prefix = ".".join(path[:depth])
            parent = model.get_submodule(prefix) if prefix else model
            direct = [n for n, _ in parent.named_parameters(recurse=False)]
            if direct:
                raise SplitError(
                    f"`{prefix or type(model).__name__}` holds parameters directly "
                    f"({', '.join(direct)}) and is an ancestor of the split container; only "
                    f"parameters inside submodules can be placed on a stage (wrap them in a module)"
                )
            if any(True for _ in parent.buffers(recurse=False)):
                shared.append(prefix)
            before = True
            for name, child in parent.named_children():
                full = f"{prefix}.{name}" if prefix else name
                if name == path[depth]:
                    before = False
                    continue
                if id(child) in block_of:
                    # another name for a block: staged with it (StagedModel._places)
                    aliases[full] = block_of[id(child)]
                    continue
                inner = [block_of[id(m)] for m in child.modules() if id(m) in block_of]
                if inner:
                    raise SplitError(
                        f"`{full}` holds {', '.join(inner)}, a block of split={split!r}, too: "
                        f"each module must sit on one pipeline stage, so a block cannot also be "
                        f"part of another parameterised module; keep it only in {split!r}"
                    )
                if any(True for _ in child.parameters()):
                    # where the forward calls it (before the first block / after the last),
                    # else where it is registered
                    where = placement.pop(full, order.get(full, "first" if before else "last"))
                    if where not in ("first", "last"):
                        raise SplitError(f"placement[{full!r}] must be 'first' or 'last'")
                    units[full] = 0 if where == "first" else num_stages - 1
                elif any(True for _ in child.buffers()):
                    shared.append(full)
        if placement:
            raise SplitError(
                f"placement names {sorted(placement)}, which are not parameterised siblings of "
                f"the split path (candidates: {sorted(units)})"
            )
        return cls(split, blocks, ranges, units, tuple(shared), aliases)

    def stage_of(self, name: str) -> int | None:
        """Stage holding parameter/buffer/module ``name``; ``None`` for shared ones."""
        for alias, block in self.aliases.items():
            if name == alias or name.startswith(alias + "."):
                name = block + name[len(alias) :]
                break
        for i, b in enumerate(self.blocks):
            if name == b or name.startswith(b + "."):
                return next(s for s, r in enumerate(self.ranges) if i in r)
        for u, s in self.units.items():
            if name == u or name.startswith(u + "."):
                return s
        return None


def _call_order(model: nn.Module, split: str, blocks: Sequence[str]) -> dict[str, str]:
    """Where the forward calls each parameterised module beside the blocks: ``"first"`` (before
    the first block) or ``"last"`` (after the last one), learnt by running the model's meta
    twin once on a tiny meta input (no memory, no values).

    Registration order alone misleads: OPT registers ``project_out`` before its blocks and
    applies it after them. The run needs an entry point that takes token ids: the outermost
    module on the path to ``split`` whose forward has an ``input_ids`` argument (every Hugging
    Face decoder); for other models, or when the meta run fails (data-dependent code), the
    result is empty and registration order decides. Modules first called between two blocks
    are left out (they cannot be placed on either end; the run's error names them).
    """
    path = split.split(".")
    candidates = [model] + [model.get_submodule(".".join(path[:d])) for d in range(1, len(path))]
    prefixes = [""] + [".".join(path[:d]) + "." for d in range(1, len(path))]
    entry = None
    for prefix, mod in zip(prefixes, candidates):
        try:
            params = inspect.signature(mod.forward).parameters
        except (TypeError, ValueError):
            continue
        if "input_ids" in params:
            # token ids for input_ids, and for a required labels/targets argument too
            ids = torch.zeros(1, 4, dtype=torch.long, device="meta")
            required = [
                k
                for k, p in params.items()
                if k in ("labels", "targets") and p.default is inspect.Parameter.empty
            ]
            entry = (prefix, mod, {"input_ids": ids, **{k: ids for k in required}})
            break
    if entry is None:
        return {}
    prefix, root, inputs = entry
    calls: list[str] = []
    handles = [
        m.register_forward_pre_hook(lambda _m, _a, n=prefix + n: calls.append(n))
        for n, m in root.named_modules()
        if n
    ]
    try:
        with torch.no_grad(), LenientMeta():
            root(**inputs)
    except Exception:  # noqa: BLE001 - any failure: fall back to registration order
        return {}
    finally:
        for h in handles:
            h.remove()
    block_set = set(blocks)
    at = [i for i, n in enumerate(calls) if n in block_set]
    if not at:
        return {}
    out: dict[str, str] = {}
    for i, n in enumerate(calls):
        if n in out or n in block_set:
            continue
        if i < at[0]:
            out[n] = "first"
        elif i > at[-1]:
            out[n] = "last"
    return out


def _refuse_router_aux_loss(model: nn.Module) -> None:
    """A mixture-of-experts router's auxiliary (load-balancing) loss cannot be split: refused.

    Hugging Face computes it on the last stage from the router logits of EVERY block, recorded
    by hooks on the router modules, in one nonlinear term (fraction of tokens per expert times
    mean router probability, each over all layers' tokens), so it is not a sum of per-stage
    parts. On a split model the routers of other stages' blocks are not on the rank: the term
    would silently cover this stage's routers only. Plain MoE training (the default,
    ``output_router_logits=False``) splits exactly."""
    for name, mod in model.named_modules():
        config = getattr(mod, "config", None)
        if getattr(config, "output_router_logits", False) is True:
            raise SplitError(
                f"`{name or type(model).__name__}` ({type(mod).__name__}) has "
                f"config.output_router_logits=True: its router auxiliary loss combines the router "
                f"logits of every block in one nonlinear term, and a pipeline stage holds only its "
                f"own blocks' routers, so the loss would be wrong. Fix: set "
                f"config.output_router_logits=False (the default) to train the model split, or "
                f"train it without split= (docs/strategy.md, mixture-of-experts)"
            )


# -- the run-time context -----------------------------------------------------------------------


class _StageExit(BaseException):
    """Raised at the call of the next stage's first block: carries the hidden-state argument
    up through the user's code.
    A BaseException so that a user's ``except Exception`` does not swallow it."""

    def __init__(self, hidden: Tensor) -> None:
        super().__init__()
        self.hidden = hidden


@dataclass
class _Run:
    stage: int
    blocks: range
    units: set[str]
    activation: Tensor | None
    is_last: bool
    device: torch.device
    substituted: bool = False
    finished_blocks: bool = False
    called: list[int] = field(default_factory=list)


_ACTIVE: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("lpp_split_run", default=None)


def _meta_args(args: Any) -> Any:
    def conv(x: Any) -> Any:
        if isinstance(x, Phantom):
            return x._meta
        if isinstance(x, DTensor):  # tensor parallel: the twin is whole, so the whole shape
            return torch.empty(x.shape, dtype=x.dtype, device="meta")
        if isinstance(x, Tensor):
            return x.detach().to("meta")
        return x

    return tree_map(conv, args)


def _phantom_run(twin: nn.Module, name: str, device: torch.device, args, kwargs) -> Any:
    """The stand-in's output: ``twin`` (the meta build's module) run on meta copies."""
    with torch.no_grad(), LenientMeta():
        out = twin(*_meta_args(args), **_meta_args(kwargs))
    return tree_map(lambda t: Phantom(t, device, name) if isinstance(t, Tensor) else t, out)


def _check_real(what: str, stage: int, args: tuple, kwargs: dict) -> None:
    found = origins_of((args, kwargs))
    if found:
        raise PhantomValueError(
            f"stage {stage}: {what} receives a value computed from `{'`, `'.join(found)}`, which "
            f"runs on another pipeline stage; only the hidden state passed from block to block "
            f"crosses a cut (skip connections around blocks, e.g. reusing the embedding output "
            f"later, cannot be split; a module beside the blocks placed on the wrong end is "
            f"moved with PipelineStrategy(split_placement={{{found[0]!r}: 'last'}}) or 'first')"
        )


def _hidden_arg(args: tuple, kwargs: dict, name: str) -> tuple[Any, Callable[[Any], tuple]]:
    """The block's hidden-state argument and a function putting a replacement in its place."""
    if args:
        return args[0], lambda v: ((v, *args[1:]), kwargs)
    for key in ("hidden_states", "hidden_state", "x", "input"):
        if key in kwargs:
            return kwargs[key], lambda v, k=key: (args, {**kwargs, k: v})
    raise SplitError(
        f"`{name}` was called without a positional argument or a `hidden_states` keyword: "
        f"cannot tell which argument is the hidden state (keywords: {sorted(kwargs)})"
    )


class _BlockSlot:
    """Per block: the structure of its output, learnt once from the meta twin.

    The hidden state is the block's output field named ``hidden_states`` (a dict-like output),
    else its first tensor in ``tree_flatten`` order. A block may return more tensors (Bloom,
    MPT and GPT-Neo blocks return ``(hidden_states, attention_weights)``): where the block runs
    on another stage, those come back as phantoms named ``<block> output <k>``, so code that
    never reads them (the usual case) runs on, and code that does read one raises
    :class:`~lightning_pp.autosplit.phantom.PhantomValueError` naming it. Nothing but the hidden
    state is ever sent: the hand-over is the next block's hidden-state argument.
    """

    def __init__(self, index: int, name: str, twin: nn.Module) -> None:
        self.index, self.name, self.twin = index, name, twin
        self._structure: tuple[Any, list[Any], int] | None = None

    def passthrough(self, hidden: Any, args: tuple, kwargs: dict, device: torch.device) -> Any:
        """What the block returns, with ``hidden`` where its output hidden state goes."""
        if self._structure is None:
            # LenientMeta: a meta kernel stricter than the CPU one (torch's _grouped_mm meta
            # kernel takes bfloat16 only; mixture-of-experts blocks call it) must not stop a
            # run that needs only the output's structure and shapes.
            with torch.no_grad(), LenientMeta():
                out = self.twin(*_meta_args(args), **_meta_args(kwargs))
            leaves, spec = tree_flatten(out)
            where = [i for i, t in enumerate(leaves) if isinstance(t, Tensor)]
            if not where:
                raise SplitError(
                    f"`{self.name}` returns no tensor ({type(out).__name__}); a block must "
                    f"return its hidden state (a tensor, or a tuple/dict holding it) to be skipped "
                    f"or cut after"
                )
            at = where[0]
            if hasattr(out, "keys") and "hidden_states" in out.keys():
                named = tree_flatten(out["hidden_states"])[0]
                at = next((i for i in where if leaves[i] is named[0]), at) if named else at
            self._structure = (spec, leaves, at)
        spec, leaves, at = self._structure
        leaves = [
            Phantom(t, device, f"{self.name} output {i}") if isinstance(t, Tensor) else t
            for i, t in enumerate(leaves)
        ]
        leaves[at] = hidden
        return tree_unflatten(leaves, spec)


class _Absent(nn.Module):
    """Stand-in for a module held by another rank: no parameters, so no state-dict keys."""

    def __init__(self, name: str, stage: int, forward: Callable[..., Any]) -> None:
        super().__init__()
        self._lpp_name = name
        self._lpp_stage = stage
        self._lpp_forward = forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._lpp_forward(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"{self._lpp_name!r} lives on stage {self._lpp_stage}"


# -- the staged model ---------------------------------------------------------------------------


@dataclass
class TiedParameter:
    """A parameter object used under several names that live on several stages."""

    names: tuple[str, ...]  # its names on this rank
    all_names: tuple[str, ...]  # its names in the whole model
    stages: tuple[int, ...]  # every stage holding one of the names
    param: nn.Parameter


class StagedModel:
    """This rank's part of a split model, under the model's own parameter names.

    Build it with :meth:`build`. ``model`` is the user's model object with only this rank's
    stages materialised (other modules are parameter-free stand-ins), so ``model.state_dict()``
    holds exactly this rank's share of the unpipelined keys. :meth:`run` executes one local
    stage of the user's own step function.

    Example::

        staged = StagedModel.build(lambda: LlamaForCausalLM(cfg), split="model.layers",
                                   stages=schedule.stages_of(pp_rank), num_stages=pp * vpp,
                                   seed=0)

        def step(model, mb):
            return model(input_ids=mb[0], labels=mb[1]).loss

        hidden = staged.run(0, None, mb, step)        # first stage: from the microbatch
        loss = staged.run(1, hidden_from_prev, mb, step)   # a last stage returns the loss
    """

    def __init__(
        self,
        model: nn.Module,
        layout: SplitLayout,
        stages: Sequence[int],
        shape: ShapeBuild,
        device: torch.device,
    ) -> None:
        self.model = model
        self.layout = layout
        self.stages = tuple(stages)
        self.device = device
        self._shape = shape
        self._tied: list[TiedParameter] = []
        self._stand_ins: dict[int, list[tuple[str, _Absent]]] = {}

    # construction ----------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        model_fn: Callable[[], nn.Module],
        *,
        split: str,
        stages: Sequence[int],
        num_stages: int,
        seed: int | None = None,
        device: torch.device | str = "cpu",
        placement: dict[str, str] | None = None,
        ranges: Sequence[range] | None = None,
    ) -> StagedModel:
        """Build only ``stages`` of ``model_fn()``.

        Initial weights equal those of ``torch.manual_seed(seed); model_fn()`` (see
        :mod:`~lightning_pp.autosplit.materialize`); load a checkpoint afterwards to start from
        trained weights instead.
        """
        shape = meta_build(model_fn)
        layout = SplitLayout.discover(
            shape.model, split, num_stages, placement=placement, ranges=ranges
        )
        mine = set(stages)
        if any(not 0 <= s < num_stages for s in mine):
            raise SplitError(f"stages {sorted(mine)} out of range for {num_stages} stages")

        def keep(name: str) -> bool:
            s = layout.stage_of(name)
            return s is None or s in mine  # shared buffers are real everywhere

        model = replay_build(model_fn, shape, keep, seed)
        staged = cls.assemble(model, shape, layout, stages, device)
        model.to(staged.device)
        return staged

    @classmethod
    def assemble(
        cls,
        model: nn.Module,
        shape: ShapeBuild,
        layout: SplitLayout,
        stages: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> StagedModel:
        """Stage an already built ``model`` IN PLACE: modules of other stages are replaced by
        parameter-free stand-ins. ``shape.model`` is a meta-device twin of ``model`` (same names,
        same ties), from :func:`~lightning_pp.autosplit.materialize.meta_build` or
        :func:`~lightning_pp.autosplit.materialize.meta_twin`."""
        mine = set(stages)
        bad = [s for s in mine if not 0 <= s < layout.num_stages]
        if bad:
            raise SplitError(f"stages {bad} out of range for {layout.num_stages} virtual stages")
        staged = cls(model, layout, sorted(stages), shape, torch.device(device))
        staged._install(mine)
        staged._tied = staged._find_ties()
        return staged

    def _install(self, mine: set[int]) -> None:
        layout, model, twins = self.layout, self.model, self._shape.model
        # every name each module is reachable by, read before anything is replaced: a module
        # also held under a second attribute (``self.last = self.layers[-1]``) must be
        # replaced there too, or another rank's block stays real (its parameters trained and
        # saved here) and a local block's hooks fire in another stage (_only)
        self._aliases: dict[int, list[str]] = {}
        for n, m in model.named_modules(remove_duplicate=False):
            self._aliases.setdefault(id(m), []).append(n)
        self._slots: list[_BlockSlot] = []
        # Stand-ins for this rank's own modules, used while ANOTHER local stage runs (_only)
        self._stand_ins = {s: [] for s in mine}
        for i, name in enumerate(layout.blocks):
            slot = _BlockSlot(i, name, twins.get_submodule(name))
            self._slots.append(slot)
            stage = layout.stage_of(name)
            assert stage is not None
            absent = _Absent(name, stage, self._absent_block(slot, stage))
            if stage in mine:
                block = model.get_submodule(name)
                block.forward = self._block_forward(slot, block.forward)  # instance attribute
                self._stand_ins[stage] += [(n, absent) for n in self._places(name)]
            else:
                for n in self._places(name):
                    self._replace(n, absent)
        for name, stage in layout.units.items():
            twin = twins.get_submodule(name)
            absent = _Absent(name, stage, self._absent_unit(name, twin, stage))
            if stage in mine:
                unit = model.get_submodule(name)
                unit.forward = self._unit_forward(name, twin, unit.forward)
                self._stand_ins[stage] += [(n, absent) for n in self._places(name)]
            else:
                for n in self._places(name):
                    self._replace(n, absent)
        # A persistent buffer of a shared module is saved by the rank of stage 0 only, so the
        # ranks' state-dict keys stay a partition of the model's.
        if 0 not in mine:
            for prefix in layout.shared:
                mod = model.get_submodule(prefix) if prefix else model
                mod._non_persistent_buffers_set.update(
                    n for n, _ in mod.named_buffers(recurse=False)
                )

    def _places(self, name: str) -> list[str]:
        """The names under which the module at ``name`` sits in the model, one per distinct
        (parent, attribute) slot: an aliased container (two names for one ``ModuleList``) is
        one slot, replaced once."""
        target = self.model.get_submodule(name)
        slots: set[tuple[int, str]] = set()
        out: list[str] = []
        for n in self._aliases.get(id(target), [name]):
            parent_name, _, child = n.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            if (id(parent), child) not in slots:
                slots.add((id(parent), child))
                out.append(n)
        return out

    def _replace(self, name: str, new: nn.Module) -> nn.Module:
        """Put ``new`` at ``name`` in the model; returns the module that was there."""
        parent_name, _, child = name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        old = parent.get_submodule(child)
        if isinstance(parent, nn.ModuleList):
            parent[int(child)] = new
        else:
            setattr(parent, child, new)
        return old

    @contextlib.contextmanager
    def _only(self, stage: int) -> Iterator[None]:
        """While ``stage`` runs, this rank's modules of its OTHER local stages (vpp > 1: V
        placement holds stages r and 2p-1-r, a loop placement r and r+p) are swapped out of the
        model for the stand-ins other ranks' modules already are, and put back afterwards.

        Why: the stage's forward still *calls* those modules, through ``nn.Module.__call__``
        (a block before its first one passes its input through; the next stage's first block
        is where it stops), and ``__call__`` runs every hook registered on the module before
        our ``forward`` can decline to compute. FSDP2 registers a pre-forward hook on each unit:
        on the first call it lazily initialises the unit's state AS A ROOT and all-gathers its
        parameters. With V placement, pp rank 1's first stage ends by calling its second stage's
        first block, so that block became an FSDP2 root of its own, and the second chunk's
        first forward then failed ("FSDP state has already been lazily initialized for
        owned.0"); a block passed through by a later local stage had its FSDP2 (or tensor-
        parallel, or user) hooks run on phantoms, in another chunk's forward. With the swap a
        stage sees exactly the modules it runs, whatever the placement, and the hooks of a
        module fire only in its own stage's forward. The current module is read at each swap,
        so a module replaced after staging is put back as found."""
        swaps = [x for s, xs in self._stand_ins.items() if s != stage for x in xs]
        held: list[tuple[str, nn.Module]] = []
        try:
            for name, absent in swaps:
                held.append((name, self._replace(name, absent)))
            yield
        finally:
            for name, module in reversed(held):
                self._replace(name, module)

    # module behaviours -----------------------------------------------------------------------
    def _block_forward(self, slot: _BlockSlot, real: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            run = _ACTIVE.get()
            if run is None:
                return real(*args, **kwargs)
            return self._block_step(run, slot, real, args, kwargs)

        return forward

    def _absent_block(self, slot: _BlockSlot, stage: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            run = _ACTIVE.get()
            if run is None:
                raise SplitError(f"`{slot.name}` lives on stage {stage}, not on this rank")
            return self._block_step(run, slot, None, args, kwargs)

        return forward

    def _block_step(self, run: _Run, slot: _BlockSlot, real, args: tuple, kwargs: dict) -> Any:
        i, lo, hi = slot.index, run.blocks.start, run.blocks.stop
        previous = run.called[-1] if run.called else None
        run.called.append(i)
        if i < lo:
            hidden, _ = _hidden_arg(args, kwargs, slot.name)
            return slot.passthrough(hidden, args, kwargs, run.device)
        if (i > lo and previous != i - 1) or i > hi or (i < hi and real is None):
            raise SplitError(
                f"stage {run.stage}: `{slot.name}` was called out of order (blocks called so far "
                f"in this run: {run.called}; this stage runs blocks {lo}-{hi - 1}): the blocks of "
                f"{self.layout.split!r} must each be called once, in order"
            )
        if i == hi:
            # The stage ends where the NEXT stage's first block is called, so code the forward
            # runs between two blocks (an activation, a norm in the loop body) runs here, once.
            hidden, _ = _hidden_arg(args, kwargs, slot.name)
            _check_real(f"the hand-over to `{slot.name}`", run.stage, (hidden,), {})
            raise _StageExit(hidden)
        if i == lo and run.stage > 0:
            _, put = _hidden_arg(args, kwargs, slot.name)
            args, kwargs = put(run.activation)
        _check_real(f"`{slot.name}`", run.stage, args, kwargs)
        out = real(*args, **kwargs)
        if i == hi - 1:
            run.finished_blocks = True
        return out

    def _unit_forward(self, name: str, twin: nn.Module, real) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            run = _ACTIVE.get()
            if run is None:
                return real(*args, **kwargs)
            # held by this rank for another of its stages: _only swaps it out (under every
            # name it has) while that stage is not running, so this is a fallback only
            if name not in run.units:
                return _phantom_run(twin, name, run.device, args, kwargs)
            _check_real(f"`{name}`", run.stage, args, kwargs)
            return real(*args, **kwargs)

        return forward

    def _absent_unit(self, name: str, twin: nn.Module, stage: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            run = _ACTIVE.get()
            if run is None:
                raise SplitError(f"`{name}` lives on stage {stage}, not on this rank")
            return _phantom_run(twin, name, run.device, args, kwargs)

        return forward

    # running ---------------------------------------------------------------------------------
    def run(
        self,
        chunk: int,
        activation: Tensor | None,
        microbatch: Any,
        step: Callable[[nn.Module, Any], Any],
        *,
        expect_tensor: bool = True,
    ) -> Any:
        """Run local stage ``self.stages[chunk]`` of ``step(model, microbatch)``.

        Returns the hidden state to send on, or on the last stage what ``step`` returns (the
        loss; any value when ``expect_tensor=False``, e.g. a ``validation_step`` returning
        ``None``). ``activation``: the previous stage's output (``None`` on stage 0).
        """
        stage = self.stages[chunk]
        last = stage == self.layout.num_stages - 1
        if (activation is None) != (stage == 0):
            raise SplitError(f"stage {stage}: {'no' if stage else 'an'} activation was given")
        units = {u for u, s in self.layout.units.items() if s == stage}
        run = _Run(stage, self.layout.ranges[stage], units, activation, last, self.device)
        token = _ACTIVE.set(run)
        try:
            with self._only(stage):
                out = step(self.model, microbatch)
        except _StageExit as e:
            return e.hidden
        finally:
            _ACTIVE.reset(token)
        where = f"stage {stage} (blocks {run.blocks.start}-{run.blocks.stop - 1})"
        if not last or not run.finished_blocks:
            until = run.blocks.stop if not last else run.blocks.stop - 1
            raise SplitError(
                f"{where}: the step returned before block {until} was called (blocks called: "
                f"{run.called}); the model's forward must call every block of "
                f"{self.layout.split!r} in order (data-dependent early exit cannot be split)"
            )
        found = origins_of(out)
        if found:
            raise PhantomValueError(
                f"{where}: the step's result is computed from `{'`, `'.join(found)}`, which runs "
                f"on another pipeline stage (is it placed right? place it with "
                f"PipelineStrategy(split_placement={{{found[0]!r}: 'last'}}))"
            )
        if expect_tensor and not isinstance(out, Tensor):
            raise SplitError(f"{where}: the step must return the loss tensor, got {type(out)}")
        return out

    # introspection ---------------------------------------------------------------------------
    def stage_modules(self, chunk: int) -> list[nn.Module]:
        """The real modules of local stage ``chunk`` (blocks and placed units)."""
        stage = self.stages[chunk]
        names = [self.layout.blocks[i] for i in self.layout.ranges[stage]]
        names += [u for u, s in self.layout.units.items() if s == stage]
        return [self.model.get_submodule(n) for n in names]

    def _find_ties(self) -> list[TiedParameter]:
        by_id: dict[int, list[str]] = {}
        for n, p in self._shape.model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(n)
        local = dict(self.model.named_parameters(remove_duplicate=False))
        ties = []
        for names in by_id.values():
            stages = sorted({self.layout.stage_of(n) for n in names})
            if len(stages) < 2:
                continue
            here = tuple(n for n in names if n in local)
            if here:
                ties.append(TiedParameter(here, tuple(names), tuple(stages), local[here[0]]))
        return ties

    def all_ties(self) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
        """Every tie of the WHOLE model spanning several stages, as ``(names, stages)``, in the
        same order on every rank (the shape build's parameter order): collectives per tie
        (one process group each) must be created in one order everywhere."""
        by_id: dict[int, list[str]] = {}
        for n, p in self._shape.model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(n)
        out = []
        for names in by_id.values():
            stages = tuple(sorted({self.layout.stage_of(n) for n in names}))
            if len(stages) > 1:
                out.append((tuple(names), stages))
        return out

    @property
    def tied(self) -> list[TiedParameter]:
        """Tied parameters present on this rank whose users span several stages."""
        return self._tied

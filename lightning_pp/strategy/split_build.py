"""``PipelineStrategy(split=...)``: pipeline a LightningModule whose model nobody cut for it.

The module keeps its own ``training_step``/``validation_step``/``test_step``/``predict_step``
(``return self.model(input_ids=x, labels=y).loss``) and its own model class; the strategy is
told only where the repeated blocks are (``split="model.transformer.h"``, a name relative to the
LightningModule). :class:`SplitPipeline` holds everything this path does differently from the
explicit :class:`~lightning_pp.strategy.model.PipelineLayers` path; the strategy calls it at five
points
(building, setup, the engine's loss/input, the steps, checkpoint names).

Building (each rank materialises only its stages):

- model built in ``configure_model`` (recommended): the user's ``configure_model`` runs once on
  the meta device (names, shapes, ties, registration order), then once more for real with every
  tensor of another stage swapped for a meta tensor as it is registered
  (:func:`~lightning_pp.autosplit.materialize.replay_build`). Local weights equal a plain
  ``Trainer`` run's bit for bit, and the RNG ends where a plain build leaves it.
- model built in ``__init__`` (e.g. ``from_pretrained``): every rank holds the whole model until
  ``setup``, where other stages' modules are dropped.

Steps: the engine calls each local stage with its received activation AND its microbatch
(``chunk_gets_microbatch``), and the stage runs the user's hook on that microbatch; the stage
stops where the forward calls the next stage's first block (:mod:`.split`). The last stage's
hook result is the microbatch loss. ``self.log`` calls made inside the hook are captured on the
last stage, averaged over the microbatches (weighted by their size, like the loss), sent to every
rank of the pipeline and replayed there with the same arguments, so every rank logs the same
values (monitors and ``sync_dist=True`` work as under DDP).

Example::

    class Finetune(L.LightningModule):
        def configure_model(self):
            self.model = LlamaForCausalLM(config)      # unchanged model class
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.model(input_ids=x, labels=y).loss
            self.log("train_loss", loss, sync_dist=True)
            return loss

    trainer = L.Trainer(devices=4, strategy=PipelineStrategy(pp=2, split="model.model.layers"))
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..autosplit.materialize import (
    ShapeBuild,
    _registration_hooks,
    _to_meta,
    meta_twin,
    replay_build,
)
from ..autosplit.split import SplitError, SplitLayout, StagedModel
from ..layout.rank_layout import RankLayout
from ..layout.rules import PreflightError, split_cost_partition_message
from ..runtime.grad_sync import TiedGroup, TiedParameterSync
from ..runtime.microbatch import batch_size_of, batch_size_or_none, split_microbatches
from . import eval_step
from .engine_build import LossScale
from .loss_count import combine_over_dp
from .module_rules import check_no_scaler
from .preflight import split_layout, split_mixin_message

__all__ = ["SplitPipeline"]

log = logging.getLogger(__name__)


class _Shell(nn.Module):
    """A plain container holding a LightningModule's children and direct tensors: the meta twin
    of the root (the LightningModule itself is never copied: it references the Trainer)."""


def _shell_of(module: nn.Module, *, meta: bool) -> nn.Module:
    shell = _Shell()
    shell._modules.update(module._modules)
    shell._parameters.update(module._parameters)
    shell._buffers.update(module._buffers)
    if not meta:
        return meta_twin(shell).model
    for name, p in list(shell._parameters.items()):
        if p is not None and not p.is_meta:
            shell._parameters[name] = _to_meta(p)
    return shell


def _snapshot(module: nn.Module) -> dict[str, Any]:
    state = dict(module.__dict__)
    for key in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
        state[key] = type(state[key])(state[key])
    return state


def _restore(module: nn.Module, state: dict[str, Any]) -> None:
    module.__dict__.clear()
    module.__dict__.update(state)


def _loss_of(result: Any, hook: str) -> Tensor:
    if isinstance(result, dict) and "loss" in result:
        result = result["loss"]
    if not isinstance(result, Tensor):
        raise SplitError(
            f"{hook} returned {type(result).__name__}; under PipelineStrategy(split=...) it must "
            f"return the loss tensor (or a dict with 'loss')"
        )
    return result


class _LogCapture:
    """``self.log`` inside a hook: kept per name as a microbatch-size-weighted sum."""

    def __init__(self) -> None:
        self.weight: int | None = None  # size of the running microbatch; None: not the last stage
        self.values: dict[str, list[Any]] = {}

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if self.weight is None:
            return  # a stage other than the last: its hook never got to a real value
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; "
                    f"PipelineStrategy(split=...) logs scalars only"
                )
            number = float(value.detach().float())
        elif isinstance(value, (int, float)):
            number = float(value)
        else:
            raise TypeError(
                f"self.log({name!r}, {type(value).__name__}) inside a step is not supported "
                f"under PipelineStrategy(split=...): log a scalar tensor or a number (the value "
                f"is computed on the last stage and sent to the other ranks)"
            )
        entry = self.values.setdefault(name, [0.0, 0, args, kwargs])
        entry[0] += number * self.weight
        entry[1] += self.weight

    def take(self, combine: Callable | None = None) -> dict[str, tuple[float, tuple, dict]]:
        """Each name's weighted mean; ``combine`` first sums the weighted sums and weights
        over the data-parallel replicas (token weighting: the global batch's mean)."""
        values, self.values = self.values, {}
        if combine is not None:
            values = combine(values)
        return {n: (s / w, a, k) for n, (s, w, a, k) in values.items() if w}


class _SplitChunk(nn.Module):
    """One local stage as an engine chunk: ``forward(activation, microbatch)``."""

    def __init__(self, pipeline: SplitPipeline, chunk: int) -> None:
        super().__init__()
        self._pipeline = [pipeline]  # a list: not registered as a submodule
        self.chunk = chunk
        assert pipeline.staged is not None
        self.owned = nn.ModuleList(pipeline.staged.stage_modules(chunk))

    def forward(self, x: Any, microbatch: Any) -> Any:
        return self._pipeline[0].run_chunk(self.chunk, x, microbatch)


class SplitPipeline:
    """The ``split=`` path of :class:`~lightning_pp.strategy.PipelineStrategy` (see the module
    docstring). ``split``: dotted name, relative to the LightningModule, of the ModuleList of
    repeated blocks; ``placement``: ``{module name: "first" | "last"}`` for modules whose
    registration order does not say where they run."""

    def __init__(self, split: str, placement: dict[str, str] | None = None) -> None:
        self.split = split
        self.placement = dict(placement or {})
        self.staged: StagedModel | None = None
        self.chunks: list[_SplitChunk] = []
        self._step: Callable[[nn.Module, Any], Any] | None = None
        self._expect_tensor = True
        self._logs = _LogCapture()
        self._built_in_configure = False
        # Token weighting (strategy/loss_count.py): a microbatch's count, and the sum over dp
        self._log_counter: Callable[[Any], tuple[int | None, str]] | None = None
        self._log_combine: Callable | None = None

    # ------------------------------------------------------------------ building
    def _layout(self, layout: RankLayout, module: Any, twin: nn.Module) -> SplitLayout:
        """Cut the blocks as the strategy's plan says (``partition``, ``pp * vpp``), by the
        pre-flight's rules (:func:`~lightning_pp.strategy.preflight.split_layout`, which
        ``lightning-pp plan``/``fit`` ran on the meta build already)."""
        mixin = split_mixin_message(self.split, module)
        if mixin is not None:
            raise SplitError(mixin)
        plan = layout.need_plan()
        if plan.partition == "cost":  # refused with the settings already; a plan built by hand
            try:
                num_blocks: int | None = len(twin.get_submodule(self.split))  # type: ignore[arg-type]
            except (AttributeError, TypeError):
                num_blocks = None
            raise SplitError(
                split_cost_partition_message(self.split, plan.pp, plan.vpp, num_blocks)
            )
        split_layout_, plan = split_layout(
            twin, self.split, self.placement, plan, type(module).__name__
        )
        blocks = [twin.get_submodule(b) for b in split_layout_.blocks]
        params = [sum(p.numel() for p in b.parameters()) for b in blocks]
        layout.with_layers(len(blocks), layer_params=params)
        assert layout.plan is not None and layout.plan.layer_ranges == plan.layer_ranges
        return split_layout_

    def _stages(self, layout: RankLayout) -> list[int]:
        return list(layout.need_plan().schedule.stages_of(layout.need_topology().pp_rank))

    @contextlib.contextmanager
    def build_context(
        self, layout: RankLayout, module: Any, device: torch.device
    ) -> Generator[None, None, None]:
        """Around Lightning's ``configure_model`` call: build only this rank's stages."""
        if module is None or self.staged is not None:
            yield
            return
        configure = module.configure_model

        def staged_configure_model() -> None:
            self._configure(layout, module, configure, device)

        module.configure_model = staged_configure_model  # an instance attribute shadows it
        try:
            yield
        finally:
            module.__dict__.pop("configure_model", None)

    def _configure(
        self,
        layout: RankLayout,
        module: nn.Module,
        configure: Callable[[], Any],
        device: torch.device,
    ) -> None:
        before = _snapshot(module)
        registrations: list[Tensor | None] = []

        def record(_module: nn.Module, _name: str, value: Any) -> None:
            registrations.append(value)

        with _registration_hooks(record, record), torch.device("meta"):
            configure()
        twin = _shell_of(module, meta=True)
        _restore(module, before)
        try:
            built_here = all(p.is_meta for p in twin.get_submodule(self.split).parameters())
        except AttributeError:
            built_here = False
        if not built_here:  # the blocks come from __init__: setup() stages them in place
            configure()
            return
        split_layout = self._layout(layout, module, twin)
        mine = set(self._stages(layout))

        def keep(name: str) -> bool:
            stage = split_layout.stage_of(name)
            return stage is None or stage in mine

        def rebuild() -> nn.Module:
            configure()
            return module

        shape = ShapeBuild(twin, registrations)
        replay_build(rebuild, shape, keep, seed=None)
        self.staged = StagedModel.assemble(module, shape, split_layout, sorted(mine), device)
        self._built_in_configure = True

    def stage_module(
        self, layout: RankLayout, module: nn.Module, precision_plugin: Any, device: torch.device
    ) -> None:
        """At setup: stage a model that ``configure_model`` did not build (built in
        ``__init__``): every rank built all of it; other stages' modules are dropped now."""
        if self.staged is None:
            if layout.need_topology().rank == 0:
                log.info(
                    f"split={self.split!r}: the model was built outside configure_model(); "
                    f"every rank materialised all of it and now drops other stages' modules "
                    f"(build it in configure_model() to materialise only local stages)"
                )
            twin = _shell_of(module, meta=False)
            split_layout = self._layout(layout, module, twin)
            self.staged = StagedModel.assemble(
                module, ShapeBuild(twin), split_layout, self._stages(layout), device
            )
        check_no_scaler(precision_plugin)
        self.chunks = [_SplitChunk(self, c) for c in range(len(self.staged.stages))]

    def tied_sync(self, layout: RankLayout) -> TiedParameterSync:
        """Collective: one process group per tie whose copies live on several pipeline ranks.
        The owner (initialises, counts once in the global norm) holds the tie's first name."""
        staged, topo, groups = self.staged, layout.need_topology(), layout.need_groups()
        assert staged is not None
        schedule = layout.need_plan().schedule
        local = {t.all_names: t for t in staged.tied}
        out = []
        for names, stages in staged.all_ties():
            pp_ranks = sorted({schedule.locate(s)[0] for s in stages})
            if len(pp_ranks) < 2:
                continue
            owner = schedule.locate(staged.layout.stage_of(names[0]))[0]
            lists, mine = topo.stage_lists(pp_ranks)
            group = groups.new_groups(lists)  # collective: every rank creates every group
            if names in local:
                out.append(
                    TiedGroup(
                        names=names,
                        param=local[names].param,
                        owner_rank=topo.global_rank(owner),
                        ranks=lists[mine],
                        group=group,
                    )
                )
        return TiedParameterSync(out)

    def refuse_local_ties(self, tp: int) -> None:
        """``tp > 1``: tied weights (``tie_word_embeddings``) are refused for now, naming them:
        the model's plan cuts the embedding and the head each on its own, which would split
        one weight into two (a ``PipelineLayers`` model ties a vocabulary-parallel embedding
        to a column-wise head: :class:`~lightning_pp.models.decoder.DecoderLM`)."""
        assert self.staged is not None
        ties = [names for names, _ in self.staged.all_ties()]
        if ties:
            raise PreflightError(
                f"tp={tp} with split=: tied weights {ties} are not supported yet under tensor "
                f"parallelism (set tie_word_embeddings=False in the model's config, or tp=1)",
                key="tp",
            )

    def canonical_names(self) -> dict[str, str]:
        """Tied member name -> the tie's first name (what a checkpoint stores it under)."""
        assert self.staged is not None
        return {n: names[0] for names, _ in self.staged.all_ties() for n in names}

    # ------------------------------------------------------------------ running
    def engine_kwargs(self, loss_scale: LossScale, device: torch.device) -> dict[str, Any]:
        """``PipelineEngine`` arguments: stage 0 reads its microbatch itself; the last stage's
        hook result is the loss (divided like Lightning divides a plain step's loss)."""

        def loss_fn(out: Any, microbatch: Any) -> Tensor:
            if not self._expect_tensor:  # evaluation: hooks log; no loss to add up
                return torch.zeros((), device=device)
            return out / loss_scale.value

        return {"loss_fn": loss_fn, "input_fn": lambda mb: (), "chunk_gets_microbatch": True}

    def run_chunk(self, chunk: int, x: Any, microbatch: Any) -> Any:
        staged = self.staged
        assert staged is not None and self._step is not None
        stage = staged.stages[chunk]
        last = stage == staged.layout.num_stages - 1
        self._logs.weight = self._log_weight(microbatch) if last else None
        try:
            return staged.run(
                chunk,
                None if stage == 0 else x,
                microbatch,
                self._step,
                expect_tensor=self._expect_tensor,
            )
        finally:
            self._logs.weight = None

    def set_log_weights(
        self, counter: Callable[[Any], tuple[int | None, str]] | None, combine: Callable | None
    ) -> None:
        """Weight the captured logs of the next step(s) by each microbatch's valid targets
        (``counter``) and sum them over the replicas (``combine``); ``None``: by size."""
        self._log_counter, self._log_combine = counter, combine

    def _log_weight(self, microbatch: Any) -> int:
        if self._log_counter is not None:
            count, why = self._log_counter(microbatch)
            if count is None:
                raise SplitError(f"no count of valid targets for a microbatch's logs: {why}")
            return count
        return batch_size_of(microbatch)

    @contextlib.contextmanager
    def _running(
        self, module: Any, hook: str, args: Sequence[Any], kwargs: dict, train: bool
    ) -> Generator[None, None, None]:
        fn = getattr(module, hook)
        rest, extra = tuple(args[1:]), dict(kwargs)
        extra.pop("batch", None)
        if train:
            self._step = lambda _model, mb: _loss_of(fn(mb, *rest, **extra), hook)
        else:
            self._step = lambda _model, mb: fn(mb, *rest, **extra)
        self._expect_tensor = train
        module.log = self._logs  # an instance attribute: log_dict's self.log calls land here
        try:
            yield
        finally:
            module.__dict__.pop("log", None)
            self._step, self._expect_tensor = None, True

    def train_step(
        self,
        engine: Any,
        module: Any,
        args: Sequence[Any],
        kwargs: dict,
        loss_weights: Sequence[float] | None = None,
    ) -> Any:
        """The engine's training step running ``module.training_step`` on every stage
        (``loss_weights``: per microbatch, token normalization's; ``None``: by size)."""
        batch = args[0] if args else kwargs["batch"]
        with self._running(module, "training_step", args, kwargs, train=True):
            return engine.train_step(batch, loss_weights=loss_weights)

    def replay_logs(self, layout: RankLayout, module: Any, logs: dict | None = None) -> None:
        """Send the last stage's captured logs to every pipeline rank; log them everywhere."""
        if logs is None:
            payload = [self._logs.take(self._log_combine)]
            last = layout.need_placement().output_rank
            topo = layout.need_topology()
            if topo.pp > 1:
                src, group = topo.global_rank(last), layout.need_groups().pp_group
                dist.broadcast_object_list(payload, src=src, group=group)
            logs = payload[0]
        device = module.device
        for name, (value, args, kwargs) in logs.items():
            value_t = torch.tensor(value, dtype=torch.float32, device=device)
            type(module).log(module, name, value_t, *args, **kwargs)

    def forward_only(
        self,
        run: eval_step.ForwardOnly,
        hook: str,
        args: Sequence[Any],
        kwargs: dict,
        context: Callable,
        predict: bool = False,
    ) -> Any:
        """``validation_step``/``test_step``/``predict_step`` through the forward-only
        schedule: logs (or, for predict, the outputs concatenated) reach every rank."""
        module = run.module
        batch = args[0] if args else kwargs["batch"]
        rank = run.layout.need_topology().rank
        run.layout.need_plan().check_batch_on_rank(batch_size_or_none(batch), rank)
        with self._running(module, hook, args, kwargs, train=False):
            if predict:
                return eval_step.predict(run, batch, context, hook)
            self._eval_log_weights(run, module, hook, args, kwargs, batch)
            try:
                logs = eval_step.forward_only(run, batch, context, self._on_output, hook)
            finally:
                self.set_log_weights(None, None)
        self.replay_logs(run.layout, module, logs)
        return None

    def _eval_log_weights(
        self,
        run: eval_step.ForwardOnly,
        module: Any,
        hook: str,
        args: Sequence,
        kwargs: dict,
        batch: Any,
    ) -> None:
        """Under token normalization, weight an eval hook's logs by valid targets."""
        counts = run.loss_counts
        if counts is None or not counts.active:
            return
        fn = getattr(module, hook)
        rest, extra = tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "batch"}
        counter = counts.counter(module, self.split, lambda mb: fn(mb, *rest, **extra))
        m = run.engine.schedule.microbatches
        if counts.counts(split_microbatches(batch, m), counter) is not None:
            layout, collectives, device = run.layout, run.collectives, run.device
            self.set_log_weights(
                counter, lambda values: combine_over_dp(values, layout, collectives, device)
            )

    def _on_output(self, _output: Any) -> dict[str, tuple[float, tuple, dict]]:
        """On the last stage after an eval step: what the hook logged is the step's result."""
        return self._logs.take(self._log_combine)

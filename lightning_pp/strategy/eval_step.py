"""Forward-only steps of :class:`~lightning_pp.strategy.PipelineStrategy`: validation, test and
prediction share one path.

Every rank runs the forward-only schedule for the batch; the rank holding the last stage turns the
batch's output (its microbatches concatenated) into a value (metrics, predictions or captured
logs) and broadcasts it over the pipeline group, so every rank returns and logs the same thing.
If that user hook raises on the last stage, the failure travels in place of the value and the
other ranks stop with ``PipelineAborted`` instead of waiting in the broadcast.

The strategy's ``validation_step``/``test_step``/``predict_step`` hooks call :func:`step`, which
picks :func:`evaluate` or :func:`predict`; the ``split=`` path
(:mod:`lightning_pp.strategy.split_build`) runs the module's own hook through
:func:`forward_only`.

Example::

    run = ForwardOnly(engine, layout, module, collectives=strategy, device=device)
    values = evaluate(run, batch, "val", precision_plugin.val_step_context)
    # {"val_loss": tensor(...)} on every rank of the pipeline, logged on every rank
    values = step(run, "validation_step", (batch, batch_idx), precision_plugin)  # from the hook
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..runtime.failure import PipelineAborted
from ..runtime.microbatch import batch_size_or_none
from .stage_logging import LogCall, capture_logs, replay_logs

if TYPE_CHECKING:
    from ..layout.rank_layout import RankLayout
    from ..runtime.engine import PipelineEngine
    from ..runtime.records import StepRecord
    from .collectives import Collectives
    from .loss_count import LossCounts

__all__ = ["ForwardOnly", "concat_outputs", "evaluate", "forward_only", "predict", "step", "to_cpu"]

#: each forward-only Lightning hook: the precision plugin's context for it, and its data split
_HOOKS = {
    "validation_step": ("val_step_context", "val"),
    "test_step": ("test_step_context", "test"),
    "predict_step": ("predict_step_context", None),
}


@dataclass
class ForwardOnly:
    """What a forward-only step runs on: this rank's engine and layout, the module whose hooks
    it calls, the collectives that bring the last stage's result to every rank and the device
    results live on. ``record`` is the engine's record of the last step run."""

    engine: PipelineEngine
    layout: RankLayout
    module: Any
    collectives: Collectives
    device: torch.device
    record: StepRecord | None = None
    #: the loss normalization: under token weighting, replicas' values combine by their counts
    loss_counts: LossCounts | None = None


def hook_context(hook: str, precision_plugin: Any) -> Callable:
    """The precision plugin's context for a forward-only ``hook`` (``val_step_context``, ...)."""
    return getattr(precision_plugin, _HOOKS[hook][0])


def step(run: ForwardOnly, hook: str, args: Sequence[Any], precision_plugin: Any) -> Any:
    """The strategy's ``hook`` (``validation_step``, ``test_step`` or ``predict_step``) for a
    module with ``PipelineLayers``: :func:`evaluate` the batch (``args[0]``) on the hook's data
    split, or :func:`predict` it. (The ``split=`` path runs the module's own hook instead:
    :meth:`~lightning_pp.strategy.split_build.SplitPipeline.forward_only`.)"""
    context = hook_context(hook, precision_plugin)
    data_split = _HOOKS[hook][1]
    if data_split is None:
        return predict(run, args[0], context)
    return evaluate(run, args[0], data_split, context)


def forward_only(
    run: ForwardOnly,
    batch: Any,
    context: Callable,
    on_output: Callable[[Any], Any],
    hook: str,
) -> Any:
    """Run the forward-only schedule. The rank holding the last stage turns the batch's output
    (microbatches concatenated) into ``on_output(output)``; every pipeline rank returns it.

    If ``on_output`` (the user's ``hook``) raises there, the other ranks, waiting in the
    broadcast, receive the failure instead of a value and stop with ``PipelineAborted``:
    one stage's error must not leave the others blocked in a collective."""
    topo, groups = run.layout.need_topology(), run.layout.need_groups()
    placement = run.layout.need_placement()
    with context():
        result = run.engine.eval_step(batch, collect_outputs=True)
    run.record = result.record
    last = placement.output_rank
    src = topo.global_rank(last)
    payload: list[Any] = [None]
    error: Exception | None = None
    if topo.pp_rank == last:
        try:
            payload = [(True, on_output(concat_outputs(result.outputs)))]
        except Exception as e:
            if topo.pp == 1:
                raise
            error, payload = e, [(False, {"type": type(e).__name__, "message": str(e)})]
    if topo.pp > 1:
        payload = [run.collectives.broadcast_object(payload[0], src, groups.pp_group, "outputs")]
    ok, value = payload[0]
    if error is not None:
        raise error
    if not ok:
        rank = topo.rank
        origin = {"rank": src, "where": hook, **value}
        raise PipelineAborted(
            f"rank {rank}: stopped because rank {src} (last stage) failed in "
            f"{hook}(): {value['type']} (its error is printed by rank {src})",
            rank,
            src,
            origin,
        )
    return value


def evaluate(run: ForwardOnly, batch: Any, split: str, context: Callable) -> dict[str, Tensor]:
    """``pipeline_eval_step`` on the last stage, averaged over replicas, logged everywhere."""
    topo, groups = run.layout.need_topology(), run.layout.need_groups()
    run.layout.need_plan().check_batch_on_rank(batch_size_or_none(batch), topo.rank)
    module = run.module

    def metrics(output: Any) -> tuple[list[str], Tensor, list[LogCall]]:
        # What the hook self.log()s is captured here and replayed on every rank below.
        with context(), capture_logs(module, "pipeline_eval_step", topo.rank) as logs:
            values = module.pipeline_eval_step(output, batch, split)
        stacked = torch.stack([torch.as_tensor(v).detach().float() for v in values.values()])
        count = _replica_count(run, batch)
        if topo.dp > 1 and count is not None:  # a mean over the global batch's targets
            weighted = torch.cat([stacked.double() * count, stacked.new_tensor([count]).double()])
            run.collectives.all_reduce(weighted, group=groups.dp_group, what="the eval metrics")
            stacked = (weighted[:-1] / weighted[-1]).float()
        elif topo.dp > 1:  # average over replicas (each saw a different shard)
            run.collectives.all_reduce(stacked, group=groups.dp_group, what="the eval metrics")
            stacked = stacked / topo.dp
        return list(values), stacked.cpu(), logs

    names, stacked, logs = forward_only(run, batch, context, metrics, "pipeline_eval_step")
    values = {n: stacked[i].to(run.device) for i, n in enumerate(names)}
    module.pipeline_log_eval(values, split)
    replay_logs(module, logs, groups.dp_group, run.device)
    return values


def _replica_count(run: ForwardOnly, batch: Any) -> int | None:
    """This replica's count of valid targets under token normalization, else ``None``."""
    counts = run.loss_counts
    if counts is None or not counts.active:
        return None
    found = counts.counts([batch], counts.counter(run.module, None))
    return None if found is None else found[0]


def predict(run: ForwardOnly, batch: Any, context: Callable, hook: str = "predict_step") -> Any:
    """The batch's output (microbatches concatenated) on every rank of the pipeline; sent to the
    other ranks on the CPU (``pp > 1``)."""
    pp = run.layout.need_topology().pp

    def output(out: Any) -> Any:
        return to_cpu(out) if pp > 1 else out

    return forward_only(run, batch, context, output, hook)


def concat_outputs(outputs: Sequence[Any]) -> Any:
    """Join per-microbatch outputs along dim 0 (tensors, or tuples/lists of tensors)."""
    first = outputs[0]
    if isinstance(first, Tensor):
        return torch.cat(list(outputs), dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(concat_outputs([o[i] for o in outputs]) for i in range(len(first)))
    return list(outputs)


def to_cpu(x: Any) -> Any:
    """Tensors (and tuples/lists of them) moved to the CPU; anything else as it is."""
    if isinstance(x, Tensor):
        return x.cpu()
    if isinstance(x, (tuple, list)):
        return type(x)(to_cpu(t) for t in x)
    return x

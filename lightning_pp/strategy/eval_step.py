"""Forward-only steps of :class:`~lightning_pp.strategy.PipelineStrategy`: validation, test and
prediction share one path.

Every rank runs the forward-only schedule for the batch; the rank holding the last stage turns the
batch's output (its microbatches concatenated) into a value (metrics, predictions or captured
logs) and broadcasts it over the pipeline group, so every rank returns and logs the same thing.
If that user hook raises on the last stage, the failure travels in place of the value and the
other ranks stop with ``PipelineAborted`` instead of waiting in the broadcast.

The strategy's ``validation_step``/``test_step``/``predict_step`` hooks call :func:`step`, which
picks :func:`evaluate` or :func:`predict`, or, for the ``split=`` path
(:mod:`lightning_pp.autosplit.strategy_glue`), the module's own hook through :func:`forward_only`.

Example::

    values = evaluate(strategy, batch, "val", strategy.precision_plugin.val_step_context)
    # {"val_loss": tensor(...)} on every rank of the pipeline, logged on every rank
    values = step(strategy, "validation_step", (batch, batch_idx), {})   # the same, from the hook
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .failure import PipelineAborted
from .stage_logging import LogCall, capture_logs, replay_logs

if TYPE_CHECKING:
    from .strategy import PipelineStrategy

__all__ = ["concat_outputs", "evaluate", "forward_only", "predict", "step", "to_cpu"]

#: each forward-only Lightning hook: the precision plugin's context for it, and its data split
_HOOKS = {
    "validation_step": ("val_step_context", "val"),
    "test_step": ("test_step_context", "test"),
    "predict_step": ("predict_step_context", None),
}


def step(strategy: PipelineStrategy, hook: str, args: Sequence[Any], kwargs: dict) -> Any:
    """The strategy's ``hook`` (``validation_step``, ``test_step`` or ``predict_step``): the
    ``split=`` path runs the module's own hook on every stage; otherwise :func:`evaluate` the
    batch (``args[0]``) on the hook's data split, or :func:`predict` it."""
    context_name, split = _HOOKS[hook]
    context = getattr(strategy.precision_plugin, context_name)
    if strategy.split_pipeline is not None:
        predicting = hook == "predict_step"
        return strategy.split_pipeline.forward_only(
            strategy, hook, args, kwargs, context, predict=predicting
        )
    if split is None:
        return predict(strategy, args[0], context)
    return evaluate(strategy, args[0], split, context)


def forward_only(
    strategy: PipelineStrategy,
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
    topo, groups, placement = strategy.topology, strategy.groups, strategy.placement
    assert topo is not None and groups is not None and placement
    with context():
        result = strategy.engine.eval_step(batch, collect_outputs=True)
    strategy.last_record = result.record
    last = placement.output_rank
    src = topo.global_rank(last)
    payload: list[Any] = [None]
    error: Exception | None = None
    if topo.pp_rank == last:
        try:
            payload = [(True, on_output(concat_outputs(result.outputs)))]
        except Exception as e:
            if strategy.pp == 1:
                raise
            error, payload = e, [(False, {"type": type(e).__name__, "message": str(e)})]
    if strategy.pp > 1:
        payload = [strategy.broadcast_object(payload[0], src, groups.pp_group, "outputs")]
    ok, value = payload[0]
    if error is not None:
        raise error
    if not ok:
        rank = strategy.global_rank
        origin = {"rank": src, "where": hook, **value}
        raise PipelineAborted(
            f"rank {rank}: stopped because rank {src} (last stage) failed in "
            f"{hook}(): {value['type']} (its error is printed by rank {src})",
            rank,
            src,
            origin,
        )
    return value


def evaluate(
    strategy: PipelineStrategy, batch: Any, split: str, context: Callable
) -> dict[str, Tensor]:
    """``pipeline_eval_step`` on the last stage, averaged over replicas, logged everywhere."""
    assert strategy.plan is not None
    strategy.plan.check_batch_of(batch, strategy.global_rank)
    module: Any = strategy.lightning_module
    topo, groups = strategy.topology, strategy.groups
    assert topo is not None and groups is not None

    def metrics(output: Any) -> tuple[list[str], Tensor, list[LogCall]]:
        # What the hook self.log()s is captured here and replayed on every rank below.
        with context(), capture_logs(module, "pipeline_eval_step", strategy.global_rank) as logs:
            values = module.pipeline_eval_step(output, batch, split)
        stacked = torch.stack([torch.as_tensor(v).detach().float() for v in values.values()])
        if topo.dp > 1:  # average over replicas (each saw a different shard)
            strategy.all_reduce(stacked, group=groups.dp_group, what="the eval metrics")
            stacked = stacked / topo.dp
        return list(values), stacked.cpu(), logs

    names, stacked, logs = forward_only(strategy, batch, context, metrics, "pipeline_eval_step")
    values = {n: stacked[i].to(strategy.root_device) for i, n in enumerate(names)}
    module.pipeline_log_eval(values, split)
    replay_logs(module, logs, groups.dp_group, strategy.root_device)
    return values


def predict(
    strategy: PipelineStrategy, batch: Any, context: Callable, hook: str = "predict_step"
) -> Any:
    """The batch's output (microbatches concatenated) on every rank of the pipeline; sent to the
    other ranks on the CPU (``pp > 1``)."""

    def output(out: Any) -> Any:
        return to_cpu(out) if strategy.pp > 1 else out

    return forward_only(strategy, batch, context, output, hook)


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

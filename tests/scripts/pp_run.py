"""Run several PipelineStrategy configurations in one process group; write per-rank JSON.

Launched by the tests, either under torchrun (processes created externally) or as a plain
``python`` command whose Trainer(devices=N) re-executes it per rank (Lightning's launcher)::

    torchrun --nproc_per_node 4 tests/scripts/pp_run.py --out DIR --configs '[{...}, ...]'
    python tests/scripts/pp_run.py --devices 2 --out DIR --configs '[...]'

Each config: {"name", "pp", "vpp", "microbatches", "accumulate", optional "precision",
"schedule"}. Output: DIR/<name>.rank<r>.json with losses, validation metrics, the best
checkpoint, parameter counts, tied-weight digests and the data-parallel all-reduce log.
"""

from __future__ import annotations

import os
import sys
import time

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from pp_common import (  # noqa: E402
    STEPS,
    Data,
    Recorder,
    configs_main,
    dump,
    make_model,
    make_trainer,
    tensor_digest,
)

from lightning_pp import PipelineStrategy  # noqa: E402
from lightning_pp.callbacks import (  # noqa: E402
    ActivationMemoryMonitor,
    ModelStateMemoryMonitor,
    PipelineTimeline,
)
from lightning_pp.runtime.dtensor_state import local_part  # noqa: E402
from lightning_pp.schedules import Op  # noqa: E402

# Count every asynchronous all-reduce; the probe keeps the data-parallel gradient buckets (issued
# by lightning_pp.runtime.grad_sync on the dp group). Since every collective is watched (issued
# async),
# others are async too: the step loss's DP mean, the per-batch SIGTERM vote on the world group.
_CALLS: list[dict] = []
_real_all_reduce = dist.all_reduce


def _counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    if async_op:
        caller = sys._getframe(1).f_globals.get("__name__")
        if caller in _SYNC_MODULES:
            _CALLS.append({"t": time.perf_counter(), "numel": tensor.numel(), "group": group})
    return _real_all_reduce(tensor, op=op, group=group, async_op=async_op)


dist.all_reduce = _counting_all_reduce
_real_reduce_scatter = dist.reduce_scatter_single
_SYNC_MODULES = ("lightning_pp.runtime.grad_sync", "lightning_pp.runtime.distributed_optimizer")


def _counting_reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    if async_op and sys._getframe(1).f_globals.get("__name__") in _SYNC_MODULES:
        _CALLS.append({"t": time.perf_counter(), "numel": input.numel(), "group": group})
    return _real_reduce_scatter(output, input, op=op, group=group, async_op=async_op)


dist.reduce_scatter_single = _counting_reduce_scatter


class SyncProbe(Callback):
    """Per batch: async all-reduce calls, and their launch times vs the engine's backward events."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        _CALLS.clear()
        trainer.strategy.grad_sync.events.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        s = trainer.strategy
        record = s.last_record
        # the chunk's weight gradients are complete after its last B (or W of a split one)
        backs = [e for e in record.events if e.action.op in (Op.B, Op.W)]
        last_b = {}
        for e in backs:
            last_b[e.action.chunk] = {"start": e.start, "end": e.end}
        self.steps.append(
            {
                "calls": sum(c["group"] is s.groups.dp_group for c in _CALLS),
                "buckets": s.grad_sync.num_buckets,
                "launches": [
                    {"chunk": ev.chunk, "t": ev.time, "numel": ev.numel}
                    for ev in s.grad_sync.events
                ],
                "call_numels": [c["numel"] for c in _CALLS if c["group"] is s.groups.dp_group],
                "last_b": {str(k): v for k, v in last_b.items()},
                "last_backward_start": max((e.start for e in backs), default=None),
                # overlap_param_gather: all-gathers still running after the optimizer step
                "gathers_in_flight": len(getattr(s.grad_sync, "_gathering", {})),
                "last_action": max(
                    ({"start": e.start, "end": e.end} for e in record.events),
                    key=lambda x: x["end"],
                    default=None,
                ),
            }
        )


def _plant_summed_reduce_scatter() -> None:
    """A planted bug for the tests that must catch it: the distributed optimizer's
    reduce-scatter sums the replicas' gradients instead of averaging them (what FSDP2 does on
    gloo, pytorch#162338): its input is multiplied back by dp."""
    import lightning_pp.runtime.distributed_optimizer as zero_module

    real_rs, real_ar = dist.reduce_scatter_single, dist.all_reduce

    def summed(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        input.mul_(dist.get_world_size(group))
        return real_rs(output, input, op=op, group=group, async_op=async_op)

    def summed_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        # on gloo the reduction runs as an all-reduce of the packed bucket (the dp group's);
        # the tied copies' sum (their own group) is left alone
        if group is strategy_dp_group[0]:
            tensor.mul_(dist.get_world_size(group))
        return real_ar(tensor, op=op, group=group, async_op=async_op)

    planted = type("PlantedDist", (), {})()  # a namespace: the real module's names
    for name in dir(dist):
        if not name.startswith("__"):
            setattr(planted, name, getattr(dist, name))
    planted.reduce_scatter_single = summed
    planted.all_reduce = summed_all_reduce
    zero_module.dist = planted


strategy_dp_group: list = [None]  # set once the strategy's groups exist (in setup)


class _DpGroupProbe(Callback):
    def setup(self, trainer, pl_module, stage) -> None:
        strategy_dp_group[0] = trainer.strategy.groups.dp_group


class _LayerInputProbe(Callback):
    """The shape of the first floating input each of this rank's layers gets in training: a
    stage's first layer gets what the previous stage sent (its P2P message)."""

    def __init__(self) -> None:
        self.shapes: dict[int, list[int]] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        for index in pl_module.layers.built_indices:
            layer = pl_module.layers.get_submodule(str(index))
            layer.register_forward_pre_hook(self._hook(index))

    def _hook(self, index: int):
        def hook(_module, args) -> None:
            x = args[0] if args else None
            if index not in self.shapes and torch.is_tensor(x) and x.is_floating_point():
                self.shapes[index] = list(x.shape)

        return hook


def _plant_tp_norm_everywhere() -> None:
    """Planted bug (torchtitan#596): the clipping's norm counts a weight replicated over the tp
    ranks (a LayerNorm) on every tp rank instead of once."""
    import lightning_pp.strategy.pipeline_strategy as strategy_module
    from lightning_pp.layout.topology import TP_DIM
    from lightning_pp.runtime.dtensor_state import counted_once

    strategy_module.counted_once = lambda param, here: counted_once(param, {**here, TP_DIM: 0})


def _plant_zero_tp_norm_everywhere() -> None:
    """Planted bug (torchtitan#596 under zero): the clipping's norm counts the rows of a weight
    replicated over the tp ranks (a LayerNorm's, the position table's) on every tp rank."""
    import lightning_pp.runtime.distributed_optimizer as zero_module
    from lightning_pp.runtime.dtensor_state import counted_once

    zero_module.counted_once = lambda param, here: counted_once(param, {k: 0 for k in here})


def _remove_plant() -> None:
    import lightning_pp.runtime.distributed_optimizer as zero_module
    import lightning_pp.strategy.pipeline_strategy as strategy_module
    from lightning_pp.runtime.dtensor_state import counted_once

    zero_module.dist = dist  # the shared worlds run other cases in this process next
    zero_module.counted_once = counted_once
    strategy_module.counted_once = counted_once


def _mesh(strategy, model) -> dict:
    """The job's DeviceMesh as the strategy and the module's hooks see it, and whether the
    strategy's process groups are the mesh's."""
    mesh, groups = strategy.device_mesh, strategy.groups
    return {
        "names": list(mesh.mesh_dim_names),
        "shape": list(mesh.shape),
        "coordinate": list(mesh.get_coordinate()),
        "module_sees_it": model.device_mesh is mesh,
        "pp_group": groups.pp_group is mesh.get_group("pipeline_parallel"),
        "dp_group": groups.dp_group is mesh.get_group("data_parallel"),
        "tp_group": groups.tp_group is mesh.get_group("tensor_parallel"),
    }


def _sharding(strategy) -> dict:
    """The sharded sync's padding (elements per rank's block beyond the parameters' rows)."""
    sync = strategy.grad_sync
    buckets = getattr(sync, "buckets", [])
    return {
        "padding": sum(b.layout.padding_numel for b in buckets) // max(1, strategy.topology.dp),
        "kind": type(sync).__name__,
        # fsdp=True: parameters FSDP2 leaves whole (a weight two local chunks share)
        "whole_numel": sum(p.numel() for p in getattr(strategy, "_fsdp_whole", [])),
        # of those, the bytes of the weights cut over tp (FSDP2 leaves them cut once only)
        "whole_tp_bytes": sum(
            p.numel() * p.element_size()
            for p in getattr(strategy, "_fsdp_whole", [])
            if _tp_sharded(p)
        ),
    }


def _tp_sharded(p) -> bool:
    """A weight cut over the tensor-parallel ranks: a DTensor whose placement on the mesh dim
    named "tensor_parallel" is not ``Replicate`` (FSDP2's own shards are on "data_parallel";
    under fsdp x tp a weight is cut on both)."""
    mesh = getattr(p, "device_mesh", None)
    names = mesh.mesh_dim_names if mesh is not None else None
    if not names or "tensor_parallel" not in names:
        return False
    return not p.placements[names.index("tensor_parallel")].is_replicate()


def run(cfg: dict, devices: int, out: str) -> None:
    name = cfg["name"]
    strategy = PipelineStrategy(
        pp=cfg["pp"],
        vpp=cfg.get("vpp"),
        microbatches=cfg.get("microbatches"),
        schedule=cfg.get("schedule"),
        bucket_cap_mb=cfg.get("bucket_cap_mb", 25.0),
        zero=cfg.get("zero", 0),
        fsdp=cfg.get("fsdp", False),
        reshard_after_forward=cfg.get("reshard_after_forward", False),
        overlap_param_gather=cfg.get("overlap_param_gather", False),
        recompute=cfg.get("recompute"),
        tp=cfg.get("tp", 1),
    )
    if cfg.get("plant") == "no_average":
        _plant_summed_reduce_scatter()
    if cfg.get("plant") == "tp_norm_everywhere":
        _plant_tp_norm_everywhere()
    if cfg.get("plant") == "zero_tp_norm_everywhere":
        _plant_zero_tp_norm_everywhere()
    # the global gradient norm the strategy's clipping computes, per optimizer step
    norms: list[float] = []
    clip = strategy._clip

    def recorded_clip(params, max_norm):
        norm = clip(params, max_norm)
        norms.append(float(norm))
        return norm

    strategy._clip = recorded_clip
    world = int(os.environ.get("WORLD_SIZE", devices))
    dp = world // (cfg["pp"] * cfg.get("tp", 1))
    rec, probe, inputs = Recorder(), SyncProbe(), _LayerInputProbe()
    # what each rank holds after the last step, measured from the tensors
    held = ModelStateMemoryMonitor(every_n_steps=STEPS)
    extra = []
    if cfg.get("timeline"):  # the last step's trace, with the data-parallel launches
        where = os.path.join(out, f"timeline_{name}")
        extra.append(PipelineTimeline(every_n_steps=STEPS, dirpath=where, png=False))
    activations = ActivationMemoryMonitor(every_n_steps=STEPS) if cfg.get("memory") else None
    if activations is not None:  # the last step's peak saved for backward, from the tensors
        extra.append(activations)
    trainer = make_trainer(
        strategy,
        devices,
        cfg["accumulate"],
        os.path.join(out, f"ckpt_{name}"),
        [rec, probe, held, inputs, *extra, _DpGroupProbe()],
        precision=cfg.get("precision", "32-true"),
        num_nodes=max(1, world // devices),
    )
    model = make_model(cfg.get("model", "gpt"))
    try:
        trainer.fit(model, Data(dp=dp, accumulate=cfg["accumulate"]))
    finally:
        _remove_plant()
    # functional collectives launched and never waited (torch keeps each, with its output,
    # until the process ends), counted in this process so far
    unwaited = torch._C._distributed_c10d._get_work_registry_size()

    layers = model.layers
    meta_counts = layers.layer_param_counts()
    local_layers = layers.built_indices
    params = list(model.parameters())
    # what this rank allocates: a DTensor's (fsdp=True) local shard
    local = [local_part(p) for p in params]
    storages = {t.untyped_storage().data_ptr() for t in [*local, *model.buffers()]}
    tied = {}
    for group in layers.tied:
        for n in group:
            if int(n.split(".")[0]) in layers:
                p = layers.get_parameter(n)
                whole = p.full_tensor() if hasattr(p, "full_tensor") else p  # dp collective
                tied[n] = tensor_digest(whole)
    rank = trainer.global_rank
    dump(
        os.path.join(out, f"{name}.rank{rank}.json"),
        {
            "rank": rank,
            "unwaited_collectives": unwaited,
            "pp_rank": strategy.topology.pp_rank,
            "dp_rank": strategy.topology.dp_rank,
            "dp": strategy.topology.dp,
            "train_loss": rec.train_loss,
            "val": rec.val,
            "best": os.path.basename(trainer.checkpoint_callback.best_model_path),
            "local_layers": local_layers,
            "layer_inputs": {str(i): shape for i, shape in inputs.shapes.items()},
            "saved_bytes": activations.last_stats[rank].saved_bytes if activations else None,
            "expected_layers": strategy.placement.local_indices(strategy.topology.pp_rank),
            "layer_ranges": [[r.start, r.stop] for r in strategy.layer_ranges],
            "param_count": sum(p.numel() for p in params),
            "expected_param_count": sum(meta_counts[i] for i in local_layers),
            "storage_bytes": sum(
                t.untyped_storage().nbytes()
                for t in {
                    t.untyped_storage().data_ptr(): t for t in [*local, *model.buffers()]
                }.values()
            ),
            "param_bytes": sum(p.numel() * p.element_size() for p in local),
            # tensor parallel: the weights cut over tp, as allocated here (the local shards'
            # storages) and as the whole model holds them
            "tp_sharded_bytes": sum(
                local_part(p).untyped_storage().nbytes() for p in params if _tp_sharded(p)
            ),
            "tp_whole_bytes": sum(p.numel() * p.element_size() for p in params if _tp_sharded(p)),
            "tp_rank": strategy.topology.tp_rank,
            "num_storages": len(storages),
            "tied": tied,
            "sync": probe.steps,
            "held": held.last[rank],
            "grad_norm": norms,
            "sharding": _sharding(strategy),
            "mesh": _mesh(strategy, model),
            # schedule="zb-auto": what the profiling step's measured costs rebuilt (else None)
            "auto_schedule": None
            if strategy.auto_schedule is None
            else {
                "text": strategy.auto_schedule.text,
                # the engine is gone after fit; the plan it was given the schedule with stays
                "plan_has_it": getattr(strategy.plan, "schedule", None)
                is strategy.auto_schedule.schedule,
                "overrides": len(strategy.auto_schedule.costs.overrides),
                "step": strategy.auto_schedule.step,
            },
        },
    )
    # every rank finished writing before the next configuration reuses the process group
    trainer.strategy.barrier()


def main() -> None:
    configs_main(run)


if __name__ == "__main__":
    main()

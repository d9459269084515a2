"""What the zero-bubble split backward costs on tensor-parallel (DTensor) stages.

pp2 x tp1 (2 processes) and pp2 x tp2 (4 processes), :class:`~lightning_pp.models.decoder.
DecoderLM` (n_embd 256, 8 heads, 4 blocks), 4 microbatches of 16 x 64 tokens: the engine runs
1f1b (fused ``B``) and zb-h1 (``I`` then ``W``) on the same layers, and the last stage's tp rank 0
reports the median compute time of each action kind over steps 3-6 (from the engine's step
records). ``I + W`` against ``B`` is the split's cost; on DTensor ops the split runs through the
retained-graph path (``runtime/split_backward.py``), not the graph-free direct weight gradients.

Usage:
    python benchmarks/tp_split_backward.py            # prints one line per tp
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_pp.layout.partition import PipelineChunk
from lightning_pp.layout.plan import PipelinePlan
from lightning_pp.layout.topology import PipelineTopology, build_process_groups
from lightning_pp.models.decoder import DecoderLM
from lightning_pp.strategy.model import select_layers

MODEL = dict(vocab_size=256, n_layer=4, n_head=8, n_embd=256, block_size=64)
STEPS, WARMUP = 6, 2


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, MODEL["vocab_size"], (16, MODEL["block_size"]), generator=g)
    return x, torch.roll(x, 1, 1)


def _rank(rank: int, tp: int, port: int, queue) -> None:  # noqa: ANN001
    from lightning_pp.runtime.engine import PipelineEngine

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2 * tp)
    topo = PipelineTopology.from_world(2 * tp, rank, pp=2, tp=tp)
    groups = build_process_groups(topo)
    medians = {}
    for name in ("1f1b", "zb-h1"):
        plan = PipelinePlan.build(
            pp=2, tp=tp, world_size=2 * tp, schedule=name, microbatches=4
        ).with_layers(MODEL["n_layer"] + 2)
        stages = plan.stage_layers(topo.pp_rank)
        model = DecoderLM(**MODEL)
        with select_layers([i for r in stages for i in r]):
            model.configure_model()
        if tp > 1:
            for i in model.layers.built_indices:
                model.pipeline_tensor_parallel(model.layers[i], i, groups.mesh["tensor_parallel"])
            model.layers.retie()
        chunks = [PipelineChunk([model.layers[i] for i in r], indices=r) for r in stages]
        engine = PipelineEngine(
            chunks,
            plan.schedule,
            topo,
            groups,
            loss_fn=model.pipeline_loss,
            input_fn=lambda b: b[0],
        )
        times: dict[str, list[float]] = {}
        for step in range(STEPS):
            record = engine.train_step(_batch(step)).record
            for ev in record.events if step >= WARMUP else ():
                end = ev.compute_end if ev.compute_end is not None else ev.end
                times.setdefault(ev.action.op.value, []).append((end - ev.start) * 1e3)
        medians[name] = {op: round(statistics.median(v), 2) for op, v in times.items()}
    if topo.pp_rank == 1 and topo.tp_rank == 0:
        queue.put(medians)
    dist.destroy_process_group()


def main() -> None:
    ctx = mp.get_context("spawn")
    for tp in (1, 2):
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, tp, 29541 + tp, queue)) for r in range(2 * tp)]
        for p in procs:
            p.start()
        got = queue.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
        fused, split = got["1f1b"]["B"], got["zb-h1"]["I"] + got["zb-h1"]["W"]
        print(
            f"pp2 x tp{tp}: 1f1b {got['1f1b']}  zb-h1 {got['zb-h1']}  "
            f"I + W = {split:.2f} ms vs B = {fused:.2f} ms ({split / fused:.2f} x)"
        )


if __name__ == "__main__":
    main()

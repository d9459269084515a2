"""Train the small GPT with PipelineStrategy on synthetic data: a quick smoke run.

    python examples/train_gpt.py --devices 4 --pp 2 --vpp 2          # Lightning launches 4 ranks
    torchrun --nproc_per_node 4 examples/train_gpt.py --pp 4         # torchrun launches them
    python examples/train_gpt.py --devices 1 --pp 0                  # no pipeline: plain Trainer

Under torchrun (or SLURM) the device and node counts come from the launcher's environment.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_pp import PipelineStrategy
from lightning_pp.models import GPT


class Progressions(Dataset):
    """``(start + step * t) % vocab`` sequences: a next-token task a tiny GPT can learn."""

    def __init__(self, n: int, vocab: int, block: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        seq = (start + step * torch.arange(block + 1)) % vocab
        self.x, self.y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (0: no pipeline)")
    p.add_argument("--vpp", type=int, default=None, help="chunks per rank (unset: the schedule's)")
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--schedule", default=None)
    p.add_argument("--devices", type=int, default=None, help="default: launcher's or --pp")
    p.add_argument("--num-nodes", type=int, default=None)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16, help="per data-parallel replica")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--accelerator", default="cpu", help="cpu (gloo) or gpu (NCCL)")
    args = p.parse_args()
    torch.set_num_threads(1)

    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    devices = args.devices or (int(local_world) if local_world else max(1, args.pp))
    world = int(os.environ.get("WORLD_SIZE", devices))
    num_nodes = args.num_nodes or max(1, world // devices)
    strategy = (
        PipelineStrategy(
            pp=args.pp, vpp=args.vpp, microbatches=args.microbatches, schedule=args.schedule
        )
        if args.pp
        else "auto"
    )
    vocab, block = 64, 32
    model = GPT(
        vocab_size=vocab,
        n_layer=args.n_layer,
        n_head=4,
        n_embd=64,
        block_size=block,
        lr=3e-3,
        warmup_steps=5,
        max_steps=args.steps,
    )
    train = DataLoader(Progressions(4096, vocab, block, seed=1), batch_size=args.batch_size)
    val = DataLoader(Progressions(256, vocab, block, seed=2), batch_size=args.batch_size)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=args.steps,
        val_check_interval=10,
        limit_val_batches=2,
        check_val_every_n_epoch=None,
        gradient_clip_val=1.0,
        precision=args.precision,
        logger=False,
        enable_checkpointing=False,
        log_every_n_steps=5,
    )
    trainer.fit(model, train, val)
    if trainer.is_global_zero:
        m = trainer.callback_metrics
        print(
            f"final train_loss={float(m['train_loss']):.4f} val_loss={float(m['val_loss']):.4f} "
            f"val_acc={float(m['val_acc']):.3f}"
        )


if __name__ == "__main__":
    main()

"""Fine-tune a Hugging Face causal LM under PipelineStrategy, with zero edits to the model class.

The LightningModule below is what you would write for a plain Trainer: it builds the model in
``configure_model`` and its ``training_step`` is
``self.model(input_ids=ids, attention_mask=mask, labels=labels).loss``. The batches are
fine-tuning batches: examples of different lengths, right-padded (attention mask 0), the prompt
and the padding masked out of the loss (label -100). The model's loss is a mean over the valid
labels; the strategy finds them in the model call and weights each microbatch and replica by its
count, so the pipelined loss equals a plain Trainer's on the same global batch
(docs/strategy.md, "Loss normalization").
The only pipeline-specific line is ``PipelineStrategy(split="model.model.layers")``: where the
repeated decoder layers are (the embedding goes to the first stage, the final norm and head to
the last). Each rank builds only its own stages.

    # pp 2 x dp 2 on 4 CPU processes, the stdlib-text data (no download), a few minutes:
    PYTHONPATH=examples lightning-pp fit configs/finetune_hf_cpu.yaml
    python examples/finetune_hf.py                         # the same, without the YAML
    python examples/finetune_hf.py --pp 0 --devices 1      # plain Trainer, no pipeline

To start from pretrained weights instead, build ``AutoModelForCausalLM.from_pretrained(name)``
in ``__init__`` (every rank loads it, then keeps only its stages), or load a state dict after
``configure_model``: the keys are the model's own.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import lightning as L
import torch

from lightning_pp import PipelineStrategy
from lightning_pp.models.data import StdlibCharDataModule

PAD, IGNORE = 0, -100


class SFTStdlibDataModule(StdlibCharDataModule):
    """The standard library's source cut into fine-tuning examples: each block becomes a
    prompt (its first characters) and an answer, of a length between a quarter of the block and
    all of it, right-padded; ``(input_ids, attention_mask, labels)`` with label -100 on the
    prompt and the padding. Lengths and prompts follow from each block's characters, so every
    run (and every data-parallel layout) sees the same batches."""

    @staticmethod
    def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        ids = torch.stack([x for x, _ in samples])
        block = ids.shape[1]
        key = ids.sum(1)
        length = block // 4 + key % (block - block // 4 + 1)
        prompt = 1 + ids[:, 0] % (length // 2)
        pos = torch.arange(block)[None, :]
        mask = (pos < length[:, None]).long()
        ids = ids.masked_fill(mask == 0, PAD)
        labels = ids.masked_fill((mask == 0) | (pos < prompt[:, None]), IGNORE)
        return ids, mask, labels

    def train_dataloader(self) -> Any:
        loader = super().train_dataloader()
        loader.collate_fn = self.collate  # set before the first iteration: used by its workers
        return loader

    def val_dataloader(self) -> Any:
        loader = super().val_dataloader()
        loader.collate_fn = self.collate
        return loader


class HFCausalLM(L.LightningModule):
    """Any ``transformers`` causal LM, built from a config; nothing pipeline-specific.

    Args:
        model_type: a ``transformers.AutoConfig`` model type (``"llama"``, ``"qwen2"``,
            ``"gpt2"``, ...); ``config``: its arguments.
    """

    def __init__(
        self, model_type: str = "llama", config: dict | None = None, lr: float = 1e-3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model(self.hparams.model_type, **(self.hparams.config or {}))
        self.model = AutoModelForCausalLM.from_config(cfg)

    def _loss(self, batch: Any) -> torch.Tensor:
        if len(batch) == 2:  # plain language modelling: (x, y) blocks
            x, _ = batch
            return self.model(input_ids=x, labels=x).loss  # the model shifts the labels itself
        ids, mask, labels = batch  # fine-tuning: padded, prompt masked
        return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)


LLAMA = dict(
    vocab_size=StdlibCharDataModule.vocab_size,  # ASCII characters
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=True,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (0: plain Trainer)")
    p.add_argument("--vpp", type=int, default=None, help="chunks per rank (unset: the schedule's)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(1234, verbose=False)
    strategy: Any = "auto"
    if args.pp:
        strategy = PipelineStrategy(
            pp=args.pp, vpp=args.vpp, microbatches=args.microbatches, split="model.model.layers"
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        val_check_interval=50,
        limit_val_batches=5,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        log_every_n_steps=10,
        logger=False,
        enable_checkpointing=False,
    )
    data = SFTStdlibDataModule(block_size=64, batch_size=16, max_chars=500_000)
    start = time.perf_counter()
    trainer.fit(HFCausalLM("llama", LLAMA), data)
    if trainer.is_global_zero:
        m = trainer.callback_metrics
        print(
            f"{args.steps} steps in {time.perf_counter() - start:.0f}s: "
            f"train_loss={float(m['train_loss']):.3f} val_loss={float(m['val_loss']):.3f}"
            f" (pid {os.getpid()})"
        )


if __name__ == "__main__":
    main()

"""Shared by the token-normalization tests (issue 34) and the script they run in the Trainer
worlds: SFT-style padded, prompt-masked batches; an unmodified Hugging Face decoder of any
family in a minimal LightningModule (``split=``); a ``PipelineLayers`` model whose loss means
over valid tokens; the Trainer settings and the plain single-process reference.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from byom_families import VOCAB, family_fn  # noqa: E402

from lightning_pp import PipelineLayers, PipelineMixin  # noqa: E402

SEQ, GLOBAL_BATCH, STEPS = 16, 8, 5


class SFT(Dataset):
    """Prompt + answer, right-padded to ``SEQ``: lengths 4..16, the prompt (1..4 tokens) and the
    padding carry label -100, the padding attention mask 0. The answer continues an arithmetic
    progression mod VOCAB (learnable)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(1, VOCAB, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + step * torch.arange(SEQ)) % (VOCAB - 1) + 1
        self.length = torch.randint(4, SEQ + 1, (n,), generator=g)
        self.prompt = torch.randint(1, 5, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pos = torch.arange(SEQ)
        mask = (pos < self.length[i]).long()
        ids = self.ids[i].masked_fill(mask == 0, 0)
        labels = ids.masked_fill((mask == 0) | (pos < self.prompt[i]), -100)
        return ids, mask, labels


class Data(L.LightningDataModule):
    """The same global batches for any dp: replica r takes samples r, r+dp, ... of each."""

    def __init__(self, dp: int) -> None:
        super().__init__()
        self.dp = dp
        self.train = SFT(GLOBAL_BATCH * STEPS, seed=1)
        self.val = SFT(GLOBAL_BATCH, seed=2)

    def _loader(self, ds: Dataset) -> DataLoader:
        if self.dp == 1:
            return DataLoader(ds, batch_size=GLOBAL_BATCH)
        sampler = DistributedSampler(
            ds, shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs
        )
        return DataLoader(ds, batch_size=GLOBAL_BATCH // self.dp, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val)


class FamilyLM(L.LightningModule):
    """What a user writes for a plain Trainer: the model class untouched, its own ``.loss``."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.family = family
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = family_fn(self.family)[0]()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, mask, labels = batch
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, mask, labels = batch
        loss = self.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a causal running mean mixes positions, so padding must not leak into valid tokens
        mixed = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device)[None, :, None]
        return x + F.gelu(self.fc(mixed))


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


class TokenLayersLM(PipelineMixin, L.LightningModule):
    """A ``PipelineLayers`` model whose loss is a mean over valid (shifted) tokens."""

    def configure_model(self) -> None:
        if getattr(self, "layers", None) is not None:
            return
        self.layers = PipelineLayers([_Embed] + [_Block] * 4 + [_Head], seed=0)

    def pipeline_input(self, batch: Any) -> torch.Tensor:
        return batch[0]

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        logits, labels = output[:, :-1], batch[2][:, 1:]
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def pipeline_loss_count(self, batch: Any) -> torch.Tensor:
        return (batch[2][:, 1:] != -100).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def make_module(cfg: dict) -> L.LightningModule:
    return TokenLayersLM() if cfg["kind"] == "layers" else FamilyLM(cfg["family"])


class Losses(Callback):
    def __init__(self) -> None:
        self.train: list[float] = []
        self.val: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train.append(float(trainer.callback_metrics["train_loss"]))

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.val.append(float(trainer.callback_metrics["val_loss"]))


def make_trainer(strategy: Any, devices: int, callbacks: list) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        val_check_interval=STEPS,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=callbacks,
    )


def run_reference(cfg: dict) -> dict[str, Any]:
    """The same module under a plain single-process Trainer on the global batches."""
    L.seed_everything(0, verbose=False)
    losses = Losses()
    module = make_module(cfg)
    make_trainer("auto", 1, [losses]).fit(module, Data(dp=1))
    return {"train": losses.train, "val": losses.val, "keys": sorted(module.state_dict())}

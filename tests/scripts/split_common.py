"""Shared by the ``PipelineStrategy(split=...)`` tests and the script they launch: unmodified
models (GPT-2, Llama, Qwen2, a nanoGPT-style GPT) in minimal LightningModules, data whose
sequence length changes from batch to batch, and the Trainer settings.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from byom_models import VOCAB, model_fn  # noqa: E402

BLOCK, GLOBAL_BATCH, STEPS = 12, 8, 10


class Tokens(Dataset):
    """Arithmetic progressions mod VOCAB: a learnable next-token task."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(1, VOCAB, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.seq = (start + step * torch.arange(BLOCK + 1)) % VOCAB

    def __len__(self) -> int:
        return len(self.seq)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        # The samples of one global batch share a length (7..BLOCK) that changes from batch to
        # batch, so every data-parallel share and the plain run's batch are cut alike: the side
        # inputs (positions, masks, rotary tables) must follow the length.
        return self.seq[i], BLOCK - (i // GLOBAL_BATCH) % 6


def collate(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` cut to the batch's length."""
    seq = torch.stack([s for s, _ in samples])
    length = samples[0][1]
    return seq[:, :length].contiguous(), seq[:, 1 : length + 1].contiguous()


class Data(L.LightningDataModule):
    """The same global batches for any dp: replica r takes samples r, r+dp, ... of each."""

    def __init__(self, dp: int, accumulate: int = 1) -> None:
        super().__init__()
        self.dp = dp
        self.train = Tokens(GLOBAL_BATCH * STEPS * accumulate, seed=1)
        self.val = Tokens(GLOBAL_BATCH * 2, seed=2)

    def _loader(self, ds: Dataset) -> DataLoader:
        if self.dp == 1:
            return DataLoader(ds, batch_size=GLOBAL_BATCH, collate_fn=collate)
        kw = self.trainer.strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(ds, shuffle=False, **kw)
        size = GLOBAL_BATCH // self.dp
        return DataLoader(ds, batch_size=size, sampler=sampler, collate_fn=collate)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=GLOBAL_BATCH, collate_fn=collate)


class CausalLM(L.LightningModule):
    """The minimal module a user writes: no pipeline hooks, the model class untouched.

    ``build="configure_model"`` builds the model there (each rank materialises only its
    stages); ``build="init"`` builds it in ``__init__`` (every rank builds all of it).
    """

    def __init__(self, name: str, build: str = "configure_model", lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None
        if build == "init":
            self.model = model_fn(name)[0]()

    def configure_model(self) -> None:
        if self.model is None:
            self.model = model_fn(self.hparams.name)[0]()

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.hparams.name == "nanogpt":
            return self.model(x, y)[1]  # nanoGPT's forward returns (logits, loss)
        return self.model(input_ids=x, labels=y).loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self._loss(x, y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(*batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(*batch), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        if self.hparams.name == "nanogpt":
            return self.model(x, x)[0]  # with targets: logits at every position
        return self.model(input_ids=x).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)


class Losses(Callback):
    """The logged train loss per batch and val loss per validation."""

    def __init__(self) -> None:
        self.train: list[float] = []
        self.val: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train.append(float(trainer.callback_metrics["train_loss"]))

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.val.append(float(trainer.callback_metrics["val_loss"]))


def make_trainer(strategy: Any, devices: int, cfg: dict, callbacks: list) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=cfg.get("accumulate", 1),
        gradient_clip_val=cfg.get("clip"),
        precision=cfg.get("precision", "32-true"),
        val_check_interval=5 * cfg.get("accumulate", 1),
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=callbacks,
    )


def run_reference(cfg: dict) -> dict[str, Any]:
    """The same module under a plain single-process Trainer: losses and the final weights."""
    L.seed_everything(cfg.get("seed", 0), verbose=False)
    losses = Losses()
    trainer = make_trainer("auto", 1, cfg, [losses])
    module = CausalLM(cfg["model"], cfg.get("build", "configure_model"))
    data = Data(dp=1, accumulate=cfg.get("accumulate", 1))
    trainer.fit(module, data)
    out = {
        "train": losses.train,
        "val": losses.val,
        "state_dict": {k: v.detach().clone() for k, v in module.model.state_dict().items()},
    }
    if cfg.get("eval"):
        out["test"] = trainer.test(module, data, verbose=False)[0]["test_loss"]
        out["predict"] = [p.tolist() for p in trainer.predict(module, data)]
    return out

"""Shared by the strategy tests and the scripts they launch: tiny GPT, data, Trainer settings.

One place decides the model, the data order and the Trainer flags, so a pipelined run and its
single-process reference differ only in the strategy.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_pp.models import GPT, DecoderLM

VOCAB, BLOCK = 32, 8
GLOBAL_BATCH = 8
MODEL_KW = dict(
    vocab_size=VOCAB,
    n_layer=6,
    n_head=2,
    n_embd=16,
    block_size=BLOCK,
    lr=3e-3,
    weight_decay=0.1,
    warmup_steps=3,
    max_steps=10,
    seed=7,
)
STEPS = 10  # optimizer steps per run
#: the models a configuration's ``"model"`` names: GPT (fused qkv), and the same GPT with
#: separate q/k/v projections that tensor parallelism can shard (lightning_pp.models.decoder)
MODELS = {
    "gpt": GPT,
    "decoder": DecoderLM,
    # the same model with sequence parallelism under tp (no effect at tp=1: same reference)
    "decoder-sp": functools.partial(DecoderLM, sequence_parallel=True),
}


def make_model(name: str = "gpt") -> L.LightningModule:
    """The tests' model ``name`` (:data:`MODELS`) with :data:`MODEL_KW`."""
    return MODELS[name](**MODEL_KW)


class Progressions(Dataset):
    """Token sequences ``(start + step * t) % VOCAB``: learnable next-token prediction."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        seq = (start + step * torch.arange(BLOCK + 1)) % VOCAB
        self.x, self.y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Data(L.LightningDataModule):
    """Same global batches for any dp: replica r of dp takes samples r, r+dp, ... of each batch."""

    def __init__(self, dp: int, accumulate: int, train_samples: int | None = None) -> None:
        super().__init__()
        self.dp = dp
        self.train = Progressions(train_samples or GLOBAL_BATCH * STEPS * accumulate, seed=1)
        self.val = Progressions(GLOBAL_BATCH * 2, seed=2)

    def _loader(self, ds: Dataset) -> DataLoader:
        if self.dp == 1:
            return DataLoader(ds, batch_size=GLOBAL_BATCH, shuffle=False)
        kw = self.trainer.strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(ds, shuffle=False, **kw)
        return DataLoader(ds, batch_size=GLOBAL_BATCH // self.dp, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val)


class Recorder(Callback):
    """Per batch: the logged train loss; per validation: val_loss/val_acc and the step."""

    def __init__(self) -> None:
        self.train_loss: list[float] = []
        self.val: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train_loss.append(float(trainer.callback_metrics["train_loss"]))

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        m = trainer.callback_metrics
        self.val.append(
            {
                "step": trainer.global_step,
                "val_loss": float(m["val_loss"]),
                "val_acc": float(m["val_acc"]),
            }
        )


def make_trainer(
    strategy: Any,
    devices: int,
    accumulate: int,
    ckpt_dir: str,
    callbacks: list[Callback],
    precision: str = "32-true",
    num_nodes: int = 1,
) -> L.Trainer:
    ckpt = ModelCheckpoint(
        dirpath=ckpt_dir, monitor="val_loss", mode="min", save_top_k=1, filename="{step}"
    )
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=0.5,
        precision=precision,
        val_check_interval=4 * accumulate,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ckpt, *callbacks],
    )


class GradNormProbe(Callback):
    """The gradient norm the clipping reads, per optimizer step (before clipping): the whole
    model's, computed from the single process's own gradients."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad.detach().reshape(-1) for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.cat(grads).norm()))


#: (accumulate, model) -> the reference's record: the test session computes each reference once,
#: whichever module asks first (test_strategy and test_sharded_dp read the same two)
_REFERENCES: dict[tuple[int, str], dict[str, Any]] = {}


def run_reference(accumulate: int, ckpt_dir: str, model: str = "gpt") -> dict[str, Any]:
    """The same module (:func:`make_model`) under a plain single-process Trainer. Computed once
    per process for each ``(accumulate, model)``; ``ckpt_dir`` is the first call's (the record
    names the best checkpoint's file, not its directory)."""
    key = (accumulate, model)
    if key not in _REFERENCES:
        _REFERENCES[key] = _train_reference(accumulate, ckpt_dir, model)
    return _REFERENCES[key]


def _train_reference(accumulate: int, ckpt_dir: str, model: str) -> dict[str, Any]:
    rec, norms = Recorder(), GradNormProbe()
    trainer = make_trainer("auto", 1, accumulate, ckpt_dir, [rec, norms])
    trainer.fit(make_model(model), Data(dp=1, accumulate=accumulate))
    return {
        "train_loss": rec.train_loss,
        "val": rec.val,
        "best": os.path.basename(trainer.checkpoint_callback.best_model_path),
        "grad_norm": norms.norms,
    }


def reference_runs(base: str) -> dict[int, dict[str, Any]]:
    """:func:`run_reference` for accumulation 1 and 2 (the tests' two references), under
    ``base``."""
    torch.set_num_threads(1)
    return {acc: run_reference(acc, os.path.join(base, f"acc{acc}")) for acc in (1, 2)}


def load_runs(out: Any, configs: list[dict], size: int) -> dict[str, list[dict]]:
    """What every rank of a ``pp_run`` world wrote, by configuration name (index = rank)."""
    return {
        c["name"]: [
            json.loads(open(os.path.join(str(out), f"{c['name']}.rank{r}.json")).read())
            for r in range(size)
        ]
        for c in configs
    }


def rel_errors(got: list[float], want: list[float]) -> list[float]:
    """Relative error of each value of ``got`` against ``want`` (same length)."""
    assert len(got) == len(want), (len(got), len(want))
    return [abs(g - w) / abs(w) for g, w in zip(got, want)]


def mismatches(ranks: list[dict], ref: dict, tol: float) -> list[str]:
    """What a ``pp_run`` run's ranks logged differently from the reference beyond ``tol``
    (relative): the train loss, the validation loss and accuracy, the clipping's gradient norm
    and the best checkpoint. Empty: the run is the reference's."""
    bad = []
    for d in ranks:
        errs = rel_errors(d["train_loss"], ref["train_loss"])
        if max(errs) > tol:
            bad.append(f"rank {d['rank']}: train loss relative errors {max(errs):.2e}")
        for key in ("val_loss", "val_acc"):
            errs = rel_errors([v[key] for v in d["val"]], [v[key] for v in ref["val"]])
            if max(errs) > tol:
                bad.append(f"rank {d['rank']}: {key} relative errors {max(errs):.2e}")
        errs = rel_errors(d["grad_norm"], ref["grad_norm"])
        if max(errs) > tol:
            bad.append(f"rank {d['rank']}: gradient norm relative errors {max(errs):.2e}")
        if d["best"] != ref["best"]:
            bad.append(f"rank {d['rank']}: best checkpoint {d['best']} != {ref['best']}")
    return bad


def state_bytes_off(plan: Any, shapes: list, ranks: list[dict], tol: float = 0.02) -> list[str]:
    """The planner's per-rank state bytes (``planner.sharding.sharded_state_bytes`` of
    ``plan`` on the layers' parameter ``shapes``) against what ``ModelStateMemoryMonitor``
    measured from the tensors after the optimizer step (each rank's ``held``): every part
    further than ``tol`` (relative) from its prediction, as ``rank r key: got vs predicted``."""
    from lightning_pp.planner.sharding import sharded_state_bytes

    off = []
    for d in ranks:
        want = sharded_state_bytes(plan, shapes, d["pp_rank"], dp_rank=d["dp_rank"], param_bytes=4)
        predicted = {
            "params": want.params_at_step,
            "grads": want.grads_at_step,
            "master": want.master,
            "optimizer": want.optimizer,
        }
        for key, value in predicted.items():
            got = d["held"][key]
            if abs(got - value) > tol * max(got, value):
                off.append(f"rank {d['rank']} {key}: {got} vs {value}")
    return off


def tensor_digest(t: torch.Tensor) -> str:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # any dtype, bf16 too
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def dump(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def configs_main(run: Any, key: str = "configs") -> None:
    """The scripts' command line: ``--out DIR --configs JSON [--devices N]`` (``--phases`` for
    ckpt_run); calls ``run(config, devices, out)`` for each configuration, in order, in this
    process group. ``devices``: ``--devices``, else the launcher's ``LOCAL_WORLD_SIZE``
    (torchrun, the shared test worlds), else ``WORLD_SIZE``."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument(f"--{key}", required=True, help="JSON list")
    parser.add_argument("--devices", type=int, default=None)
    args = parser.parse_args()
    env = os.environ
    devices = args.devices or int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    os.makedirs(args.out, exist_ok=True)
    for cfg in json.loads(getattr(args, key)):
        run(cfg, devices, args.out)

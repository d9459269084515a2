"""Lightning's own checkpoint paths on the DCP format, under the real Trainer (2-rank world).

What ``ModelCheckpoint`` and the Trainer do besides ``every_n_train_steps`` + ``ckpt_path=DIR``
(tests/test_checkpoint.py): ``save_last`` and top-k on a monitor, ``trainer.save_checkpoint``,
``fit(ckpt_path="last")``, ``validate(ckpt_path="best")``, ``validate``/``test(ckpt_path=DIR)``
(weights only, no optimizer). pp=2 1F1B, the tiny GPT, saving synchronously and in the
background (``async_checkpoint=True``: the paths are the same, a save returns before it is
published, and ``strategy.wait_for_checkpoint()`` is what a script calls before reading one).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
from worlds import SCRIPTS, world

pytestmark = pytest.mark.timeout(400)


def _lightning_paths(rank: int, size: int, root: str, asynchronous: bool) -> dict:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    from pp_common import MODEL_KW, Data, Recorder

    from lightning_pp import PipelineStrategy
    from lightning_pp.checkpoint import is_pipeline_checkpoint
    from lightning_pp.models import GPT

    torch.set_num_threads(1)
    ckpts = Path(root) / "ckpts"

    class WithTest(Data):
        def test_dataloader(self):
            return self.val_dataloader()

    def trainer(max_steps: int, *callbacks) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu",
            devices=size,
            strategy=PipelineStrategy(
                pp=2,
                microbatches=2,
                timeout=timedelta(seconds=90),
                async_checkpoint=asynchronous,
            ),
            max_steps=max_steps,
            val_check_interval=2,
            limit_val_batches=2,
            num_sanity_val_steps=0,
            use_distributed_sampler=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=list(callbacks),
            default_root_dir=root,
        )

    def model() -> GPT:
        torch.manual_seed(0)
        return GPT(**MODEL_KW)

    data = WithTest(dp=1, accumulate=1)
    out: dict = {}
    top = ModelCheckpoint(dirpath=ckpts, monitor="val_loss", save_top_k=1, save_last=True)
    first = trainer(4, top)
    trained = model()
    first.fit(trained, data)
    out["in_memory"] = first.validate(trained, data, verbose=False)[0]["val_loss"]
    first.save_checkpoint(ckpts / "manual.ckpt")  # every rank calls it, as Lightning does
    first.strategy.wait_for_checkpoint()  # a no-op when synchronous
    out["best"] = Path(top.best_model_path).name
    out["last"] = Path(top.last_model_path).name
    out["entries"] = sorted(p.name for p in ckpts.iterdir())
    out["complete"] = {n: is_pipeline_checkpoint(ckpts / n) for n in out["entries"]}
    out["best_val"] = first.validate(model(), data, ckpt_path="best", verbose=False)[0]["val_loss"]

    # resume from "last" (step 4) up to step 6: two more batches, not six
    rec = Recorder()
    again = trainer(6, rec, ModelCheckpoint(dirpath=ckpts, save_last=True, monitor="val_loss"))
    again.fit(model(), data, ckpt_path="last")
    out["resumed_batches"] = len(rec.train_loss)
    out["resumed_step"] = again.global_step

    # weights only, into a fresh module: the saved step-4 model
    other = trainer(1)
    manual = str(ckpts / "manual.ckpt")
    out["validate"] = other.validate(model(), data, ckpt_path=manual, verbose=False)[0]["val_loss"]
    out["untrained"] = other.validate(model(), data, verbose=False)[0]["val_loss"]
    out["test"] = other.test(model(), data, ckpt_path=manual, verbose=False)[0]["test_loss"]
    return out


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_lightning_checkpoint_paths_on_the_dcp_format(tmp_path, asynchronous):
    run = world("trainer", 2).run
    results = run(_lightning_paths, str(tmp_path), asynchronous, timeout=360)
    r = results[0]
    assert r["best"] == "epoch=0-step=4.ckpt" or r["best"] == "epoch=0-step=2.ckpt", r
    assert r["last"] == "last.ckpt"
    assert set(r["entries"]) == {r["best"], "last.ckpt", "manual.ckpt"}, r  # top-1 rotated
    assert all(r["complete"].values()), r  # every one a complete DCP directory
    assert r["resumed_batches"] == 2 and r["resumed_step"] == 6, r
    # the saved weights are the trained ones: validating them equals validating in memory
    assert r["validate"] == pytest.approx(r["in_memory"], rel=1e-6)
    assert r["test"] == pytest.approx(r["in_memory"], rel=1e-6)
    assert r["untrained"] != pytest.approx(r["in_memory"], rel=1e-3)  # the load did matter
    if r["best"] == "epoch=0-step=4.ckpt":
        assert r["best_val"] == pytest.approx(r["in_memory"], rel=1e-6)
    assert all(other == r for other in results[1:])  # every rank saw the same

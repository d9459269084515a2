"""A Lightning user's own module under PipelineStrategy: logging, hooks, rebuilds, the summary.

One 2-rank Trainer world of its own (tests/worlds.py: forked ranks, no launcher) runs every
scenario of tests/scripts/hooks_run.py; the tests read its per-rank JSON. Issue 13, items 1, 2,
3 and 14.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))

from worlds import World, script_main  # noqa: E402


@pytest.fixture(scope="module")
def hooks(tmp_path_factory) -> dict:
    """Every scenario of tests/scripts/hooks_run.py on a 2-rank Trainer world of its own (one
    scenario ends in an error on every rank, which leaves the world's store marked: the world is
    closed afterwards, as every case meant to fail is)."""
    out = tmp_path_factory.mktemp("hooks")
    own = World("trainer", 2)
    try:
        own.run(script_main, "hooks_run", ["--out", str(out)], timeout=400)
    finally:
        own.close()
    data: dict = {"out": out}
    for path in sorted(out.glob("*.json")):
        data[path.stem] = json.loads(path.read_text())
    return data


def _ranks(hooks: dict, scenario: str) -> list[dict]:
    missing = [r for r in range(2) if f"{scenario}.rank{r}" not in hooks]
    assert not missing, f"{scenario}: no result from ranks {missing} in {hooks['out']}"
    return [hooks[f"{scenario}.rank{r}"] for r in range(2)]


# ------------------------------------------------------------------ item 1: self.log in hooks
def test_values_logged_in_pipeline_eval_step_reach_every_rank(hooks):
    ranks = _ranks(hooks, "fit_validate")
    for when in ("after_fit", "validated"):
        for d in ranks:
            m = d[when]
            for name in ("val_plain", "val_synced", "val_batches", "val_acc_copy"):
                assert name in m, f"{when}: {name} missing on a rank: {sorted(m)}"
            assert m["val_plain"] == pytest.approx(2 * m["val_loss"], rel=1e-6)
            assert m["val_synced"] == pytest.approx(3 * m["val_loss"], rel=1e-6)
            # 2 batches, summed over data-parallel replicas (dp = 1), not over pipeline ranks
            assert m["val_batches"] == 2.0
            assert m["val_acc_copy"] == pytest.approx(m["val_acc"], rel=1e-6)
        assert ranks[0][when] == ranks[1][when]  # identical on every rank


def test_log_in_a_training_hook_of_one_stage_fails_clearly_on_every_rank(hooks):
    ranks = _ranks(hooks, "train_log")
    errors = [d["error"] for d in ranks]
    assert all(errors), errors
    # the last stage names the hook and the supported alternatives; rank 0 stops, naming it
    assert "self.log('train_ppl')" in errors[1] and "pipeline_loss" in errors[1], errors[1]
    assert "pipeline_log_train_loss" in errors[1] and "pipeline_eval_step" in errors[1]
    assert "rank 1" in errors[0], errors[0]


# ------------------------------------------------------------------ item 2: ignored overrides
def test_warns_once_about_step_overrides_the_strategy_does_not_call(hooks):
    ranks = _ranks(hooks, "fit_validate")
    assert [d["user_validation_steps"] for d in ranks] == [0, 0]
    notes = [w for w in ranks[0]["warnings"] if "validation_step" in w and "not call" in w]
    assert len(notes) == 1, ranks[0]["warnings"]
    assert "pipeline_eval_step" in notes[0] and "EvalLoggingGPT" in notes[0]
    assert "training_step" not in notes[0]  # PipelineMixin's own default, not the user's


# ------------------------------------------------------------------ item 3: configure_model again
def test_validate_after_fit_reports_the_trained_model(hooks):
    ranks = _ranks(hooks, "fit_validate")
    for d in ranks:
        assert d["validated"]["val_loss"] == pytest.approx(d["after_fit"]["val_loss"], rel=1e-6)
        assert d["validated"]["val_acc"] == pytest.approx(d["after_fit"]["val_acc"], rel=1e-6)
    notes = [w for w in ranks[0]["warnings"] if "configure_model" in w and "trained" in w]
    assert len(notes) == 1, ranks[0]["warnings"]
    assert "already built" in notes[0]


# ------------------------------------------------------------------ item 14: model summary
def test_model_summary_counts_the_whole_pipeline(hooks):
    rank0 = _ranks(hooks, "fit_validate")[0]
    summary = rank0["summary"]
    total = rank0["full_params"]
    assert f"{total:<10}Total params" in summary, summary
    assert "Stage" in summary, summary  # each row says which stage holds it


# ------------------------------------------------------------------ the pieces, in-process
def _gpt(**kw):
    from lightning_pp.models import GPT

    return GPT(vocab_size=16, n_layer=2, n_head=2, n_embd=8, block_size=4, **kw)


def test_capture_records_log_and_log_dict_instead_of_logging():
    import torch

    from lightning_pp.strategy.stage_logging import capture_logs

    module = _gpt()
    with capture_logs(module, "pipeline_eval_step", rank=3) as calls:
        module.log("a", torch.tensor(2.0), prog_bar=True)
        module.log("b", 1.5, True, sync_dist=True, reduce_fx="sum")  # prog_bar positionally
        module.log_dict({"c": torch.tensor(3.0)}, on_epoch=True)
    assert "log" not in vars(module)  # the method is back
    assert [(c.name, float(c.value)) for c in calls] == [("a", 2.0), ("b", 1.5), ("c", 3.0)]
    assert calls[0].kwargs["prog_bar"] is True and calls[1].kwargs["prog_bar"] is True
    assert calls[1].kwargs["sync_dist"] is True and calls[1].kwargs["reduce_fx"] == "sum"
    assert calls[2].kwargs["on_epoch"] is True


def test_capture_rejects_what_cannot_be_replayed_on_other_ranks():
    import torch
    from torchmetrics.classification import MulticlassAccuracy

    from lightning_pp.strategy.stage_logging import capture_logs

    module = _gpt()
    with pytest.raises(TypeError, match=r"rank 1: self.log\('acc', <MulticlassAccuracy>\)"):
        with capture_logs(module, "pipeline_eval_step", rank=1):
            module.log("acc", MulticlassAccuracy(num_classes=3))
    with pytest.raises(ValueError, match="drop sync_dist_group"):
        with capture_logs(module, "pipeline_eval_step", rank=1):
            module.log("x", torch.tensor(1.0), sync_dist=True, sync_dist_group=object())
    assert "log" not in vars(module)


def test_replay_syncs_over_the_data_parallel_group():
    import torch

    from lightning_pp.strategy.stage_logging import LogCall, replay_logs

    class Sink:
        def __init__(self):
            self.calls = []

        def log(self, name, value, **kwargs):
            self.calls.append((name, value, kwargs))

    dp_group = object()
    sink = Sink()
    calls = [
        LogCall("s", torch.tensor(1.0), {"sync_dist": True, "sync_dist_group": None}),
        LogCall("p", 2.0, {"sync_dist": False}),
    ]
    replay_logs(sink, calls, dp_group, torch.device("cpu"))
    assert sink.calls[0][2]["sync_dist_group"] is dp_group
    assert sink.calls[1] == ("p", 2.0, {"sync_dist": False})


def test_refuse_names_the_hook_and_where_to_log():
    from lightning_pp.strategy.stage_logging import refuse_logs

    module = _gpt()
    with pytest.raises(RuntimeError) as info:
        with refuse_logs(module, "pipeline_input", rank=0):
            module.log("n", 1.0)
    text = str(info.value)
    assert "rank 0: self.log('n') inside pipeline_input()" in text
    assert "pipeline_eval_step" in text and "pipeline_log_train_loss" in text
    assert "log" not in vars(module)


def test_ignored_step_overrides_are_the_users_own():
    import lightning as L

    from lightning_pp.models import GPT
    from lightning_pp.strategy.module_rules import ignored_step_overrides, ignored_steps_message

    assert ignored_step_overrides(_gpt()) == []  # PipelineMixin's defaults

    class Custom(GPT):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx)

        def test_step(self, batch, batch_idx):
            pass

    module = Custom(vocab_size=16, n_layer=2, n_head=2, n_embd=8, block_size=4)
    steps = ignored_step_overrides(module)
    assert steps == ["training_step", "test_step"]
    message = ignored_steps_message(module, steps)
    assert "Custom overrides training_step, test_step" in message
    assert "pipeline_loss" in message and "pipeline_eval_step" in message

    class NoMixin(L.LightningModule):  # duck-typed hooks: compared with Lightning's own steps
        def predict_step(self, batch):
            return batch

    assert ignored_step_overrides(NoMixin()) == ["predict_step"]


def test_rebuilt_layers_match_only_the_same_model():
    from lightning_pp.strategy.model import rebuilt_layers_match, replace_submodule

    a, b, c = _gpt(), _gpt(), _gpt()
    a.configure_model()
    b.configure_model()
    assert rebuilt_layers_match(a.layers, b.layers)
    from lightning_pp.models import GPT

    wider = GPT(vocab_size=16, n_layer=2, n_head=2, n_embd=16, block_size=4)
    wider.configure_model()
    assert not rebuilt_layers_match(a.layers, wider.layers)
    deeper = GPT(vocab_size=16, n_layer=3, n_head=2, n_embd=8, block_size=4)
    deeper.configure_model()
    assert not rebuilt_layers_match(a.layers, deeper.layers)
    trained = a.layers
    assert replace_submodule(a, a.layers, b.layers) and a.layers is b.layers
    assert not replace_submodule(c, trained, b.layers)  # not attached there


def test_merged_summary_counts_tied_copies_once():
    from lightning.pytorch.utilities.model_summary import get_human_readable_count

    from lightning_pp.strategy.model_summary import StageSummary, merge_summaries

    def stage(label, params, tied):
        return StageSummary(
            label, ["layers"], ["PipelineLayers"], [params], [True], params, params, tied,
            params * 4e-6, 3, 0, 0,
        )  # fmt: skip

    columns, total, trainable, size, modes, flops = merge_summaries(
        [stage("0", 1000, 0), stage("1", 900, 100)]
    )
    assert (total, trainable, modes, flops) == (1800, 1800, {"train": 6, "eval": 0}, 0)
    assert size == pytest.approx(1800 * 4e-6)
    assert dict(columns)["Stage"] == ["0", "1"]
    assert dict(columns)["Params"] == [get_human_readable_count(n) for n in (1000, 900)]


def test_pipeline_summary_keeps_the_callback_class_and_restores_it():
    from lightning.pytorch.callbacks import ModelSummary

    from lightning_pp.strategy.model_summary import (
        PipelineSummary,
        StageInfo,
        restore_summaries,
        use_pipeline_summaries,
    )

    original = ModelSummary(max_depth=3)
    callbacks = [object(), original]
    use_pipeline_summaries(callbacks, lambda s: [s], StageInfo("0", 0))
    wrapped = callbacks[1]
    assert isinstance(wrapped, PipelineSummary) and isinstance(wrapped, ModelSummary)
    assert wrapped is not original and not isinstance(original, PipelineSummary)
    restore_summaries(callbacks)
    assert callbacks[1] is original

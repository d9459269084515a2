"""Run-file loading and checking (lightning_pp.commands.config) and the CLI's user-error path.

Everything here runs in-process and starts no worker processes.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from lightning_pp.commands._common import check_run
from lightning_pp.commands.cli import main
from lightning_pp.commands.config import ConfigError, instantiate, load_config
from lightning_pp.commands.fit import build_model_and_data
from lightning_pp.commands.launch import detect_launch_environment

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo_cpu.yaml"

# A user's own LightningModule and DataModule, in a module that is not part of the package.
USER_MODULE = """
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class TinyRegressor(L.LightningModule):
    def __init__(self, width: int = 4, lr: float = 0.1, name: str = "tiny"):
        super().__init__()
        self.width, self.lr, self.name = width, lr, name
        self.net = torch.nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TinyData(L.LightningDataModule):
    def __init__(self, n: int = 32, width: int = 4, batch_size: int = 8):
        super().__init__()
        self.n, self.width, self.batch_size = n, width, batch_size

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n, self.width, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=self.batch_size)
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``user_models_mod`` importable from a temporary directory on sys.path."""
    (tmp_path / "user_models_mod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_models_mod"
    sys.modules.pop("user_models_mod", None)


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


BASE = """
model:
  class_path: user_models_mod.TinyRegressor
  init_args: {width: 4}
data:
  _target_: user_models_mod.TinyData
  width: 4
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 3
"""


def config_error(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides or [])
    return str(info.value)


# ------------------------------------------------------------------------------ unknown keys


def test_unknown_trainer_key_names_key_file_and_suggestion(tmp_path, user_module):
    path = write(tmp_path, BASE + "  max_step: 10\n")
    msg = config_error(path)
    assert "'trainer.max_step'" in msg
    assert str(path) in msg
    assert "Did you mean 'max_steps'?" in msg


def test_unknown_section_suggests_the_section(tmp_path, user_module):
    path = write(tmp_path, BASE + "stratgy:\n  pp: 2\n")
    msg = config_error(path)
    assert "'stratgy'" in msg and "Did you mean 'strategy'?" in msg and str(path) in msg


def test_unknown_strategy_key_checked_against_pipeline_strategy(tmp_path, user_module):
    path = write(tmp_path, BASE + "strategy:\n  pp: 1\n  microbatch: 4\n")
    msg = config_error(path)
    assert "'strategy.microbatch'" in msg and "Did you mean 'microbatches'?" in msg


def test_unknown_init_arg_checked_against_user_class(tmp_path, user_module):
    path = write(tmp_path, BASE.replace("{width: 4}", "{widht: 4}"))
    msg = config_error(path)
    assert "'model.init_args.widht'" in msg and "Did you mean 'width'?" in msg


def test_unknown_target_kwarg_checked_against_user_class(tmp_path, user_module):
    path = write(tmp_path, BASE.replace("  width: 4\ntrainer", "  batch_sise: 4\ntrainer"))
    msg = config_error(path)
    assert "'data.batch_sise'" in msg and "Did you mean 'batch_size'?" in msg


def test_unknown_key_from_override_names_the_override(tmp_path, user_module):
    path = write(tmp_path, BASE)
    msg = config_error(path, ["trainer.max_epoch=3"])
    assert "'trainer.max_epoch'" in msg
    assert "command-line override 'trainer.max_epoch=3'" in msg
    assert "Did you mean 'max_epochs'?" in msg


def test_misspelled_class_path_suggests_the_class(tmp_path, user_module):
    path = write(tmp_path, BASE.replace("TinyRegressor", "TinyRegresor"))
    msg = config_error(path)
    assert "model.class_path" in msg and "Did you mean 'user_models_mod.TinyRegressor'?" in msg


def test_trainer_callbacks_point_to_their_section(tmp_path, user_module):
    path = write(tmp_path, BASE + "  callbacks: []\n")
    msg = config_error(path)
    assert "'trainer.callbacks'" in msg and "top-level 'callbacks:' section" in msg


def test_all_mistakes_reported_at_once(tmp_path, user_module):
    path = write(tmp_path, BASE + "  max_step: 10\n  devcies: 2\n")
    msg = config_error(path)
    assert "'trainer.max_step'" in msg and "'trainer.devcies'" in msg


# ------------------------------------------------------------------------------ wrong types


def test_wrong_type_names_key_expected_and_got(tmp_path, user_module):
    path = write(tmp_path, BASE.replace("max_steps: 3", "max_steps: lots"))
    msg = config_error(path)
    assert "'trainer.max_steps'" in msg and str(path) in msg
    assert "expected int, got str 'lots'" in msg


def test_wrong_type_in_user_init_args(tmp_path, user_module):
    path = write(tmp_path, BASE.replace("{width: 4}", "{width: 4, lr: fast}"))
    msg = config_error(path)
    assert "'model.init_args.lr'" in msg and "expected float, got str 'fast'" in msg


def test_wrong_type_from_override(tmp_path, user_module):
    path = write(tmp_path, BASE)
    msg = config_error(path, ["trainer.max_steps=1.5"])
    assert "'trainer.max_steps'" in msg and "expected int, got float 1.5" in msg
    assert "command-line override 'trainer.max_steps=1.5'" in msg


def test_literal_choices_are_listed(tmp_path, user_module):
    path = write(tmp_path, BASE + "  precision: bf17-mixed\n")
    msg = config_error(path)
    assert "'trainer.precision'" in msg and "'bf16-mixed'" in msg and "got str 'bf17-mixed'" in msg


def test_int_accepted_where_float_expected(tmp_path, user_module):
    path = write(tmp_path, BASE.replace("{width: 4}", "{width: 4, lr: 1}"))
    assert load_config(path).get("model.init_args.lr") == 1


def test_malformed_override_and_missing_file(tmp_path, user_module):
    path = write(tmp_path, BASE)
    assert "key=value" in config_error(path, ["trainer.max_steps"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


# ------------------------------------------------------------------------------ overrides


def test_dotlist_override_changes_resolved_value_and_interpolations():
    base = load_config(DEMO)
    cfg = load_config(DEMO, ["trainer.max_steps=7", "strategy.microbatches=8", "strategy.pp=4"])
    assert base.get("trainer.max_steps") != 7
    assert cfg.get("trainer.max_steps") == 7
    # ${trainer.max_steps} in the model section follows the override after resolution
    assert cfg.get("model.init_args.max_steps") == 7
    assert cfg.get("strategy.microbatches") == 8 and cfg.get("strategy.pp") == 4
    assert "max_steps: 7" in cfg.to_yaml()


def test_pipeline_shape_errors_name_the_numbers():
    cfg = load_config(DEMO, ["strategy.pp=3"])
    with pytest.raises(ConfigError) as info:
        check_run(cfg, None, model="skip")
    msg = str(info.value)
    assert "'strategy.pp' in command-line override 'strategy.pp=3'" in msg
    assert "world size 4 is not divisible by pp=3" in msg and "use pp in [1, 2, 4]" in msg
    assert "world = devices(4) x num_nodes(1), from trainer.devices x trainer.num_nodes" in msg
    run = check_run(load_config(DEMO), None, model="skip")
    assert (run.world, run.plan.pp, run.plan.dp, run.plan.microbatch_sizes(32)) == (
        4,
        2,
        2,
        [8] * 4,
    )


def test_uneven_microbatches_are_accepted():
    # the engine splits 32 samples into 3 microbatches of 11, 11, 10 exactly: no divisibility rule
    run = check_run(load_config(DEMO, ["strategy.microbatches=3"]), None, model="skip")
    assert run.plan.microbatch_sizes(32) == [11, 11, 10]


# ------------------------------------------------------------------------------ class specs


@pytest.mark.parametrize("style", ["class_path", "_target_"])
def test_both_spec_styles_instantiate_a_user_class(tmp_path, user_module, style):
    if style == "class_path":
        spec = "model:\n  class_path: user_models_mod.TinyRegressor\n  init_args:\n"
        spec += "    width: 3\n    name: from-yaml\n"
    else:
        spec = "model:\n  _target_: user_models_mod.TinyRegressor\n  width: 3\n  name: from-yaml\n"
    text = spec + "data:\n  _target_: user_models_mod.TinyData\n  width: 3\n"
    cfg = load_config(write(tmp_path, text))
    model, data = build_model_and_data(cfg)
    assert type(model).__name__ == "TinyRegressor" and type(model).__module__ == "user_models_mod"
    assert (model.width, model.name, model.net.in_features) == (3, "from-yaml", 3)
    assert type(data).__name__ == "TinyData" and data.width == 3


def test_optimizer_section_replaces_configure_optimizers(tmp_path, user_module):
    text = BASE + "optimizer:\n  class_path: torch.optim.Adam\n  init_args: {lr: 0.05}\n"
    text += "lr_scheduler:\n  class_path: torch.optim.lr_scheduler.StepLR\n"
    text += "  init_args: {step_size: 2}\n  interval: step\n"
    model, _ = build_model_and_data(load_config(write(tmp_path, text)))
    out = model.configure_optimizers()
    import torch

    assert isinstance(out["optimizer"], torch.optim.Adam)
    assert out["optimizer"].param_groups[0]["lr"] == 0.05
    assert isinstance(out["lr_scheduler"]["scheduler"], torch.optim.lr_scheduler.StepLR)
    assert out["lr_scheduler"]["interval"] == "step"


def test_instantiate_builds_nested_specs():
    obj = instantiate(
        {
            "_target_": "collections.OrderedDict",
            "inner": {"class_path": "datetime.timedelta", "init_args": {"minutes": 1}},
        }
    )
    assert obj["inner"].total_seconds() == 60


# ------------------------------------------------------------------------------ CLI user errors


def test_cli_user_error_exits_2_without_traceback(tmp_path, user_module, capsys):
    path = write(tmp_path, BASE + "  max_step: 10\n")
    for command in ("plan", "validate", "fit"):
        assert main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert f"lightning-pp {command}: error:" in err
        assert "Did you mean 'max_steps'?" in err and str(path) in err
        assert "Traceback" not in err


# ------------------------------------------------------------------------------ launchers


def test_detect_torchrun_and_slurm_environments():
    assert detect_launch_environment({}) is None
    env = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    got = detect_launch_environment(env)
    assert (got.launcher, got.devices, got.num_nodes, got.world_size) == ("torchrun", 2, 2, 4)
    slurm = {"SLURM_NTASKS": "16", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "train"}
    got = detect_launch_environment(slurm)
    assert (got.launcher, got.devices, got.num_nodes) == ("slurm", 8, 2)
    assert detect_launch_environment({**slurm, "SLURM_JOB_NAME": "bash"}) is None


def test_launcher_sizes_replace_config_devices():
    cfg = load_config(DEMO)
    env = detect_launch_environment(
        {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    )
    run = check_run(cfg, env, model="skip")
    assert (run.world, run.devices, run.num_nodes, run.plan.dp) == (8, 4, 2, 4)


def test_fit_trains_a_plain_user_module_in_process(tmp_path, user_module, capsys):
    """A LightningModule that knows nothing of pipelines trains from YAML (strategy: auto)."""
    text = BASE + "  enable_checkpointing: false\n  enable_progress_bar: false\n"
    text += f"  default_root_dir: {tmp_path}\nlogger: false\nstrategy: auto\n"
    text += "optimizer:\n  _target_: torch.optim.SGD\n  lr: 0.05\n"
    losses = tmp_path / "losses.csv"
    assert main(["fit", str(write(tmp_path, text)), "--losses-out", str(losses)]) == 0
    rows = losses.read_text().splitlines()
    assert rows[0] == "step,loss" and [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3"]
    assert "[lightning-pp] fit" in capsys.readouterr().out


def test_progress_bar_tokens_and_pipeline_bubble():
    from types import SimpleNamespace

    import torch

    from lightning_pp.callbacks.progress import batch_tokens, pipeline_bubble

    ids = torch.zeros(4, 16, dtype=torch.long)
    assert batch_tokens((ids, ids)) == 64
    assert batch_tokens({"x": torch.zeros(3, 2)}) == 3  # no integer tensor: count samples
    # The bar shows the pipeline's bubble (all pipeline ranks, RunSummary's window) next to the
    # simulator's; nothing before the first measurement (never one rank's own idle share).
    assert pipeline_bubble(SimpleNamespace(callback_metrics={})) is None
    metrics = {"pp/bubble_window": torch.tensor(0.3), "pp/bubble_window_expected": 0.25}
    assert pipeline_bubble(SimpleNamespace(callback_metrics=metrics)) == pytest.approx((0.3, 0.25))


def test_plan_refuses_to_pipeline_a_model_without_layers(tmp_path, user_module, capsys):
    path = write(tmp_path, BASE + "strategy:\n  pp: 2\n")
    assert main(["plan", str(path), "trainer.devices=2"]) == 2
    err = capsys.readouterr().err
    assert "TinyRegressor" in err and "no pipeline_layers()" in err and "pp(2) x vpp(1)" in err
    assert main(["fit", str(path), "trainer.devices=2"]) == 2  # refused before any launch
    assert "no pipeline_layers()" in capsys.readouterr().err
    assert main(["plan", str(path), "strategy.pp=1"]) == 0


# ------------------------------------------------------------------------------ fit == plan
# Settings that `fit` used to launch (4 ranks, 4 tracebacks) while `validate` judged them
# otherwise. Each must exit 2 before any process starts, from both commands, naming the key,
# where its value came from, and the fix.

BAD_SETTINGS = [
    (
        ["strategy.pp=4", "strategy.vpp=2", "strategy.schedule=interleaved"],
        ["cannot cut num_layers=6 into pp(4) * vpp(2) = 8", "strategy", "use vpp=1"],
    ),
    (
        ["strategy.partition=foo"],
        ["'strategy.partition' in command-line override", "use one of ['uniform', 'param"],
    ),
    (["strategy.microbatches=0"], ["'strategy.microbatches' in", "positive integer, got 0"]),
    (["data.init_args.batch_size=0"], ["'data.init_args.batch_size' in", "positive integer"]),
    (["data.init_args.block_size=0"], ["'data.init_args.block_size' in", "positive integer"]),
    (["data.init_args.max_chars=-1"], ["'data.init_args.max_chars' in", "positive integer"]),
    (["strategy.watchdog_timeout=0"], ["'strategy.watchdog_timeout' in", "seconds or None"]),
    (["trainer.devices=0"], ["'trainer.devices' in", "set trainer.devices to the number"]),
    (["trainer.max_steps=-5"], ["'trainer.max_steps' in", "or -1 for no limit"]),
    (["strategy.bucket_cap_mb=-1"], ["'strategy.bucket_cap_mb' in", "number of megabytes"]),
    (["trainer.num_nodes=0"], ["'trainer.num_nodes' in", "positive integer"]),
    (["strategy.pp=3"], ["'strategy.pp' in", "world size 4 is not divisible by pp=3"]),
    (["data.init_args.batch_size=3"], ["batch size 3 per replica is smaller than microbatches"]),
    (["strategy.zero=3"], ["'strategy.zero' in", "ZeRO-3, sharded parameters, is fsdp=True"]),
    (["strategy.zero=1", "strategy.fsdp=true"], ["fsdp=True with zero=1", "use fsdp=True with"]),
    (["strategy.pp=4", "strategy.zero=2"], ["zero=2 shards over", "but dp=1"]),
]


@pytest.fixture
def no_launch(monkeypatch):
    """`fit` must not get as far as training: fail loudly if it would."""
    import lightning_pp.commands.fit as fit_cmd

    def launched(*args, **kwargs):
        raise AssertionError("fit started training although the config is invalid")

    monkeypatch.setattr(fit_cmd, "train", launched)


@pytest.mark.parametrize("overrides, needles", BAD_SETTINGS, ids=lambda v: str(v[0]))
@pytest.mark.parametrize("command", ["fit", "plan"])
def test_fit_and_plan_refuse_the_same_settings(command, overrides, needles, no_launch, capsys):
    assert main([command, str(DEMO), *overrides]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"lightning-pp {command}: error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    if "=" in overrides[0] and needles[0].startswith("'"):  # names the override it came from
        assert f"command-line override '{overrides[0]}'" in err


def test_pipeline_over_a_world_known_only_at_run_time(no_launch, capsys):
    auto = ["trainer.accelerator=auto", "trainer.devices=auto", "strategy.pp=null"]
    run = check_run(load_config(DEMO, auto), None, model="skip")
    assert run.world is None and run.plan is None and run.pipeline
    assert main(["plan", str(DEMO), *auto]) == 0
    assert "pp=None: the pipeline spans all processes" in capsys.readouterr().out
    # what needs no pipeline size is still checked
    assert main(["fit", str(DEMO), *auto, "strategy.microbatches=0"]) == 2
    assert "'strategy.microbatches' in" in capsys.readouterr().err


def test_max_steps_minus_one_means_unlimited(no_launch):
    run = check_run(load_config(DEMO, ["trainer.max_steps=-1"]), None, model="skip")
    assert run.plan is not None


def test_accelerator_missing_here(monkeypatch, no_launch, capsys):
    import lightning_pp.commands._common as common

    monkeypatch.setattr(common, "_accelerator_available", lambda name: False)
    assert main(["fit", str(DEMO), "trainer.accelerator=gpu"]) == 2
    err = capsys.readouterr().err
    assert "'trainer.accelerator' in command-line override 'trainer.accelerator=gpu'" in err
    assert "use trainer.accelerator=cpu" in err
    # `plan` may check a GPU run on a laptop: it says so and still shows the plan
    assert main(["plan", str(DEMO), "trainer.accelerator=gpu"]) == 0
    out = capsys.readouterr().out
    assert "note: 'trainer.accelerator'" in out and "`lightning-pp fit` refuses" in out


def test_validate_is_a_deprecated_alias_of_plan(capsys):
    assert main(["plan", str(DEMO)]) == 0
    planned = capsys.readouterr()
    assert main(["validate", str(DEMO)]) == 0
    validated = capsys.readouterr()
    assert validated.out == planned.out
    assert validated.err.strip() == (
        "lightning-pp validate is deprecated: use `lightning-pp plan` (same arguments)"
    )
    assert planned.err == ""


def test_recompute_values_checked_with_the_key(tmp_path, user_module):
    path = write(tmp_path, BASE + "strategy:\n  pp: 1\n  recompute: fully\n")
    assert "'strategy.recompute'" in config_error(path)
    path = write(tmp_path, BASE + "strategy:\n  pp: 1\n  recompute: auto\n")
    assert "needs activation_budget" in config_error(path)
    path = write(
        tmp_path, BASE + "strategy:\n  pp: 1\n  recompute: auto\n  activation_budget: 6 gigs\n"
    )
    assert "'strategy.activation_budget'" in config_error(path)

"""`plan` is `fit`'s pre-flight (issue 35 items 2-4): every setting is applied or refused, the
`split=` and recompute rules that need the model are found from the meta build before any
process starts, by the same function under `plan`, `fit` and the strategy, and a config can
call nothing but the classes its sections allow.

In-process runs of the CLI (`main([...])`) with `fit`'s `train` replaced by a failure: a refused
case must exit 2 with one message before training would start. One launched `fit` per kind
checks the real command line (exit code 2, one error line, no traceback, no rank output).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import background
import pytest
import torch
from torch import nn

from lightning_pp.commands.cli import main
from lightning_pp.layout.recompute_spec import Selective
from lightning_pp.layout.rules import PreflightError
from lightning_pp.runtime.recompute import select_targets

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo_cpu.yaml"

# A model nobody wrote for pipelining (4 blocks in a ModuleList), held as self.model and built in
# configure_model, plus a PipelineLayers beside it (a wrong split= target).
SPLIT_MODULE = """
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pp.strategy.model import PipelineLayers


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.mlp(torch.tanh(self.attn(x)))


class Net(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.h = nn.ModuleList([Block() for _ in range(blocks)])
        self.lm_head = nn.Linear(8, 16)

    def forward(self, x):
        x = self.wte(x)
        for b in self.h:
            x = b(x)
        return self.lm_head(x)


class SplitLM(L.LightningModule):
    def __init__(self, blocks: int = 4):
        super().__init__()
        self.blocks = blocks
        self.model = None

    def configure_model(self):
        if self.model is not None:
            return
        self.model = Net(self.blocks)
        self.pl = PipelineLayers([lambda: nn.Linear(8, 8) for _ in range(4)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


from lightning_pp.strategy.model import PipelineMixin


class MixinList(PipelineMixin, L.LightningModule):
    # a PipelineMixin whose layers is a plain ModuleList (its pipeline_layers() cannot run)

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(16, 8), Block(), Block(), nn.Linear(8, 16)])

    def pipeline_input(self, batch):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return nn.functional.cross_entropy(output.flatten(0, 1), batch[1].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Tokens(L.LightningDataModule):
    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        x = torch.randint(0, 16, (16, 6))
        return DataLoader(TensorDataset(x, x), batch_size=self.batch_size)
"""

SPLIT_RUN = """
model: {class_path: split_models_mod.SplitLM}
data: {class_path: split_models_mod.Tokens, init_args: {batch_size: 4}}
trainer: {accelerator: cpu, devices: 2, max_steps: 1}
strategy: {pp: 2, microbatches: 2, split: model.h}
"""


@pytest.fixture
def split_run(tmp_path, monkeypatch):
    """A run file of the split model; its module importable (also by launched commands)."""
    (tmp_path / "split_models_mod.py").write_text(SPLIT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO)]))
    path = tmp_path / "split.yaml"
    path.write_text(textwrap.dedent(SPLIT_RUN))
    yield path
    sys.modules.pop("split_models_mod", None)


@pytest.fixture
def no_launch(monkeypatch):
    """`fit` must stop before training (where the Trainer and the processes would start)."""
    import lightning_pp.commands.fit as fit_cmd

    def launched(*args, **kwargs):
        raise AssertionError("fit got past its pre-flight: the run would have been launched")

    monkeypatch.setattr(fit_cmd, "train", launched)


# (overrides, the key named, a piece of the message)
SPLIT_REFUSED = [
    (["strategy.split=model.nope"], "strategy.split", "has no such module"),
    (["strategy.split=model.wte"], "strategy.split", "is a Embedding; it must name the ModuleList"),
    (["strategy.split=pl"], "strategy.split", "is a PipelineLayers"),
    (
        ["strategy.vpp=3", "strategy.schedule=interleaved"],
        "model",  # the cut: 'model (...) cut by strategy (...)'
        "cannot cut num_layers=4 into pp(2) * vpp(3) = 6",
    ),
    (["strategy.partition=[1,1]"], "strategy.partition", "sums to 2 layers but the model has"),
    (["strategy.partition=cost"], "strategy.partition", "partition='cost' with split="),
    (
        ["strategy.split_placement={model.nope: first}"],
        "strategy.split_placement",
        "not parameterised siblings of the split path",
    ),
    (
        ["strategy.split_placement={model.lm_head: middle}"],
        "strategy.split_placement",
        "must be 'first' or 'last'",
    ),
    (
        ["strategy.recompute=auto", "strategy.activation_budget=1MiB"],
        "strategy.recompute",
        "recompute='auto' is not supported with split=",
    ),
    (["strategy.recompute=[1]"], "strategy.recompute", "not supported with split="),
    (
        ["strategy.recompute=selective:nonexistent_module"],
        "strategy.recompute",
        "matches no module inside any pipeline layer",
    ),
    # the split rules' own fix, not the layers hook's (whose fix is for the path without split=);
    # under fit this once escaped as a traceback from the strategy's before-launch check
    (
        ["model.class_path=split_models_mod.MixinList", "strategy.split=layers"],
        "strategy.split",
        "is a PipelineMixin whose layers is a ModuleList, not PipelineLayers, and it keeps",
    ),
]

DEMO_REFUSED = [
    (["strategy.recompute=[99]"], "strategy.recompute", "the model has 6 pipeline layers"),
    (
        ["strategy.recompute=selective:nonexistent_module"],
        "strategy.recompute",
        "candidates: 'drop', 'fc',",
    ),
    (
        ["strategy.split_placement={lm_head: last}"],
        "strategy.split_placement",
        "is only used with split=",
    ),
    (["strategy.partition=[1,1]"], "strategy.partition", "sums to 2 layers but the model has"),
    # an explicit vpp the schedule cannot run (vpp=1 was once read as "unset" and replaced)
    (
        ["strategy.schedule=zbv", "strategy.vpp=1"],
        "strategy.vpp",
        "schedule 'zbv' runs exactly 2 chunks per rank (V placement) but vpp=1 was given",
    ),
    (["strategy.schedule=zbv", "strategy.vpp=3"], "strategy.vpp", "but vpp=3 was given"),
    (
        ["strategy.schedule=zb-h1", "strategy.vpp=2"],
        "strategy.vpp",
        "'zb-h1' cannot interleave: it runs one chunk per rank but vpp=2 was given",
    ),
]


def _refused(command: str, path: Path, overrides: list[str], key: str, needle: str, capsys):
    assert main([command, str(path), *overrides]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"lightning-pp {command}: error: "), err
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert f"'{key}'" in err or err.split("error: ", 1)[1].startswith(key), err
    assert needle in err, err
    assert "[lightning-pp] fit" not in out


@pytest.mark.parametrize("overrides, key, needle", SPLIT_REFUSED, ids=lambda v: str(v))
@pytest.mark.parametrize("command", ["plan", "fit"])
def test_split_mistakes_refused_alike_before_launch(
    command, overrides, key, needle, split_run, no_launch, capsys
):
    _refused(command, split_run, overrides, key, needle, capsys)


@pytest.mark.parametrize("overrides, key, needle", DEMO_REFUSED, ids=lambda v: str(v))
@pytest.mark.parametrize("command", ["plan", "fit"])
def test_settings_applied_or_refused(command, overrides, key, needle, no_launch, capsys):
    _refused(command, DEMO, overrides, key, needle, capsys)


def test_a_good_split_run_passes_both(split_run, no_launch, capsys, monkeypatch):
    """The same file with working settings: plan says OK, fit reaches training."""
    ok = ["strategy.recompute=selective:attn", "strategy.split_placement={model.lm_head: last}"]
    assert main(["plan", str(split_run), *ok]) == 0
    assert "OK:" in capsys.readouterr().out
    import lightning_pp.commands.fit as fit_cmd

    reached = []
    monkeypatch.setattr(fit_cmd, "train", lambda *a, **k: reached.append(1) or 0)
    assert main(["fit", str(split_run), *ok]) == 0 and reached == [1]


def test_search_needs_at_least_one_device(capsys):
    for devices in ("0", "-2"):
        assert main(["plan", str(DEMO), "--search", "--devices", devices]) == 2
        err = capsys.readouterr().err
        assert f"--devices {devices}" in err and "N >= 1" in err, err


def test_recompute_auto_names_what_only_fit_checks(capsys):
    ok = ["strategy.recompute=auto", "strategy.activation_budget=3MiB"]
    assert main(["plan", str(DEMO), *ok]) == 0
    out = capsys.readouterr().out
    assert "activation_budget=3MiB is checked only by fit, on the first batch" in out


# ---------------------------------------------------------------- a config calls only classes
PWN = """
model: {MODEL}
data: {{class_path: lightning_pp.models.data.StdlibCharDataModule, init_args: {{batch_size: 8}}}}
trainer: {{accelerator: cpu, devices: 1, max_steps: 1}}
strategy: ddp
"""


@pytest.mark.parametrize(
    "model",
    [
        '{class_path: os.system, init_args: {command: "touch PWNED"}}',
        '{_target_: os.system, command: "touch PWNED"}',
        "{class_path: lightning_pp.models.GPT, init_args: {vocab_size: {_target_: os.system, "
        'command: "touch PWNED"}}}',
    ],
    ids=["class_path", "_target_", "nested"],
)
@pytest.mark.parametrize("command", ["plan", "fit"])
def test_a_config_naming_a_function_runs_nothing(command, model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "pwn.yaml"
    path.write_text(PWN.format(MODEL=model))
    assert main([command, str(path)]) == 2
    assert not (tmp_path / "PWNED").exists(), "the config's command ran"
    err = capsys.readouterr().err
    assert "'os.system' is a builtin_function_or_method, not a class; refusing to call it" in err


def test_a_class_of_the_wrong_kind_is_not_called(tmp_path, monkeypatch, capsys):
    """A class is not enough: subprocess.Popen as a trainer plugin (a list entry) is refused."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "pwn.yaml"
    text = PWN.format(MODEL="{class_path: lightning_pp.models.GPT}")
    text = text.replace(
        "max_steps: 1}",
        "max_steps: 1, plugins: "
        "[{class_path: subprocess.Popen, init_args: {args: [touch, PWNED]}}]}",
    )
    path.write_text(text)
    assert main(["fit", str(path)]) == 2
    assert not (tmp_path / "PWNED").exists()
    assert "'trainer.plugins.0.class_path'" in capsys.readouterr().err


# ---------------------------------------------------------------- the launched command line
LAUNCHED_REFUSALS = {
    "split": ["strategy.split=model.wte"],
    "partition": ["strategy.partition=[1,1]"],
}


def _launched_refusal(overrides: list[str], tmp: Path) -> str:
    """The real `lightning-pp fit` of a 2-process run: exit 2, one line, no rank started (a rank
    would print Lightning's banner or a traceback; none does)."""
    (tmp / "split_models_mod.py").write_text(SPLIT_MODULE)
    path = tmp / "split.yaml"
    path.write_text(textwrap.dedent(SPLIT_RUN))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), str(REPO)])}
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_pp", "fit", str(path), *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("lightning-pp fit: error: "), proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    return lines[0]


def background_jobs(items, tmp_path_factory) -> dict:
    """Each launched command (a fresh interpreter importing Lightning) runs in the background
    while the in-process tests run (tests/background.py); the tests read the verdicts."""
    wanted = {
        item.callspec.params["case"]
        for item in items
        if getattr(item, "originalname", "") == "test_launched_fit_refuses_before_any_rank"
    }
    return {
        f"launched-refusal-{case}": functools.partial(
            _launched_refusal, LAUNCHED_REFUSALS[case], tmp_path_factory.mktemp(f"refusal-{case}")
        )
        for case in sorted(wanted)
    }


@pytest.mark.timeout(background.WAIT)
@pytest.mark.parametrize("case", sorted(LAUNCHED_REFUSALS))
def test_launched_fit_refuses_before_any_rank(case):
    print(background.check(f"launched-refusal-{case}"))


# ---------------------------------------------------------------- the strategy's own checks
def test_strategy_refuses_the_settings_at_construction():
    from lightning_pp.strategy import PipelineStrategy

    with pytest.raises(PreflightError, match="split_placement=.* is only used with split="):
        PipelineStrategy(pp=2, split_placement={"lm_head": "last"})
    cost_fix = "partition='cost' with split='model.h'.*Fix: partition='parameters'"
    with pytest.raises(PreflightError, match=cost_fix):
        PipelineStrategy(pp=2, split="model.h", partition="cost")
    with pytest.raises(ValueError, match="not supported with split="):
        PipelineStrategy(pp=2, split="model.h", recompute=[0])


def test_an_explicit_vpp_is_applied_or_refused_never_replaced():
    """vpp defaults to None, the schedule's own chunk count (zbv 2, others 1); a vpp given is
    used as given or refused at construction naming the numbers. Before, the default was 1, so
    PipelineStrategy(schedule="zbv", vpp=1) silently ran 2 chunks per rank."""
    from lightning_pp.strategy import PipelineStrategy

    for pp in (2, None):  # pp=None: refused without the world size too
        zbv_one = r"'zbv' runs exactly 2 .* but vpp=1 was given"
        with pytest.raises(PreflightError, match=zbv_one) as e:
            PipelineStrategy(pp=pp, schedule="zbv", vpp=1)
        assert e.value.key == "vpp" and "vpp=2 or leave vpp unset" in str(e.value)
        assert "schedule='zb-h1'" in str(e.value)  # the one-chunk alternative
        with pytest.raises(PreflightError, match="'zb-h1' cannot interleave.*vpp=2 was given"):
            PipelineStrategy(pp=pp, schedule="zb-h1", vpp=2)
        with pytest.raises(PreflightError, match="'1f1b' cannot interleave.*vpp=2 was given"):
            PipelineStrategy(pp=pp, schedule="1f1b", vpp=2)
    unset = PipelineStrategy(pp=2, schedule="zbv")
    assert unset.vpp == 2 and unset.plan is not None and unset.plan.vpp == 2
    assert PipelineStrategy(pp=2, schedule="zbv", vpp=2).plan.num_stages == 4
    assert PipelineStrategy(pp=None, schedule="zbv").vpp == 2  # before the world is known
    plain = PipelineStrategy(pp=2)
    assert (plain.vpp, plain.schedule_name) == (1, "1f1b")
    assert PipelineStrategy(pp=2, vpp=2).schedule_name == "interleaved"


def test_selective_names_start_at_each_split_block():
    """On a split= stage (an `owned` list of blocks and modules) 'selective:attn' selects the
    blocks' attn, as it does inside a PipelineLayers layer."""

    class Chunk(nn.Module):
        def __init__(self):
            super().__init__()
            blocks = [nn.ModuleDict({"attn": nn.Linear(2, 2), "mlp": nn.Linear(2, 2)})] * 1
            self.owned = nn.ModuleList([*blocks, nn.Linear(2, 2)])

    chunk = Chunk()
    (picked,) = select_targets([chunk], "selective:attn")
    assert [name for name, _ in picked] == ["owned.0.attn"]
    assert picked[0][1] is chunk.owned[0]["attn"]
    assert select_targets([chunk], Selective("nothing")) == [[]]


def test_api_fit_refuses_a_wrong_partition_before_launch(tmp_path):
    """Trainer(strategy=PipelineStrategy(partition=[1, 1])).fit on a 6-layer model: raised in
    the launching process by the launcher's pre-flight, before any rank process exists."""
    import lightning.pytorch as pl

    from lightning_pp.models import GPT
    from lightning_pp.strategy import PipelineStrategy

    spawned = []
    strategy = PipelineStrategy(pp=2, partition=[1, 1], start_method="spawn")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    import torch.multiprocessing as mp

    real = mp.start_processes

    def start_processes(*args, **kwargs):
        spawned.append(1)
        return real(*args, **kwargs)

    mp.start_processes = start_processes
    try:
        model = GPT(vocab_size=16, n_layer=4, n_head=2, n_embd=8, block_size=8)
        with pytest.raises(PreflightError, match="sums to 2 layers but the model has"):
            trainer.fit(model, train_dataloaders=[torch.zeros(2, 8, dtype=torch.long)])
    finally:
        mp.start_processes = real
    assert spawned == []
    assert model.layers is None, "the meta check left the module changed"


def test_a_budget_refused_after_launch_is_said_once(monkeypatch, capsys):
    """recompute='auto' is planned on the first batch, after launch, where every rank raises
    the same RecomputeBudgetError: `fit` prints it once (global rank 0) and exits 2 on every
    rank, with no traceback."""
    import lightning.pytorch as pl

    from lightning_pp.planner.recompute import RecomputeBudgetError

    def fit(self, *args, **kwargs):
        raise RecomputeBudgetError("rank 0 needs at least 2.00 MiB; the budget is 1.00 KiB")

    monkeypatch.setattr(pl.Trainer, "fit", fit)
    args = ["strategy.recompute=auto", "strategy.activation_budget=1kB", "--no-summary"]
    assert main(["fit", str(DEMO), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err
    assert "'strategy.activation_budget': rank 0 needs at least 2.00 MiB" in err

    monkeypatch.setattr(pl.Trainer, "is_global_zero", property(lambda self: False))
    assert main(["fit", str(DEMO), *args]) == 2
    assert "error" not in capsys.readouterr().err  # the other ranks say nothing

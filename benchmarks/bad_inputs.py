"""A table of bad inputs: what `lightning-pp fit`, `plan` and the Python API do with them.

Each input runs in its own process group (two at a time, each under a timeout) against a source
tree, and is classified from its exit code and output:

* ``clean``: refused before any rank process started, exit code 2 (the API: the exception raised
  in the launching process, which the runner turns into exit 2), and no traceback;
* ``works``: the input is fine (listed as such here) and the run or plan succeeded;
* ``silently accepted``: a bad input that exits 0;
* ``after spawn``: refused, but only once rank processes had started;
* ``unclean before spawn``: refused before spawn, but with a traceback or another exit code;
* ``hang``: still running at the timeout (its process group and descendants are killed).

Rank processes are detected by a ``sitecustomize`` module placed first on ``PYTHONPATH``: a
process started with ``LOCAL_RANK`` >= 1 in its environment (Lightning's launcher sets it for the
ranks it starts) prints a marker line.

    python3 benchmarks/bad_inputs.py                   # this tree
    python3 benchmarks/bad_inputs.py --tree /work/base # another checkout (old CLI module too)
    python3 benchmarks/bad_inputs.py --only split      # the inputs whose name contains 'split'
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

MARKER = "[bad_inputs] rank process started"
POLL_S = 2.0
IDLE_WINDOW = 20.0
HARD_CAP = 8
CLASSES = ("clean", "works", "silently accepted", "after spawn", "unclean before spawn", "hang")

# Modules of the table's own (written into the temporary directory, first on PYTHONPATH): a
# tiny data module, an unmodified model for split=, a PipelineMixin whose layers is a
# ModuleList, and the spawn marker.
SITECUSTOMIZE = f"""
import os, sys
if os.environ.get("LOCAL_RANK", "0") not in ("", "0"):
    sys.stderr.write("{MARKER} (LOCAL_RANK=%s)\\n" % os.environ["LOCAL_RANK"])
    sys.stderr.flush()
"""

MODELS = '''
"""Tiny modules for benchmarks/bad_inputs.py (tree independent: only public names)."""
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pp import PipelineMixin


class TinyData(L.LightningDataModule):
    def __init__(self, batch_size: int = 8, seq: int = 16, vocab: int = 64, samples: int = 128):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (samples, seq), generator=g)
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.x.roll(-1, 1)), batch_size=self.batch_size,
                          drop_last=True)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, h):
        return h + torch.tanh(self.fc(h))


class Net(nn.Module):
    def __init__(self, n_blocks: int, d: int = 16, vocab: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n_blocks)])
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class TinySplit(L.LightningModule):
    """An unmodified model: split="model.blocks" cuts it."""

    def __init__(self, n_blocks: int = 4):
        super().__init__()
        self.n_blocks = n_blocks
        self.model = None

    def configure_model(self):
        if self.model is None:
            self.model = Net(self.n_blocks)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class MixinList(PipelineMixin, L.LightningModule):
    """A PipelineMixin whose layers is a plain nn.ModuleList (not PipelineLayers)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(64, 16)] + [Block(16) for _ in range(4)]
                                    + [nn.Linear(16, 64)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def pipeline_input(self, batch):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return F.cross_entropy(output.flatten(0, 1), batch[1].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
'''

# The Python API runner: builds the model and a Trainer(devices=2) with the strategy's keyword
# arguments given as JSON, and turns an exception in the launching process (building the strategy
# or the Trainer, or in fit) into exit code 2.
API_RUNNER = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import lightning as L
from lightning_pp import PipelineStrategy
import bi_models

spec = json.loads(sys.argv[1])
trainer = None
try:
    # the strategy checks its settings when it is built (a PreflightError there is the API's
    # before-spawn refusal), the rest when fit starts
    model = getattr(bi_models, spec.get("model", "TinySplit"))(**spec.get("model_args", {}))
    if spec.get("gpt"):
        from lightning_pp import GPT
        model = GPT(vocab_size=64, n_layer=4, n_head=2, n_embd=16, block_size=16, max_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=spec.get("devices", 2), max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        strategy=PipelineStrategy(**spec["strategy"]))
    trainer.fit(model, bi_models.TinyData())
except Exception as exc:
    if trainer is not None and trainer.global_rank != 0:
        raise
    print(f"ERROR: {type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(2)
"""

GPT_MODEL = {
    "class_path": "lightning_pp.GPT",
    "init_args": {
        "vocab_size": 64,
        "n_layer": 4,  # + embedding + head = 6 pipeline layers
        "n_head": 2,
        "n_embd": 16,
        "block_size": 16,
        "max_steps": 2,
    },
}
SPLIT_MODEL = {"class_path": "bi_models.TinySplit", "init_args": {"n_blocks": 4}}
DATA = {"class_path": "bi_models.TinyData", "init_args": {"batch_size": 8}}
TRAINER = {
    "accelerator": "cpu",
    "devices": 2,
    "num_nodes": 1,
    "max_steps": 2,
    "limit_val_batches": 0,
    "num_sanity_val_steps": 0,
    "enable_checkpointing": False,
    "enable_model_summary": False,
    "enable_progress_bar": False,
}


def base_config(model: dict | None = None, **strategy: object) -> dict:
    return {
        "seed": 1,
        "logger": False,
        "model": json.loads(json.dumps(model or GPT_MODEL)),
        "data": json.loads(json.dumps(DATA)),
        "trainer": dict(TRAINER),
        "strategy": {"pp": 2, "microbatches": 2, "schedule": "1f1b", **strategy},
    }


@dataclass
class Case:
    name: str
    area: str
    kind: str  # "fit" | "plan" | "api"
    args: list[str] = field(default_factory=list)  # CLI: overrides and flags after the config
    config: dict | str | None = None  # CLI: the YAML (a dict, or raw text); None: base_config()
    api: dict | None = None  # API: the runner's spec
    valid: bool = False  # the input is actually fine: exit 0 is "works"
    marker: str | None = None  # a file whose existence after the run means code ran
    timeout: float = 90.0


def cases() -> list[Case]:
    c: list[Case] = []

    def fit(name, area, *args, config=None, valid=False, **kw):
        c.append(Case(name, area, "fit", list(args), config, valid=valid, **kw))

    def plan(name, area, *args, config=None, valid=False, **kw):
        c.append(Case(name, area, "plan", list(args), config, valid=valid, **kw))

    def api(name, area, strategy, valid=False, **spec):
        c.append(Case(name, area, "api", api={"strategy": strategy, **spec}, valid=valid))

    split = base_config(SPLIT_MODEL, split="model.blocks")
    search = ["--search", "--repeats", "1", "--cores", "0"]

    # schedules
    fit("schedule typo 'interleave'", "schedule", "strategy.schedule=interleave")
    fit("1f1b with vpp=2", "schedule", "strategy.vpp=2")
    fit("zbv, vpp unset (zbv picks 2)", "schedule", "strategy.schedule=zbv", valid=True)
    fit("zbv with explicit vpp=1", "schedule", "strategy.schedule=zbv", "strategy.vpp=1")
    fit("zbv with vpp=3", "schedule", "strategy.schedule=zbv", "strategy.vpp=3")
    fit(
        "zbv vpp=2 microbatches=1",
        "schedule",
        "strategy.schedule=zbv",
        "strategy.vpp=2",
        "strategy.microbatches=1",
        valid=True,
    )
    fit("zb-h1 with vpp=2", "schedule", "strategy.schedule=zb-h1", "strategy.vpp=2")
    fit(
        "interleaved microbatches=1 < pp",
        "schedule",
        "strategy.schedule=interleaved",
        "strategy.vpp=2",
        "strategy.microbatches=1",
    )
    fit("group_size with 1f1b", "schedule", "strategy.group_size=2")
    fit(
        "interleaved group_size=5 > microbatches=4",
        "schedule",
        "strategy.schedule=interleaved",
        "strategy.vpp=2",
        "strategy.microbatches=4",
        "strategy.group_size=5",
    )
    fit("zb-h1 (fine)", "schedule", "strategy.schedule=zb-h1", valid=True)
    # microbatches
    fit("microbatches=0", "microbatches", "strategy.microbatches=0")
    fit("microbatches=abc", "microbatches", "strategy.microbatches=abc")
    fit("microbatches=100 > batch 8", "microbatches", "strategy.microbatches=100")
    fit("microbatches=1 under 1f1b (warns)", "microbatches", "strategy.microbatches=1", valid=True)
    # pipeline shape and trainer
    fit("pp=0", "shape", "strategy.pp=0")
    fit("pp=3 on 2 devices", "shape", "strategy.pp=3")
    fit(
        "vpp=4 interleaved, 6 layers < 8 chunks",
        "shape",
        "strategy.schedule=interleaved",
        "strategy.vpp=4",
        "strategy.microbatches=4",
    )
    fit("dp=2 with pp=2 on 2 devices", "shape", "strategy.dp=2")
    fit("trainer.devices=0", "shape", "trainer.devices=0")
    fit("devices=3 with pp=2", "shape", "trainer.devices=3")
    # recompute
    fit("recompute=[99] (6 layers)", "recompute", "strategy.recompute=[99]")
    fit(
        "recompute selective:nonexistent_module",
        "recompute",
        "strategy.recompute=selective:nonexistent_module",
    )
    fit("recompute=bogus", "recompute", "strategy.recompute=bogus")
    fit("recompute=full (fine)", "recompute", "strategy.recompute=full", valid=True)
    fit("recompute=auto, no budget", "recompute", "strategy.recompute=auto")
    # budgets
    fit("activation_budget without recompute=auto", "budget", "strategy.activation_budget=1GiB")
    fit(
        "activation_budget=lots",
        "budget",
        "strategy.recompute=auto",
        "strategy.activation_budget=lots",
    )
    fit(
        "activation_budget=-1GiB",
        "budget",
        "strategy.recompute=auto",
        "strategy.activation_budget=-1GiB",
    )
    fit(
        "activation_budget=1 byte (impossible)",
        "budget",
        "strategy.recompute=auto",
        "strategy.activation_budget=1",
    )
    fit(
        "recompute=auto budget=1GiB (fine)",
        "budget",
        "strategy.recompute=auto",
        "strategy.activation_budget=1GiB",
        valid=True,
    )
    fit("watchdog_timeout=0", "budget", "strategy.watchdog_timeout=0")
    # partitions
    fit("partition=foo", "partition", "strategy.partition=foo")
    fit("partition=[1,1] (6 layers)", "partition", "strategy.partition=[1,1]")
    fit("partition=[1,2,3] (3 entries, 2 stages)", "partition", "strategy.partition=[1,2,3]")
    fit("partition=cost, GPT gives no layer costs", "partition", "strategy.partition=cost")
    # data
    fit("data batch_size=1 < microbatches=2", "data", "data.init_args.batch_size=1")
    # split=
    fit("split=model.blocks (fine)", "split", config=split, valid=True)
    fit("split names nothing", "split", "strategy.split=model.nonexistent", config=split)
    fit(
        "split names a Linear, not a ModuleList", "split", "strategy.split=model.head", config=split
    )
    fit("split on a PipelineLayers model", "split", "strategy.split=layers")
    fit(
        "split on a PipelineMixin whose layers is a ModuleList",
        "split",
        "strategy.split=layers",
        config=base_config({"class_path": "bi_models.MixinList"}),
    )
    fit(
        "split, 3 blocks < pp*vpp=4",
        "split",
        "strategy.schedule=interleaved",
        "strategy.vpp=2",
        "strategy.microbatches=4",
        "model.init_args.n_blocks=3",
        config=split,
    )
    fit("split + partition=[1,1] (4 blocks)", "split", "strategy.partition=[1,1]", config=split)
    fit("split + partition=cost", "split", "strategy.partition=cost", config=split)
    fit(
        "split + recompute=auto",
        "split",
        "strategy.recompute=auto",
        "strategy.activation_budget=1GiB",
        config=split,
    )
    fit("split + recompute=[99]", "split", "strategy.recompute=[99]", config=split)
    fit(
        "split_placement unknown module",
        "split",
        "strategy.split_placement={model.nope: last}",
        config=split,
    )
    fit(
        "split_placement value 'middle'",
        "split",
        "strategy.split_placement={model.emb: middle}",
        config=split,
    )
    fit(
        "split_placement head last (fine)",
        "split",
        "strategy.split_placement={model.head: last}",
        config=split,
        valid=True,
    )
    fit("split_placement without split", "split", "strategy.split_placement={head: last}")
    # config files
    cfg = base_config()
    fit("config: YAML syntax error", "config", config="model: {class_path: [unclosed\n")
    fit("config: no model section", "config", config={k: v for k, v in cfg.items() if k != "model"})
    fit("config: model class does not exist", "config", "model.class_path=nopkg.Model")
    fit(
        "config: model class_path=os.system (marker)",
        "config",
        config="os.system",
        marker="PWNED_fit",
    )
    fit("config: unknown top-level key", "config", "nonsense_section.x=1")
    fit("config: unknown strategy key", "config", "strategy.nonexistent_key=1")
    fit("config: data class is builtins.dict", "config", "data.class_path=builtins.dict")
    fit("config: trainer.accelerator=gpu (no GPU)", "config", "trainer.accelerator=gpu")
    # plan
    plan("plan fine", "plan", valid=True)
    plan(
        "plan model class_path=os.system (marker)", "plan", config="os.system", marker="PWNED_plan"
    )
    plan("plan split names nothing", "plan", "strategy.split=model.nonexistent", config=split)
    plan("plan split + partition=[1,1]", "plan", "strategy.partition=[1,1]", config=split)
    plan("plan split + partition=cost", "plan", "strategy.partition=cost", config=split)
    plan(
        "plan split + recompute=auto",
        "plan",
        "strategy.recompute=auto",
        "strategy.activation_budget=1GiB",
        config=split,
    )
    plan("plan recompute=[99]", "plan", "strategy.recompute=[99]")
    plan("plan split_placement without split", "plan", "strategy.split_placement={head: last}")
    # planner flags
    plan("plan --search (fine)", "planner", *search, "--top", "3", valid=True, timeout=240)
    plan("plan --search --devices 0", "planner", *search, "--devices", "0")
    plan("plan --search --top 0", "planner", *search, "--top", "0")
    plan(
        "plan --search --memory-per-device lots", "planner", *search, "--memory-per-device", "lots"
    )
    plan("plan --search --memory-per-device -1GiB", "planner", *search, "--memory-per-device=-1GiB")
    plan(
        "plan --search --memory-per-device 1KiB (nothing fits)",
        "planner",
        *search,
        "--memory-per-device",
        "1KiB",
    )
    plan("plan --search --max-microbatches 0", "planner", *search, "--max-microbatches", "0")
    plan(
        "plan --search --profile missing.json",
        "planner",
        *search,
        "--profile",
        "/nonexistent/profile.json",
    )
    plan("plan --search --optimizer foo", "planner", *search, "--optimizer", "foo")
    plan("plan --search --bandwidth 0", "planner", *search, "--bandwidth", "0")
    plan("plan --verify -1", "planner", *search, "--verify=-1")
    plan("plan --devices 4 without --search", "planner", "--devices", "4")
    # the Python API
    api("API pp=3 on 2 devices", "api", {"pp": 3, "split": "model.blocks"})
    api(
        "API zbv, vpp unset (zbv picks 2)",
        "api",
        {"pp": 2, "schedule": "zbv", "split": "model.blocks"},
        valid=True,
    )
    api(
        "API zbv with explicit vpp=1",
        "api",
        {"pp": 2, "schedule": "zbv", "vpp": 1, "split": "model.blocks"},
    )
    api("API microbatches=0", "api", {"pp": 2, "microbatches": 0, "split": "model.blocks"})
    api(
        "API watchdog_timeout=-1", "api", {"pp": 2, "watchdog_timeout": -1, "split": "model.blocks"}
    )
    api("API split names nothing", "api", {"pp": 2, "split": "model.nope"})
    api(
        "API split + partition=[1,2,1] (3 entries)",
        "api",
        {"pp": 2, "split": "model.blocks", "partition": [1, 2, 1]},
    )
    api(
        "API split + partition=cost", "api", {"pp": 2, "split": "model.blocks", "partition": "cost"}
    )
    api(
        "API split + microbatches=100",
        "api",
        {"pp": 2, "split": "model.blocks", "microbatches": 100},
    )
    api("API split fine", "api", {"pp": 2, "microbatches": 2, "split": "model.blocks"}, valid=True)
    api("API GPT recompute=[99]", "api", {"pp": 2, "microbatches": 2, "recompute": [99]}, gpt=True)
    api(
        "API GPT partition=[1,2,3]",
        "api",
        {"pp": 2, "microbatches": 2, "partition": [1, 2, 3]},
        gpt=True,
    )
    api(
        "API GPT split_placement without split",
        "api",
        {"pp": 2, "microbatches": 2, "split_placement": {"head": "last"}},
        gpt=True,
    )
    return c


@dataclass
class Result:
    case: Case
    rc: int | None
    seconds: float
    spawned: bool
    tracebacks: int
    first_line: str
    marker_hit: bool
    klass: str


def cli_module(tree: Path) -> str:
    """``lightning_pp`` (``python -m lightning_pp``) on trees with ``__main__.py``, else the old
    ``lightning_pp.cli``."""
    if (tree / "lightning_pp" / "__main__.py").exists():
        return "lightning_pp"
    if (tree / "lightning_pp" / "cli.py").exists():
        return "lightning_pp.cli"
    raise SystemExit(f"{tree} has neither lightning_pp/__main__.py nor lightning_pp/cli.py")


ERROR_LINE = re.compile(
    r"(^[\w.]*(Error|Exception|Aborted|Warning)\b|error:|ERROR|\bcannot\b|\bmust\b|refus|"
    r"invalid|unknown|not (a|an|supported)\b|\bfix\b)",
    re.IGNORECASE,
)
WARNING_AT = re.compile(r"^/\S+\.py:\d+: ")
EXC_LINE = re.compile(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception|Aborted|Interrupt)\b.*")


def first_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and MARKER not in ln]
    if "Traceback (most recent call last)" in text:
        # the exception line that ends the first traceback
        after = text.split("Traceback (most recent call last)", 1)[1].splitlines()
        for ln in after:
            if EXC_LINE.match(ln.strip()):
                return ln.strip()
    for i, ln in enumerate(lines):
        if WARNING_AT.match(ln) or ln.startswith("warnings.warn"):
            continue  # a library's warning ("/.../x.py:70: You defined ..."), not the error
        if ERROR_LINE.search(ln):
            # a heading ("error: invalid configuration X:") is followed by the reason
            return f"{ln} {lines[i + 1]}" if ln.endswith(":") and i + 1 < len(lines) else ln
    return lines[-1] if lines else ""


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` from /proc (a rank may sit in a session of its own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def tree_sample(pid: int) -> tuple[float, bool]:
    """CPU time (user + system) of ``pid`` and its live descendants, and whether any of them
    is runnable or in uninterruptible sleep (state R or D: working, or waiting for a CPU)."""
    ticks, busy = 0, False
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
            busy = busy or fields[0] in ("R", "D")
        except (OSError, ValueError, IndexError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK"), busy


def wait_or_hang(proc: subprocess.Popen, timeout: float) -> int | None:
    """The exit code, or ``None`` for a hang: past ``timeout`` seconds, a job whose processes
    all slept through the last ``IDLE_WINDOW`` seconds (never runnable when sampled, and under
    1.5 CPU-seconds in all): blocked, not slow. On a loaded machine a healthy job at nice 19
    can wait minutes for a CPU; it is runnable then, so it is not called a hang before
    ``HARD_CAP * timeout``."""
    start = time.monotonic()
    samples: list[tuple[float, float, bool]] = []
    while True:
        try:
            return proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        samples.append((now, *tree_sample(proc.pid)))
        samples = [x for x in samples if now - x[0] <= IDLE_WINDOW + POLL_S]
        elapsed = now - start
        if elapsed > HARD_CAP * timeout:
            return None
        if elapsed > timeout and now - samples[0][0] >= IDLE_WINDOW:
            idle = samples[-1][1] - samples[0][1] < 1.5 and not any(x[2] for x in samples)
            if idle:
                return None


def kill_tree(proc: subprocess.Popen) -> None:
    pids = descendants(proc.pid) if proc.poll() is None else []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_case(case: Case, tree: Path, work: Path, index: int) -> Result:
    d = work / f"case{index:03d}"
    d.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    for key in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(key, None)
    env.update(
        PYTHONPATH=f"{work}{os.pathsep}{tree}",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore::DeprecationWarning",
    )
    marker = d / case.marker if case.marker else None
    if case.kind == "api":
        cmd = [sys.executable, str(work / "bi_api.py"), json.dumps(case.api)]
    else:
        if isinstance(case.config, str) and case.config.startswith("/"):
            path = case.config
        else:
            path = str(d / "run.yaml")
            if case.config == "os.system":
                text = yaml.safe_dump(
                    {
                        **base_config(),
                        "model": {
                            "class_path": "os.system",
                            "init_args": {"command": f"touch {marker}"},
                        },
                    }
                )
            elif isinstance(case.config, str):
                text = case.config
            else:
                text = yaml.safe_dump(case.config or base_config())
            Path(path).write_text(text)
        # flags go before the config: the overrides after it take every remaining argument
        overrides = [
            a
            for a in case.args
            if not a.startswith("-")
            and ("=" in a or a.startswith(("strategy.", "model.", "data.", "trainer.")))
        ]
        flags = [a for a in case.args if a not in overrides]
        if case.kind == "plan" and "--search" in case.args:
            flags += ["--cache-dir", str(work / "profile_cache")]
        cmd = [sys.executable, "-m", cli_module(tree), case.kind, *flags, path, *overrides]
    start = time.monotonic()
    with open(d / "out.txt", "w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=d,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        rc = wait_or_hang(proc, case.timeout)
        kill_tree(proc)  # a finished job's leftovers too (a rank, a store process)
        proc.wait()
    seconds = time.monotonic() - start
    text = (d / "out.txt").read_text(errors="replace")
    spawned = MARKER in text
    tracebacks = text.count("Traceback (most recent call last)")
    marker_hit = bool(marker and marker.exists())
    if rc is None:
        klass = "hang"
    elif rc == 0:
        klass = "works" if case.valid and not marker_hit else "silently accepted"
    elif spawned:
        klass = "after spawn"
    elif rc == 2 and tracebacks == 0 and not marker_hit:
        klass = "clean"
    else:
        klass = "unclean before spawn"
    line = first_error_line(text) if rc != 0 else _warning(text)
    return Result(case, rc, seconds, spawned, tracebacks, line, marker_hit, klass)


def _warning(text: str) -> str:
    for ln in text.splitlines():
        if "Warning" in ln or "warning" in ln:
            return ln.strip()
    return ""


def cell(text: str, width: int = 150) -> str:
    text = text.replace("|", "\\|").replace("`", "'")
    return text if len(text) <= width else text[: width - 3] + "..."


def row(r: Result) -> dict:
    return {
        "name": r.case.name,
        "area": r.case.area,
        "kind": r.case.kind,
        "rc": r.rc,
        "spawned": r.spawned,
        "tracebacks": r.tracebacks,
        "class": r.klass,
        "first_line": r.first_line,
        "marker_hit": r.marker_hit,
        "seconds": round(r.seconds, 1),
    }


def load_rows(path: Path | None) -> list[dict] | None:
    return None if path is None else json.loads(path.read_text())


def summary(rows: list[dict]) -> str:
    counts = Counter(r["class"] for r in rows)
    return f"{len(rows)} inputs: " + ", ".join(f"{counts.get(k, 0)} {k}" for k in CLASSES)


def render(rows: list[dict], before: list[dict] | None = None) -> str:
    """The markdown table and the counts per class; with ``before`` (an earlier run's JSON, e.g.
    on the old tree) a column with that run's class per input, and its counts (over the inputs
    both runs hold)."""
    old = {r["name"]: r for r in before or []}
    head = "| # | area | input | via |" + (" before |" if before is not None else "")
    head += " exit | before spawn | tracebacks | class | first line of the output's error |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, r in enumerate(rows, 1):
        rc = "timeout" if r["rc"] is None else str(r["rc"])
        extra = " (marker file created: code ran)" if r.get("marker_hit") else ""
        was = ""
        if before is not None:
            was = f" {old[r['name']]['class']} |" if r["name"] in old else " - |"
        out.append(
            f"| {i} | {r['area']} | {cell(r['name'], 60)} | {r['kind']} |{was} {rc} | "
            f"{'no' if r['spawned'] else 'yes'} | {r['tracebacks']} | {r['class']} | "
            f"{cell(r['first_line'])}{extra} |"
        )
    out.append("")
    if before is not None:
        both = [old[r["name"]] for r in rows if r["name"] in old]
        out.append(f"before: {summary(both)}")
        out.append(f"after:  {summary([r for r in rows if r['name'] in old])}")
        if len(both) != len(rows):
            out.append(f"(all {summary(rows)})")
    else:
        out.append(summary(rows))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tree",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="source tree to run against (PYTHONPATH); default: this one",
    )
    ap.add_argument("--jobs", type=int, default=2, help="inputs run at once (default 2)")
    ap.add_argument("--only", default=None, help="run only inputs whose name contains this")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the outputs (printed path)")
    ap.add_argument(
        "--compare", type=Path, default=None, help="an earlier --json file: add its class column"
    )
    ap.add_argument(
        "--first",
        default="",
        help="comma-separated areas to run first (the table keeps the listed order)",
    )
    ap.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="an earlier --json file of this run: keep its rows (except hangs), run the rest",
    )
    ap.add_argument(
        "--report",
        type=Path,
        default=None,
        help="run nothing: print the table of this --json file (with --compare)",
    )
    args = ap.parse_args(argv)
    if args.report is not None:
        print(render(load_rows(args.report) or [], load_rows(args.compare)))
        return 0
    tree = args.tree.resolve()
    todo = [c for c in cases() if args.only is None or args.only in c.name]
    kept = [r for r in load_rows(args.resume) or [] if r["class"] != "hang"]
    done_names = {r["name"] for r in kept}
    order = {c.name: i for i, c in enumerate(todo)}
    kept = [r for r in kept if r["name"] in order]
    todo = [c for c in todo if c.name not in done_names]
    first = [a for a in args.first.split(",") if a]
    todo.sort(key=lambda c: first.index(c.area) if c.area in first else len(first))
    work = Path(tempfile.mkdtemp(prefix="bad_inputs_"))
    (work / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (work / "bi_models.py").write_text(MODELS)
    (work / "bi_api.py").write_text(API_RUNNER)
    (work / "profile_cache").mkdir()
    print(
        f"{len(todo)} inputs against {tree} (CLI: python3 -m {cli_module(tree)}), "
        f"{args.jobs} at a time; outputs in {work}",
        file=sys.stderr,
    )
    start = time.monotonic()
    lock = threading.Lock()
    done = [0]
    finished: list[dict] = list(kept)

    def one(pair: tuple[int, Case]) -> Result:
        r = run_case(pair[1], tree, work, pair[0])
        with lock:
            done[0] += 1
            print(
                f"[{done[0]}/{len(todo)}] {r.klass:20s} {r.seconds:5.1f}s  {r.case.name}",
                file=sys.stderr,
                flush=True,
            )
            if args.json:  # as it goes: a run stopped early keeps what it measured
                finished.append(row(r))
                args.json.write_text(json.dumps(finished, indent=1))
        return r

    with ThreadPoolExecutor(max_workers=max(1, min(args.jobs, 2))) as pool:
        results = list(pool.map(one, enumerate(todo)))
    total = time.monotonic() - start

    rows = sorted(kept + [row(r) for r in results], key=lambda r: order[r["name"]])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(render(rows, load_rows(args.compare)))
    print(f"\n({len(rows)} inputs against {tree} in {total:.0f} s)")
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``PipelineStrategy(split=...)`` on models nobody wrote for pipelining, under the real Trainer.

The modules (tests/scripts/split_common.py) hold an unmodified GPT-2 (tied head), Llama (rotary,
RMSNorm, untied), Qwen2 (tied) or nanoGPT-style GPT and implement only ``training_step`` /
``validation_step`` / ``test_step`` / ``predict_step`` as for a plain Trainer. One 4-process
torchrun job trains every configuration in sequence (pp 2 and 4, vpp 1 and 2, dp 1 and 2,
1F1B / interleaved / zbv / zb-h1, FSDP2 per chunk under 1F1B, interleaved and zbv, accumulation,
clipping, bf16-mixed, the model built in ``configure_model`` or in ``__init__``, a checkpoint
resharded on load); this process runs the plain references.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))

from byom_models import model_fn  # noqa: E402
from split_common import CausalLM, run_reference  # noqa: E402
from worlds import script_main, world  # noqa: E402

from lightning_pp.autosplit import meta_build  # noqa: E402
from lightning_pp.checkpoint.consolidate import consolidate_checkpoint  # noqa: E402
from lightning_pp.commands.cli import main as cli_main  # noqa: E402

REL_TOL = 1e-5
# One torchrun job (8 configurations, 4 processes) plus 7 plain references: about 2 minutes on
# an idle 2-core machine, several times that under load; the fixtures count against each test.
pytestmark = pytest.mark.timeout(1200)
GPT2, LLAMA = "model.transformer.h", "model.model.layers"
CONFIGS = [
    # pp4 x dp1, 1F1B, accumulation and clipping; built in configure_model
    dict(
        name="gpt2_pp4",
        model="gpt2",
        split=GPT2,
        pp=4,
        microbatches=4,
        accumulate=2,
        clip=0.5,
        eval=True,  # trainer.test and trainer.predict too
    ),
    # pp2 x dp2, interleaved (vpp 2), the distributed optimizer (zero=1) and clipping
    dict(
        name="llama_pp2_vpp2_dp2_zero1",
        model="llama",
        split=LLAMA,
        pp=2,
        vpp=2,
        microbatches=2,
        zero=1,
        clip=0.5,
    ),
    # pp4 x vpp2 (8 stages of one block), the model built in __init__ (tied head); zbv's V
    # placement puts the embedding and the tied head on rank 0, and m=4 < 2p
    dict(
        name="nanogpt_pp4_vpp2_zbv",
        model="nanogpt",
        split="model.transformer.h",
        pp=4,
        vpp=2,
        schedule="zbv",
        microbatches=4,
        build="init",
        clip=1.0,
    ),
    # pp2 x dp2, bf16-mixed, tied head, split backward (unmodified HF layers free the graph at I)
    dict(
        name="qwen2_pp2_dp2_bf16_zbh1",
        model="qwen2-tied",
        split=LLAMA,
        pp=2,
        schedule="zb-h1",
        microbatches=2,
        precision="bf16-mixed",
    ),
    # pp2 x dp2, FSDP2 per chunk (each HF block a unit of its own), clipping
    dict(
        name="gpt2_pp2_dp2_fsdp",
        model="gpt2",
        split=GPT2,
        pp=2,
        microbatches=2,
        fsdp=True,
        clip=0.5,
    ),
    # pp2 x dp2, FSDP2 per chunk under zbv (two chunks per rank, V placement): pp rank 1's
    # first stage ends by calling its second stage's first block, pp rank 0's second stage
    # passes its first stage's blocks through, and the tied embedding/head sit in both of its
    # chunks (kept whole, all-reduced)
    dict(
        name="qwen2_pp2_dp2_fsdp_zbv",
        model="qwen2-tied",
        split=LLAMA,
        pp=2,
        schedule="zbv",
        microbatches=2,
        fsdp=True,
        clip=0.5,
    ),
    # gpt2_pp4's checkpoint loaded at pp2 x vpp2 x dp2 (resharded by name)
    dict(
        name="gpt2_resume_pp2_vpp2_dp2",
        model="gpt2",
        split=GPT2,
        pp=2,
        vpp=2,
        microbatches=2,
        resume="gpt2_pp4",
    ),
]
TRAINED = [c for c in CONFIGS if "resume" not in c]
BY_NAME = {c["name"]: c for c in CONFIGS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    out = tmp_path_factory.mktemp("split")
    argv = ["--out", str(out), "--configs", json.dumps(CONFIGS)]
    world("trainer", 4).run(script_main, "split_run", argv, timeout=1000)
    data = {
        c["name"]: [json.loads((out / f"{c['name']}.rank{r}.json").read_text()) for r in range(4)]
        for c in CONFIGS
    }
    return out, data


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    torch.set_num_threads(1)
    return {c["name"]: run_reference(c) for c in TRAINED}


def _rel(got: list[float], want: list[float]) -> list[float]:
    assert len(got) == len(want), (len(got), len(want))
    return [abs(g - w) / abs(w) for g, w in zip(got, want)]


@pytest.mark.parametrize("cfg", TRAINED, ids=[c["name"] for c in TRAINED])
def test_losses_match_a_plain_trainer(runs, references, cfg):
    ranks, ref = runs[1][cfg["name"]], references[cfg["name"]]
    tol = 5e-2 if cfg.get("precision") == "bf16-mixed" else REL_TOL  # bf16: ~3 digits
    assert len(ref["train"]) == 10 * cfg.get("accumulate", 1)
    for d in ranks:
        assert all(math.isfinite(x) for x in d["train"])
        errs = _rel(d["train"], ref["train"])
        assert max(errs) <= tol, f"rank {d['rank']}: train loss relative errors {errs}"
        errs = _rel([*d["val"], d.get("test", 1.0)], [*ref["val"], ref.get("test", 1.0)])
        assert max(errs) <= tol, f"rank {d['rank']}: val/test loss relative errors {errs}"
        # every rank logs the same values (captured on the last stage, sent to the others)
        assert d["train"] == ranks[0]["train"] and d["val"] == ranks[0]["val"]
    assert len({round(x, 4) for x in ranks[0]["train"]}) > 3, "the loss must move"


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_each_rank_holds_its_stages_share_under_the_plain_keys(runs, cfg):
    ranks = runs[1][cfg["name"]]
    plain_keys = sorted(meta_build(lambda: CausalLM(cfg["model"], "init")).model.state_dict())
    for d in ranks:
        assert d["meta"] == 0, f"rank {d['rank']}: {d['meta']} parameters left on meta"
        assert d["numel"] == d["share"], f"rank {d['rank']}: {d['numel']} != {d['share']}"
    for dp in (0, 1) if 4 // cfg["pp"] == 2 else (0,):
        keys = [k for d in ranks if d["dp_rank"] == dp for k in d["keys"]]
        assert sorted(keys) == plain_keys  # a partition of the plain module's keys


@pytest.mark.parametrize("cfg", TRAINED[:3], ids=[c["name"] for c in TRAINED[:3]])
def test_consolidated_checkpoint_loads_into_the_plain_model(runs, references, cfg):
    out, _ = runs
    state = consolidate_checkpoint(out / f"ckpt_{cfg['name']}", submodule="model")
    torch.manual_seed(123)
    plain = model_fn(cfg["model"])[0]()
    plain.load_state_dict(state, strict=True)
    ref = model_fn(cfg["model"])[0]()
    ref.load_state_dict(references[cfg["name"]]["state_dict"], strict=True)
    x = torch.randint(1, 60, (2, 9))
    with torch.no_grad():
        if cfg["model"] == "nanogpt":
            got, want = plain(x, x)[0], ref(x, x)[0]
        else:
            got, want = plain(input_ids=x).logits, ref(input_ids=x).logits
    assert ((got - want).norm() / want.norm()).item() <= REL_TOL


def test_consolidate_cli_writes_the_hf_state_dict(runs, tmp_path):
    out, _ = runs
    target = tmp_path / "gpt2.pt"
    args = ["consolidate", str(out / "ckpt_gpt2_pp4"), str(target), "--submodule", "model"]
    assert cli_main(args) == 0
    plain = model_fn("gpt2")[0]()
    plain.load_state_dict(torch.load(target, weights_only=True), strict=True)


def test_predict_matches(runs, references):
    want = references["gpt2_pp4"]["predict"]
    for d in runs[1]["gpt2_pp4"]:
        assert len(d["predict"]) == len(want)
        for got, exp in zip(d["predict"], want):
            got, exp = torch.tensor(got), torch.tensor(exp)
            assert ((got - exp).norm() / exp.norm()).item() <= REL_TOL


def test_resharded_checkpoint_validates_like_the_run_that_wrote_it(runs):
    _, data = runs
    written = data["gpt2_pp4"][0]["val"][-1]  # validated at the last step, as saved
    for d in data["gpt2_resume_pp2_vpp2_dp2"]:
        assert abs(d["val_resumed"] - written) <= REL_TOL * abs(written)

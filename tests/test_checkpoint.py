"""Sharded checkpoints under the real Trainer and real gloo process groups, every placement.

Four groups of ranks (:mod:`worlds`: torchrun-like Trainer workers, no launcher):

* A (the shared 4-rank world): 10 straight steps and 5 steps + save, for interleaved (pp=4,
  vpp=2), 1F1B (pp=2 x dp=2) and zbv (pp=4, V placement); and 10 steps of 1F1B saving in the
  background (``async_checkpoint=True``) at steps 5 and 10;
* in this process: 5 steps of a plain Trainer (no PipelineStrategy) + its single-file save;
* two 2-rank worlds whose rank 1 dies half-way through its second save (its DCP data write),
  one saving synchronously, one in the background;
* B (4 NEW processes, a world of its own): resume at the same shape, from the background save,
  reshard (the interleaved checkpoint at dp=2 x pp=2, the 1F1B one at pp=4 vpp=2) and cross
  placements and schedules (zbv -> interleaved, zbv -> 1F1B, interleaved -> zbv); each
  continues the original run;
* C (the shared 2-rank world): the interleaved checkpoint at pp=2 vpp=1, the plain Trainer's
  file at pp=2, and both crashed runs from the checkpoint before the crash.

Then, in this process: ``lightning-pp consolidate`` (plain state_dict and full Lightning
checkpoint) and a plain single-process Trainer resuming from the latter and, through
:class:`~lightning_pp.PipelineCheckpointIO`, from pipeline directories.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from distributed import DistributedFailure  # noqa: E402
from pp_common import MODEL_KW  # noqa: E402
from worlds import World, script_main, world  # noqa: E402

from lightning_pp.checkpoint.consolidate import (  # noqa: E402
    consolidate_checkpoint,
    is_pipeline_checkpoint,
)
from lightning_pp.checkpoint.dcp_format import read_dcp_checkpoint_meta  # noqa: E402
from lightning_pp.checkpoint.dcp_safe import read_dcp_metadata  # noqa: E402
from lightning_pp.checkpoint.errors import CheckpointError  # noqa: E402
from lightning_pp.commands.cli import main as cli_main  # noqa: E402
from lightning_pp.models import GPT  # noqa: E402

pytestmark = pytest.mark.timeout(600)

IL = {"pp": 4, "vpp": 2, "microbatches": 4}  # interleaved
ZBV = {"pp": 4, "microbatches": 8, "schedule": "zbv"}  # vpp unset: zbv's own 2
FB = {"pp": 2, "microbatches": 2}  # 1f1b, dp = 2 at world 4
ASYNC = {"async": True}
CRASH = {"fail_rank": 1, "fail_save": 2}  # rank 1 dies inside its second save's data write
EXACT_TOL = 1e-7
RESHARD_TOL = 1e-6


def _phase(name: str, shape: dict, **kw) -> dict:
    return {"name": name, **shape, **kw}


def _read(out: Path, name: str, world: int) -> list[dict]:
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(world)]


def _check_launch(result: dict, what: str) -> None:
    assert result["codes"] == [0] * len(result["codes"]), f"{what}:\n{result['output']}"


def _group(world: World, out: Path, phases: list[dict]) -> None:
    """The phases in sequence on every rank of ``world`` (one case: ckpt_run's main)."""
    out.mkdir(parents=True, exist_ok=True)
    argv = ["--out", str(out), "--phases", json.dumps(phases)]
    world.run(script_main, "ckpt_run", argv, timeout=400)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ckpt")
    il_ckpt, fb_ckpt, zbv_ckpt = out / "il_ckpt", out / "fb_ckpt", out / "zbv_ckpt"
    async_ckpt = out / "async_ckpt"
    # group A in the shared Trainer world: train, and save at step 5
    _group(
        world("trainer", 4),
        out / "a",
        [
            _phase("il_full", IL, max_steps=10),
            _phase("il_save", IL, max_steps=5, every=5, ckpt_dir=str(il_ckpt)),
            _phase("fb_full", FB, max_steps=10, best_dir=str(out / "fb_best")),
            _phase("fb_save", FB, max_steps=5, every=5, ckpt_dir=str(fb_ckpt)),
            _phase("zbv_full", ZBV, max_steps=10),
            _phase("zbv_save", ZBV, max_steps=5, every=5, ckpt_dir=str(zbv_ckpt)),
            _phase("fb_async", FB, max_steps=10, every=5, ckpt_dir=str(async_ckpt), **ASYNC),
        ],
    )
    il5, fb5 = str(il_ckpt / "step=5.ckpt"), str(fb_ckpt / "step=5.ckpt")
    zbv5, async5 = str(zbv_ckpt / "step=5.ckpt"), str(async_ckpt / "step=5.ckpt")
    # a plain Trainer's own single-file checkpoint, for a pipelined run to resume from
    from ckpt_run import run_phase

    torch.set_num_threads(1)
    plain_dir = out / "plain_ckpt"
    plain_spec = {"name": "plain_save", "pp": 0, "max_steps": 5, "every": 5}
    (out / "p").mkdir()
    run_phase({**plain_spec, "ckpt_dir": str(plain_dir)}, str(out / "p"), 1)
    plain5 = str(plain_dir / "step=5.ckpt")
    # ranks that die inside a save: saves at steps 5 and 10; rank 1 dies inside its second
    # DCP data write (os._exit(17), in the writer thread when asynchronous), so each world is
    # lost: worlds of their own
    crash: dict[str, DistributedFailure | None] = {}
    for name, kw in (("crash", {}), ("crash_async", ASYNC)):
        doomed = World("trainer", 2)
        spec = {"pp": 2, "microbatches": 2}
        ckpt_dir = str(out / f"{name}_ckpt")
        phase = _phase(name, spec, max_steps=10, every=5, ckpt_dir=ckpt_dir, **CRASH, **kw)
        try:
            _group(doomed, out / name, [phase])
            crash[name] = None
        except DistributedFailure as failure:
            crash[name] = failure
        finally:
            doomed.close()
    # group B in new processes (a world of its own): resume, reshard, across placements
    fresh = World("trainer", 4)
    try:
        _group(
            fresh,
            out / "b",
            [
                _phase("il_resume", IL, max_steps=10, resume=il5),
                _phase("fb_resume", FB, max_steps=10, resume=fb5),
                _phase("il_to_dp2pp2", {"pp": 2, "microbatches": 2}, max_steps=10, resume=il5),
                _phase("fb_to_pp4vpp2", IL, max_steps=10, resume=fb5),
                _phase("zbv_to_il", IL, max_steps=10, resume=zbv5),
                _phase("zbv_to_1f1b", {"pp": 4, "microbatches": 4}, max_steps=10, resume=zbv5),
                _phase("il_to_zbv", ZBV, max_steps=10, resume=il5),
                _phase("fb_async_resume", FB, max_steps=10, resume=async5),
            ],
        )
    finally:
        fresh.close()
    pp2 = {"pp": 2, "microbatches": 4}
    _group(
        world("trainer", 2),
        out / "c",
        [
            _phase("il_to_pp2", pp2, max_steps=10, resume=il5),
            _phase("plain_to_pp2", pp2, max_steps=10, resume=plain5),
            *(
                _phase(f"{n}_resume", pp2, max_steps=10, resume=str(out / f"{n}_ckpt/step=5.ckpt"))
                for n in crash
            ),
        ],
    )
    return {
        "out": out,
        "il5": il5,
        "fb5": fb5,
        "zbv5": zbv5,
        "async5": async5,
        "plain5": plain5,
        "crash": crash,
    }


def _losses(out: Path, group: str, name: str, world: int) -> list[float]:
    ranks = _read(out / group, name, world)
    for d in ranks[1:]:  # every rank reports the very same loss
        assert d["train_loss"] == ranks[0]["train_loss"], name
    return ranks[0]["train_loss"]


def _rel(got: list[float], want: list[float]) -> list[float]:
    assert len(got) == len(want), (len(got), len(want))
    return [abs(g - w) / abs(w) for g, w in zip(got, want)]


# ---------------------------------------------------------------------------- exact resume
@pytest.mark.parametrize("cfg", ["il", "fb"], ids=["interleaved", "1f1b_dp2"])
def test_kill_and_resume_is_exact(runs, cfg):
    out = runs["out"]
    full = _losses(out, "a", f"{cfg}_full", 4)
    first = _losses(out, "a", f"{cfg}_save", 4)
    resumed = _losses(out, "b", f"{cfg}_resume", 4)
    assert len(full) == 10 and len(first) == 5 and len(resumed) == 5
    assert first == full[:5]
    errs = _rel(resumed, full[5:])
    assert max(errs) <= EXACT_TOL, errs
    d_full = _read(out / "a", f"{cfg}_full", 4)[0]
    d_res = _read(out / "b", f"{cfg}_resume", 4)[0]
    assert d_res["lr"] == d_full["lr"][5:]  # LR scheduler state restored
    assert d_res["global_step"] == 10


# ---------------------------------------------------------------------------- resharding
@pytest.mark.parametrize(
    "name,group,world,source",
    [
        ("il_to_dp2pp2", "b", 4, "il"),
        ("il_to_pp2", "c", 2, "il"),
        ("fb_to_pp4vpp2", "b", 4, "fb"),
        # across placements: V (zbv) to loop (interleaved) and back
        ("zbv_to_il", "b", 4, "zbv"),
        ("il_to_zbv", "b", 4, "il"),
        ("zbv_to_1f1b", "b", 4, "zbv"),  # and across schedules: zero-bubble to 1F1B
    ],
)
def test_reshard_continues_the_original_run(runs, name, group, world, source):
    out = runs["out"]
    full = _losses(out, "a", f"{source}_full", 4)
    assert _losses(out, "a", f"{source}_save", 4) == full[:5]
    resumed = _losses(out, group, name, world)
    errs = _rel(resumed, full[5:])
    # the first step after loading checks the weights; the others optimizer + scheduler state
    assert max(errs) <= RESHARD_TOL, errs
    assert (
        _read(out / group, name, world)[0]["lr"]
        == _read(out / "a", f"{source}_full", 4)[0]["lr"][5:]
    )


def test_a_pipelined_run_resumes_from_a_plain_trainer_checkpoint(runs):
    """A plain Lightning checkpoint (one file, optimizer state by position) continues at pp=2:
    5 plain steps + 5 pipelined ones equal the 10 steps of the uninterrupted run."""
    out = runs["out"]
    full = _losses(out, "a", "il_full", 4)
    plain = json.loads((out / "p" / "plain_save.rank0.json").read_text())
    assert max(_rel(plain["train_loss"], full[:5])) <= RESHARD_TOL
    assert Path(runs["plain5"]).is_file()  # Lightning's own single file, not a directory
    errs = _rel(_losses(out, "c", "plain_to_pp2", 2), full[5:])
    assert max(errs) <= RESHARD_TOL, errs  # step 6 checks the weights, 7-10 AdamW's moments
    resumed = _read(out / "c", "plain_to_pp2", 2)[0]
    assert resumed["lr"] == _read(out / "a", "il_full", 4)[0]["lr"][5:]
    assert resumed["global_step"] == 10


def test_async_save_changes_nothing_and_resumes_exactly(runs):
    """Saving in the background (``async_checkpoint=True``) while training goes on: the run's
    losses are those of the run without saves, the checkpoint holds the step-5 values (equal
    to the synchronous save's, though steps 6-10 changed the tensors while it was written),
    and resuming from it continues the run."""
    out = runs["out"]
    full = _losses(out, "a", "fb_full", 4)
    assert _losses(out, "a", "fb_async", 4) == full
    ckpt_dir = Path(runs["async5"]).parent
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step=10.ckpt", "step=5.ckpt"]
    ours, sync = consolidate_checkpoint(runs["async5"]), consolidate_checkpoint(runs["fb5"])
    assert ours.keys() == sync.keys()
    assert all(torch.equal(ours[k], sync[k]) for k in ours)
    errs = _rel(_losses(out, "b", "fb_async_resume", 4), full[5:])
    assert max(errs) <= EXACT_TOL, errs


def test_plain_trainer_resumes_from_a_pp2_dp2_directory_with_the_io_plugin(runs, tmp_path):
    from ckpt_run import run_phase

    torch.set_num_threads(1)
    spec = {"name": "plain_io_fb", "pp": 0, "max_steps": 10, "resume": runs["fb5"]}
    result = run_phase({**spec, "pipeline_io": True}, str(tmp_path), 1)
    errs = _rel(result["train_loss"], _losses(runs["out"], "a", "fb_full", 4)[5:])
    assert max(errs) <= RESHARD_TOL, errs
    assert result["global_step"] == 10


def test_plain_trainer_resumes_from_consolidated_lightning_checkpoint(runs, tmp_path):
    from ckpt_run import run_phase

    full_ckpt = tmp_path / "full.ckpt"
    assert cli_main(["consolidate", runs["il5"], str(full_ckpt), "--lightning"]) == 0
    torch.set_num_threads(1)
    result = run_phase(
        {"name": "plain", "pp": 0, "max_steps": 10, "resume": str(full_ckpt)}, str(tmp_path), 1
    )
    full = _losses(runs["out"], "a", "il_full", 4)
    errs = _rel(result["train_loss"], full[5:])
    assert max(errs) <= RESHARD_TOL, errs
    assert result["lr"] == _read(runs["out"] / "a", "il_full", 4)[0]["lr"][5:]


def test_plain_trainer_resumes_from_the_pipeline_directory_with_the_io_plugin(runs, tmp_path):
    """Issue 13 item 11: ``Trainer(plugins=[PipelineCheckpointIO()]).fit(ckpt_path=DIR)`` with
    no PipelineStrategy continues the run (a plain ``torch.load(DIR)`` is an IsADirectoryError)."""
    from ckpt_run import run_phase

    torch.set_num_threads(1)
    spec = {"name": "plain_io", "pp": 0, "max_steps": 10, "resume": runs["il5"]}
    result = run_phase({**spec, "pipeline_io": True}, str(tmp_path), 1)
    full = _losses(runs["out"], "a", "il_full", 4)
    errs = _rel(result["train_loss"], full[5:])
    assert max(errs) <= RESHARD_TOL, errs
    assert result["lr"] == _read(runs["out"] / "a", "il_full", 4)[0]["lr"][5:]
    assert result["global_step"] == 10


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_consolidate_refuses_a_tampered_real_checkpoint(runs, tmp_path, capsys):
    """Issue 13 item 10 on a real pp=4 checkpoint, DCP format: a data file deleted, or two
    swapped, is refused naming the file, and nothing is written."""
    dropped = _copy(runs["il5"], tmp_path / "dropped.ckpt")
    gone = sorted(dropped.glob("*.distcp"))[2]
    gone.unlink()
    assert cli_main(["consolidate", str(dropped), str(tmp_path / "a.pt")]) == 2
    err = capsys.readouterr().err
    assert gone.name in err and "missing" in err, err
    assert not (tmp_path / "a.pt").exists()

    swapped = _copy(runs["il5"], tmp_path / "swapped.ckpt")
    one, other = sorted(swapped.glob("*.distcp"))[1:3]
    one.rename(swapped / "tmp")
    other.rename(one)
    (swapped / "tmp").rename(other)
    assert cli_main(["consolidate", str(swapped), str(tmp_path / "b.pt")]) == 2
    err = capsys.readouterr().err
    assert one.name in err or other.name in err, err
    assert not (tmp_path / "b.pt").exists()


# ---------------------------------------------------------------------------- format
def test_on_disk_layout(runs):
    il, fb = read_dcp_checkpoint_meta(runs["il5"]), read_dcp_checkpoint_meta(runs["fb5"])
    assert il["layout"]["pp"] == 4 and il["layout"]["vpp"] == 2
    assert fb["layout"]["dp"] == 2
    for path, meta in ((runs["il5"], il), (runs["fb5"], fb)):
        files = {p.name for p in Path(path).iterdir()}
        assert {".metadata", "complete.json", "meta.json", "meta.safetensors"} <= files
        assert not {f for f in files if f.endswith((".pt", ".pkl"))}  # nothing torch.save'd
        # the tied head weight stored once, under the embedding's name, with its optimizer
        # state; optimizer state keyed by name, every stored parameter's
        assert "layers.0.wte.weight" in meta["model"]
        assert "layers.7.head.weight" not in meta["model"]
        assert meta["tied"] == [["layers.0.wte.weight", "layers.7.head.weight"]]
        assert set(meta["optimizers"][0]["group_of"]) == set(meta["model"])
        assert "layers.0.wte.weight" in meta["optimizers"][0]["tensors"]
        # dp = 2: DCP's planner wrote each tensor once (no replica's second copy)
        md = read_dcp_metadata(Path(path) / ".metadata")
        written = sum(p.stat().st_size for p in Path(path).glob("*.distcp"))
        assert written == sum(info.length for info in md.storage_data.values())


def test_best_k_rotation_deletes_checkpoint_directories(runs):
    d = _read(runs["out"] / "a", "fb_full", 4)[0]
    vals = [v["val_loss"] for v in d["val"]]
    assert len(vals) == 2 and vals[1] < vals[0]  # step 10 replaced step 5 as the best
    entries = sorted(p.name for p in (runs["out"] / "fb_best").iterdir())
    assert entries == [Path(d["best"]).name] == ["epoch=1-step=10.ckpt"]
    assert is_pipeline_checkpoint(d["best"])


# ---------------------------------------------------------------------------- consolidate
def test_consolidated_state_dict_loads_strictly_into_plain_module(runs, tmp_path, capsys):
    out = tmp_path / "gpt.pt"
    assert cli_main(["consolidate", runs["il5"], str(out)]) == 0
    assert "pp=4 vpp=2 dp=1" in capsys.readouterr().out
    state = torch.load(out, weights_only=True)
    model = GPT(**MODEL_KW)
    model.configure_model()
    model.load_state_dict(state, strict=True)
    assert torch.equal(model.layers[0].wte.weight, model.layers[7].head.weight)
    # a 1F1B pp2 x dp2 checkpoint gives the same kind of file
    state_fb = consolidate_checkpoint(runs["fb5"])
    assert set(state_fb) == set(state)


# ---------------------------------------------------------------------------- atomicity
@pytest.mark.parametrize("name", ["crash", "crash_async"], ids=["sync", "async"])
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_resuming_exactly(runs, name):
    crash = runs["crash"][name]
    assert crash is not None, "the rank meant to die inside its save did not"
    assert "exited with code 17" in crash.failures[1], crash  # the injected os._exit
    assert 0 in crash.failures and 0 not in crash.results, crash  # rank 0 did not finish
    out = runs["out"]
    ckpt_dir = out / f"{name}_ckpt"
    names = sorted(p.name for p in ckpt_dir.iterdir())
    assert "step=5.ckpt" in names and "step=10.ckpt" not in names, names
    partial = [n for n in names if n.startswith(".step=10.ckpt.partial-")]
    assert len(partial) == 1, names
    with pytest.raises(CheckpointError, match="complete.json is missing: the save did not"):
        read_dcp_checkpoint_meta(ckpt_dir / partial[0])
    errs = _rel(_losses(out, "c", f"{name}_resume", 2), _losses(out, "a", "fb_full", 4)[5:])
    assert max(errs) <= RESHARD_TOL, errs


def test_loading_refuses_incomplete_or_foreign_paths(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_dcp_checkpoint_meta(tmp_path / "nope.ckpt")
    f = tmp_path / "file.ckpt"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file"):
        read_dcp_checkpoint_meta(f)
    d = tmp_path / "half.ckpt"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="complete.json is missing"):
        read_dcp_checkpoint_meta(d)
    assert not is_pipeline_checkpoint(d)
    assert cli_main(["consolidate", str(d), str(tmp_path / "o.pt")]) == 2


# ---------------------------------------------------------------------------- zero-bubble
def test_zbv_checkpoint_records_its_shape(runs):
    layout = read_dcp_checkpoint_meta(runs["zbv5"])["layout"]
    assert layout["pp"] == 4 and layout["vpp"] == 2


def test_plain_trainer_resumes_from_consolidated_zbv_checkpoint(runs, tmp_path):
    from ckpt_run import run_phase

    full_ckpt = tmp_path / "full.ckpt"
    assert cli_main(["consolidate", runs["zbv5"], str(full_ckpt), "--lightning"]) == 0
    torch.set_num_threads(1)
    result = run_phase(
        {"name": "plain", "pp": 0, "max_steps": 10, "resume": str(full_ckpt)}, str(tmp_path), 1
    )
    full = _losses(runs["out"], "a", "zbv_full", 4)
    errs = _rel(result["train_loss"], full[5:])
    assert max(errs) <= RESHARD_TOL, errs


_PEAK_OF_A_LOAD = """
import sys, torch
from torch import nn
from lightning_pp.checkpoint.plain_load import load_plain_checkpoint

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

def peak_growth(load):
    open("/proc/self/clear_refs", "w").write("5")  # the peak resident size starts again here
    before = status("VmRSS")
    load()
    return status("VmHWM") - before

path = sys.argv[1]
module = nn.ModuleDict({"a": nn.Linear(1024, 1024, bias=False)})  # 4 MiB of a 32 MiB file
mapped = peak_growth(lambda: load_plain_checkpoint(path, module, canonical={}, strict=False))
whole = peak_growth(lambda: torch.load(path, weights_only=True)["state_dict"]["a.weight"].clone())
print(mapped, whole)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads /proc peaks")
def test_a_rank_pages_in_only_the_tensors_it_takes_from_a_plain_checkpoint(tmp_path):
    """A pipeline rank resuming from a plain Lightning checkpoint maps the file: of a 32 MiB
    file whose 4 MiB it holds, its resident peak grows by far less than the file (each of a
    node's ranks read all of it into its own memory before). Measured by the kernel (the
    process's peak resident size, reset just before each load, in one fresh interpreter); the
    control reads the same file whole with ``torch.load`` and must grow by about the file, so
    the measurement can tell the two apart."""
    import subprocess

    state = {f"{c}.weight": torch.randn(1024, 1024) for c in "abcdefgh"}  # 8 x 4 MiB
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": state, "epoch": 0, "global_step": 3}, path)
    script = tmp_path / "peak.py"
    script.write_text(_PEAK_OF_A_LOAD)
    size = path.stat().st_size
    run = subprocess.run(
        [sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    mapped, whole = (int(v) for v in run.stdout.split()[-2:])
    assert whole > 0.9 * size, (whole, size)  # the control: a whole read shows
    assert mapped < 0.35 * size, (mapped, size, whole)

"""``lightning-pp schedule``: text, JSON and PNG output, and clean failures (exit 2)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_pp.commands.cli import main
from lightning_pp.schedules import build_schedule

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["schedule", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_contract(capsys):
    code, out, err = run(
        capsys,
        "--schedule",
        "interleaved",
        "--pp",
        "4",
        "--vpp",
        "2",
        "--microbatches",
        "8",
        "--format",
        "json",
    )
    assert code == 0 and err == ""
    d = json.loads(out)
    assert (d["schedule"], d["pp"], d["vpp"], d["microbatches"]) == ("interleaved", 4, 2, 8)
    expected = build_schedule("interleaved", pp=4, vpp=2, microbatches=8)
    assert d["ranks"] == [[a.to_dict() for a in r] for r in expected.ranks]
    assert set(d["ranks"][0][0]) == {"op", "mb", "chunk"}
    assert d["bubble_ratio"] == pytest.approx(3 / 16, abs=1e-12)
    assert d["makespan"] == pytest.approx(28.5)
    warmup = [2 * (4 - r - 1) + 4 for r in range(4)]
    assert d["peak_inflight"] == [w + 1 for w in warmup]


def test_json_1f1b_fewer_microbatches_than_ranks(capsys):
    code, out, _ = run(
        capsys, "--schedule", "1f1b", "--pp", "4", "--microbatches", "2", "--format", "json"
    )
    d = json.loads(out)
    assert code == 0
    assert d["peak_inflight"] == [2, 2, 2, 1]
    assert d["bubble_ratio"] == pytest.approx(3 / 2)


def test_text_grid(capsys):
    code, out, _ = run(capsys, "--schedule", "1f1b", "--pp", "4", "--microbatches", "8")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "1f1b: pp=4 vpp=1 microbatches=8"
    assert [ln.split(" |")[0] for ln in lines[1:5]] == [f"rank {r}" for r in range(4)]
    assert "bubble ratio:   0.3750" in out and "peak in-flight: r0=4 r1=3 r2=2 r3=1" in out


def test_png(capsys, tmp_path):
    png = tmp_path / "g.png"
    code, out, _ = run(
        capsys,
        "--schedule",
        "gpipe",
        "--pp",
        "2",
        "--vpp",
        "2",
        "--microbatches",
        "3",
        "--png",
        str(png),
    )
    assert code == 0 and f"wrote {png}" in out
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000


@pytest.mark.parametrize(
    "argv, needles",
    [
        (
            ["--schedule", "interleaved", "--pp", "4", "--vpp", "2", "--microbatches", "6"],
            ["6 % 4 = 2 < pp=4"],
        ),
        (
            [
                "--schedule",
                "interleaved",
                "--pp",
                "4",
                "--vpp",
                "2",
                "--microbatches",
                "8",
                "--group-size",
                "9",
            ],
            ["N=9", "pp=4", "microbatches=8"],
        ),
        (
            ["--schedule", "interleaved", "--pp", "4", "--vpp", "1", "--microbatches", "8"],
            ["vpp=1"],
        ),
        (["--schedule", "1f1b", "--pp", "4", "--vpp", "2", "--microbatches", "8"], ["vpp=2"]),
        (["--schedule", "gpipe", "--pp", "0", "--microbatches", "8"], ["pp", "got 0"]),
        # the plan's rules, as for a run
        (
            ["--schedule", "gpipe", "--pp", "2", "--microbatches", "0"],
            ["microbatches must be a positive integer, got 0"],
        ),
        (
            ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--group-size", "2"],
            ["group_size applies only to the interleaved schedule"],
        ),
    ],
)
def test_invalid_combos_exit_2_without_traceback(capsys, argv, needles):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("lightning-pp schedule: error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err


def test_unknown_schedule_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["schedule", "--schedule", "zb", "--pp", "2", "--microbatches", "2"])
    assert exc.value.code == 2
    assert "invalid choice: 'zb'" in capsys.readouterr().err


def _console_script() -> str:
    found = shutil.which("lightning-pp") or str(Path(sys.executable).with_name("lightning-pp"))
    assert Path(found).exists(), (
        "the lightning-pp console script is not installed (pip install -e .)"
    )
    return found


def test_installed_console_script():
    exe = _console_script()
    ok = subprocess.run(
        [
            exe,
            "schedule",
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "3",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["peak_inflight"] == [2, 1]
    bad = subprocess.run(
        [
            exe,
            "schedule",
            "--schedule",
            "interleaved",
            "--pp",
            "3",
            "--vpp",
            "2",
            "--microbatches",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert "microbatches=2 < pp=3" in bad.stderr and "Traceback" not in bad.stderr

"""``scripts/gpu_checks.py``: the one prepared GPU check, kept from rotting between GPU runs.

The smoke (``--smoke``: tiny models, a few steps, on this CPU) runs every registered part through the
bench scripts' command lines, as the GPU run does, so a change that breaks a script's command line or the
engine API a script uses fails here. The budget, the cut-short part that keeps what it wrote, the bundle
for the device tool's OUT folder and a rerun of one part are checked with stand-in parts in seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import gpu_checks  # noqa: E402


def log_tail(folder: Path) -> str:
    log = folder / "log.txt"
    return log.read_text()[-3000:] if log.is_file() else "(no log)"


def test_the_smoke_reaches_every_part_and_each_built_part_writes_its_files(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_checks.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = (tmp_path / "summary.md").read_text()
    outcomes = {o["part"]: o for o in json.loads((tmp_path / "summary.json").read_text())["parts"]}
    assert "- device: " in summary and "- commit: " in summary and "diffusers " in summary
    for part in gpu_checks.PARTS:
        assert f"| {part.name} | " in summary, part.name
        outcome = outcomes[part.name]
        if part.missing():
            assert outcome["status"] == "not built yet", outcome
            continue
        folder = tmp_path / part.name
        assert outcome["status"] == "done", (outcome, log_tail(folder))
        for pattern in part.writes:
            assert list(folder.glob(pattern)), (part.name, pattern, log_tail(folder))
        assert outcome["figures"] and "unreadable" not in outcome["figures"], outcome
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def stand_in(tmp_path: Path, name: str, body: str, needs: tuple = ()) -> gpu_checks.Part:
    """A part whose script writes ``<name>.json`` into its folder, then runs ``body``."""
    script = tmp_path / f"{name}.py"
    script.write_text(
        "import json, sys, time\nfrom pathlib import Path\n"
        f"Path(sys.argv[1], '{name}.json').write_text(json.dumps({{'x': 1}}))\n{body}\n"
    )
    return gpu_checks.Part(
        name,
        f"stand-in {name}",
        1,
        lambda run: [str(script), str(run.folder(name))],
        (f"{name}.json",),
        lambda folder, run: f"x={json.loads((folder / f'{name}.json').read_text())['x']}",
        needs,
    )


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    parts = [
        stand_in(tmp_path, "fast", "pass"),
        stand_in(tmp_path, "slow", "time.sleep(60)"),
        stand_in(tmp_path, "later", "pass"),
        stand_in(tmp_path, "future", "pass", needs=(("scripts/no_such_bench.py", None),)),
    ]
    monkeypatch.setattr(gpu_checks, "PARTS", parts)
    monkeypatch.setattr(gpu_checks.tempfile, "tempdir", str(tmp_path))  # the bundle's scratch folder
    monkeypatch.setattr(gpu_checks, "MIN_START_S", 0.5)
    monkeypatch.setattr(gpu_checks, "machine", lambda python, commit: {"device": "CPU", "commit": "abc"})
    return parts


def test_a_part_cut_at_the_budget_keeps_what_it_wrote_and_out_gets_a_bundle(tmp_path, monkeypatch, stand_ins):
    bundle = tmp_path / "OUT"
    bundle.mkdir()
    monkeypatch.setenv("OUT", str(bundle))
    assert gpu_checks.main(["--smoke", "--budget-s", "3"]) == 1
    assert sorted(p.name for p in bundle.iterdir()) == ["gpu_checks.tar.gz", "summary.md"]  # 8 files at most
    summary = (bundle / "summary.md").read_text()
    assert "| fast | done | " in summary and "x=1" in summary
    assert "| slow | cut short (stopped at the budget" in summary
    assert "| later | not reached (" in summary
    assert "| future | not built yet (needs scripts/no_such_bench.py) |" in summary
    with tarfile.open(bundle / "gpu_checks.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"summary.md", "fast/fast.json", "slow/slow.json", "slow/log.txt"} <= names


def test_a_rerun_of_one_part_keeps_the_others_outcomes(tmp_path, monkeypatch, stand_ins):
    out = tmp_path / "figures"
    monkeypatch.delenv("OUT", raising=False)
    gpu_checks.main(["--smoke", "--budget-s", "3", "--out", str(out)])
    assert gpu_checks.main(["--smoke", "--parts", "later", "--out", str(out)]) == 1  # slow: still cut short
    summary = (out / "summary.md").read_text()
    assert "| fast | done (an earlier run) | " in summary and "| later | done | " in summary
    assert (out / "fast" / "fast.json").is_file() and (out / "later" / "later.json").is_file()

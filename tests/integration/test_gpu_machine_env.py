"""``scripts/gpu_checks.py`` on a machine that has a torch and only the wheels the device recipe carries.

The device machine keeps its own CUDA torch and gets everything else as wheels installed with pip's
``--no-deps`` (``gpu_checks.py --wheels``, from ``scripts/gpu_wheels.txt``). A smoke in the full dev venv,
which has every package, would show a wheel the recipe forgets only on the GPU; so the one smoke run of the
suite is here, in a venv built as that machine has it:

  torch     the dev venv's own, not downloaded again: a new venv (``--without-pip``) with a .pth file
            naming a folder of symbolic links to the files of torch and of what torch itself requires
            (its Requires-Dist, followed; no extras), and pip (the device machine has one)
  wheels    the list's wheels, at its versions, downloaded by pip (``--no-deps --only-binary=:all:``, the
            recipe's flags, for this machine's Python instead of the device's 3.12) and installed by
            ``gpu_checks.py --wheels`` itself with the recipe's flags (``--no-index --no-deps --target``)

Then ``gpu_checks.py --wheels <folder> --smoke`` in that venv must pass every part; with one wheel
needed at import left out (requests, which diffusers imports at its own import) its import probe must
stop it at once, naming the package and how to carry it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = REPO_ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))

from gpu import environment, parts  # noqa: E402

# What the device machine has besides torch's own requirements: pip, and numpy (2.x on the H100 image:
# a carried numpy 1.x shadowed it and broke its scipy, found on the first device call).
BASE = ["torch", "pip", "numpy"]


def key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements_closure(names: list[str]) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions ``names`` name and everything they require (no extras), followed."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if key(name) in found:
            continue
        dist = importlib.metadata.distribution(name)
        found[key(name)] = dist
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def link_distributions(dists, target: Path) -> None:
    """Each distribution's top-level files and folders (by its RECORD) linked into ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    for dist in dists.values():
        tops = {
            Path(str(f)).parts[0]
            for f in dist.files or []
            if not str(f).startswith("..") and Path(str(f)).parts[0] != "__pycache__"
        }
        for top in sorted(tops):
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (target / top).exists():
                (target / top).symlink_to(source)


def clean_environment() -> dict[str, str]:
    """This process's environment less what would let the dev venv in."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "OUT")}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix)
    )
    return env


@pytest.fixture(scope="module")
def machine(tmp_path_factory) -> Path:
    """A venv with torch (and its requirements, and pip) from this one, and nothing else: its python."""
    root = tmp_path_factory.mktemp("gpu_machine")
    venv = root / "venv"
    base = sys._base_executable  # the interpreter this venv was made from
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    dists = requirements_closure(BASE)
    link_distributions(dists, root / "torch_only")
    (site / "machine_torch.pth").write_text(str(root / "torch_only") + "\n")
    # The machine holds torch and its requirements only: nothing the wheel list names besides.
    assert not {key(n) for n in environment.wheel_pins()} & {"torch", "torchvision"}
    found = subprocess.run(
        [str(python), "-c", "import torch, pip; import importlib.util as u; print(u.find_spec('diffusers'))"],
        capture_output=True,
        text=True,
        env=clean_environment(),
    )
    assert found.returncode == 0 and found.stdout.strip() == "None", found.stderr[-2000:]
    return python


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    """The list's wheels for this machine's Python, downloaded with the recipe's pip flags."""
    folder = tmp_path_factory.mktemp("wheels")
    command = environment.download_command(folder, for_device=False)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stderr[-3000:]}"
    names = {environment.normalise(w.name.split("-")[0]) for w in folder.glob("*.whl")}
    assert names == set(environment.wheel_pins()), names ^ set(environment.wheel_pins())
    return folder


def checks(python: Path, wheels: Path, out: Path) -> subprocess.CompletedProcess:
    command = [
        str(python),
        str(SCRIPTS / "gpu_checks.py"),
        "--wheels",
        str(wheels),
        "--smoke",
        "--out",
        str(out),
    ]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=900, env=clean_environment(), cwd=REPO_ROOT
    )


def log_tail(folder: Path) -> str:
    log = folder / "log.txt"
    return log.read_text()[-3000:] if log.is_file() else "(no log)"


def test_the_smoke_passes_on_a_machine_with_torch_and_the_carried_wheels_only(machine, wheels, tmp_path):
    """The one smoke run of every part (tiny models, on this CPU), as the device runs it: each part's
    command line and the engine API it uses, each built part's files (complete, with provenance) and
    figures, and the carried wheels alone."""
    result = checks(machine, wheels, tmp_path)
    output = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, output
    state = json.loads((tmp_path / "summary.json").read_text())
    statuses = {o["part"]: o["status"] for o in state["parts"]}
    built = [p.name for p in parts.PARTS if not p.missing()]
    assert all(statuses[name] == "done" for name in built), statuses
    summary = (tmp_path / "summary.md").read_text()
    assert "- device: " in summary and "- commit: " in summary and "diffusers " in summary
    outcomes = {o["part"]: o for o in state["parts"]}
    for part in parts.PARTS:
        assert f"| {part.name} | " in summary, part.name
        if part.missing():
            assert outcomes[part.name]["status"] == "not built yet", outcomes[part.name]
            continue
        folder = tmp_path / part.name
        for pattern in part.writes:
            assert list(folder.glob(pattern)), (part.name, pattern, log_tail(folder))
            for path in folder.glob(pattern):  # rewritten as it measured; now complete, with provenance
                artefact = json.loads(path.read_text())
                assert artefact.get("complete") is True, (part.name, path.name)
                assert {"command", "commit", "date", "machine", "versions"} <= set(artefact["provenance"])
        figures = outcomes[part.name]["figures"]
        assert figures and "unreadable" not in figures, outcomes[part.name]
    # the parts ran on the carried wheels, not on anything of the dev venv's
    versions = state["provenance"]["versions"]
    assert versions["diffusers"] == environment.wheel_pins()["diffusers"], versions
    assert "wheels installed into" in result.stdout


def test_a_wheel_needed_at_import_left_out_stops_it_at_once_with_what_to_carry(machine, wheels, tmp_path):
    fewer = tmp_path / "wheels"
    fewer.mkdir()
    for wheel in wheels.glob("*.whl"):
        if not wheel.name.startswith("requests-"):
            (fewer / wheel.name).symlink_to(wheel)
    result = checks(machine, fewer, tmp_path / "out")
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert "not in the folder: requests==" in result.stdout
    assert "missing on this machine: requests" in result.stderr
    assert "scripts/gpu_wheels.txt" in result.stderr and "--download-wheels" in result.stderr
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "- not started: missing on this machine: requests" in summary
    assert "| cuda_graphs | not started (the import probe failed" in summary
    assert not (tmp_path / "out" / "cuda_graphs").exists()


def test_the_recipe_downloads_every_listed_wheel_for_the_device(tmp_path):
    """The device's Python 3.12 on manylinux x86_64: each pin has such a wheel, and they fit the carry."""
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_checks.py"), "--download-wheels", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    wheels = list(tmp_path.glob("*.whl"))
    assert {environment.normalise(w.name.split("-")[0]) for w in wheels} == set(environment.wheel_pins())
    assert not environment.wheel_differences(wheels)
    assert all("cp311" not in w.name for w in wheels)
    assert sum(w.stat().st_size for w in wheels) < 58 * 2**20  # the device tool carries 64 MiB in all
    shutil.rmtree(tmp_path)

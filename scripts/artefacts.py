"""Benchmark artefacts: where every figure of the docs comes from.

An artefact is a JSON object with a ``provenance`` (the command that wrote it, the commit, the date, the
machine and the library versions) beside its rows. :func:`write` saves one atomically (a temporary file,
then ``os.replace``), so a benchmark that writes after each measurement keeps what it measured when it is
cut; ``scripts/figures.py`` renders the docs' figure blocks from these files and nothing else.

Nothing here imports torch at module level: the unit tests load it in milliseconds.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("torch", "diffusers", "transformers", "tritonclient", "nvidia-pytriton")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu() -> str | None:
    """The first CUDA device's name, only where torch is already imported (a CPU script never pays for
    importing it here)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    except Exception:  # a broken driver still gets an artefact, without the GPU's name
        return None
    return None


def _state() -> tuple[str, list[str]]:
    """The commit and the tracked files outside docs/ that differ from it."""
    if os.environ.get("ARTEFACTS_COMMIT"):  # a copy without git (the device machine): the caller says
        return os.environ["ARTEFACTS_COMMIT"], []
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            # docs/ left out: the artefacts themselves live there (a run of several benchmarks writes one
            # before the next starts), and no page changes what is measured.
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown", []
    return head, [line[3:] for line in dirty.splitlines() if line.strip()]


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def machine() -> dict[str, Any]:
    memory = None
    try:
        import psutil

        memory = round(psutil.virtual_memory().total / 2**30)
    except ImportError:
        pass
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": memory, "gpu": _gpu()}


def provenance(command: list[str] | None = None) -> dict[str, Any]:
    """What made an artefact: the command line (``sys.argv`` by default, the script's path relative to
    the repository), the commit (``+dirty`` when tracked files outside docs/ differ from it, and then
    ``dirty``: those files), the UTC date, the machine and the library versions."""
    argv = list(sys.argv if command is None else command)
    if argv:
        script = Path(argv[0])
        try:
            argv[0] = str(script.resolve().relative_to(REPO_ROOT))
        except ValueError:
            pass
    head, dirty = _state()
    return {
        "command": shlex.join(argv),
        "commit": f"{head}+dirty" if dirty else head,
        # What differed from the commit (a reader judges whether any of it is what was measured).
        **({"dirty": dirty} if dirty else {}),
        "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        "machine": machine(),
        "versions": _versions(),
    }


def write(path: Path | str, artefact: dict[str, Any]) -> Path:
    """Save ``artefact`` as JSON at ``path`` atomically; a ``provenance`` is added when it has none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = dict(artefact)
    body.setdefault("provenance", provenance())
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
        json.dump(body, handle, indent=1, sort_keys=False, default=str)
        handle.write("\n")
        temporary = handle.name
    os.chmod(temporary, 0o644)  # NamedTemporaryFile makes it 0600
    os.replace(temporary, path)
    return path


def read(path: Path | str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())

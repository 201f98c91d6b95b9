"""The device machine's Python: the wheels it is carried, the import probe, the parts' environment and the
machine's description.

That machine keeps its own CUDA torch; everything else the parts import travels as wheels (the list:
scripts/gpu_wheels.txt), downloaded here for its Python 3.12 (``download_wheels``) and installed there with
pip's ``--no-deps`` into a scratch folder put first on the parts' PYTHONPATH (``install_wheels``). Before
any part, ``probe_imports`` imports what the planned parts import, in the interpreter they run with, and
says what is missing and how to carry it.
"""

from __future__ import annotations

import atexit
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = REPO_ROOT / "scripts"
WHEEL_LIST = SCRIPTS / "gpu_wheels.txt"


# ---- the wheels the device machine lacks -------------------------------------------------------------
# pip's flags, one place: the download here (for the device's Python and platform) and the install there.
DEVICE_PLATFORM = [
    "--python-version", "3.12", "--implementation", "cp",
    *[
        arg
        for tag in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014",
                    "manylinux_2_12", "manylinux2010", "manylinux_2_5", "manylinux1")
        for arg in ("--platform", f"{tag}_x86_64")
    ],
]  # fmt: skip
DOWNLOAD_FLAGS = ["--no-deps", "--only-binary=:all:"]
INSTALL_FLAGS = ["-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade"]


def wheel_pins(path: Path = WHEEL_LIST) -> dict[str, str]:
    """NAME -> VERSION from the wheel list (names normalised as wheel file names spell them)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[normalise(name)] = version.strip()
    return pins


def normalise(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(".", "_")


def download_command(folder: Path, for_device: bool = True, python: str = sys.executable) -> list[str]:
    """pip download of every listed wheel into ``folder``: for the device (Python 3.12, manylinux x86_64)
    or for ``python`` itself (the test's venv)."""
    platform_flags = DEVICE_PLATFORM if for_device else []
    return [python, "-m", "pip", "download", "-q", *DOWNLOAD_FLAGS, *platform_flags, "-d", str(folder),
            "-r", str(WHEEL_LIST)]  # fmt: skip


def install_command(wheels: list[Path], target: Path, python: str = sys.executable) -> list[str]:
    return [python, "-m", "pip", "install", *INSTALL_FLAGS, "--target", str(target), *map(str, wheels)]


def download_wheels(folder: Path) -> int:
    """Here: the listed wheels for the device into ``folder`` (its other wheels removed first: two
    versions of one stop the install there)."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.whl"):
        old.unlink()
    done = subprocess.run(download_command(folder))
    if done.returncode:
        return done.returncode
    wheels = sorted(folder.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"[gpu_checks] {len(wheels)} wheels, {size:.0f} MiB in {folder} (the device tool carries 64 MiB "
          f"with the working tree): name {folder.name} in the run's carry")  # fmt: skip
    return 0


def wheel_differences(wheels: list[Path]) -> list[str]:
    """How a folder of wheels differs from the list (missing, other versions, unlisted)."""
    found = {}
    for wheel in wheels:
        name, version = wheel.name.split("-")[:2]
        found[normalise(name)] = version
    pins = wheel_pins()
    notes = [f"not in the folder: {n}=={v}" for n, v in pins.items() if n not in found]
    notes += [
        f"{n}: {found[n]} in the folder, {v} in the list" for n, v in pins.items() if found.get(n, v) != v
    ]
    notes += [f"not in the list: {n}=={v}" for n, v in found.items() if n not in pins]
    return notes


def install_wheels(folder: Path, python: str) -> Path:
    """There: the folder's wheels into a scratch site folder, put first on this process's and the parts'
    PYTHONPATH (the machine's own torch stays)."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(
            f"[gpu_checks] no wheels in {folder}: run --download-wheels {folder} where pip works"
        )
    for note in wheel_differences(wheels):
        print(f"[gpu_checks] wheels: {note} ({WHEEL_LIST.relative_to(REPO_ROOT)})", flush=True)
    target = Path(tempfile.mkdtemp(prefix="gpu_checks_site_"))
    atexit.register(shutil.rmtree, target, True)
    started = time.monotonic()
    done = subprocess.run(install_command(wheels, target, python), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"[gpu_checks] installing the wheels failed:\n{done.stderr[-2000:]}")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(target))
    print(f"[gpu_checks] {len(wheels)} wheels installed into {target} in {time.monotonic() - started:.0f} s",
          flush=True)  # fmt: skip
    return target


# ---- the import probe --------------------------------------------------------------------------------
# Every script the planned parts run is imported (they guard their work with __name__ == "__main__"), and
# the diffusers objects the parts reach through its lazy imports: the pipelines and the schedulers (which
# import scipy where it is installed).
PROBE = r"""
import importlib, json, re, sys, traceback
from pathlib import Path
def missing(exc):  # a module not found, or a distribution (importlib.metadata's, in version checks)
    text = str(exc.name or exc)
    named = re.search(r"'([^']+)' distribution", text)
    return re.split(r"[<>=!~ ;\[.]", named.group(1) if named else text)[0]
for script in sys.argv[1:]:
    sys.path.insert(0, str(Path(script).parent))
found = {"missing": {}, "errors": {}}
names = [*(Path(script).stem for script in sys.argv[1:]),
         "diffusers:StableDiffusionPipeline", "diffusers:FluxPipeline", "diffusers:FluxTransformer2DModel",
         "diffusers:EulerDiscreteScheduler", "diffusers:FlowMatchEulerDiscreteScheduler",
         "diffusers:DPMSolverMultistepScheduler", "transformers:CLIPTextModel",
         "transformers:T5EncoderModel", "peft:LoraConfig"]
for name in names:
    module, _, attribute = name.partition(":")
    try:
        value = importlib.import_module(module)
        if attribute:
            getattr(value, attribute)
    except ModuleNotFoundError as exc:
        found["missing"].setdefault(missing(exc), []).append(name)
    except Exception as exc:
        cause = exc
        while cause.__cause__ is not None or cause.__context__ is not None:
            inner = cause.__cause__ or cause.__context__
            if isinstance(inner, ModuleNotFoundError):
                found["missing"].setdefault(missing(inner), []).append(name)
                break
            cause = inner
        else:
            found["errors"][name] = traceback.format_exc(limit=3)[-600:]
print(json.dumps(found))
"""
# module -> distribution, where the names differ
DISTRIBUTIONS = {
    "PIL": "pillow",
    "yaml": "pyyaml",
    "charset_normalizer": "charset-normalizer",
    "huggingface_hub": "huggingface-hub",
    "importlib_metadata": "importlib-metadata",
}


def probe_imports(python: str, scripts: list[str], smoke: bool) -> str | None:
    """None when everything the parts import imports; else what is missing and how to carry it."""
    paths = [str(SCRIPTS / script) for script in dict.fromkeys(scripts)]
    try:
        done = subprocess.run(
            [python, "-c", PROBE, *paths],
            capture_output=True, text=True, timeout=600, cwd=REPO_ROOT, env=child_environment(smoke),
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the import probe did not run: {exc}"
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return f"the import probe failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}"
    found = json.loads(lines[-1])
    if not found["missing"] and not found["errors"]:
        return None
    text = []
    if found["missing"]:
        names = [DISTRIBUTIONS.get(module, module) for module in found["missing"]]
        text.append(
            "missing on this machine: "
            + "; ".join(f"{module} (for {', '.join(needed)})" for module, needed in found["missing"].items())
            + f". Carry their wheels: add {', '.join(n + '==VERSION' for n in names)} to "
            "scripts/gpu_wheels.txt, run `.venv/bin/python scripts/gpu_checks.py --download-wheels .whl` "
            "where pip works, name .whl in the device call's carry, and run `python3 scripts/gpu_checks.py "
            "--wheels .whl` (or, where pip can reach an index: pip install " + " ".join(names) + ")"
        )
    for name, error in found["errors"].items():
        text.append(f"importing {name} failed: {error.strip()}")
        if "numpy" in error and "numpy" in wheel_pins():
            text.append(
                f"(the carried numpy=={wheel_pins()['numpy']} comes first on the path: a package of this "
                "machine's own built against its numpy may refuse it; try without the numpy line of "
                "scripts/gpu_wheels.txt)"
            )
    return "\n".join(text)


# ---- the parts' environment and the machine ----------------------------------------------------------
# What made the artefacts: scripts/artefacts.py's provenance (command, commit, date, machine, versions),
# taken in the interpreter the parts run with, torch imported first (so the GPU is named), with what the
# summary's head adds: CUDA's version, peft and the hub.
PROVENANCE = """
import json, sys
from importlib.metadata import version
sys.path.insert(0, sys.argv[1])
info = {}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda)
    info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
except Exception as exc:  # noqa: BLE001
    info["torch"] = f"not importable ({type(exc).__name__}: {exc})"
import artefacts
info["provenance"] = artefacts.provenance(json.loads(sys.argv[2]))
for name in ("diffusers", "transformers", "peft", "huggingface_hub", "numpy"):
    try:
        info[name] = version(name)
    except Exception as exc:  # noqa: BLE001
        info[name] = f"missing ({type(exc).__name__})"
print(json.dumps(info))
"""


def child_environment(smoke: bool) -> dict[str, str]:
    """The package (and its client) from this checkout, no install needed; output unbuffered; no hub. The
    smoke's parts take one thread each: on a CPU shared with other work, torch's spinning threads made
    them several times slower (35 s of CPU became 215 s)."""
    env = dict(os.environ)
    if smoke:
        env.setdefault("OMP_NUM_THREADS", "1")
    paths = [str(path) for path in (REPO_ROOT / "src", REPO_ROOT / "client" / "src") if path.is_dir()]
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def command_output(args: list[str], timeout: float = 60, env: dict[str, str] | None = None) -> str | None:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine(python: str, commit: str | None, command: list[str] | None = None) -> dict:
    """Device, driver, versions, commit (git's, else ``commit``) and the provenance every artefact of this
    script records, for the summary's head."""
    info: dict = {}
    command = command or ["scripts/gpu_checks.py", *sys.argv[1:]]
    found = command_output(
        [python, "-c", PROVENANCE, str(SCRIPTS), json.dumps(command)], 180, child_environment(False)
    )
    if found is None:
        info["torch"] = "not importable"
    else:
        info.update(json.loads(found.splitlines()[-1]))
    smi = command_output(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    )
    info["driver"] = smi.splitlines()[0] if smi else "no nvidia-smi"
    head = command_output(["git", "rev-parse", "HEAD"])
    if head:
        dirty = command_output(["git", "status", "--porcelain", "--untracked-files=no"])
        info["commit"] = head + (" (with uncommitted changes)" if dirty else "")
    elif commit:
        info["commit"] = f"{commit} (as given: no git here)"
    provenance = info.get("provenance")
    if isinstance(provenance, dict) and info.get("commit"):
        provenance["commit"] = info["commit"]
    host = provenance.get("machine", {}) if isinstance(provenance, dict) else {}
    info["host"] = f"{host.get('cpu') or platform.machine()}, {host.get('cores') or os.cpu_count()} CPUs"
    return info

"""Every pending GPU figure from one script, within a wall-clock budget: run this first whenever a GPU is
lent, in one call, and commit what it writes.

Each part is one of the bench scripts, run as a subprocess through its command line (so a change in the
engine's Python API breaks a script's run, which the summary names, not this one), with a timeout of what
is left of the budget. The parts run in the registry's order, the cheapest and most important first; each
writes its files under ``<out>/<part>/`` as soon as it finishes, and ``<out>/summary.md`` (device, driver,
versions and commit on top, one line per part: done / cut short / failed, its key figures, its files) is
rewritten after every part, so a run cut short keeps what it measured.

Weights are random: full-size architectures built from the diffusers configs in the package
(``triton_diffusion.tiny_models.ARCHITECTURES``: ``sd15``), and the tiny families for the invariance
table; nothing comes from a hub.

    python3 scripts/gpu_checks.py                    # a GPU: every part, 480 s, into docs/gpu/ (or $OUT)
    python3 scripts/gpu_checks.py --parts lora       # one part again
    .venv/bin/python scripts/gpu_checks.py --smoke --out /tmp/gpu_smoke   # CPU: tiny models, seconds

Where the environment variable OUT is set (the device tool's folder, from which only 8 files come back)
and ``--out`` is not given, the parts write into a scratch folder and OUT receives ``summary.md`` and
``gpu_checks.tar.gz`` (every part's files and logs, refreshed after each part): unpack it with
``tar -xzf gpu_checks.tar.gz -C docs/gpu``.

Adding a part is one ``Part(...)`` entry in PARTS: its name, what it measures, its expected seconds on an
H100, its command (GPU and smoke), the files it writes and how to read its key figures (gpu_figures.py). A
part whose script or flag does not exist yet (``needs``) is listed as "not built yet" and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from gpu_figures import (
    cuda_graphs_figures,
    engines_figures,
    family_figures,
    lora_figures,
    no_figures,
    request_saturation,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = REPO_ROOT / "scripts"
DEFAULT_BUDGET_S = 480.0
MIN_START_S = 10.0  # a part is not started with less of the budget left
SD15 = "--arch sd15 --height 512 --width 512 --steps 20 --dtype bfloat16"
# FLUX.1's transformer at full size (19 + 38 blocks, 3072 wide; random weights, built on the GPU) over the
# tiny pipeline's text encoders and VAE: bench_caches.py --flux1-size.
FLUX1_1024 = "--arch tiny-flux --flux1-size --height 1024 --width 1024 --dtype bfloat16"


@dataclass
class Run:
    """One run of the checks: where parts write, smoke or GPU, and what earlier parts left."""

    out: Path  # where the parts' folders are
    smoke: bool
    python: str = sys.executable
    outcomes: dict[str, Outcome] = field(default_factory=dict)

    def folder(self, part: str) -> Path:
        return self.out / part


@dataclass(frozen=True)
class Part:
    """One registered check. ``command`` gives the script and its arguments (after the interpreter);
    ``writes`` are glob patterns under the part's folder that a finished part must have written;
    ``figures`` reads the key figures back from its folder for the summary; ``needs`` lists
    (file, text) pairs that must exist for the part to be built at all."""

    name: str
    measures: str
    expected_s: float  # on one H100, the GPU arguments
    command: Callable[[Run], list[str]]
    writes: tuple[str, ...]
    figures: Callable[[Path, Run], str]
    needs: tuple[tuple[str, str | None], ...] = ()

    def missing(self) -> str | None:
        """What is not built yet, or None."""
        for path, text in self.needs:
            file = REPO_ROOT / path
            if not file.is_file():
                return f"needs {path}"
            if text is not None and text not in file.read_text():
                return f"needs {text} in {path}"
        return None


@dataclass
class Outcome:
    part: str
    status: str  # done, cut short, failed, not built yet, not reached, not selected
    detail: str = ""
    seconds: float | None = None
    figures: str = ""
    files: list[str] = field(default_factory=list)


# ---- the parts' commands: (script, arguments), the GPU's or the smoke's ------------------------------
def cuda_graphs_command(run: Run) -> list[str]:
    sizes = "--steps 2 --repeats 1" if run.smoke else f"{SD15} --repeats 5"
    return ["bench_graphs.py", *sizes.split(), "--out", str(run.folder("cuda_graphs"))]


def engines_command(run: Run, graphs: bool) -> list[str]:
    name = "engines_graphs" if graphs else "engines_eager"
    if run.smoke and graphs:  # on a CPU both runs are eager: the second alone runs every kind of traffic
        sizes = "--steps 2 --cap 2 --concurrency 2 --requests 2 --no-mixed --profile-forwards 1 --loads="
    elif run.smoke:
        sizes = "--steps 2 --cap 2 --concurrency 1,2 --requests 4 --poisson-requests 10 --profile-forwards 2"
    else:
        sizes = f"{SD15} --concurrency 1,16 --requests 16 --poisson-requests 40 --profile-forwards 20"
    args = ["bench_engines.py", *sizes.split(), "--no-image-mix"]
    if not (run.smoke and graphs):
        args += ["--loads", "0.8"]
    if graphs:
        args += ["--cuda-graphs", "--no-raw"]  # the raw pipeline does not use the graphs: once is enough
    else:
        saturated = request_saturation(run.folder("engines_graphs"))
        if saturated is not None:  # the same Poisson arrivals as the captured run's
            args += ["--saturated", f"{saturated:.4f}"]
    return [*args, "--out", str(run.folder(name))]


def lora_command(run: Run) -> list[str]:
    sizes = "--steps 2 --rows 4" if run.smoke else f"{SD15} --rank 16 --rows 8"
    repeats = "1" if run.smoke else "2"
    args = [*sizes.split(), "--distinct", "4", "--repeats", repeats, "--exactness"]
    return ["bench_lora.py", *args, "--out", str(run.folder("lora"))]


def family_command(run: Run) -> list[str]:
    # The smoke: an inpainting checkpoint and a video family in fp32; the GPU: every family, both dtypes.
    args = "--families tiny-sd-inpaint,tiny-wan" if run.smoke else "--dtype bfloat16 --dtype float16"
    out = run.folder("family_invariance") / "family.json"
    return ["family_invariance.py", *args.split(), "--out", str(out)]


def step_caches_command(run: Run) -> list[str]:
    if run.smoke:
        sizes = "--arch tiny-flux --height 64 --width 64 --steps 3 --requests 4 --cap 2 --concurrency 2"
    else:
        sizes = f"{FLUX1_1024} --steps 20 --requests 12 --cap 4 --concurrency 4"
    return ["bench_caches.py", *sizes.split(), "--out", str(run.folder("step_caches"))]


def slo_command(run: Run) -> list[str]:
    if run.smoke:
        sizes = "--requests 8 --loads 0.9 --cap 2 --interactive-steps 2 --background-steps 3-4"
    else:
        sizes = "--arch sd15 --height 512 --width 512 --requests 120 --background-steps 16-30"
    return ["bench_slo.py", *sizes.split(), "--out", str(run.folder("slo"))]


# The registry, in running order: the cheapest and most important first.
PARTS: list[Part] = [
    Part(
        "cuda_graphs",
        "captured vs eager forwards at 1/4/8 images, FLOPs against the bf16 peak, one request captured vs "
        "diffusers' pipeline(...) (target >= 2x), exactness (SD 1.5 512x512 bf16; builds the weights)",
        75,
        cuda_graphs_command,
        ("bench_graphs.json", "bench_graphs.md"),
        cuda_graphs_figures,
    ),
    Part(
        "engines_graphs",
        "the in-process engines table on the true clock with captured forwards (SD 1.5 512x512 bf16: "
        "closed loop c=1 and 16, mixed, Poisson 80%, stage costs, profile)",
        90,
        lambda run: engines_command(run, graphs=True),
        ("bench_engines.json", "bench_engines.md"),
        engines_figures,
    ),
    Part(
        "engines_eager",
        "the same table with eager forwards (the same Poisson rate), and the raw pipeline's ceiling",
        95,
        lambda run: engines_command(run, graphs=False),
        ("bench_engines.json", "bench_engines.md"),
        engines_figures,
    ),
    Part(
        "lora",
        "mixed LoRA at rank 16: mixed-4 against no adapters and one batch per adapter, and its bf16 bound "
        "against diffusers' own set_adapters (SD 1.5 512x512 bf16)",
        75,
        lora_command,
        ("lora_*.json", "lora_*.md"),
        lora_figures,
    ),
    Part(
        "family_invariance",
        "batch invariance per family in bf16 and fp16 (tiny weights; the inpainting checkpoints and Wan "
        "included): a request alone vs fused among 7, the step engine vs the pipeline",
        90,
        family_command,
        ("family.json", "family.md"),
        family_figures,
    ),
    Part(
        "step_caches",
        "step caches per request (none, FBC at two thresholds, TaylorSeer) on FLUX.1's full-size "
        "transformer at 1024x1024 bf16 (random weights: speed only, the reuse fractions say nothing about "
        "a real model's) (issue 33)",
        150,
        step_caches_command,
        ("bench_caches.json", "bench_caches.md"),
        no_figures,
        needs=(("scripts/bench_caches.py", "--flux1-size"),),
    ),
    Part(
        "slo",
        "service tiers and deadlines: interactive and background classes at 70/90/110% load, per-class "
        "latency, SLO attainment, preemptions, against FIFO and the request-level engine (SD 1.5 512x512 "
        "bf16) (issue 34)",
        150,
        slo_command,
        ("bench_slo.json", "bench_slo.md"),
        no_figures,
        needs=(("scripts/bench_slo.py", "--trace"),),
    ),
]


# ---- running -----------------------------------------------------------------------------------------
VERSIONS = """
import json, platform, torch
from importlib.metadata import version
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
for name in ("diffusers", "transformers", "peft"):
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


def command_output(args: list[str], timeout: float = 60) -> str | None:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine(python: str, commit: str | None) -> dict[str, str]:
    """Device, driver, versions and commit (git's, else ``commit``), for the summary's head."""
    info: dict[str, str] = {}
    versions = command_output([python, "-c", VERSIONS], timeout=120)
    if versions is None:
        info["torch"] = "not importable"
    else:
        info.update(json.loads(versions.splitlines()[-1]))
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
    info["host"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
    return info


class Child:
    """The part's process, in its own process group so that a timeout or a stop ends all of it."""

    current: subprocess.Popen | None = None

    @classmethod
    def run(cls, args: list[str], log: Path, timeout: float, smoke: bool) -> int | None:
        """Its exit status, or None when it was stopped at ``timeout``."""
        with log.open("w") as out:
            cls.current = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env=child_environment(smoke),
                preexec_fn=os.setpgrp,  # noqa: PLW1509  (no threads here)
            )
            try:
                return cls.current.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                cls.stop()
                return None
            finally:
                cls.current = None

    @classmethod
    def stop(cls) -> None:
        proc = cls.current
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return


def last_error(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["no output"])[-1][:200]


def run_part(part: Part, run: Run, left: float) -> Outcome:
    folder = run.folder(part.name)
    if folder.exists():
        shutil.rmtree(folder)  # no figures from an earlier run pass for this one's
    folder.mkdir(parents=True)
    args = part.command(run)
    log = folder / "log.txt"
    (folder / "command.txt").write_text(
        " ".join(["python3", str(Path("scripts", args[0])), *args[1:]]) + "\n"
    )
    print(f"[gpu_checks] {part.name}: started, {left:.0f} s of the budget left", flush=True)
    started = time.monotonic()
    code = Child.run([run.python, str(SCRIPTS / args[0]), *args[1:]], log, left, run.smoke)
    outcome = Outcome(part.name, "done", seconds=time.monotonic() - started)
    if code is None:
        outcome.status, outcome.detail = (
            "cut short",
            f"stopped at the budget ({left:.0f} s left at its start)",
        )
    elif code != 0:
        outcome.status, outcome.detail = "failed", f"exit {code}: {last_error(log)}"
    outcome.files = sorted(
        str(path.relative_to(run.out)) for pattern in part.writes for path in folder.glob(pattern)
    )
    absent = [pattern for pattern in part.writes if not any(folder.glob(pattern))]
    if outcome.status == "done" and absent:
        outcome.status, outcome.detail = "failed", f"wrote no {', '.join(absent)}"
    if outcome.files:
        try:
            outcome.figures = part.figures(folder, run)
        except Exception as exc:  # noqa: BLE001  (a figure we cannot read must not lose the others)
            outcome.figures = f"figures unreadable ({type(exc).__name__}: {exc})"[:200]
    print(
        f"[gpu_checks] {part.name}: {outcome.status} in {outcome.seconds:.0f} s {outcome.detail}", flush=True
    )
    return outcome


def summary(run: Run, info: dict[str, str], budget: float, elapsed: float) -> str:
    mode = "smoke (tiny models, CPU presets)" if run.smoke else f"GPU presets, budget {budget:.0f} s"
    lines = [
        "# GPU checks (`scripts/gpu_checks.py`)",
        "",
        f"- taken: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {mode}, {elapsed:.0f} s in all",
        f"- commit: {info.get('commit', 'unknown (no git here: see the command that ran it)')}",
        f"- device: {info.get('device', '?')}; driver: {info.get('driver', '?')}",
        f"- torch {info.get('torch', '?')} (CUDA {info.get('cuda', '-')}), "
        f"diffusers {info.get('diffusers', '?')}, transformers {info.get('transformers', '?')}, "
        f"peft {info.get('peft', '?')}, "
        f"Python {info.get('python', '?')}; {info.get('host', '')}",
        "",
        "| part | status | seconds (expected on an H100) | key figures | files |",
        "|---|---|---|---|---|",
    ]
    for part in PARTS:
        outcome = run.outcomes.get(part.name, Outcome(part.name, "not reached"))
        status = outcome.status + (f" ({outcome.detail})" if outcome.detail else "")
        seconds = "-" if outcome.seconds is None else f"{outcome.seconds:.0f}"
        files = ", ".join(f"[{Path(f).name}]({f})" for f in outcome.files) or "-"
        expected = f"{seconds} ({part.expected_s:.0f})"
        lines.append(f"| {part.name} | {status} | {expected} | {outcome.figures or '-'} | {files} |")
    lines += ["", "What each part measures (its command and log are in its folder):", ""]
    lines += [f"- `{part.name}`: {part.measures}" for part in PARTS]
    return "\n".join(lines) + "\n"


def publish(run: Run, bundle: Path | None, text: str, info: dict[str, str]) -> None:
    """summary.md (and .json) where the parts are; with a bundle folder, there too, with a tarball of all."""
    (run.out / "summary.md").write_text(text)
    state = {"machine": info, "smoke": run.smoke, "parts": [o.__dict__ for o in run.outcomes.values()]}
    (run.out / "summary.json").write_text(json.dumps(state, indent=2) + "\n")
    if bundle is None:
        return
    (bundle / "summary.md").write_text(text)
    partial = bundle / "gpu_checks.tar.gz.partial"
    with tarfile.open(partial, "w:gz") as tar:
        for path in sorted(run.out.iterdir()):
            tar.add(path, arcname=path.name)
    partial.replace(bundle / "gpu_checks.tar.gz")


def earlier_outcomes(out: Path) -> dict[str, Outcome]:
    """The outcomes an earlier run left in this folder (kept for the parts ``--parts`` leaves out)."""
    path = out / "summary.json"
    if not path.is_file():
        return {}
    outcomes = {}
    for saved in json.loads(path.read_text()).get("parts", []):
        if saved["status"] in ("done", "cut short", "failed") and (out / saved["part"]).is_dir():
            outcome = Outcome(**saved)
            if "an earlier run" not in outcome.detail:
                outcome.detail = "; ".join(x for x in (outcome.detail, "an earlier run") if x)
            outcomes[outcome.part] = outcome
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="wall clock for all parts")
    parser.add_argument("--out", type=Path, help="default: $OUT if set (bundled, see above), else docs/gpu")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny models and a few steps: every part, on a CPU"
    )
    parser.add_argument(
        "--parts", help=f"comma-separated, in registry order (default: all of {[p.name for p in PARTS]})"
    )
    parser.add_argument("--list", action="store_true", help="print the registry and stop")
    parser.add_argument("--commit", help="the commit checked out, for a copy without git (the device tool's)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter the parts run with")
    args = parser.parse_args(argv)
    if args.list:
        for part in PARTS:
            state = f"not built yet: {part.missing()}" if part.missing() else part.measures
            print(f"{part.name:18} {part.expected_s:4.0f} s  {state}")
        return 0
    names = [p.name for p in PARTS]
    chosen = args.parts.split(",") if args.parts else names
    if unknown := sorted(set(chosen) - set(names)):
        parser.error(f"unknown parts {unknown}; choose from {names}")

    bundle = Path(os.environ["OUT"]) if args.out is None and os.environ.get("OUT") else None
    out = Path(tempfile.mkdtemp(prefix="gpu_checks_")) if bundle else (args.out or REPO_ROOT / "docs" / "gpu")
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out.resolve(), args.smoke, args.python)
    started = time.monotonic()
    info = machine(run.python, args.commit)
    print(f"[gpu_checks] {json.dumps(info)}", flush=True)
    if not args.smoke and info.get("device", "CPU") == "CPU":
        print("[gpu_checks] no CUDA device here (or no torch): use --smoke on a CPU", file=sys.stderr)
        publish(run, bundle, summary(run, info, args.budget_s, 0.0), info)
        return 2

    def stopped(signum, frame):  # the caller's own limit: keep what was measured
        Child.stop()
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        run_parts(run, bundle, info, args, chosen, started)
    finally:
        signal.signal(signal.SIGTERM, previous)
    text = summary(run, info, args.budget_s, time.monotonic() - started)
    publish(run, bundle, text, info)
    print(text)
    built = [o for o in run.outcomes.values() if o.status not in ("not built yet", "not selected")]
    return 0 if all(o.status == "done" for o in built) else 1


def run_parts(
    run: Run,
    bundle: Path | None,
    info: dict[str, str],
    args: argparse.Namespace,
    chosen: list[str],
    started: float,
) -> None:
    """Each registered part in order, the summary published after each."""
    earlier = earlier_outcomes(run.out)
    for part in PARTS:
        left = args.budget_s - (time.monotonic() - started)
        if part.name not in chosen:
            run.outcomes[part.name] = earlier.get(part.name) or Outcome(part.name, "not selected", "--parts")
        elif missing := part.missing():
            run.outcomes[part.name] = Outcome(part.name, "not built yet", missing)
        elif left < MIN_START_S:
            run.outcomes[part.name] = Outcome(
                part.name, "not reached", f"{max(left, 0):.0f} s of budget left"
            )
        else:
            try:
                run.outcomes[part.name] = run_part(part, run, left)
            except (SystemExit, KeyboardInterrupt):
                Child.stop()
                run.outcomes[part.name] = Outcome(part.name, "cut short", "the run was stopped from outside")
                publish(run, bundle, summary(run, info, args.budget_s, time.monotonic() - started), info)
                raise
        publish(run, bundle, summary(run, info, args.budget_s, time.monotonic() - started), info)


if __name__ == "__main__":
    sys.exit(main())

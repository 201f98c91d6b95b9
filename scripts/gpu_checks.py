"""Every pending GPU figure from one script, within a wall-clock budget: run this first whenever a GPU is
lent, in one call, and commit what it writes.

Each part is one of the bench scripts, run as a subprocess through its command line (so a change in the
engine's Python API breaks a script's run, which the summary names, not this one). Each part's budget is
computed from what it runs (its denoising forwards, at how many images each) and what a step costs on one
H100 (STEP_COSTS, each with its source), times MARGIN; the plan (parts, budgets, total) is printed at the
start, and parts that do not fit in ``--budget-s`` are left out, named, with the ``--parts`` for another
call (none fitting: it refuses to start). The parts run in the registry's order, the cheapest and most
important first, each with its own budget plus what earlier parts left unused; each writes its files under
``<out>/<part>/`` (the bench scripts rewrite their artefact after each measured row, so a part cut at its
budget keeps its rows), and ``<out>/summary.md`` and ``summary.json`` (command, commit, date, machine,
library versions; one line per part: done / cut short / failed, its key figures, its files) are
rewritten after every part and while a part's files change, so a run cut short keeps what it measured.

Before any part, one import probe (in the interpreter the parts use) imports what the planned parts
import; a missing package stops the run at once with its name and how to carry its wheel.

Weights are random: full-size architectures built from the diffusers configs in the package
(``triton_diffusion.tiny_models.ARCHITECTURES``: ``sd15``), and the tiny families for the invariance
table; nothing comes from a hub.

    python3 scripts/gpu_checks.py --wheels .whl          # a GPU: the planned parts into docs/gpu/ (or $OUT)
    python3 scripts/gpu_checks.py --parts lora           # one part again
    python3 scripts/gpu_checks.py --list                 # the registry, each part's budget and the plan
    .venv/bin/python scripts/gpu_checks.py --download-wheels .whl   # here: the wheels the device lacks
    .venv/bin/python scripts/gpu_checks.py --smoke --out /tmp/gpu_smoke   # CPU: tiny models, seconds

``--wheels DIR`` installs DIR's wheels (``--download-wheels`` fetched the ones scripts/gpu_wheels.txt
names, for the device's Python 3.12) with ``pip install --no-index --no-deps --no-compile --target`` into
a scratch folder put first on the parts' PYTHONPATH: the device machine's own torch stays.

Where the environment variable OUT is set (the device tool's folder, from which only 8 files come back)
and ``--out`` is not given, the parts write into a scratch folder and OUT receives ``summary.md`` and
``gpu_checks.tar.gz`` (every part's files and logs, refreshed after each part and while one writes):
unpack it with ``tar -xzf gpu_checks.tar.gz -C docs/gpu``.

Adding a part is one ``Part(...)`` entry in PARTS: its name, what it measures, its work on the GPU (the
forwards its GPU command runs: its budget), its command (GPU and smoke), the files it writes and how to
read its key figures (gpu_figures.py). A part whose script or flag does not exist yet (``needs``) is
listed as "not built yet" and skipped.
"""

from __future__ import annotations

import argparse
import atexit
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
WHEEL_LIST = SCRIPTS / "gpu_wheels.txt"
# The device tool's longest command is 600 s; around the parts go installing the wheels, the import probe,
# the machine's description and the last bundle (about 30 s on an H100 machine): 540 s for the parts.
DEFAULT_BUDGET_S = 540.0
MIN_START_S = 10.0  # a part is not started with less of the budget left
REFRESH_S = 15.0  # while a part runs, the summary and bundle are refreshed this often if its files changed
MARGIN = 1.25  # a part's budget over its estimate
SD15_STEPS = 20
SD15 = f"--arch sd15 --height 512 --width 512 --steps {SD15_STEPS} --dtype bfloat16"
# FLUX.1's transformer at full size (19 + 38 blocks, 3072 wide; random weights, built on the GPU) over the
# tiny pipeline's text encoders and VAE: bench_caches.py --flux1-size.
FLUX1_1024 = "--arch tiny-flux --flux1-size --height 1024 --width 1024 --dtype bfloat16"


# ---- what a step costs on one H100, and so what each part costs ---------------------------------------
@dataclass(frozen=True)
class StepCost:
    """Seconds of one denoising forward of ``images`` images (both CFG rows where the model has them) on
    one H100 in bf16, and where the figure comes from."""

    images: int
    seconds: float
    source: str


STEP_COSTS: dict[str, tuple[StepCost, ...]] = {
    "sd15-512": (
        StepCost(
            1,
            0.037,
            "measured: docs/gpu/bench_engines_sd15.json (H100 80GB HBM3, torch 2.11, 2026-11-22, eager): "
            "diffusers' pipeline at batch 1 made 1.349 images/s at 20 steps, 0.741 s an image with the "
            "text encoding and decode folded in: 37 ms a step",
        ),
        StepCost(
            8,
            0.066,
            "measured: the same file's profile: 66.1 ms an engine step at 8 images (16 rows) a forward",
        ),
    ),
    "flux1-1024": (
        StepCost(
            1,
            0.128,
            "derived: FLUX.1-dev's transformer (19 double + 38 single blocks, 3072 wide) at 1024x1024 runs "
            "about 74.5 TFLOP a step (4096 image + 512 text tokens: the blocks' linear layers 59.4, "
            "attention 14.9), at 582 TFLOP/s (73% of the 798 TFLOP/s an 8192^3 bf16 matmul reached on "
            "the device tool's H100): 128 ms; one forward per step (guidance-distilled, no CFG), k images "
            "cost k times one (compute-bound)",
        ),
    ),
}


def step_seconds(model: str, images: int) -> float:
    """One forward of ``images`` images: linear between measured sizes, the smallest one's below them
    (launch-bound), in proportion to images above the largest (compute-bound)."""
    points = STEP_COSTS[model]
    if images >= points[-1].images:
        return points[-1].seconds * images / points[-1].images
    if images <= points[0].images:
        return points[0].seconds
    for low, high in zip(points, points[1:], strict=False):
        if images <= high.images:
            share = (images - low.images) / (high.images - low.images)
            return low.seconds + share * (high.seconds - low.seconds)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Work:
    """One piece of a part's GPU run: ``forwards`` denoising forwards of ``images`` images each, plus
    ``seconds`` that no step cost sets (starting, imports, building weights, capturing graphs; the arrival
    times of an open loop)."""

    what: str
    forwards: int = 0
    images: int = 1
    model: str = "sd15-512"
    seconds: float = 0.0

    def estimate(self) -> float:
        return self.seconds + (self.forwards * step_seconds(self.model, self.images) if self.forwards else 0)


def open_loop(what: str, requests: int, steps: float, load: float, batch: int, model: str = "sd15-512"):
    """Poisson arrivals at ``load`` of the saturated throughput (``batch`` images a forward): the run lasts
    until the last arrival (or, overloaded, until the work is done), plus the last request's own latency."""
    per_image = steps * step_seconds(model, batch) / batch
    span = max(requests * per_image / load, requests * per_image)
    return Work(what, seconds=span + steps * step_seconds(model, batch))


def estimate(work: list[Work]) -> float:
    return sum(piece.estimate() for piece in work)


# ---- the parts' work on a GPU (their GPU commands' sizes; the smoke runs its own, in seconds) ----------
CUDA_GRAPHS = {"repeats": 5, "images": (1, 4, 8)}
ENGINES = {"concurrency": (1, 16), "requests": 16, "poisson": 40, "load": 0.8, "profile": 20, "cap": 8}
LORA = {"rank": 16, "rows": 8, "distinct": 4, "repeats": 2}
# The step caches' part, sized to share a call with slo (about 190 s of the 540): FLUX.1 at 1024x1024, 10
# steps, 4 requests at c=2, none + the script's 3 caches (FBC at two thresholds, TaylorSeer) and its probe,
# 2 rounds (its noise verdicts need two), closed loop and Poisson at 80%.
STEP_CACHES = {
    "steps": 10,
    "requests": 4,
    "cap": 2,
    "concurrency": 2,
    "variants": 4,
    "rounds": 2,
    "load": 0.8,
}
FAMILIES = 14  # family_invariance.FAMILIES (tests/unit/test_gpu_checks.py holds them equal)
# The SLO part: 60 requests (half interactive at 4 steps, half background at 16-30), 2 rounds of 4 variants
# at 3 loads (about 300 s).
SLO = {
    "requests": 60,
    "loads": (0.7, 0.9, 1.1),
    "variants": 4,
    "rounds": 2,
    "cap": 8,
    "steps": 0.5 * 4 + 0.5 * 23,
}


def cuda_graphs_work() -> list[Work]:
    repeats, steps = CUDA_GRAPHS["repeats"], SD15_STEPS
    timed = repeats + 1  # bench_engines.timed_median: a warm-up, then the repeats
    return [
        Work("start, imports, SD 1.5's weights built, graphs captured at 1-8 images (estimate)", seconds=30),
        *[
            Work(f"a forward of {k} image(s), eager and replayed (and FLOPs counted)", 2 * timed + 1, k)
            for k in CUDA_GRAPHS["images"]
        ],
        Work(
            "one request alone: pipeline(...), eager and captured, and the exactness images",
            (3 * timed + 2) * steps,
        ),
        Work("one request amid 7 others (exactness)", steps, 8),
    ]


def engines_work(graphs: bool) -> list[Work]:
    e, steps, cap = ENGINES, SD15_STEPS, ENGINES["cap"]
    requests, both = e["requests"], 2  # both engines: request-level and step
    work = [
        Work(
            "start, imports, SD 1.5's weights built"
            + (", graphs captured" if graphs else "")
            + " (estimate)",
            seconds=30 if graphs else 20,
        ),
        Work("warm-up: both engines, a full batch", both * steps, cap),
        Work("closed loop c=1: both engines", both * requests * steps, 1),
        Work("closed loop c=16 (8 a forward): both engines", both * requests * steps // cap, cap),
        Work("mixed steps and guidance at c=16: both engines", both * requests * steps // cap, cap),
        *[
            open_loop(f"Poisson {e['load']:.0%}, {engine}", e["poisson"], steps, e["load"], cap)
            for engine in ("request", "step", "step-eager")
        ],
        *[Work(f"stage costs at {k} image(s) (a warm-up + 7)", 8, k) for k in (1, 2, 4, 8)],
        Work("profile: 3 warm-up requests, then forwards at 8 images", steps + e["profile"], cap),
    ]
    if not graphs:
        calls = max(requests // 2, cap * 2)  # bench_engines.raw_ceiling: images per batch size
        work += [
            Work("diffusers' pipeline at batch 1 (a warm-up + calls)", (calls + 1) * steps, 1),
            Work("diffusers' pipeline at batch 8 (a warm-up + calls)", (calls // cap + 1) * steps, cap),
        ]
    return work


def lora_work() -> list[Work]:
    steps, rows, k, runs = SD15_STEPS, LORA["rows"], LORA["distinct"], LORA["repeats"] + 1
    return [
        Work(
            "start, imports, SD 1.5's weights, 4 adapters built, the model loaded twice (estimate)",
            seconds=40,
        ),
        Work("none, unused and mixed-4: 8 rows (a warm-up + repeats)", 3 * runs * steps, rows),
        Work("split-4: 4 batches of 2 rows (a warm-up + repeats)", runs * k * steps, rows // k),
        Work("exactness: mixed-4 once", steps, k),
        Work("exactness: diffusers' set_adapters + pipeline(...) per adapter", k * steps, 1),
    ]


def family_work() -> list[Work]:
    checks = 2 * FAMILIES  # bf16 and fp16
    return [
        Work("start, imports, tiny weights built where missing (estimate)", seconds=20),
        Work(
            f"{checks} family and dtype checks: a pipeline loaded, one request alone, 8 fused, 8 through "
            "the step engine, 4 steps of a tiny model each (launch-bound; estimate 2.5 s a check)",
            seconds=2.5 * checks,
        ),
    ]


def step_caches_work() -> list[Work]:
    c, model = STEP_CACHES, "flux1-1024"
    steps, requests, rounds, c2 = c["steps"], c["requests"], c["rounds"], c["concurrency"]
    return [
        Work(
            "start, imports, tiny FLUX.1, FLUX.1's transformer built at full size on the GPU (estimate)",
            seconds=30,
        ),
        Work("warm-up: none and the probe on one batch", 2 * steps, c2, model),
        *[
            piece
            for r in range(1, rounds + 1)
            for piece in (
                Work(
                    f"round {r}, closed loop c={c2}: {c['variants']} variants, every row computed (at most)",
                    c["variants"] * requests * steps // c2,
                    c2,
                    model,
                ),
                # fbc:1.0: from its second step nearly every row reuses (the first block and the output
                # layers run: about a tenth of a forward)
                Work(f"round {r}, the probe (fbc:1.0)", requests * steps // c2 // 10 + 1, c2, model),
                *[
                    open_loop(
                        f"round {r}, Poisson {c['load']:.0%}, variant {v + 1}",
                        requests,
                        steps,
                        c["load"],
                        c["cap"],
                        model,
                    )  # fmt: skip
                    for v in range(c["variants"])
                ],
            )
        ],
    ]


def slo_work() -> list[Work]:
    s, cap = SLO, SLO["cap"]
    sample = max(2 * cap, 16)  # bench_slo.capacity's sample of the mix
    return [
        Work("start, imports, SD 1.5's weights built (estimate)", seconds=20),
        Work("a warm step engine at 1-8 images, 4 steps each", cap * 4, cap // 2),
        Work("the interactive request alone (7 times)", 7 * 4),
        Work(
            "capacity: the request-level engine over a sample of the mix",
            round(sample * s["steps"] / cap),
            cap,
        ),
        *[
            open_loop(f"round {r}, Poisson {load:.0%}, variant {v + 1}", s["requests"], s["steps"], load, cap)
            for load in s["loads"]
            for r in range(1, s["rounds"] + 1)
            for v in range(s["variants"])
        ],
    ]


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
    """One registered check. ``work`` is what its GPU command runs (its budget: ``budget()``);
    ``command`` gives the script and its arguments (after the interpreter); ``writes`` are glob patterns
    under the part's folder that a finished part must have written (its JSON artefacts: scripts/figures.py
    renders the tables from them); ``figures`` reads the key figures
    back from its folder for the summary; ``needs`` lists (file, text) pairs that must exist for the
    part to be built at all."""

    name: str
    measures: str
    work: Callable[[], list[Work]]
    command: Callable[[Run], list[str]]
    writes: tuple[str, ...]
    figures: Callable[[Path, Run], str]
    needs: tuple[tuple[str, str | None], ...] = ()

    def budget(self) -> float:
        """Seconds on one H100: its estimate times MARGIN."""
        return MARGIN * estimate(self.work())

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
    status: str  # done, cut short, failed, running, not built yet, not reached, not selected, not planned
    detail: str = ""
    seconds: float | None = None
    figures: str = ""
    files: list[str] = field(default_factory=list)


# ---- the parts' commands: (script, arguments), the GPU's or the smoke's ------------------------------
def joined(values) -> str:
    return ",".join(str(v) for v in values)


def cuda_graphs_command(run: Run) -> list[str]:
    sizes = "--steps 2 --repeats 1" if run.smoke else f"{SD15} --repeats {CUDA_GRAPHS['repeats']}"
    return ["bench_graphs.py", *sizes.split(), "--out", str(run.folder("cuda_graphs"))]


def engines_command(run: Run, graphs: bool) -> list[str]:
    name = "engines_graphs" if graphs else "engines_eager"
    e = ENGINES
    if run.smoke and graphs:  # on a CPU both runs are eager: the second alone runs every kind of traffic
        sizes = "--steps 2 --cap 2 --concurrency 2 --requests 2 --no-mixed --profile-forwards 1 --loads="
    elif run.smoke:
        sizes = "--steps 2 --cap 2 --concurrency 1,2 --requests 4 --poisson-requests 10 --profile-forwards 2"
    else:
        sizes = (
            f"{SD15} --cap {e['cap']} --concurrency {joined(e['concurrency'])} --requests {e['requests']} "
            f"--poisson-requests {e['poisson']} --profile-forwards {e['profile']}"
        )
    args = ["bench_engines.py", *sizes.split(), "--no-image-mix"]
    if not (run.smoke and graphs):
        args += ["--loads", str(e["load"])]
    if graphs:
        args += ["--cuda-graphs", "--no-raw"]  # the raw pipeline does not use the graphs: once is enough
    else:
        saturated = request_saturation(run.folder("engines_graphs"))
        if saturated is not None:  # the same Poisson arrivals as the captured run's
            args += ["--saturated", f"{saturated:.4f}"]
    return [*args, "--out", str(run.folder(name))]


def lora_command(run: Run) -> list[str]:
    sizes = "--steps 2 --rows 4" if run.smoke else f"{SD15} --rank {LORA['rank']} --rows {LORA['rows']}"
    repeats = "1" if run.smoke else str(LORA["repeats"])
    args = [*sizes.split(), "--distinct", str(LORA["distinct"]), "--repeats", repeats, "--exactness"]
    return ["bench_lora.py", *args, "--out", str(run.folder("lora"))]


def family_command(run: Run) -> list[str]:
    # The smoke: an inpainting checkpoint and a video family in fp32; the GPU: every family, both dtypes.
    args = "--families tiny-sd-inpaint,tiny-wan" if run.smoke else "--dtype bfloat16 --dtype float16"
    out = run.folder("family_invariance") / "family.json"
    return ["family_invariance.py", *args.split(), "--out", str(out)]


def step_caches_command(run: Run) -> list[str]:
    c = STEP_CACHES
    if run.smoke:
        sizes = "--arch tiny-flux --height 64 --width 64 --steps 3 --requests 4 --cap 2 --concurrency 2"
    else:
        sizes = (
            f"{FLUX1_1024} --steps {c['steps']} --requests {c['requests']} --cap {c['cap']} "
            f"--concurrency {c['concurrency']} --load {c['load']} --rounds {c['rounds']}"
        )
    return ["bench_caches.py", *sizes.split(), "--out", str(run.folder("step_caches"))]


def slo_command(run: Run) -> list[str]:
    s = SLO
    if run.smoke:
        sizes = "--requests 8 --loads 0.9 --cap 2 --interactive-steps 2 --background-steps 3-4"
    else:
        sizes = (
            f"--arch sd15 --height 512 --width 512 --cap {s['cap']} --requests {s['requests']} --loads "
            f"{joined(s['loads'])} --rounds {s['rounds']} --interactive-steps 4 --background-steps 16-30"
        )
    return ["bench_slo.py", *sizes.split(), "--out", str(run.folder("slo"))]


# The registry, in running order: the cheapest and most important first.
PARTS: list[Part] = [
    Part(
        "cuda_graphs",
        "captured vs eager forwards at 1/4/8 images, FLOPs against the bf16 peak, one request captured vs "
        "diffusers' pipeline(...) (target >= 2x), exactness (SD 1.5 512x512 bf16; builds the weights)",
        cuda_graphs_work,
        cuda_graphs_command,
        ("bench_graphs.json",),
        cuda_graphs_figures,
    ),
    Part(
        "engines_graphs",
        "the in-process engines table on the true clock with captured forwards (SD 1.5 512x512 bf16: "
        "closed loop c=1 and 16, mixed, Poisson 80%, stage costs, profile)",
        lambda: engines_work(graphs=True),
        lambda run: engines_command(run, graphs=True),
        ("bench_engines.json",),
        engines_figures,
    ),
    Part(
        "engines_eager",
        "the same table with eager forwards (the same Poisson rate), and the raw pipeline's ceiling",
        lambda: engines_work(graphs=False),
        lambda run: engines_command(run, graphs=False),
        ("bench_engines.json",),
        engines_figures,
    ),
    Part(
        "lora",
        "mixed LoRA at rank 16: mixed-4 against no adapters and one batch per adapter, and its bf16 bound "
        "against diffusers' own set_adapters (SD 1.5 512x512 bf16)",
        lora_work,
        lora_command,
        ("bench_lora.json",),
        lora_figures,
    ),
    Part(
        "family_invariance",
        "batch invariance per family in bf16 and fp16 (tiny weights; the inpainting checkpoints and Wan "
        "included): a request alone vs fused among 7, the step engine vs the pipeline",
        family_work,
        family_command,
        ("family.json",),
        family_figures,
    ),
    Part(
        "step_caches",
        "step caches per request (none, FBC at two thresholds, TaylorSeer) on FLUX.1's full-size "
        "transformer at 1024x1024 bf16, 10 steps, 4 requests at c=2, 2 rounds (random weights: speed only, "
        "the reuse fractions say nothing about a real model's) (issue 33)",
        step_caches_work,
        step_caches_command,
        ("bench_caches.json",),
        no_figures,
        needs=(("scripts/bench_caches.py", "--flux1-size"),),
    ),
    Part(
        "slo",
        "service tiers and deadlines: interactive and background classes at 70/90/110% load, per-class "
        "latency, SLO attainment, preemptions, against FIFO and the request-level engine (SD 1.5 512x512 "
        "bf16) (issue 34)",
        slo_work,
        slo_command,
        ("bench_slo.json",),
        no_figures,
        needs=(("scripts/bench_slo.py", "--trace"),),
    ),
]


# ---- the plan: which parts fit in this call ----------------------------------------------------------
@dataclass
class Plan:
    limit: float
    budgets: dict[str, float] = field(default_factory=dict)  # the parts planned, in running order
    left_out: dict[str, str] = field(default_factory=dict)  # the parts that do not fit, and why

    @property
    def total(self) -> float:
        return sum(self.budgets.values())

    def later(self, name: str) -> float:
        """The budgets of the planned parts after ``name``: what the part must leave them."""
        names = list(self.budgets)
        return sum(self.budgets[n] for n in names[names.index(name) + 1 :])

    def lines(self) -> list[str]:
        lines = [f"plan for one H100 within {self.limit:.0f} s (budget = estimate x {MARGIN}):"]
        lines += [f"  {name:18} {budget:4.0f} s" for name, budget in self.budgets.items()]
        lines.append(f"  {'total':18} {self.total:4.0f} s of {self.limit:.0f}")
        if self.left_out:
            lines.append(
                "left out of this call: "
                + "; ".join(f"{name} ({why})" for name, why in self.left_out.items())
                + f"; another call: --parts {','.join(self.left_out)}"
            )
        return lines


def make_plan(parts: list[Part], chosen: list[str], limit: float) -> Plan:
    """The chosen, built parts in registry order, each that fits in what the earlier ones left."""
    plan = Plan(limit)
    for part in parts:
        if part.name not in chosen or part.missing():
            continue
        budget = part.budget()
        left = limit - plan.total
        if budget <= left:
            plan.budgets[part.name] = budget
        else:
            plan.left_out[part.name] = f"needs {budget:.0f} s, {left:.0f} s left"
    return plan


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


# ---- running -----------------------------------------------------------------------------------------
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


class Child:
    """The part's process, in its own process group so that a timeout or a stop ends all of it."""

    current: subprocess.Popen | None = None

    @classmethod
    def run(
        cls,
        args: list[str],
        log: Path,
        timeout: float,
        smoke: bool,
        tick: Callable[[], None] | None = None,
    ) -> int | None:
        """Its exit status, or None when it was stopped at ``timeout``; ``tick`` is called every REFRESH_S
        while it runs."""
        deadline = time.monotonic() + timeout
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
                while True:
                    left = deadline - time.monotonic()
                    try:
                        return cls.current.wait(timeout=max(0.0, min(left, REFRESH_S)))
                    except subprocess.TimeoutExpired:
                        if left <= REFRESH_S:
                            cls.stop()
                            return None
                        if tick is not None:
                            tick()
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


def kept_rows(folder: Path, part: Part) -> str:
    """What a part that did not finish left: its JSON artefacts' rows (``rows``, else ``rounds`` or
    ``runs``: the bench scripts rewrite them after each measured row, with ``"complete": false`` until the
    last)."""
    kept = []
    for pattern in part.writes:
        for path in sorted(folder.glob(pattern)):
            if path.suffix != ".json":
                continue
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                kept.append(f"{path.name} unreadable")
                continue
            if not isinstance(data, dict):
                data = {"rows": data}
            key = next((k for k in ("rows", "rounds", "runs") if isinstance(data.get(k), list | dict)), None)
            count = f"{len(data[key])} {key}" if key else "no rows"
            unfinished = isinstance(data, dict) and data.get("complete") is False
            kept.append(f"{path.name}: {count}" + (", incomplete" if unfinished else ""))
    return "kept " + "; ".join(kept) if kept else "kept nothing"


@dataclass
class Checks:
    """One run's state for publishing: the parts' folder, the bundle folder, the machine, the plan."""

    run: Run
    bundle: Path | None
    info: dict
    plan: Plan
    budget: float
    started: float = field(default_factory=time.monotonic)

    def publish(self) -> None:
        elapsed = time.monotonic() - self.started
        publish(
            self.run, self.bundle, summary(self.run, self.info, self.budget, elapsed, self.plan), self.info
        )


def run_part(part: Part, checks: Checks, timeout: float) -> Outcome:
    run = checks.run
    folder = run.folder(part.name)
    if folder.exists():
        shutil.rmtree(folder)  # no figures from an earlier run pass for this one's
    folder.mkdir(parents=True)
    args = part.command(run)
    log = folder / "log.txt"
    (folder / "command.txt").write_text(
        " ".join(["python3", str(Path("scripts", args[0])), *args[1:]]) + "\n"
    )
    planned = checks.plan.budgets.get(part.name)
    budget = "" if planned is None or run.smoke else f" (its budget {planned:.0f} s)"
    print(f"[gpu_checks] {part.name}: started, {timeout:.0f} s for it{budget}", flush=True)
    started = time.monotonic()
    seen = {"newest": 0.0}

    def tick() -> None:  # a part's rows reach the bundle while it runs: an outer kill keeps them
        newest = max((p.stat().st_mtime for p in folder.iterdir() if p.name != "log.txt"), default=0.0)
        if newest > seen["newest"]:
            seen["newest"] = newest
            running = Outcome(part.name, "running", seconds=time.monotonic() - started)
            running.files = sorted(
                str(p.relative_to(run.out)) for pat in part.writes for p in folder.glob(pat)
            )
            running.detail = kept_rows(folder, part) + " so far"
            run.outcomes[part.name] = running
            checks.publish()

    code = Child.run([run.python, str(SCRIPTS / args[0]), *args[1:]], log, timeout, run.smoke, tick)
    outcome = Outcome(part.name, "done", seconds=time.monotonic() - started)
    if code is None:
        outcome.status = "cut short"
        outcome.detail = f"stopped at the budget, {timeout:.0f} s; {kept_rows(folder, part)}"
    elif code != 0:
        outcome.status, outcome.detail = (
            "failed",
            f"exit {code}: {last_error(log)}; {kept_rows(folder, part)}",
        )
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


def summary(run: Run, info: dict, budget: float, elapsed: float, plan: Plan | None = None) -> str:
    mode = "smoke (tiny models, CPU presets)" if run.smoke else f"GPU presets, budget {budget:.0f} s"
    provenance = info.get("provenance") or {}
    lines = [
        "# GPU checks (`scripts/gpu_checks.py`)",
        "",
        f"- taken: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {mode}, {elapsed:.0f} s in all",
        f"- command: `{provenance.get('command', 'scripts/gpu_checks.py ' + ' '.join(sys.argv[1:]))}`",
        f"- commit: {info.get('commit', 'unknown (no git here: see the command that ran it)')}",
        f"- device: {info.get('device', '?')}; driver: {info.get('driver', '?')}",
        f"- torch {info.get('torch', '?')} (CUDA {info.get('cuda', '-')}), "
        f"diffusers {info.get('diffusers', '?')}, transformers {info.get('transformers', '?')}, "
        f"peft {info.get('peft', '?')}, huggingface_hub {info.get('huggingface_hub', '?')}, "
        f"numpy {info.get('numpy', '?')}, "
        f"Python {info.get('python', (provenance.get('versions') or {}).get('python', '?'))}; "
        f"{info.get('host', '')}",
        *([f"- not started: {info['probe']}"] if info.get("probe") else []),
        "",
        "| part | status | seconds (budget on an H100) | key figures | files |",
        "|---|---|---|---|---|",
    ]
    for part in PARTS:
        outcome = run.outcomes.get(part.name, Outcome(part.name, "not reached"))
        status = outcome.status + (f" ({outcome.detail})" if outcome.detail else "")
        seconds = "-" if outcome.seconds is None else f"{outcome.seconds:.0f}"
        files = ", ".join(f"[{Path(f).name}]({f})" for f in outcome.files) or "-"
        planned = f"{seconds} ({part.budget():.0f})"
        lines.append(f"| {part.name} | {status} | {planned} | {outcome.figures or '-'} | {files} |")
    if plan is not None and not run.smoke:
        lines += ["", "```", *plan.lines(), "```"]
    lines += ["", "What each part measures (its command and log are in its folder):", ""]
    lines += [f"- `{part.name}`: {part.measures}" for part in PARTS]
    return "\n".join(lines) + "\n"


def atomic_write(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def publish(run: Run, bundle: Path | None, text: str, info: dict) -> None:
    """summary.md (and .json) where the parts are; with a bundle folder, there too, with a tarball of all;
    each written whole, then moved into place."""
    atomic_write(run.out / "summary.md", text)
    state = {
        "provenance": info.get("provenance"),
        "machine": {k: v for k, v in info.items() if k != "provenance"},
        "smoke": run.smoke,
        "parts": [o.__dict__ for o in run.outcomes.values()],
    }
    atomic_write(run.out / "summary.json", json.dumps(state, indent=2) + "\n")
    if bundle is None:
        return
    atomic_write(bundle / "summary.md", text)
    partial = bundle / "gpu_checks.tar.gz.partial"
    with tarfile.open(partial, "w:gz") as tar:
        for path in sorted(run.out.iterdir()):
            if not path.name.endswith(".partial"):
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


def list_parts(plan: Plan) -> None:
    for part in PARTS:
        state = f"not built yet: {part.missing()}" if part.missing() else part.measures
        print(f"{part.name:18} {part.budget():4.0f} s  {state}")
        for piece in part.work():
            print(f"{'':25}{piece.estimate():6.1f} s  {piece.what}")
    print("\nwhat a step costs on one H100 (bf16):")
    for model, points in STEP_COSTS.items():
        for point in points:
            print(f"  {model} x{point.images}: {1000 * point.seconds:.0f} ms ({point.source})")
    print()
    print("\n".join(plan.lines()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--budget-s", type=float, default=DEFAULT_BUDGET_S, help="wall clock for the parts (the plan's limit)"
    )
    parser.add_argument("--out", type=Path, help="default: $OUT if set (bundled, see above), else docs/gpu")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny models and a few steps: every part, on a CPU"
    )
    parser.add_argument(
        "--parts", help=f"comma-separated, in registry order (default: all of {[p.name for p in PARTS]})"
    )
    parser.add_argument("--list", action="store_true", help="print the registry, the budgets and the plan")
    parser.add_argument("--commit", help="the commit checked out, for a copy without git (the device tool's)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter the parts run with")
    parser.add_argument(
        "--wheels", type=Path, help="install this folder's wheels (--no-deps) first, into a scratch folder"
    )
    parser.add_argument(
        "--download-wheels",
        type=Path,
        metavar="DIR",
        help="here: download the wheels scripts/gpu_wheels.txt names, for the device's Python 3.12, and stop",
    )
    args = parser.parse_args(argv)
    if args.download_wheels:
        return download_wheels(args.download_wheels)
    names = [p.name for p in PARTS]
    chosen = args.parts.split(",") if args.parts else names
    if unknown := sorted(set(chosen) - set(names)):
        parser.error(f"unknown parts {unknown}; choose from {names}")
    plan = make_plan(PARTS, chosen, args.budget_s)
    if args.list:
        list_parts(plan)
        return 0
    if not args.smoke:
        print("[gpu_checks] " + "\n[gpu_checks] ".join(plan.lines()), flush=True)
        if not plan.budgets:
            print("[gpu_checks] nothing fits in --budget-s: not started", file=sys.stderr)
            return 2

    bundle = Path(os.environ["OUT"]) if args.out is None and os.environ.get("OUT") else None
    out = Path(tempfile.mkdtemp(prefix="gpu_checks_")) if bundle else (args.out or REPO_ROOT / "docs" / "gpu")
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out.resolve(), args.smoke, args.python)
    if args.wheels:
        install_wheels(args.wheels, run.python)
    if args.commit:  # for the bench scripts' artefacts, in a copy without git
        os.environ["ARTEFACTS_COMMIT"] = args.commit
    started = time.monotonic()
    info = machine(run.python, args.commit)
    print(f"[gpu_checks] {json.dumps(info)}", flush=True)
    checks = Checks(run, bundle, info, plan, args.budget_s, started)
    probed = [p for p in PARTS if p.name in chosen and not p.missing()]
    scripts = [p.command(run)[0] for p in probed if args.smoke or p.name in plan.budgets]
    if problem := probe_imports(run.python, scripts, args.smoke):
        print(f"[gpu_checks] not started: {problem}", file=sys.stderr, flush=True)
        for part in PARTS:
            run.outcomes[part.name] = Outcome(part.name, "not started", "the import probe failed: see above")
        info["probe"] = problem
        checks.publish()
        return 3
    if not args.smoke and info.get("device", "CPU") == "CPU":
        print("[gpu_checks] no CUDA device here (or no torch): use --smoke on a CPU", file=sys.stderr)
        checks.publish()
        return 2

    def stopped(signum, frame):  # the caller's own limit: keep what was measured
        Child.stop()
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        run_parts(checks, args, chosen)
    finally:
        signal.signal(signal.SIGTERM, previous)
    checks.publish()
    print(summary(run, info, args.budget_s, time.monotonic() - started, plan))
    built = [o for o in run.outcomes.values() if o.status not in ("not built yet", "not selected")]
    return 0 if all(o.status == "done" for o in built) else 1


def run_parts(checks: Checks, args: argparse.Namespace, chosen: list[str]) -> None:
    """Each registered part in order, the summary published after each. On a GPU each planned part has
    what is left of the budget less the later planned parts' budgets (its own, and what earlier parts left
    unused); the smoke's parts have what is left. The budget counts from the first part on."""
    run, plan = checks.run, checks.plan
    earlier = earlier_outcomes(run.out)
    started = time.monotonic()
    for part in PARTS:
        left = args.budget_s - (time.monotonic() - started)
        timeout = left if run.smoke else left - plan.later(part.name) if part.name in plan.budgets else 0
        if part.name not in chosen:
            run.outcomes[part.name] = earlier.get(part.name) or Outcome(part.name, "not selected", "--parts")
        elif missing := part.missing():
            run.outcomes[part.name] = Outcome(part.name, "not built yet", missing)
        elif not run.smoke and part.name in plan.left_out:
            detail = f"{plan.left_out[part.name]}: another call, --parts {','.join(plan.left_out)}"
            run.outcomes[part.name] = Outcome(part.name, "not planned", detail)
        elif timeout < MIN_START_S:
            run.outcomes[part.name] = Outcome(
                part.name, "not reached", f"{max(timeout, 0):.0f} s of budget left"
            )
        else:
            try:
                run.outcomes[part.name] = run_part(part, checks, timeout)
            except (SystemExit, KeyboardInterrupt):
                Child.stop()
                run.outcomes[part.name] = Outcome(part.name, "cut short", "the run was stopped from outside")
                checks.publish()
                raise
        checks.publish()


if __name__ == "__main__":
    sys.exit(main())

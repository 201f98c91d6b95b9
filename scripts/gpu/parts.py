"""The parts: each one bench script run through its command line, with its sizes on a GPU (its work, and so
its budget: ``budget.py``) and on a CPU (the smoke), the files it writes and how to read its key figures
back (``gpu_figures.py``).

Adding a part is one ``Part(...)`` entry in PARTS: its name, what it measures, its work on the GPU (the
forwards its GPU command runs: its budget), its command (GPU and smoke), the files it writes and how to
read its key figures. A part whose script or flag does not exist yet (``needs``) is listed as "not built
yet" and skipped.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpu_figures import (
    cuda_graphs_figures,
    engines_figures,
    family_figures,
    lora_figures,
    mixed_sizes_figures,
    no_figures,
    request_saturation,
)

from gpu.budget import MARGIN, Work, estimate, open_loop, step_seconds
from gpu.environment import REPO_ROOT

SD15_STEPS = 20
SD15 = f"--arch sd15 --height 512 --width 512 --steps {SD15_STEPS} --dtype bfloat16"
# FLUX.1's transformer at full size (19 + 38 blocks, 3072 wide; random weights, built on the GPU) over the
# tiny pipeline's text encoders and VAE: bench_caches.py --flux1-size.
FLUX1_1024 = "--arch tiny-flux --flux1-size --height 1024 --width 1024 --dtype bfloat16"


# ---- the parts' work on a GPU (their GPU commands' sizes; the smoke runs its own, in seconds) ----------
CUDA_GRAPHS = {"repeats": 5, "images": (1, 4, 8)}
ENGINES = {"concurrency": (1, 16), "requests": 16, "poisson": 40, "load": 0.8, "profile": 20, "cap": 8}
LORA = {"rank": 16, "rows": 8, "distinct": 4, "repeats": 2}
# The step caches' part, sized to share one call with slo (its budget about 220 s of the 540, at FLUX.1's
# measured 254 ms a step): FLUX.1 at 1024x1024, 6 steps, 4 requests at c=2, none + the script's 3 caches
# (FBC at two thresholds, TaylorSeer) and its probe, 2 rounds (its noise verdicts need two), closed loop
# and Poisson at 80%. At 7 steps the two would need 541 s; at 10, 629 s.
STEP_CACHES = {
    "steps": 6,
    "requests": 4,
    "cap": 2,
    "concurrency": 2,
    "variants": 4,
    "rounds": 2,
    "load": 0.8,
}
FAMILIES = 14  # family_invariance.FAMILIES (tests/unit/test_gpu_checks.py holds them equal)
# The SLO part: 40 requests (half interactive at 4 steps, half background at 16-30), 2 rounds of the step
# engine with tiers and deadlines against first come first served (the H200 run at e12dd70 found tiers
# refusing most interactive requests there: docs/gpu/checks_h200/slo), at 70% and 110% load.
SLO = {
    "requests": 40,
    "loads": (0.7, 1.1),
    "variants": ("tiers", "oldest"),
    "rounds": 2,
    "cap": 8,
    "steps": 0.5 * 4 + 0.5 * 23,
}
# A run waits for its arrivals, Poisson at load x the capacity the bench measures (requests/s of the mix
# through the request-level engine): 2.99 and 3.75 on the H200 (docs/gpu/checks_h200/slo, and a re-run the
# same day), below what forwards of 8 images alone would give; the lower one here.
SLO_CAPACITY = 3.0
# The mixed-sizes part (issue: packed forwards): FLUX.1's full-size transformer in bf16, mixed traffic over
# 512x512, 768x768 and 1024x1024, 4 steps, packed vs by-shape vs the request-level engine, 6 requests at
# c=3 (3 jobs a forward), closed loop and Poisson at 80% of by-shape's closed loop, 2 rounds: about 113 s
# (at 5 steps 134 s, at 8 requests 143 s). Homogeneous traffic is left out: at one size packed and
# by-shape run the same forwards (a forward of one size is never packed).
MIXED_SIZES = {
    "sizes": (512, 768, 1024),
    "steps": 4,
    "requests": 6,
    "poisson": 6,
    "concurrency": 3,
    "cap": 3,
    "rounds": 2,
    "load": 0.8,
}

# The checkpoint-cost part (issue: a crash loses no work): SD 1.5 at 512x512 bf16, a full running set of 8
# jobs of 20 steps, checkpoints off / every step / every 5 steps, 3 rounds of 60 engine steps each (after a
# warm-up of 20), alternated in blocks: what a checkpoint costs an engine step on a GPU.
CHECKPOINT_COST = {"running": 8, "steps": 20, "engine_steps": 60, "rounds": 3, "intervals": (0, 1, 5)}


def cuda_graphs_work() -> list[Work]:
    repeats, steps = CUDA_GRAPHS["repeats"], SD15_STEPS
    timed = repeats + 1  # benchmarks/inprocess.timed_median: a warm-up, then the repeats
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
        calls = max(requests // 2, cap * 2)  # benchmarks/engines.raw_ceiling: images per batch size
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
    batches = -(-requests // c2)
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
                # fbc:1.0: each batch's first step computes; from its second nearly every row reuses (the
                # first block and the output layers run: under a tenth of a forward)
                Work(f"round {r}, the probe (fbc:1.0)", batches + -(-batches * (steps - 1) // 10), c2, model),
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
    sample = max(2 * cap, 16)  # benchmarks/slo.capacity's sample of the mix
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
            Work(
                f"round {r}, Poisson {load:.0%}, {variant}",
                seconds=s["requests"] / (load * SLO_CAPACITY) + s["steps"] * step_seconds("sd15-512", cap),
            )
            for load in s["loads"]
            for r in range(1, s["rounds"] + 1)
            for variant in s["variants"]
        ],
    ]


def flux1_share(side: int) -> float:
    """A FLUX.1 forward of one side x side image over one of 1024x1024, by FLOPs (STEP_COSTS' flux1-1024:
    at 4096 image + 512 text tokens, linear layers 59.4 TFLOP, in proportion to tokens, attention 14.9, to
    their square). The text counted at FLUX.1-dev's 512 tokens, more than tiny-flux's 64: an upper bound,
    like the compute-bound cost itself at the smaller sizes."""
    share = ((side // 16) ** 2 + 512) / (4096 + 512)
    return (59.4 * share + 14.9 * share**2) / (59.4 + 14.9)


def mixed_sizes_work() -> list[Work]:
    """In forwards of one 1024x1024 image (flux1-1024; flux1_share converts): a packed forward pads every
    row to the largest in it, counted here as 1024x1024 (at most); by-shape and the request-level engine
    compute each size at its own cost, the mixed traffic's mean."""
    m, model = MIXED_SIZES, "flux1-1024"
    steps, requests, rounds, load = m["steps"], m["requests"], m["rounds"], m["load"]
    shares = [flux1_share(side) for side in m["sizes"]]
    mean = sum(shares) / len(shares)
    one = step_seconds(model, 1)

    def forwards(image_steps: float) -> int:
        return math.ceil(image_steps)

    def poisson(what: str, share: float) -> Work:
        # arrivals at 80% of by-shape's capacity: a variant slower than that (packed) runs its work; plus
        # the last request's own latency at a full forward a step (as budget.open_loop)
        work = m["poisson"] * steps * one
        span = max(work * mean / load, work * share) + steps * one * mean * m["cap"]
        return Work(what, seconds=span)

    sizes = len(m["sizes"])
    return [
        Work(
            "start, imports, tiny FLUX.1, FLUX.1's transformer built at full size on the GPU (estimate)",
            seconds=30,
        ),
        Work(
            "warm-up, packed: every size twice (at most 1024x1024 a row)",
            forwards(2 * sizes * steps),
            1,
            model,
        ),
        Work(
            "warm-up, by-shape and request: every size twice", forwards(2 * 2 * steps * sum(shares)), 1, model
        ),
        *[
            piece
            for r in range(1, rounds + 1)
            for piece in (
                Work(
                    f"round {r}, closed loop c={m['concurrency']}: packed (rows padded: at most 1024x1024)",
                    forwards(requests * steps),
                    1,
                    model,
                ),
                Work(
                    f"round {r}, closed loop c={m['concurrency']}: by-shape and request",
                    forwards(2 * requests * steps * mean),
                    1,
                    model,
                ),
                poisson(f"round {r}, Poisson {load:.0%}: packed", 1.0),
                poisson(f"round {r}, Poisson {load:.0%}: by-shape", mean),
                poisson(f"round {r}, Poisson {load:.0%}: request", mean),
            )
        ],
    ]


@dataclass
class Run:
    """One run of the checks: where parts write, smoke or GPU, and what earlier parts left."""

    out: Path  # where the parts' folders are
    smoke: bool
    python: str = sys.executable
    outcomes: dict[str, PartOutcome] = field(default_factory=dict)

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
class PartOutcome:
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
            f"{joined(s['loads'])} --rounds {s['rounds']} --variants {joined(s['variants'])} "
            "--interactive-steps 4 --background-steps 16-30"
        )
    return ["bench_slo.py", *sizes.split(), "--out", str(run.folder("slo"))]


def checkpoint_cost_work() -> list[Work]:
    c = CHECKPOINT_COST
    # Each round: its warm-up steps, then the measured ones of every interval (in alternated blocks).
    per_round = c["steps"] + c["engine_steps"] * len(c["intervals"])
    return [
        Work("start, imports, SD 1.5's weights built (estimate)", seconds=30),
        Work(
            f"{c['rounds']} rounds of {per_round} engine steps, {c['running']} jobs a forward",
            c["rounds"] * per_round,
            c["running"],
        ),
    ]


def checkpoint_cost_command(run: Run) -> list[str]:
    c = CHECKPOINT_COST
    if run.smoke:
        sizes = "--running 2 --steps 4 --engine-steps 6 --rounds 1 --threads 1"
    else:
        sizes = (
            f"--arch sd15 --size 512 --running {c['running']} --steps {c['steps']} "
            f"--engine-steps {c['engine_steps']} --rounds {c['rounds']} --intervals {joined(c['intervals'])}"
        )
    return ["bench.py", "checkpoint-cost", *sizes.split(), "--out", str(run.folder("checkpoint_cost"))]


def mixed_sizes_command(run: Run) -> list[str]:
    m = MIXED_SIZES
    if run.smoke:
        sizes = (
            "--sizes 64x64,96x64,64x128 --steps 2 --requests 4 --cap 2 --concurrency 2 --rounds 1 --loads="
        )
    else:
        sizes = (
            f"--flux1-size --dtype bfloat16 --sizes {joined(f'{s}x{s}' for s in m['sizes'])} "
            f"--steps {m['steps']} --requests {m['requests']} --poisson-requests {m['poisson']} "
            f"--cap {m['cap']} --concurrency {m['concurrency']} --rounds {m['rounds']} --loads {m['load']}"
        )
    args = ["mixed-sizes", "--arch", "tiny-flux", "--traffic", "mixed", *sizes.split()]
    return ["bench.py", *args, "--out", str(run.folder("mixed_sizes"))]


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
        "closed loop c=1 and 16, mixed, Poisson 80%, stage costs, the engine's stopwatch against a synced "
        "host clock, profile)",
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
        "transformer at 1024x1024 bf16, 6 steps, 4 requests at c=2, 2 rounds (random weights: speed only, "
        "the reuse fractions say nothing about a real model's) (issue 33)",
        step_caches_work,
        step_caches_command,
        ("bench_caches.json",),
        no_figures,
        needs=(("scripts/benchmarks/caches.py", "--flux1-size"),),
    ),
    Part(
        "slo",
        "service tiers and deadlines: interactive and background classes at 70% and 110% load, per-class "
        "latency, SLO attainment, preemptions, refusals with the estimates they rested on and the cost model "
        "the run ended with, against first come first served (SD 1.5 512x512 bf16) (issue 34)",
        slo_work,
        slo_command,
        ("bench_slo.json",),
        no_figures,
        needs=(("scripts/benchmarks/slo.py", "cost_model"),),
    ),
    Part(
        "mixed_sizes",
        "mixed sizes in one forward: packed vs one size per forward vs the request-level engine on FLUX.1's "
        "full-size transformer in bf16 (random weights: speed only), 512x512 / 768x768 / 1024x1024 drawn "
        "per request, 4 steps, 6 requests at c=3, closed loop and Poisson at 80%, 2 rounds",
        mixed_sizes_work,
        mixed_sizes_command,
        ("mixed_sizes.json",),
        mixed_sizes_figures,
        needs=(("scripts/benchmarks/mixed_sizes.py", "--flux1-size"),),
    ),
    Part(
        "checkpoint_cost",
        "what a job checkpoint costs an engine step: off vs every step vs every 5 steps, a full running set "
        "of 8 jobs, 3 alternated rounds (SD 1.5 512x512 bf16) (issue 43)",
        checkpoint_cost_work,
        checkpoint_cost_command,
        ("checkpoint_cost.json",),
        no_figures,
    ),
]

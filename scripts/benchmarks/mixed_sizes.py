"""Mixed resolutions in one forward: the step engine packing rows of different sizes into one denoiser call,
against one forward per latent shape, against the request-level engine, in one process.

Variants (one loaded model per family; the switch is flipped on its step adapter between runs):
  packed    the step engine with the adapter's packing on: jobs of every size share one group, each
            row padded to the longest with an attention key mask; the packing gate runs a forward of
            several sizes one size at a time where its cost fit prices that cheaper (the served default)
  by-shape  the step engine with it off: one latent shape per forward (the engine
            before packing: three sizes in flight take three forwards for every job to advance once)
  request   the request-level engine: one fused diffusers call per compatibility key (so per size) of each
            batch Triton would form (at most --window requests), --cap images a call
  packed-ungated  (only when named in --variants) packing on and the gate off (config packing_gate):
            every forward of several sizes runs packed, so its ratio is what the gate spares or costs

Where the adapter cannot pack (a tree before the feature) ``packed`` runs what ``by-shape`` runs;
the artefact records it (``families.<arch>.packing_available``) and the figures block says so.

Traffic, sizes given as WxH (--sizes; the defaults are the tiny models' CPU sizes):
  mixed        each request's size drawn uniformly (seed --size-seed) from --sizes: 64x64, 96x64, 64x128
  homogeneous  every request at the first of --sizes (64x64)
each at --steps steps and guidance 7.5, closed loop at --concurrency clients, then Poisson arrivals at
--loads (50/80/95%) of the capacity: the closed loop's images/s of the --capacity-of variant (default
by-shape, the baseline packing is measured against; the engines benchmark takes the request-level
engine's), its median over rounds, per family and traffic. Every Poisson run of one load has the same
arrival times (--arrival-seed); its first 10% by arrival are left out (warm-up).

Rounds: each of --rounds rounds runs the three variants back to back, in an order rotated from round to
round (packed, by-shape, request; then by-shape, request, packed; ...), so each round's ratio compares runs
that saw the same machine; the artefact keeps every run, and its summary takes the median over rounds. A
ratio is read by the one verdict rule (scripts/verdicts.py): its median's 90% sign-test interval, at least
5 rounds.

Per run: images/s delivered (every offered request counts: one refused, expired or failed is a miss),
mean and p95 latency from when the request was sent (its Poisson arrival, or its client's previous
answer), forwards per engine step (request-level: pipeline calls per engine step), jobs per forward
(images per call), distinct sizes per engine step (step engine), and the padded-token share of the
forwards (padded tokens over tokens plus padded tokens; 0 where the forwards do not report tokens), and
of the forwards whose jobs were of several sizes, the share the packing gate ran by size.

The defaults are the full run (both families, both traffic kinds, closed loop and three loads, three
rounds): about 12 minutes on this project's 2-core CPU host (15 with other work on its cores), written to
--out/mixed_sizes.json after every run (with the sizes, the device and the dtype it ran):

    .venv/bin/python scripts/bench.py mixed-sizes --out docs/cpu
    .venv/bin/python scripts/bench.py mixed-sizes --rounds 1 --requests 16 --loads '' --out /tmp/smoke

With ``--device-profile flux1-h100`` (``--arch tiny-flux``), tiny-flux's transformer and decode wait what
FLUX.1-dev's would take on an H100 and compute nothing (adapters/device_profiles.py): the packing gate at
that GPU's cost ratios, on this CPU, at FLUX.1's sizes:

    .venv/bin/python scripts/bench.py mixed-sizes --arch tiny-flux --device-profile flux1-h100 \
        --sizes 512x512,768x768,1024x1024 --rounds 5 --requests 16 --loads '' --out docs/profiles/flux1-h100

On a GPU (bf16 by default there; ``--dtype`` and ``--device`` choose), ``--flux1-size`` swaps FLUX.1's
transformer at full size (random weights, built on the device: speed only) into tiny-flux, over its text
encoders and VAE, as the step caches' benchmark does (``benchmarks.inprocess.full_size_flux1``); the GPU
check (``scripts/gpu_checks.py``, part ``mixed_sizes``) runs it at real sizes:

    python scripts/bench.py mixed-sizes --arch tiny-flux --traffic mixed --flux1-size --dtype bfloat16 \
        --sizes 512x512,768x768,1024x1024 --steps 4 --requests 6 --poisson-requests 6 --cap 3 \
        --concurrency 3 --rounds 2 --loads 0.8 --out docs/gpu/mixed_sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import time
from pathlib import Path

import artefacts
import torch
from tables.mixed_sizes import render
from verdicts import balanced_orders

from benchmarks.arrivals import Traffic, poisson_arrivals
from benchmarks.common import (
    POISSON_LOADS,
    REPO_ROOT,
    WARM_UP_FRACTION,
    benchmark_parser,
    poisson_label,
)
from benchmarks.engine_runs import outcome, run_request_level, run_step_engine
from benchmarks.inprocess import DTYPES, Bench, Recorder, device_and_dtype, full_size_flux1
from triton_diffusion.adapters.device_profiles import PROFILES, load_costs, profiles_for
from triton_diffusion.engine.jobs import StepReport
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.tiny_models import ARCHITECTURES

# The default sizes, WxH (width 96 and height 64, width 64 and height 128): the tiny models' on a CPU.
SIZES = ("64x64", "96x64", "64x128")
TRAFFIC_KINDS = ("mixed", "homogeneous")
# variant -> packing on (set_packing); packed-ungated: on with the packing gate off (config packing_gate),
# so every forward of mixed sizes runs packed: what the gate spares where it runs them by size.
VARIANTS = {"packed": True, "by-shape": False, "request": None, "packed-ungated": True}
DEFAULT_VARIANTS = ("packed", "by-shape", "request")
BASELINE = "by-shape"
GUIDANCE = 7.5
# The targets, packed / by-shape closed-loop throughput: never worse than by-shape (homogeneous
# traffic, and every family's mixed), and FLUX.1's mixed at least 1.3x.
TARGETS = {"mixed": ">= 1.0", "homogeneous": ">= 1.0"}
FLUX_MIXED_TARGET = ">= 1.3"
FLUX1_TEXT_TO_IMAGE = ("tiny-flux", "flux-bench")  # FLUX.1's text-to-image weights (not Fill, not a LoRA's)


def family_targets(arch: str) -> dict[str, str]:
    """The targets for one family's runs (its ``families`` entry in the artefact)."""
    return {**TARGETS, "mixed": FLUX_MIXED_TARGET} if arch in FLUX1_TEXT_TO_IMAGE else dict(TARGETS)


class SizedRecorder(Recorder):
    """A Recorder that also counts what packing changes: engine steps, forwards (or fused calls), jobs per
    forward, sizes per step, tokens and padded tokens; and ends the requests that leave without an image
    (refused, expired, failed), so the loop does not wait for them and they count as misses."""

    def __init__(self, traffic: Traffic, sizes: list[str]) -> None:
        super().__init__(traffic)
        self.sizes = sizes  # each request's size, by its index
        self.steps = self.forwards = self.jobs = self.tokens = self.padded = 0
        self.gated = {True: 0, False: 0}  # forwards of several sizes the packing gate ran packed / by size
        self.tokens_reported = False
        self.sizes_per_step: list[int] = []
        self.misses: set[int] = set()
        self.packed_over_plane: float | None = None  # the step engine's, when its run ended

    def ended(self, engine: StepEngine) -> None:
        # What its packed forwards measured over the cost plane's price for them (the factor the packing
        # gate prices a packed forward by; engine/estimates.py).
        self.packed_over_plane = engine.times.packed_factor

    def render(self, report: StepReport) -> None:
        super().render(report)
        calls = getattr(report, "calls", [])
        if report.forwards or calls or report.admitted:  # an engine step (not a call's progress report)
            self.steps += 1
        for forward in report.forwards:
            self.forwards += 1
            self.jobs += forward.images
            tokens, padded = getattr(forward, "tokens", None), getattr(forward, "padded_tokens", None)
            packing = getattr(forward, "packing", None)
            if packing is not None:
                self.gated[packing.packed] += 1
            if tokens is not None:
                self.tokens_reported = True
                self.tokens += tokens
                self.padded += padded or 0
        for call in calls:
            self.forwards += 1
            self.jobs += call.rows
        if report.forwards and report.stepped:
            self.sizes_per_step.append(len({self.sizes[s.job.record] for s in report.stepped}))
        for left in report.left:
            index = left.job.record
            if left.reason not in ("finished", "ended") and index not in self.misses:
                self.misses.add(index)
                self.traffic.done(index)

    def figures(self) -> dict:
        total = self.tokens + self.padded
        return {
            "engine_steps": self.steps,
            "forwards": self.forwards,
            "forwards_per_step": self.forwards / self.steps if self.steps else None,
            "jobs_per_forward": self.jobs / self.forwards if self.forwards else None,
            "sizes_per_step": statistics.fmean(self.sizes_per_step) if self.sizes_per_step else None,
            "tokens": self.tokens,
            "padded_tokens": self.padded,
            "padded_share": self.padded / total if total else 0.0,
            "tokens_reported": self.tokens_reported,
            # Of the forwards whose jobs were of several sizes, the share the gate ran by size.
            "by_size_share": self.gated[False] / sum(self.gated.values())
            if sum(self.gated.values())
            else None,
            "packed_over_plane": self.packed_over_plane,
        }


def cpu_stall_us() -> float | None:
    """Microseconds so far that some runnable task waited for a CPU (Linux PSI, /proc/pressure/cpu), or
    None where the kernel does not say: its growth over a run is how much other work took the cores."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    return float(line.rsplit("total=", 1)[1])


def set_packing(adapter: object, on: bool) -> None:
    """Packing on or off for a variant: the adapter's ``sizes.packing`` (its ``packs_sizes`` in a tree
    before adapters/row_sizes.py)."""
    sizes = getattr(adapter, "sizes", None)
    if hasattr(sizes, "packing"):
        sizes.packing = dataclasses.replace(sizes.packing, on=on)
    else:
        adapter.packs_sizes = on  # type: ignore[attr-defined]


def parse_size(size: str) -> tuple[int, int]:
    """``"WxH"`` -> (width, height)."""
    width, _, height = size.lower().partition("x")
    if not (width.isdigit() and height.isdigit()) or int(width) < 1 or int(height) < 1:
        raise ValueError(f"a size is WxH, like 512x768: got {size!r}")
    return int(width), int(height)


def traffic_sizes(sizes: tuple[str, ...] = SIZES) -> dict[str, tuple[str, ...]]:
    """Each traffic kind's sizes: mixed draws from all of them, homogeneous runs the first."""
    return {"mixed": tuple(sizes), "homogeneous": tuple(sizes[:1])}


def size_draw(count: int, traffic: str, seed: int, sizes: tuple[str, ...] = SIZES) -> list[str]:
    """Each request's size: drawn uniformly from the traffic's sizes (seeded: every variant and round sees
    the same sequence)."""
    rng = random.Random(seed)
    return [rng.choice(traffic_sizes(sizes)[traffic]) for _ in range(count)]


def sized_requests(bench: Bench, sizes: list[str], steps: int) -> list[dict]:
    """The requests' validated fields, as execute() parses them, each at its own size."""
    out = []
    for index, size in enumerate(sizes):
        raw = bench.raw_request(index, steps, GUIDANCE)
        raw["width"], raw["height"] = parse_size(size)
        out.append(bench.model.fields.parse(raw))
    return out


class SizedBench:
    """One family's loaded model and its runs of the three variants."""

    def __init__(self, arch: str, args: argparse.Namespace, device: str, dtype: torch.dtype) -> None:
        width, height = parse_size(args.sizes.split(",")[0])  # the model's default size: the first
        self.bench = Bench(arch, height, width, args.cap, device, dtype, device_profile=args.device_profile)
        if args.flux1_size:  # FLUX.1's transformer at full size, and a step adapter over it
            full_size_flux1(self.bench, device, dtype)
        self.args = args
        adapter = self.bench.adapter
        self.packing_available = adapter is not None and (
            hasattr(getattr(adapter, "sizes", None), "packing") or hasattr(adapter, "packs_sizes")
        )
        if adapter is None:
            raise SystemExit(f"{arch} has no step adapter: the step engine cannot serve it")
        if not self.packing_available:
            print(
                f"  {arch}: the step adapter has no packs_sizes (a tree before packing): "
                "packed runs what by-shape runs",
                flush=True,
            )

    def run(self, variant: str, traffic: Traffic, sizes: list[str]) -> SizedRecorder:
        bench = self.bench
        recorder = SizedRecorder(traffic, sizes)
        if VARIANTS[variant] is None:
            run_request_level(bench, traffic, self.args.window, recorder)
        else:
            set_packing(bench.adapter, bool(VARIANTS[variant]))
            bench.packing_gate = variant != "packed-ungated"
            run_step_engine(bench, traffic, bench.cohort, recorder=recorder)
        return recorder

    def measure(
        self,
        variant: str,
        requests: list[dict],
        sizes: list[str],
        labels: dict,
        concurrency: int | None = None,
        rate: float | None = None,
    ) -> dict:
        """One run: closed loop at ``concurrency`` or Poisson at ``rate``; its record for the artefact."""
        if rate is None:
            traffic = Traffic(requests, concurrency=concurrency)
        else:
            arrivals = poisson_arrivals(len(requests), rate, self.args.arrival_seed)
            traffic = Traffic(requests, arrivals=arrivals, warm_up_fraction=WARM_UP_FRACTION)
        stalled, started = cpu_stall_us(), time.perf_counter()
        recorder = self.run(variant, traffic, sizes)
        wall = time.perf_counter() - started
        after = cpu_stall_us()
        pressure = None if stalled is None or after is None else (after - stalled) / 1e6 / wall
        result = outcome(variant, labels["load"], traffic, concurrency, rate, [])
        measured = [i for i in range(traffic.warm_up, len(requests))]
        misses = sum(1 for i in measured if i in recorder.misses)
        delivered = result.images_per_s * (len(measured) - misses) / len(measured)
        return {
            **labels,
            "variant": variant,
            "packs_sizes": VARIANTS[variant] if self.packing_available else None,
            "concurrency": concurrency,
            "rate": rate,
            "requests": result.requests,
            "measured_requests": result.measured_requests,
            "misses": misses,
            "duration_s": result.duration_s,
            "images_per_s": delivered,
            "offered_images_per_s": result.offered_images_per_s,
            "latency_mean_s": result.latency_mean_s,
            "latency_p95_s": result.latency_p95_s,
            "first_step_mean_s": result.first_step_mean_s,
            "cpu_pressure": pressure,  # share of the run's time some task waited for a CPU (other work)
            **recorder.figures(),
        }


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__, "mixed-sizes")
    step_families = sorted(a for a in ARCHITECTURES if "flux" in a or "sd3" in a)
    parser.add_argument(
        "--arch", default="tiny-flux,tiny-sd3", help=f"families, comma-separated (of {step_families})"
    )
    parser.add_argument("--traffic", default="mixed,homogeneous", help="traffic kinds: mixed, homogeneous")
    parser.add_argument(
        "--sizes",
        default=",".join(SIZES),
        help="WxH, comma-separated: mixed traffic draws from them, homogeneous runs the first",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if any")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bfloat16 on cuda, float32 on cpu"
    )
    parser.add_argument(
        "--flux1-size",
        action="store_true",
        help="FLUX.1's transformer at full size (19 + 38 blocks, 3072 wide, random weights, built on the "
        "device) in place of tiny-flux's, over its text encoders and VAE (a GPU's figures; speed only)",
    )
    parser.add_argument(
        "--device-profile",
        choices=profiles_for("FluxPipeline"),
        help="its GPU's forward and decode times in place of tiny-flux's transformer and decode "
        "(adapters/device_profiles.py: flux1-h100); it computes no image",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (each runs every variant)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    parser.add_argument("--requests", type=int, default=160, help="requests per closed-loop run")
    parser.add_argument("--poisson-requests", type=int, default=120, help="requests per Poisson run")
    parser.add_argument(
        "--loads",
        default=",".join(str(load) for load in POISSON_LOADS),
        help="Poisson loads, fractions of the --capacity-of variant's closed-loop images/s ('' for none)",
    )
    parser.add_argument("--capacity-of", default=BASELINE, choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cap", type=int, default=8, help="jobs per forward / images per fused call")
    parser.add_argument("--window", type=int, default=32, help="Triton's max_batch_size (request engine)")
    parser.add_argument("--arrival-seed", type=int, default=1)
    parser.add_argument("--size-seed", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results")
    return parser


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def summarise(runs: list[dict]) -> list[dict]:
    """One row per family x traffic x load x variant: medians over rounds, and each round's ratio to the
    same round's by-shape run (throughput; p95 latency for Poisson)."""
    cells: dict[tuple, dict[int, dict]] = {}
    for run in runs:
        key = (run["family"], run["traffic"], run["load"], run["variant"])
        cells.setdefault(key, {})[run["round"]] = run
    rows = []
    for (family, traffic, load, variant), by_round in cells.items():
        base = cells.get((family, traffic, load, BASELINE), {})
        paired = [r for r in sorted(by_round) if r in base]
        row = {
            "family": family,
            "traffic": traffic,
            "load": load,
            "variant": variant,
            "rounds": len(by_round),
        }
        for name in ("images_per_s", "latency_mean_s", "latency_p95_s", "forwards_per_step",
                     "jobs_per_forward", "sizes_per_step", "padded_share", "by_size_share",
                     "packed_over_plane"):  # fmt: skip
            values = [run[name] for run in by_round.values() if run.get(name) is not None]
            row[name] = spread(values) if values else None
        for name, figure in (
            ("throughput_vs_by_shape", "images_per_s"),
            ("p95_vs_by_shape", "latency_p95_s"),
        ):
            ratios = [by_round[r][figure] / base[r][figure] for r in paired if base[r][figure]]
            row[name] = spread(ratios) if ratios else None
        row["tokens_reported"] = any(run["tokens_reported"] for run in by_round.values())
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    archs = [a for a in args.arch.split(",") if a]
    kinds = [t for t in args.traffic.split(",") if t]
    variants = [v for v in args.variants.split(",") if v]
    loads = [float(load) for load in args.loads.split(",")] if args.loads else []
    for name, chosen, known in (("--arch", archs, ARCHITECTURES), ("--traffic", kinds, TRAFFIC_KINDS),
                                ("--variants", variants, VARIANTS)):  # fmt: skip
        if not chosen or set(chosen) - set(known):
            parser.error(f"{name}: choose from {sorted(known)}")
    sizes = tuple(dict.fromkeys(size.strip().lower() for size in args.sizes.split(",") if size.strip()))
    try:
        dimensions = {size: parse_size(size) for size in sizes}
    except ValueError as exc:
        parser.error(f"--sizes: {exc}")
    if not sizes:
        parser.error("--sizes: at least one WxH")
    args.sizes = ",".join(sizes)
    if args.flux1_size and archs != ["tiny-flux"]:
        parser.error("--flux1-size swaps FLUX.1's transformer into tiny-flux: --arch tiny-flux alone")
    if args.device_profile and (args.flux1_size or archs != ["tiny-flux"]):
        parser.error(
            "--device-profile times tiny-flux's transformer: --arch tiny-flux alone, no --flux1-size"
        )
    if loads and args.capacity_of not in variants:
        parser.error("--capacity-of must be one of --variants for Poisson loads")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    device, dtype = device_and_dtype(args.device, args.dtype)
    report: dict = {
        "benchmark": "mixed-sizes",
        "settings": {
            "sizes": {name: {"width": w, "height": h} for name, (w, h) in dimensions.items()},
            "traffic": {kind: list(traffic_sizes(sizes)[kind]) for kind in kinds},
            "device": device,
            "dtype": str(dtype).removeprefix("torch."),
            "flux1_size": args.flux1_size,
            "device_profile": args.device_profile,
            # the times its stand-ins waited, and where they came from
            "device_profile_costs": load_costs(PROFILES[args.device_profile]).record()
            if args.device_profile
            else None,
            "variants": variants,
            # Each round's order of the variants: balanced for what one run leaves to the next (a
            # collection before each run besides), where rotated orders put each variant after the same one.
            "orders": "balanced",
            "baseline": BASELINE,
            "targets": TARGETS,
            **{
                k: getattr(args, k)
                for k in (
                    "rounds",
                    "concurrency",
                    "requests",
                    "poisson_requests",
                    "capacity_of",
                    "steps",
                    "cap",
                    "window",
                    "arrival_seed",
                    "size_seed",
                )
            },  # fmt: skip
            "guidance_scale": GUIDANCE,
            "loads": loads,
            "warm_up_fraction": WARM_UP_FRACTION,
        },
        "families": {},
        "runs": [],
        "summary": [],
        "complete": False,  # until the last run: a run cut short keeps what it measured
        "provenance": artefacts.provenance(),
    }
    path = args.out / "mixed_sizes.json"

    def measured(run: dict) -> None:
        report["runs"].append(run)
        report["summary"] = summarise(report["runs"])
        artefacts.write(path, report)

    started = time.perf_counter()
    for arch in archs:
        print(f"[{arch}]", flush=True)
        sized = SizedBench(arch, args, device, dtype)
        family = report["families"][arch] = {
            **sized.bench.report_header(args.steps),
            "transformer": "FLUX.1 at full size (random weights)"
            if args.flux1_size
            else f"device profile {args.device_profile}: {PROFILES[args.device_profile].what}"
            if args.device_profile
            else "its own",
            "packing_available": sized.packing_available,
            "targets": family_targets(arch),
            # The packing gate's prices from load (models/calibration.py): "rows x tokens": seconds.
            "calibration": {
                f"{rows}x{tokens}": seconds
                for (rows, tokens), seconds in (
                    sized.bench.calibration.calibration if sized.bench.calibration is not None else {}
                ).items()
            },
            "capacity_images_per_s": {},
        }
        warm_sizes = list(sizes) * 2  # every shape through every variant once before measuring
        warm = sized_requests(sized.bench, warm_sizes, args.steps)
        for variant in variants:
            sized.measure(variant, warm, warm_sizes, {"load": "warm-up"}, concurrency=len(warm))
        for kind in kinds:
            drawn = size_draw(max(args.requests, args.poisson_requests), kind, args.size_seed, sizes)
            requests = sized_requests(sized.bench, drawn, args.steps)
            closed = {"family": arch, "traffic": kind, "load": "closed"}
            print(f"[{arch} {kind}: closed loop at {args.concurrency}]", flush=True)
            for round_, order in enumerate(balanced_orders(variants, args.rounds)):
                for variant in order:
                    labels = {**closed, "round": round_}
                    gc.collect()  # the last run's garbage collected before this one, not during it
                    measured(
                        sized.measure(variant, requests[: args.requests], drawn, labels, args.concurrency)
                    )
            if not loads:
                continue
            capacity = statistics.median(
                r["images_per_s"]
                for r in report["runs"]
                if (r["family"], r["traffic"], r["load"], r["variant"])
                == (arch, kind, "closed", args.capacity_of)
            )
            family["capacity_images_per_s"][kind] = capacity
            poisson = requests[: args.poisson_requests]
            for load in loads:
                print(f"[{arch} {kind}: Poisson at {load:.0%} of {capacity:.2f} images/s]", flush=True)
                for round_, order in enumerate(balanced_orders(variants, args.rounds)):
                    for variant in order:
                        labels = {
                            "family": arch,
                            "traffic": kind,
                            "load": poisson_label(load),
                            "round": round_,
                        }
                        gc.collect()
                        measured(sized.measure(variant, poisson, drawn, labels, rate=load * capacity))
    report["complete"] = True
    report["wall_s"] = time.perf_counter() - started
    artefacts.write(path, report)
    print(render(report))
    print(f"wrote {path} ({report['wall_s']:.0f} s)")

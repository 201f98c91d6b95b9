"""Step caches per request on the step engine, in one process: the same traffic with no cache, First Block
Cache at two thresholds and TaylorSeer, side by side (``bench_engines.py --step-cache`` runs this).

For each variant, on the same requests (each with that ``step_cache``):
  closed    a closed loop at --concurrency: throughput, mean and p95 latency
  poisson   an open loop at --load of the uncached run's throughput (the same arrival times for every
            variant): mean and p95 latency
  reuse     the fraction of denoiser row-steps served from the caches
  overhead  (FBC) the cached forwards' time against their ideal: what always runs (a forward of the same
            jobs with every row reusing: the first block, embeddings, output layers, scheduler steps)
            plus the rest of an uncached forward in proportion to the rows that computed (both measured
            here per number of jobs); the per-row machinery (gathering rows, the per-branch decision)
            is what is above it

Random weights say nothing about quality, and little about how often a real model reuses: the reuse
fractions here are the tiny model's. Works on CPU (``flux-bench`` at 128x128) and on a GPU (bf16).

    .venv/bin/python scripts/bench_caches.py --out bench_results/caches
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    REPO_ROOT,
    Traffic,
    machine_description,
    mean,
    percentile,
    poisson_arrivals,
)
from bench_engines import Bench, Recorder, sync  # noqa: E402

from triton_diffusion.engine.jobs import StepReport  # noqa: E402
from triton_diffusion.tiny_models import ARCHITECTURES  # noqa: E402

# Random weights change their features far more from step to step than a trained model's: on flux-bench
# FBC starts to reuse at about 0.7 (a trained FLUX.1 at 0.05-0.12), so these thresholds are the random
# model's, chosen to reuse some and most steps.
VARIANTS = ("none", "fbc:0.7", "fbc:0.9", "taylorseer:4:2")


class CacheRecorder(Recorder):
    """The engines' reports into the traffic's clock, and each forward's jobs, rows and time."""

    def __init__(self, traffic: Traffic) -> None:
        super().__init__(traffic)
        self.forwards: list[tuple[int, int, int, float]] = []  # (jobs, rows, rows reused, seconds)

    def render(self, report: StepReport) -> None:
        super().render(report)
        self.forwards += [(f.images, f.rows, f.rows_reused, f.seconds) for f in report.forwards]


def run(bench: Bench, variant: str, requests: list[dict], traffic: Traffic) -> dict:
    recorder = CacheRecorder(traffic)
    engine = bench.step_engine(bench.cohort)
    while not traffic.finished:
        for index, values in traffic.arrived():
            engine.add(bench.job(index, {**values, "step_cache": variant}, "step"))
        if engine.active:
            recorder.render(engine.step())
        else:
            traffic.wait_for_arrival()
    sync(bench.device)
    measured = traffic.measure()
    rows = sum(f[1] for f in recorder.forwards)
    return {
        "variant": variant,
        "images_per_s": measured.delivered_per_s,
        "offered_per_s": measured.offered_per_s,
        "latency_mean_s": mean(measured.latencies),
        "latency_p95_s": percentile(measured.latencies, 0.95),
        "reused_fraction": sum(f[2] for f in recorder.forwards) / rows if rows else 0.0,
        "forwards": recorder.forwards,
    }


def forward_costs(bench: Bench, steps: int, repeats: int = 5) -> dict[int, dict[str, float]]:
    """Median seconds of one forward of k jobs uncached (``full``) and with every row reusing its First
    Block Cache (``head``: the first block, and the machinery around it)."""
    costs: dict[int, dict[str, float]] = {}
    adapter = bench.adapter
    for jobs_count in range(1, bench.cap + 1):
        full, head = [], []
        for cache, times in (("none", full), ("fbc:1.0", head)):
            jobs = [
                bench.job(i, {**bench.request(i, steps, 3.5), "step_cache": cache}, "step")
                for i in range(jobs_count)
            ]
            for job, start in zip(jobs, adapter.prepare(jobs), strict=True):
                job.begin(start)
            adapter.step(jobs)  # the first step computes and fills each job's cache
            for job in jobs:
                job.steps_done = 1
            for _ in range(repeats):
                sync(bench.device)
                started = time.perf_counter()
                adapter.step(jobs)  # fbc:1.0 reuses every row from the second step on
                sync(bench.device)
                times.append(time.perf_counter() - started)
        costs[jobs_count] = {"full": statistics.median(full), "head": statistics.median(head)}
    return costs


def overhead(forwards: list[tuple[int, int, int, float]], costs: dict[int, dict[str, float]]) -> float | None:
    """The cached forwards' time over their ideal: what always runs (``head``: the same jobs with every row
    reusing) plus the rest of an uncached forward (``full - head``) in proportion to the rows computed."""
    cached = [f for f in forwards if f[2]]
    if not cached:
        return None
    ideal = 0.0
    for jobs, rows, reused, _ in cached:
        cost = costs[jobs]
        ideal += cost["head"] + (cost["full"] - cost["head"]) * (rows - reused) / rows
    return sum(f[3] for f in cached) / ideal - 1


def full_size_flux1(bench: Bench, device: str, dtype: torch.dtype) -> None:
    """Swap in FLUX.1-dev's transformer shape (random weights, made on the device: no 24 GB on disk), fed
    by the loaded pipeline's own text encoders (so only its input projections differ from FLUX.1's)."""
    from diffusers import FluxTransformer2DModel

    from triton_diffusion.adapters.step_adapters import step_adapter_for

    pipe = bench.pipe
    tiny = pipe.transformer.config
    with torch.device(device):
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=tiny.in_channels,
            out_channels=tiny.out_channels,
            num_layers=19,
            num_single_layers=38,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=tiny.joint_attention_dim,
            pooled_projection_dim=tiny.pooled_projection_dim,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        ).to(dtype)
    pipe.transformer = transformer
    model = bench.model
    bench.adapter = step_adapter_for(
        pipe, model.facts, model.schedulers, model.call_extras.get("max_sequence_length")
    )


def markdown(report: dict) -> str:
    lines = [
        f"Step caches per request ({report['machine']}), {report['arch']} {report['size']}, "
        f"{report['steps']} steps, {report['requests']} requests; closed loop at c={report['concurrency']}, "
        f"Poisson at {report['load']:.0%} of the uncached throughput.",
        "",
        "| variant | closed images/s | vs none | mean s | p95 s | Poisson mean s | Poisson p95 s | reused "
        "| overhead over ideal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = report["closed"][0]["images_per_s"]
    for closed, poisson in zip(report["closed"], report["poisson"], strict=True):
        extra = closed.get("overhead")
        lines.append(
            f"| {closed['variant']} | {closed['images_per_s']:.2f} | {closed['images_per_s'] / base:.2f}x "
            f"| {closed['latency_mean_s']:.2f} | {closed['latency_p95_s']:.2f} "
            f"| {poisson['latency_mean_s']:.2f} | {poisson['latency_p95_s']:.2f} "
            f"| {closed['reused_fraction']:.0%} | {'-' if extra is None else f'{extra:+.0%}'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="flux-bench")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="step_cache values, 'none' first")
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cap", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument(
        "--flux1-size",
        action="store_true",
        help="FLUX.1's transformer at full size (19 + 38 blocks, 3072 wide, random weights, built on the "
        "device) in place of the loaded one, over its text encoders and VAE (a GPU's step-cache figures)",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "caches")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        args.dtype, torch.bfloat16 if device == "cuda" else torch.float32
    )
    bench = Bench(args.arch, args.height, args.width, args.cap, device, dtype)
    if args.flux1_size:
        full_size_flux1(bench, device, dtype)
    requests = [bench.request(i, args.steps, 3.5) for i in range(args.requests)]
    print("warm-up and forward costs", flush=True)
    costs = forward_costs(bench, args.steps)
    report: dict = {
        "machine": machine_description(f"{torch.get_num_threads()} torch threads", device),
        "arch": args.arch,
        "size": f"{args.width}x{args.height}",
        "steps": args.steps,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "load": args.load,
        "forward_costs": costs,
        "closed": [],
        "poisson": [],
    }
    for variant in variants:
        result = run(bench, variant, requests, Traffic(requests, concurrency=args.concurrency))
        forwards = result.pop("forwards")  # the ideal is FBC's (skipped blocks), not TaylorSeer's (attention)
        result["overhead"] = overhead(forwards, costs) if variant.startswith("fbc") else None
        report["closed"].append(result)
        images, reused = result["images_per_s"], result["reused_fraction"]
        print(f"  closed {variant}: {images:.2f} images/s, reused {reused:.0%}", flush=True)
    rate = args.load * report["closed"][0]["images_per_s"]
    arrivals = poisson_arrivals(len(requests), rate, seed=1)
    for variant in variants:
        result = run(bench, variant, requests, Traffic(requests, arrivals=arrivals, warm_up_fraction=0.1))
        result.pop("forwards")
        report["poisson"].append(result)
        print(f"  poisson {variant}: p95 {result['latency_p95_s']:.2f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_caches.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / "bench_caches.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()

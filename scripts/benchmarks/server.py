"""Benchmark on the real server: the two image engines side by side, and the in-process ceiling.

Variants, on the same model and machine:
  request    the request-level engine: one fused diffusers call per compatible group (engine request)
  step       the step engine: requests join a running denoising loop at the next step (engine step)
  singleton  (--singleton) the request-level engine with one row per call: no batching at all
  raw        the same diffusers pipeline called in-process, batch 1 and batch = max batch size, no server

Each server variant is started by this script (a temporary copy of the model repository), driven with the
project's gRPC client (closed loop at each --concurrency), then stopped. --mixed adds mixed traffic (steps
from {4, 8, 16} x guidance from {1, 5, 7.5}, closed loop at the top concurrency); --poisson adds Poisson
arrivals at 50/80/95% of the request-level engine's saturated throughput (mean/p95 latency and time to
the first step); --sweep the request-level engine's images-per-call x queue-delay grid; --openai the
OpenAI front's overhead (one step-engine server with the front: closed loop at the top concurrency through
the official ``openai`` client and through Python's ``http.client`` against gRPC direct, in --rounds
rounds rounded up to whole cycles of six, the paths in orders balanced for what one run leaves to the
next).
Writes bench.json, bench.md and bench.png (throughput and p95 latency against concurrency) to --out.


    .venv/bin/python scripts/bench.py server --concurrency 1,2,4,8,16 --requests 96 --mixed --poisson
    .venv/bin/python scripts/bench.py --concurrency 1,2,4,8,16 --requests 96 --mixed --poisson  # the same
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, replace
from pathlib import Path

import artefacts
from verdicts import balanced_orders, rotated_orders

from benchmarks.common import (
    MIXED_GUIDANCE,
    MIXED_STEPS,
    POISSON_LOADS,
    PROMPTS,
    REPO_ROOT,
    benchmark_parser,
    machine_description,
    max_sequence_length,
    poisson_label,
    ratio_value,
    step_request_ratios,
)
from benchmarks.reports import load_cell, number_cell, ratio_table, write_heatmap, write_plot
from benchmarks.servers import FRONT_CLIENTS, RunStats, ServerVariant, make_requests
from triton_diffusion.serving.server_process import WEIGHTS, free_port
from triton_diffusion.tiny_models import ARCHITECTURES, build_missing

MODEL_FOR_ARCH = {"tiny-sd": "text_to_image", "tiny-flux": "text_to_image_flux", "sd15": "text_to_image"}

ENGINE_VARIANTS = {
    "request": {"engine": "request"},
    "step": {"engine": "step"},
    "singleton": {"engine": "request", "max_rows_per_call": "1"},
}


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__, "server")
    parser.add_argument(
        "--arch",
        choices=sorted(ARCHITECTURES),
        default="tiny-sd",
        help="random-weight architecture to build and serve (full-size ones for GPUs)",
    )
    parser.add_argument("--concurrency", default="1,2,4,8", help="comma-separated closed-loop concurrencies")
    parser.add_argument("--requests", type=int, default=64, help="requests per run")
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=8,
        help="images per fused call or forward (max_rows_per_call)",
    )
    parser.add_argument(
        "--triton-max-batch-size",
        type=int,
        default=32,
        help="requests Triton hands one execute() (the planner's window)",
    )
    parser.add_argument("--queue-delay-us", type=int, default=20000)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--progress", action="store_true", help="stream progress (reports time to first)")
    parser.add_argument("--singleton", action="store_true", help="also the unbatched request-level engine")
    parser.add_argument("--mixed", action="store_true", help="also mixed steps x guidance traffic")
    parser.add_argument("--poisson", action="store_true", help="also Poisson arrivals at 50/80/95%% load")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each traffic (closed loop at the top concurrency, mixed, each Poisson load: its own "
        "arrivals a round), the servers alternated; each ratio is read round by round. Every server "
        "stays up (idle while another runs) until its last round: on a GPU, each holds its pipeline",
    )
    parser.add_argument(
        "--poisson-requests",
        type=int,
        default=400,
        help="requests per Poisson run (steady state: the first 10%% are left out)",
    )
    parser.add_argument("--sweep", action="store_true", help="also sweep images per call x queue delay")
    parser.add_argument(
        "--openai", action="store_true", help="also the OpenAI front's overhead against gRPC direct"
    )
    parser.add_argument("--no-raw", action="store_true", help="skip the in-process ceiling")
    parser.add_argument(
        "--slo",
        action="store_true",
        help="instead: service tiers and deadlines through the server (bench_slo_server.py; its own "
        "options follow --slo-args)",
    )
    parser.add_argument("--slo-args", default="", help="options for bench_slo_server.py, as one string")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results")
    return parser


def instead(argv: list[str]) -> tuple[str, list[str]] | None:
    """``--slo`` runs the benchmark ``slo_server`` in this one's place (the dispatcher, ``benchmarks.main``,
    runs it), with --slo-args, --arch and --out."""
    args = build_parser().parse_args(argv)
    if args.slo:
        return "slo_server", [*args.slo_args.split(), "--arch", args.arch, "--out", str(args.out)]
    return None


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.slo:
        parser.error("--slo runs another benchmark: run it through scripts/bench.py")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    build_missing(WEIGHTS, only=[args.arch])
    weights = WEIGHTS / args.arch
    model = MODEL_FOR_ARCH[args.arch]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    top = max(concurrencies)
    shape = (args.height, args.width, args.steps)
    requests = make_requests(args.requests, [shape], args.progress)
    mixed_shapes = [(args.height, args.width, steps) for steps in MIXED_STEPS]
    mixed = make_requests(args.requests, mixed_shapes, True, seed=3, guidance=MIXED_GUIDANCE)
    size_edits = {
        "default_height": str(args.height),
        "default_width": str(args.width),
        "max_height": str(max(args.height, 2048)),
        "max_width": str(max(args.width, 2048)),
    }
    args.out.mkdir(parents=True, exist_ok=True)

    names = ["request", "step"] + (["singleton"] if args.singleton else [])
    variants: dict[str, ServerVariant] = {}
    runs: list[RunStats] = []
    try:
        # Each round runs every server's closed loops (every concurrency in the first, the top one after)
        # and mixed traffic, the servers in rotated order; a server starts once and stays up (idle while
        # another runs) until its last run.
        for round_, order in enumerate(rotated_orders(names, args.rounds)):
            for name in order:
                if name not in variants:
                    variants[name] = start_variant(args, name, model, weights, size_edits, requests, mixed)
                variant = variants[name]
                for concurrency in concurrencies if round_ == 0 else [top]:
                    runs.append(replace(variant.run(requests, concurrency, None), round=round_))
                if args.mixed and name != "singleton":
                    runs.append(replace(variant.run(mixed, top, None), traffic="mixed", round=round_))
                last = round_ == args.rounds - 1
                if last and name != "step" and not (args.poisson and name == "request"):
                    variants.pop(name).stop()  # kept for the Poisson runs (idle meanwhile): no second start
        if args.poisson:
            closed = [r for r in runs if r.variant == "request" and r.traffic == "homogeneous"]
            saturated = max(  # the best concurrency's, its rounds pooled
                sum(r.requests for r in at) / sum(r.duration_s for r in at)
                for at in ([r for r in closed if r.concurrency == c] for c in concurrencies)
            )
            poisson_requests = make_requests(args.poisson_requests, [shape], True)
            for load in POISSON_LOADS:
                # Each round its own arrivals, the same for both servers, in rotated order.
                for round_, order in enumerate(rotated_orders(["request", "step"], args.rounds)):
                    for name in order:
                        seed = 1 + round_
                        stats = variants[name].run(poisson_requests, None, load * saturated, seed=seed)
                        runs.append(
                            replace(stats, traffic=poisson_label(load), round=round_, arrival_seed=seed)
                        )
    finally:
        for variant in variants.values():
            variant.stop()
    if args.openai:
        runs += run_front_overhead(args, model, weights, size_edits, requests, top)

    raw = []
    if not args.no_raw:
        print("[raw] in-process pipeline", flush=True)
        length = max_sequence_length(args.arch)
        extra = {"max_sequence_length": length} if length else {}
        raw = run_raw(
            weights, [1, args.max_batch_size], args.requests, args.height, args.width, args.steps, extra
        )

    report = {
        "machine": machine_description(),
        "arch": args.arch,
        "model": model,
        "height": args.height,
        "width": args.width,
        "steps": args.steps,
        "max_batch_size": args.max_batch_size,
        "triton_max_batch_size": args.triton_max_batch_size,
        "queue_delay_us": args.queue_delay_us,
        "requests": args.requests,
        "rounds": args.rounds,
        "runs": [asdict(r) for r in runs],
        "raw": raw,
    }
    report["ratios"], report["ratio_rounds"] = ratios(runs, raw, top)
    if args.sweep:
        report["sweep"] = run_sweep(args, model, weights, size_edits, requests, top)

    artefacts.write(args.out / "bench.json", report)
    (args.out / "bench.md").write_text(markdown(report))
    # The first round's closed loops: the one round that ran every concurrency.
    write_plot([r for r in runs if r.traffic == "homogeneous" and r.round == 0], args.out / "bench.png")
    print(markdown(report))
    print(f"wrote {args.out}/bench.json, bench.md, bench.png")


def run_front_overhead(
    args: argparse.Namespace, model: str, weights: Path, size_edits: dict, requests: list[dict], top: int
) -> list[RunStats]:
    """One step-engine server with the OpenAI front: gRPC direct and through the front with each client of
    FRONT_CLIENTS at the top concurrency, in ``front_rounds(args.rounds)`` rounds, the paths in orders
    balanced for what one run leaves to the next, so all see the same server and the same machine and
    each ratio is read from its rounds."""
    print(
        "[openai] the front's overhead: one step-engine server, gRPC direct and through the front", flush=True
    )
    variant = ServerVariant(
        "step",
        model,
        weights,
        args.max_batch_size,
        args.queue_delay_us,
        args.triton_max_batch_size,
        {**size_edits, **ENGINE_VARIANTS["step"]},
        openai_port=free_port(),
    )
    plain = [{k: v for k, v in r.items() if k != "progress"} for r in requests]
    try:
        variant.warm_up(plain[0], args.max_batch_size)
        for client in FRONT_CLIENTS:  # warm-up
            variant.run(plain[: args.max_batch_size], args.max_batch_size, None, front=client)
        runs = []
        paths: list[str | None] = [None, *FRONT_CLIENTS]  # gRPC direct, then through the front
        for round_, order in enumerate(balanced_orders(paths, front_rounds(args.rounds))):
            for path in order:
                before = variant.cpu_seconds()
                stats = variant.run(plain, top, None, front=path)
                after = variant.cpu_seconds()
                cpu = {part: 1000 * (after[part] - before[part]) / len(plain) for part in after}
                runs.append(replace(stats, traffic=path or "grpc", cpu_ms_per_request=cpu, round=round_))
                shares = ", ".join(f"{part} {ms:.2f}" for part, ms in cpu.items())
                print(f"    round {round_} {path or 'grpc'}: CPU ms per request: {shares}", flush=True)
        return runs
    finally:
        variant.stop()


def front_rounds(rounds: int) -> int:
    """The front's rounds: the take's (--rounds) rounded up to whole cycles of the balanced orders of its
    three paths (six rounds: each path after each other equally often within them), and at least one
    cycle, more than the 5 a verdict needs (scripts/verdicts.py): three short closed loops a round."""
    cycle = 6
    return max(cycle, -(-rounds // cycle) * cycle)


def run_raw(
    weights: Path, batch_sizes: list[int], images: int, height: int, width: int, steps: int, extra: dict
) -> list[dict]:
    """The ceiling: the same pipeline called in-process, no server."""
    import resource

    import torch
    from diffusers import DiffusionPipeline

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pipe = DiffusionPipeline.from_pretrained(weights, torch_dtype=dtype, use_safetensors=True).to(device)
    pipe.set_progress_bar_config(disable=True)
    out = []
    for batch in batch_sizes:

        def call(offset: int, batch: int = batch) -> None:
            prompts = [PROMPTS[(offset + i) % len(PROMPTS)] for i in range(batch)]
            generators = [torch.Generator("cpu").manual_seed(offset + i) for i in range(batch)]
            with torch.inference_mode():
                pipe(
                    prompt=prompts,
                    generator=generators,
                    height=height,
                    width=width,
                    num_inference_steps=steps,
                    output_type="pil",
                    **extra,
                )

        call(0)  # warm-up (torch.compile-free, but first calls allocate)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        calls = max(1, images // batch)
        started = time.perf_counter()
        for n in range(calls):
            call(n * batch)
        if device == "cuda":
            torch.cuda.synchronize()
        duration = time.perf_counter() - started
        peak = (
            torch.cuda.max_memory_allocated() / 2**20
            if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        )
        out.append(
            {
                "variant": f"raw-batch{batch}",
                "batch": batch,
                "images": calls * batch,
                "duration_s": duration,
                "images_per_s": calls * batch / duration,
                "latency_per_call_s": duration / calls,
                "peak_memory_mb": peak,
            }
        )
        print(f"  raw batch {batch}: {calls * batch / duration:.2f} images/s", flush=True)
    return out


def markdown(report: dict) -> str:
    lines = [
        f"Machine: {report['machine']}; model {report['model']} ({report['arch']}), "
        f"{report['height']}x{report['width']}, {report['steps']} steps, "
        f"{report['max_batch_size']} images per fused call or forward, Triton max_batch_size "
        f"{report['triton_max_batch_size']}, "
        f"queue delay {report['queue_delay_us'] / 1000:g} ms, {report['requests']} requests per run.",
        "",
        "| variant | traffic | concurrency / rate | req/s | images/s | mean (s) | p50 (s) | p95 (s) "
        "| p99 (s) | first step (s) | images per call or forward | peak memory (MB) | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        first = number_cell(r["first_progress_mean_s"])
        rows = number_cell(r["mean_rows_per_call"], 2)
        lines.append(
            f"| {r['variant']} | {r['traffic']} | {load_cell(r['concurrency'], r['rate'])} "
            f"| {r['requests_per_s']:.2f} "
            f"| {r['images_per_s']:.2f} | {r['latency_mean_s']:.3f} | {r['latency_p50_s']:.3f} "
            f"| {r['latency_p95_s']:.3f} | {r['latency_p99_s']:.3f} | {first} | {rows} "
            f"| {r['peak_memory_mb']:.0f} | {r['errors']} |"
        )
    for raw in report["raw"]:
        lines.append(
            f"| {raw['variant']} (in-process) | - | - | {raw['images_per_s']:.2f} "
            f"| {raw['images_per_s']:.2f} "
            f"| {raw['latency_per_call_s']:.3f} per call | - | - | - | - | {raw['batch']} "
            f"| {raw['peak_memory_mb']:.0f} | 0 |"
        )
    lines += ["", *ratio_table(report["ratios"])]
    if report.get("sweep"):
        s = report["sweep"]
        lines += [
            "",
            f"Sweep (request-level engine) at concurrency {s['concurrency']}: best images per call="
            f"{s['best']['max_batch_size']}, max_queue_delay={s['best']['queue_delay_us'] / 1000:g} ms "
            f"({s['best']['requests_per_s']:.2f} req/s).",
        ]
    return "\n".join(lines) + "\n"


FRONT_CLIENT_LABELS = {"openai": "the official openai client", "http": "http.client"}


def front_ratios(
    grpc: list[RunStats], front: list[RunStats], label: str, top: int
) -> tuple[dict[str, tuple[float, str]], dict[str, list[float]]]:
    """Through the front with one kind of client against gRPC direct in the same round: throughput and
    p95 latency, each the median of its rounds (kept for the verdict); and the CPU per request that
    separates the front's cost and the client's from the server's work (on one machine all share the
    cores), the median round's (a share, read against no target)."""
    direct_by_round = {r.round: r for r in grpc}
    throughput, p95, own, client = [], [], [], []  # one value a round
    for through in front:
        direct = direct_by_round.get(through.round)
        if direct is None:
            continue
        cpu, direct_cpu = through.cpu_ms_per_request, direct.cpu_ms_per_request
        throughput.append(through.images_per_s / direct.images_per_s)
        p95.append(through.latency_p95_s / direct.latency_p95_s)
        if cpu["server"] > 0:  # CPU time comes in clock ticks: a short run may show none
            own.append(cpu["front"] / cpu["server"])
            client.append((cpu["client"] - direct_cpu["client"]) / cpu["server"])
    if not throughput:
        return {}, {}
    names = {
        "throughput": f"OpenAI front ({label}) / gRPC direct throughput, step engine, c={top}",
        "p95": f"OpenAI front ({label}) / gRPC direct p95 latency, c={top}",
    }
    out = {
        names["throughput"]: (ratio_value(throughput), ">= 0.95"),
        names["p95"]: (ratio_value(p95), "-"),
    }
    if own:
        out[f"OpenAI front's own CPU / the server's, per request ({label})"] = (ratio_value(own), "-")
        out[f"{label}'s CPU over the gRPC client's, per request / the server's"] = (ratio_value(client), "-")
    rounds = {names["throughput"]: throughput, names["p95"]: p95} if len(throughput) > 1 else {}
    return out, rounds


def ratios(
    runs: list[RunStats], raw: list[dict], top: int
) -> tuple[dict[str, tuple[float, str]], dict[str, list[float]]]:
    """``{label: (value, target)}``, and each ratio's rounds where it has more than one."""

    def pick(variant: str, traffic: str = "homogeneous") -> RunStats | None:
        found = [r for r in runs if r.variant == variant and r.traffic == traffic]
        if traffic == "homogeneous":
            found = [r for r in found if r.concurrency == top]
        return found[-1] if found else None

    out, rounds = step_request_ratios(runs, top, "first_progress_mean_s", key="variant")
    grpc = [r for r in runs if r.traffic == "grpc"]
    for client, label in FRONT_CLIENT_LABELS.items():
        front = [r for r in runs if r.traffic == client]
        if grpc and front:
            values, each = front_ratios(grpc, front, label, top)
            out.update(values)
            rounds.update(each)
    step, request = pick("step"), pick("request")
    if pick("singleton"):
        out[f"homogeneous c={top}: request / singleton throughput"] = (
            request.images_per_s / pick("singleton").images_per_s,
            "-",
        )
    if raw:
        batched = raw[-1]["images_per_s"]
        out[f"step c={top} / raw batch-{raw[-1]['batch']} (server and clients share the CPU)"] = (
            step.images_per_s / batched,
            "-",
        )
        out["raw batched / raw single (most batching can give)"] = (batched / raw[0]["images_per_s"], "-")
    return out, rounds


def start_variant(
    args: argparse.Namespace,
    name: str,
    model: str,
    weights: Path,
    size_edits: dict[str, str],
    requests: list[dict],
    mixed: list[dict],
) -> ServerVariant:
    """A server of engine variant ``name``, warmed up on a full batch (and on each mixed step count)."""
    print(f"[{name}] starting the server", flush=True)
    variant = ServerVariant(
        name,
        model,
        weights,
        args.max_batch_size,
        args.queue_delay_us,
        args.triton_max_batch_size,
        {**size_edits, **ENGINE_VARIANTS[name]},
    )
    try:
        variant.warm_up(requests[0], args.max_batch_size)
        if args.mixed and name != "singleton":
            for steps in MIXED_STEPS:
                variant.warm_up(dict(mixed[0], num_inference_steps=steps), 2)
    except BaseException:  # not yet the caller's to stop
        variant.stop()
        raise
    return variant


def run_sweep(
    args: argparse.Namespace,
    model: str,
    weights: Path,
    size_edits: dict,
    requests: list[dict],
    concurrency: int,
) -> dict:
    sizes = sorted({1, 2, 4, args.max_batch_size})
    delays = [0, 5000, 20000, 50000]
    cells: dict[tuple[int, int], float] = {}
    results = []
    for size in sizes:
        for delay in delays:
            variant = ServerVariant(
                f"b{size}-d{delay}",
                model,
                weights,
                size,
                delay,
                max(size, args.triton_max_batch_size),
                size_edits,
            )
            try:
                variant.warm_up(requests[0], size)
                stats = variant.run(requests, concurrency, None)
            finally:
                variant.stop()
            cells[(size, delay)] = stats.requests_per_s
            results.append(
                {
                    "max_batch_size": size,
                    "queue_delay_us": delay,
                    "requests_per_s": stats.requests_per_s,
                    "latency_p95_s": stats.latency_p95_s,
                }
            )
    write_heatmap(cells, sizes, delays, args.out / "sweep.png")
    best = max(results, key=lambda r: (r["requests_per_s"], -r["latency_p95_s"]))
    return {"concurrency": concurrency, "cells": results, "best": best}

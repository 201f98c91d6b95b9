"""Captured (CUDA graph) forwards against eager ones, in one process, over the served step adapter.

  forward    one denoising forward at 1, 4 and 8 images (2, 8 and 16 model rows with CFG), eager and
             replayed from a captured graph (config ``cuda_graphs``, adapters/captured_forwards.py); the
             model FLOPs of the forward (torch.utils.flop_counter) over its time, against the device's
             peak (``--peak-tflops``; by default by the device's name: H100 SXM and H200 989, H100 PCIe 756
             TFLOP/s dense bf16)
  alone      one request end to end (text encoding, every step, decode) through the step engine, eager
             and captured, against diffusers' own ``pipeline(...)`` at batch 1 (the issue's target: the
             captured one >= 2x faster)
  exactness  the largest difference of a replay from the eager forward (relative to the forward's largest
             value), and one request's image eager alone, captured alone and captured amid 7 others (the
             largest difference in uint8 levels)

On a CPU nothing is captured (graphs are CUDA's): the eager forward, its FLOPs and the single request
only, as a smoke run. Medians of --repeats after a warm-up.

    .venv/bin/python scripts/bench.py graphs                  # CPU, tiny SD: eager only
    .venv/bin/python scripts/bench_graphs.py                  # the same
    python3 scripts/bench_graphs.py --arch sd15 --height 512 --width 512 --steps 20   # a GPU, bf16
"""

from __future__ import annotations

from pathlib import Path

import artefacts
import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import REPO_ROOT, benchmark_parser
from benchmarks.inprocess import Bench, sync, timed_median
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.tiny_models import ARCHITECTURES

IMAGES = (1, 4, 8)
# Dense bf16 tensor-core peak (NVIDIA's data sheets), the first name that matches the device's.
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.1}


def peak_tflops(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def prepared_jobs(bench: Bench, count: int, steps: int, first: int = 0) -> list[Job]:
    jobs = [bench.job(i, bench.request(i, steps, 7.5), "step") for i in range(first, first + count)]
    for job, start in zip(jobs, bench.adapter.prepare(jobs), strict=True):
        job.begin(start)
    return jobs


def forward_figures(bench: Bench, steps: int, repeats: int, graphs, out: list[dict], save) -> list[dict]:
    """Each image count's forward: eager and replayed seconds, FLOPs, the replay's largest difference;
    each row appended to ``out``, then ``save()``."""
    adapter, size = bench.adapter, (bench.height, bench.width)
    for images in IMAGES:
        jobs = prepared_jobs(bench, images, steps)
        with torch.inference_mode():
            rows, timesteps, conditioning, _ = adapter.forward_inputs(
                jobs, [job.state.timesteps[0] for job in jobs]
            )
            inputs = (torch.cat(rows), timesteps, conditioning)
            with FlopCounterMode(display=False) as counter:
                eager = adapter.predict(*inputs, size)
            row = {
                "images": images,
                "model_rows": int(inputs[0].shape[0]),
                "flops": counter.get_total_flops(),
                "eager_s": timed_median(
                    lambda inputs=inputs: adapter.predict(*inputs, size), bench.device, repeats
                ),
            }
            if graphs is not None and graphs.graph_for(*inputs, size) is not None:  # a bucket holds it
                replayed = graphs(*inputs, size)
                scale = eager.float().abs().max().item()
                row["replay_difference"] = (replayed.float() - eager.float()).abs().max().item() / scale
                row["captured_s"] = timed_median(
                    lambda inputs=inputs: graphs(*inputs, size), bench.device, repeats
                )
        out.append(row)
        save()
        print(f"  forward, {images} images: {row}", flush=True)
    return out


def serve(bench: Bench, jobs: list[Job]) -> dict[int, np.ndarray]:
    """The jobs through a step engine from one step on, their images by record."""
    engine = StepEngine(bench.adapter, EngineLimits(bench.cap, bench.cap))
    for job in jobs:
        engine.add(job)
    images = {}
    while engine.active:
        for finished in engine.step().finished:
            images[finished.job.record] = np.asarray(finished.output, dtype=int)
    sync(bench.device)
    return images


def alone_seconds(bench: Bench, steps: int, repeats: int) -> float:
    return timed_median(
        lambda: serve(bench, [bench.job(0, bench.request(0, steps, 7.5), "step")]), bench.device, repeats
    )


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, "graphs")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="tiny-sd")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cap", type=int, default=8, help="images per forward (graphs up to 2x rows)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--peak-tflops", type=float, help="the device's peak (default: by its name)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results")
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        args.dtype, torch.bfloat16 if device == "cuda" else torch.float32
    )
    bench = Bench(args.arch, args.height, args.width, args.cap, device, dtype)
    adapter = bench.adapter
    graphs = None
    if device == "cuda":
        print(f"[capturing at {args.width}x{args.height}]", flush=True)
        # As the model does at load with cuda_graphs (and with its checks: an uncapturable family fails).
        bench.model.capture_forwards(bench.settings, adapter, bench.model.fields)
        graphs, adapter.captured = adapter.captured, None  # eager until the captured runs
    peak = args.peak_tflops or peak_tflops(device)
    report: dict = {
        **bench.report_header(args.steps),
        "peak_tflops": peak,
        "graphs": None if graphs is None else len(graphs.graphs),
        "forward": [],
        "complete": False,  # until the last figure: a run cut short keeps what it measured
        "provenance": artefacts.provenance(),
    }
    path = args.out / "bench_graphs.json"

    def save() -> None:
        artefacts.write(path, report)

    print("[forwards]", flush=True)
    forward_figures(bench, args.steps, args.repeats, graphs, report["forward"], save)

    print("[one request alone, and exactness]", flush=True)
    report["pipeline_alone_s"] = timed_median(
        lambda: bench.raw_pipeline_call([bench.request(0, args.steps, 7.5)]), device, args.repeats
    )
    save()
    report["eager_alone_s"] = alone_seconds(bench, args.steps, args.repeats)
    save()
    eager_image = serve(bench, [bench.job(0, bench.request(0, args.steps, 7.5), "step")])[0]
    if graphs is not None:
        adapter.captured = graphs
        report["captured_alone_s"] = alone_seconds(bench, args.steps, args.repeats)
        save()
        alone = serve(bench, [bench.job(0, bench.request(0, args.steps, 7.5), "step")])[0]
        amid = serve(bench, [bench.job(i, bench.request(i, args.steps, 7.5), "step") for i in range(8)])[0]
        report["uint8_difference"] = {
            "captured_alone_vs_eager_alone": int(np.abs(alone - eager_image).max()),
            "captured_amid_7_vs_eager_alone": int(np.abs(amid - eager_image).max()),
        }
        report["replays"] = graphs.replays
        adapter.captured = None
    report["complete"] = True
    save()
    (args.out / "bench_graphs.md").write_text(markdown(report))
    print(markdown(report))


def tflops(flops: int, seconds: float | None) -> float | None:
    return None if seconds is None else flops / seconds / 1e12


def markdown(report: dict) -> str:
    peak = report["peak_tflops"]
    lines = [
        f"{report['machine']}; {report['arch']} {report['dtype']}, {report['size']}, "
        f"{report['steps']} steps, {report['graphs'] or 'no'} graphs captured.",
        "",
        "| images (model rows) | eager forward (ms) | captured (ms) | eager / captured | GFLOP "
        "| eager TFLOP/s | captured TFLOP/s | of peak, eager / captured | replay's largest difference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["forward"]:
        eager, captured = row["eager_s"], row.get("captured_s")
        rates = [tflops(row["flops"], eager), tflops(row["flops"], captured)]
        shares = " / ".join("-" if r is None or not peak else f"{r / peak:.1%}" for r in rates)
        lines.append(
            f"| {row['images']} ({row['model_rows']}) | {1000 * eager:.2f} "
            f"| {'-' if captured is None else f'{1000 * captured:.2f}'} "
            f"| {'-' if captured is None else f'{eager / captured:.2f}'} | {row['flops'] / 1e9:.2f} "
            f"| {' | '.join('-' if r is None else f'{r:.2f}' for r in rates)} | {shares} "
            f"| {row.get('replay_difference', '-')} |"
        )
    pipeline, eager = report["pipeline_alone_s"], report["eager_alone_s"]
    captured = report.get("captured_alone_s")
    lines += [
        "",
        "| one request alone | seconds | diffusers pipeline(...) / this |",
        "|---|---|---|",
        f"| diffusers `pipeline(...)`, batch 1 | {pipeline:.3f} | 1.00 |",
        f"| step engine, eager | {eager:.3f} | {pipeline / eager:.2f} |",
    ]
    if captured is not None:
        lines.append(
            f"| step engine, captured forwards | {captured:.3f} | {pipeline / captured:.2f} (target >= 2) |"
        )
    if "uint8_difference" in report:
        diff = report["uint8_difference"]
        lines += [
            "",
            "Image exactness (uint8 levels): captured alone vs eager alone "
            f"{diff['captured_alone_vs_eager_alone']}, captured amid 7 others vs eager alone "
            f"{diff['captured_amid_7_vs_eager_alone']}.",
        ]
    return "\n".join(lines) + "\n"

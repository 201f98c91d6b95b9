"""Per-request LoRA on the step engine: rows with different adapters in one forward, against no adapters and
against one batch per adapter (what vLLM-Omni does: "different LoRA adapters or scales in separate batches").

In one process, over the served code (TextToImageModel.load with a ``loras`` config, the step adapter, the
step engine), ``--rows`` (8) requests at once, each ``--steps`` denoising steps:

  none        the model loaded without adapters (the base model)
  unused      the model with every adapter loaded, no request naming one (the wrapped layers' own cost)
  mixed-k     one batch: request i uses adapter i mod k (k distinct adapters in every forward)
  split-k     the same requests as k batches, one per adapter, run one after another

Figures: images/s (all rows done, text encoding and decode included) and time per engine step, medians
of --repeats runs after one warm-up, and the ratios the issue sets targets for (mixed-4 / none >= 0.8,
mixed-4 / split-4 >= 1.5). Adapters are built here (tiny_models/lora.py: rank --rank on the denoiser's
attention projections to_q/to_k/to_v/to_out.0) into weights/bench-loras/.

``--exactness``: the mixed path's bound in the model's dtype: the first 4 rows of a mixed-4 batch (each its
own adapter) against diffusers' own ``load_lora_weights`` + ``set_adapters`` + ``pipeline(...)`` for each
alone, the largest uint8 difference (and how far the adapters move the image, so the bound means something).

    .venv/bin/python scripts/bench_lora.py                      # tiny SD, CPU
    .venv/bin/python scripts/bench_lora.py --arch sd15 --height 512 --width 512 --rank 16   # a GPU, bf16
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import artefacts
import numpy as np
import torch

from benchmarks.common import PROMPTS, REPO_ROOT, benchmark_parser, machine_description
from benchmarks.inprocess import Channel
from triton_diffusion.adapters.diffusers_pipeline import row_generator
from triton_diffusion.engine.jobs import Job, StepReport
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.models.text_to_image import TextToImageModel
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.serving.server_process import WEIGHTS
from triton_diffusion.settings import ModelConfig, ModelSettings
from triton_diffusion.tiny_models import build_missing
from triton_diffusion.tiny_models.lora import build_tiny_lora

ADAPTERS = 8


def build_adapters(arch: str, rank: int) -> dict[str, str]:
    paths = {}
    for i in range(ADAPTERS):
        target = WEIGHTS / "bench-loras" / f"{arch}-r{rank}-{i}"
        if not (target / "pytorch_lora_weights.safetensors").is_file():
            build_tiny_lora(WEIGHTS / arch, target, seed=100 + i, rank=rank, text_encoders=False)
        paths[f"a{i}"] = str(target)
    return paths


def load_model(
    arch: str, loras: dict[str, str] | None, cap: int, device: str, dtype: str
) -> TextToImageModel:
    config = ModelConfig(model=str(WEIGHTS / arch), dtype=dtype, loras=loras or None)
    kind = "GPU" if device.startswith("cuda") else "CPU"
    model = TextToImageModel()
    model.fields, model.adapter = model.load(ModelSettings(arch, WEIGHTS, config, {}, cap, kind, 0))
    return model


def run_batch(
    model: TextToImageModel, args, adapters: list[str | None], images: dict | None = None
) -> tuple[float, int]:
    """The requests through one step engine until all are done: (seconds, forwards); each finished image
    into ``images`` by row when given."""
    engine = StepEngine(model.adapter, EngineLimits(args.rows, args.rows))
    for i, lora in enumerate(adapters):
        values = model.fields.parse(
            {
                "prompt": PROMPTS[i % len(PROMPTS)],
                "seed": i,
                "height": args.height,
                "width": args.width,
                "num_inference_steps": args.steps,
                "guidance_scale": 7.5,
            }
        )
        values["lora"] = lora  # the canonical text parse would give (names are the config's)
        engine.add(Job(TrackedRequest(str(i), Channel()), model.step_request(values, 0), record=i))
    forwards = 0
    started = time.perf_counter()
    while engine.active:
        report: StepReport = engine.step()
        forwards += len(report.forwards)
        for finished in report.finished if images is not None else ():
            images[finished.job.record] = np.asarray(finished.output, dtype=int)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started, forwards


def measure_alternated(
    variants: dict[str, tuple[TextToImageModel, list]], args, save=None
) -> dict[str, dict]:
    """Each variant's batches run once per round, the variants one after another in an order rotated
    every round (a machine whose speed drifts favours none); a warm-up round first. Per variant: the
    median round's throughput and each round's seconds (the ratios' spread comes from them). After each
    measured round ``save`` gets the rounds so far (``{variant: {seconds, forwards}}`` each)."""
    names = list(variants)
    rounds: dict[str, list[tuple[float, int]]] = {name: [] for name in names}
    measured: list[dict[str, dict]] = []
    for repeat in range(args.repeats + 1):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in order:
            model, batches = variants[name]
            seconds, forwards = 0.0, 0
            for adapters in batches:
                s, f = run_batch(model, args, adapters)
                seconds, forwards = seconds + s, forwards + f
            if repeat:  # the first round is a warm-up
                rounds[name].append((seconds, forwards))
        if repeat and save is not None:
            measured.append({name: {"seconds": rounds[name][-1][0], "forwards": rounds[name][-1][1]}
                             for name in order})  # fmt: skip
            save(measured)
    results = {}
    for name in names:
        images = sum(len(b) for b in variants[name][1])
        seconds = statistics.median(s for s, _ in rounds[name])
        forwards = rounds[name][0][1]
        results[name] = {
            "images_per_s": images / seconds,
            "step_ms": 1000 * seconds / forwards,
            "forwards": forwards,
            "round_seconds": [s for s, _ in rounds[name]],
        }
    return results


def ratio_spread(results: dict[str, dict], a: str, b: str) -> tuple[float, float, float]:
    """Throughput a / b: the ratio of the medians, and the lowest and highest of the per-round ratios."""
    per_round = [
        sb / sa for sa, sb in zip(results[a]["round_seconds"], results[b]["round_seconds"], strict=True)
    ]
    return results[a]["images_per_s"] / results[b]["images_per_s"], min(per_round), max(per_round)


def exactness(model: TextToImageModel, args, paths: dict[str, str]) -> dict:
    """Rows 0-3 of a mixed-4 batch against diffusers' own adapters, each row alone, in the same dtype."""
    from diffusers import DiffusionPipeline

    names = list(paths)[:4]
    served: dict[int, np.ndarray] = {}
    run_batch(model, args, [f"{names[i % 4]}:1.0" for i in range(args.rows)], served)
    reference = DiffusionPipeline.from_pretrained(
        WEIGHTS / args.arch, dtype=model.pipe.dtype, use_safetensors=True
    ).to(args.device)
    reference.set_progress_bar_config(disable=True)
    for name in names:
        reference.load_lora_weights(paths[name], adapter_name=name)

    def image(row: int, adapter: str | None) -> np.ndarray:
        if adapter is None:
            reference.disable_lora()
        else:
            reference.enable_lora()
            reference.set_adapters([adapter], adapter_weights=[1.0])
        with torch.inference_mode():
            out = reference(
                prompt=[PROMPTS[row % len(PROMPTS)]],
                generator=[row_generator(row, 0)],
                height=args.height,
                width=args.width,
                num_inference_steps=args.steps,
                guidance_scale=7.5,
            ).images[0]
        return np.asarray(out, dtype=int)

    rows = range(min(4, args.rows))
    expected = {row: image(row, names[row]) for row in rows}
    base = image(0, None)
    return {
        "dtype": str(model.pipe.dtype).removeprefix("torch."),
        "rows": len(rows),
        "largest_uint8_difference": max(int(np.abs(served[r] - expected[r]).max()) for r in rows),
        "adapter_moves_image_mean": float(np.abs(expected[0] - base).mean()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, "lora")
    parser.add_argument("--arch", default="tiny-sd")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--distinct", default="1,2,4,8", help="distinct adapters among the rows")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results")
    parser.add_argument(
        "--exactness", action="store_true", help="the mixed path against diffusers' own adapters (above)"
    )
    args = parser.parse_args(argv)
    args.device = "cuda:0" if torch.cuda.is_available() else "cpu"
    build_missing(WEIGHTS, only=[args.arch])
    paths = build_adapters(args.arch, args.rank)
    names = list(paths)
    base = load_model(args.arch, None, args.rows, args.device, args.dtype)
    adapted = load_model(args.arch, paths, args.rows, args.device, args.dtype)
    rows = range(args.rows)
    variants: dict[str, tuple[TextToImageModel, list]] = {
        "none": (base, [[None] * args.rows]),
        "unused": (adapted, [[None] * args.rows]),
    }
    for k in (int(x) for x in args.distinct.split(",")):
        mixed = [f"{names[i % k]}:1.0" for i in rows]
        variants[f"mixed-{k}"] = (adapted, [mixed])
        groups = [[a for a in mixed if a == f"{names[j]}:1.0"] for j in range(k)]
        variants[f"split-{k}"] = (adapted, [g for g in groups if g])
    config = {
        "arch": args.arch,
        "size": f"{args.width}x{args.height}",
        "rows": args.rows,
        "steps": args.steps,
        "rank": args.rank,
        "repeats": args.repeats,
        "provenance": artefacts.provenance(),
    }
    path = args.out / "bench_lora.json"
    kept: dict[str, list[dict]] = {"rounds": []}

    def save(rounds: list[dict], **final) -> None:
        """The rounds so far, rewritten after each (a run cut short keeps them); ``final``: the figures."""
        kept["rounds"] = rounds
        artefacts.write(path, {**config, **final, "rounds": rounds, "complete": bool(final)})

    results = measure_alternated(variants, args, save)
    lines = [
        f"# LoRA mixing: {args.arch} {args.width}x{args.height}, {args.rows} rows x {args.steps} steps, "
        f"rank {args.rank}, {args.device} {base.adapter.dtype}",
        "",
        f"{machine_description()}; `.venv/bin/python scripts/bench_lora.py {' '.join(argv or sys.argv[1:])}`",
        "",
        "| variant | images/s | ms per engine step | forwards |",
        "|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['images_per_s']:.2f} | {r['step_ms']:.1f} | {r['forwards']} |")
    pairs = [("unused", "none")]
    for k in (int(x) for x in args.distinct.split(",")):
        pairs += [(f"mixed-{k}", "none"), (f"mixed-{k}", f"split-{k}")]
    spreads = {f"{a} / {b}": ratio_spread(results, a, b) for a, b in pairs}
    ratios = {name: value for name, (value, _, _) in spreads.items()}
    lines += ["", "| ratio (throughput) | value | target |", "|---|---|---|"]
    targets = {"mixed-4 / none": ">= 0.8", "mixed-4 / split-4": ">= 1.5"}
    lines += [f"| {name} | {value:.2f} | {targets.get(name, '-')} |" for name, value in ratios.items()]
    bound = exactness(adapted, args, paths) if args.exactness else None
    if bound is not None:
        lines += [
            "",
            f"Exactness ({bound['dtype']}): rows over 4 adapters in one batch against diffusers' own "
            f"`load_lora_weights` + `set_adapters` + `pipeline(...)` alone, {bound['rows']} rows: largest "
            f"difference {bound['largest_uint8_difference']} uint8 levels (the adapter moves the image by "
            f"{bound['adapter_moves_image_mean']:.1f} levels on average).",
        ]
    text = "\n".join(lines)
    print(text)
    save(
        kept["rounds"],
        results=results,
        ratios={name: [value, targets.get(name, "-")] for name, value in ratios.items()},
        round_spread={name: [low, high] for name, (_, low, high) in spreads.items()},
        exactness=bound,
    )

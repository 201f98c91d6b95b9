"""Batch invariance per pipeline family in a given dtype: a request alone against the same request fused
among 7 others (one diffusers call with a list of prompts and a list of generators, as the request-level
engine runs it), and, for families with a step adapter, the step engine's image against the pipeline's
own. Prints the largest uint8 difference per family; on a GPU this is where bf16/fp16 rounding shows.

    .venv/bin/python scripts/family_invariance.py --dtype bfloat16 --dtype float16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from triton_diffusion.adapters.diffusers_pipeline import SchedulerChoices, row_generator
from triton_diffusion.adapters.latent_steps import ImageRequest
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.requests import TrackedRequest
from triton_diffusion.engine.step_engine import EngineLimits, StepEngine
from triton_diffusion.families import PipelineFacts
from triton_diffusion.serving.server_process import WEIGHTS
from triton_diffusion.tiny_models import TINY_FAMILIES, build_missing

FAMILIES = [
    "tiny-sd",
    "tiny-sdxl",
    "tiny-sd3",
    "tiny-flux",
    *[f for f in TINY_FAMILIES if f not in ("tiny-sdxl", "tiny-sd3")],
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OTHERS = [
    "a lighthouse at dusk",
    "two green apples",
    "a city in fog",
    "an old red tram",
    "waves on rocks",
    "a paper crane",
    "snow on pines",
]


class _Channel:
    def send_partial(self, outputs): ...

    def send_final(self, outputs):
        self.outputs = outputs

    def send_error(self, error):
        raise RuntimeError(error)

    def is_cancelled(self):
        return False


def render(report) -> None:
    """What the engine host does with a finished job, minimally: answer with the image."""
    for finished in report.finished:
        finished.job.request.finish(finished.output)


def pixels(image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


def check(name: str, dtype: torch.dtype, device: str) -> dict:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(WEIGHTS / name, dtype=dtype, use_safetensors=True).to(device)
    pipe.set_progress_bar_config(disable=True)
    facts = PipelineFacts.of(pipe)
    extra = {"max_sequence_length": 64} if facts.accepts("max_sequence_length") else {}
    call = {"height": 64, "width": 64, "num_inference_steps": 4, **extra}

    def run(prompts: list[str], seeds: list[int]):
        generators = [row_generator(seed, 0) for seed in seeds]
        return pipe(prompt=prompts, generator=generators, **call).images

    target, seed = "a red cat on a sofa", 1234
    alone = pixels(run([target], [seed])[0])
    among = pixels(run(OTHERS[:3] + [target] + OTHERS[3:], [10, 11, 12, seed, 13, 14, 15, 16])[3])
    result = {"family": facts.class_name, "fused_vs_alone": int(np.abs(alone - among).max())}
    schedulers = SchedulerChoices(pipe, facts, None, name)
    adapter = step_adapter_for(pipe, facts, schedulers, extra.get("max_sequence_length"))
    if adapter is not None:
        engine = StepEngine(adapter, EngineLimits(8, 8))
        jobs = []
        for i, prompt in enumerate([target, *OTHERS]):
            request = ImageRequest(
                prompt,
                None,
                seed if i == 0 else 10 + i,
                0,
                64,
                64,
                4,
                facts.default("guidance_scale"),
                None,
                schedulers.default,
            )
            jobs.append(Job(TrackedRequest(str(i), _Channel()), request))
            engine.add(jobs[-1])
        while engine.active:
            render(engine.step())
        stepped = pixels(jobs[0].request.channel.outputs)
        result["step_engine_vs_pipeline"] = int(np.abs(alone - stepped).max())
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    build_missing(WEIGHTS, only=FAMILIES)
    rows = []
    for dtype in args.dtype or ["float32"]:
        for name in FAMILIES:
            try:
                result = check(name, DTYPES[dtype], device)
            except Exception as exc:  # noqa: BLE001  (report and go on with the next family)
                result = {"family": name, "error": f"{type(exc).__name__}: {exc}"[:200]}
            result["dtype"], result["device"] = dtype, device
            rows.append(result)
            print(json.dumps(result), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    sys.exit(main())

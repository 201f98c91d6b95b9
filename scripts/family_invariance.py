"""Batch invariance per pipeline family in a given dtype: a request alone against the same request fused
among 7 others (one diffusers call with a list of prompts and a list of generators, as the request-level
engine runs it), and, for families with a step adapter, the step engine's image against the pipeline's
own. Prints the largest uint8 difference per family; on a GPU this is where bf16/fp16 rounding shows.

The inpainting checkpoints (9-channel UNets, FLUX.1 Fill, SD3's 33-channel transformer) run inpainting
requests (one source image and mask, strength 0.75); Wan runs 5-frame videos (every frame compared).
``--out FILE.json`` is rewritten after each family (a run cut short keeps what it measured), with a
table beside it (FILE.md).

    .venv/bin/python scripts/family_invariance.py --dtype bfloat16 --dtype float16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from triton_diffusion.adapters.diffusers_pipeline import SchedulerChoices, row_generator
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.codecs.video import to_uint8
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.families import PipelineFacts
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.serving.server_process import WEIGHTS
from triton_diffusion.tiny_models import TINY_FAMILIES, build_missing

sys.path.insert(0, str(Path(__file__).resolve().parent))
import artefacts  # noqa: E402

FAMILIES = [
    "tiny-sd",
    "tiny-sdxl",
    "tiny-sd3",
    "tiny-flux",
    *[f for f in TINY_FAMILIES if f not in ("tiny-sdxl", "tiny-sd3")],
    # Inpainting checkpoints (image + mask_image only) and text-to-video.
    "tiny-sd-inpaint",
    "tiny-sdxl-inpaint",
    "tiny-flux-fill",
    "tiny-sd3-inpaint",
    "tiny-wan",
]
INPAINT_STRENGTH = 0.75
VIDEO_FRAMES = 5
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


def source_and_mask(size: int = 64) -> tuple[Image.Image, Image.Image]:
    """An inpainting source with structure (gradients, a bright square) and a mask over its middle."""
    y, x = np.mgrid[0:size, 0:size]
    source = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], axis=-1)
    source[size // 4 : size // 2, size // 4 : size // 2] = 250
    mask = np.zeros((size, size), dtype=np.uint8)
    mask[size // 4 : 3 * size // 4, 5 : size // 2 + 3] = 255
    return Image.fromarray(source.astype(np.uint8)), Image.fromarray(mask).convert("RGB")


def outputs_of(pipe, result) -> list:
    """Each row's image, or each row's video as uint8 frames."""
    if hasattr(result, "frames"):
        return [to_uint8(frames) for frames in result.frames]
    return list(result.images)


def sd3_inpaint_with_shift(pipe, kwargs: dict) -> list:
    """StableDiffusion3InpaintPipeline decodes without the VAE's shift factor (diffusers issue #13611); the
    step engine decodes as every other SD3 pipeline does, so the reference is decoded so too."""
    latents = pipe(**kwargs, output_type="latent").images
    vae = pipe.vae
    image = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
    return pipe.image_processor.postprocess(image.detach(), output_type="pil")


def check(name: str, dtype: torch.dtype, device: str) -> dict:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(WEIGHTS / name, dtype=dtype, use_safetensors=True).to(device)
    pipe.set_progress_bar_config(disable=True)
    facts = PipelineFacts.of(pipe)
    extra = {"max_sequence_length": 64} if facts.accepts("max_sequence_length") else {}
    call = {"height": 64, "width": 64, "num_inference_steps": 4, **extra}
    inpaint = facts.accepts("mask_image")  # an inpainting checkpoint: its pipeline class takes a mask
    video = facts.accepts("num_frames")
    source, mask = source_and_mask()
    if inpaint:
        call.update(strength=INPAINT_STRENGTH)
    if video:
        call.update(num_frames=VIDEO_FRAMES, output_type="np")

    def run(prompts: list[str], seeds: list[int]) -> list:
        kwargs = {"prompt": prompts, "generator": [row_generator(seed, 0) for seed in seeds], **call}
        if inpaint:
            kwargs.update(image=[source] * len(prompts), mask_image=[mask] * len(prompts))
        with torch.inference_mode():
            if type(pipe).__name__ == "StableDiffusion3InpaintPipeline":
                return sd3_inpaint_with_shift(pipe, kwargs)
            return outputs_of(pipe, pipe(**kwargs))

    target, seed = "a red cat on a sofa", 1234
    alone = pixels(run([target], [seed])[0])
    among = pixels(run(OTHERS[:3] + [target] + OTHERS[3:], [10, 11, 12, seed, 13, 14, 15, 16])[3])
    result = {"family": facts.class_name, "fused_vs_alone": int(np.abs(alone - among).max())}
    schedulers = SchedulerChoices(pipe, facts, (), name)
    adapter = step_adapter_for(pipe, facts, schedulers, extra.get("max_sequence_length"))
    if adapter is not None:
        engine = StepEngine(adapter, EngineLimits(8, 8))
        jobs = []
        for i, prompt in enumerate([target, *OTHERS]):
            request = ImageParams(
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
                image=source if inpaint else None,
                strength=INPAINT_STRENGTH if inpaint else None,
                mask_image=mask if inpaint else None,
                num_frames=VIDEO_FRAMES if video else None,
            )
            jobs.append(Job(TrackedRequest(str(i), _Channel()), request))
            engine.add(jobs[-1])
        while engine.active:
            render(engine.step())
        stepped = pixels(jobs[0].request.channel.outputs)
        result["step_engine_vs_pipeline"] = int(np.abs(alone - stepped).max())
    return result


def markdown(rows: list[dict]) -> str:
    lines = [
        "Largest uint8 difference: a request alone against the same request fused among 7 others in one "
        "`pipeline(...)` call, and the step engine's image against the pipeline's alone "
        "(`scripts/family_invariance.py`, tiny random weights, 64x64, 4 steps).",
        "",
        "| model | family | dtype | device | fused vs alone | step engine vs pipeline |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        fused = row.get("fused_vs_alone", row.get("error", "-"))
        lines.append(
            f"| {row['model']} | {row['family']} | {row['dtype']} | {row['device']} | {fused} "
            f"| {row.get('step_engine_vs_pipeline', '-')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES))
    parser.add_argument("--out", type=Path, help="a JSON file, rewritten after each family (and FILE.md)")
    parser.add_argument(
        "--families", help=f"comma-separated tiny models (default: all of {','.join(FAMILIES)})"
    )
    args = parser.parse_args(argv)
    families = args.families.split(",") if args.families else FAMILIES
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {FAMILIES}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    build_missing(WEIGHTS, only=families)
    rows = []
    for dtype in args.dtype or ["float32"]:
        for name in families:
            try:
                result = check(name, DTYPES[dtype], device)
            except Exception as exc:  # noqa: BLE001  (report and go on with the next family)
                result = {"family": name, "error": f"{type(exc).__name__}: {exc}"[:200]}
            result["model"], result["dtype"], result["device"] = name, dtype, device
            rows.append(result)
            print(json.dumps(result), flush=True)
            if args.out:  # after each family: a run cut short keeps its rows
                artefacts.write(args.out, {"rows": rows, "complete": False})
                args.out.with_suffix(".md").write_text(markdown(rows))
    if args.out:
        artefacts.write(args.out, {"rows": rows, "complete": True})


if __name__ == "__main__":
    sys.exit(main())

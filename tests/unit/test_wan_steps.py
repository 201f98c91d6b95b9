"""Wan text-to-video on the step engine against ``WanPipeline`` itself, in process, CPU fp32.

Seven video requests with different prompts, negative prompts (present or not), step counts, guidance
scales (1.0: no unconditional row, as the pipeline decides), frame counts (5 and 9), sizes and arrival
steps run through the step engine with the Wan adapter; one more is cancelled half-way. Each finished
video must equal ``WanPipeline(...)(output_type="np").frames[0]`` for the same arguments and generator to
one uint8 level (after ``to_uint8``, as the server converts), and its final latents the pipeline's to
float32 rounding. Videos of one shape must have shared forwards (guided and unguided in one), and no
forward may mix frame counts or sizes.

Twice: with the scheduler tiny-wan is built with (flow-matching Euler), and with UniPC with flow sigmas
as the released Wan 2.1 checkpoints ship it, mixed per row with DPM-Solver++ (both multistep solvers: each
row keeps its own history).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from diffusers import UniPCMultistepScheduler

from tests.unit.step_harness import Host, call_arguments, load_family, run_engine
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.adapters.wan import WanAdapter
from triton_diffusion.codecs.video import to_uint8
from triton_diffusion.engine.jobs import Job

# (negative prompt, steps, guidance, frames, (height, width), arrives at engine step)
REQUESTS = [
    (None, 3, 5.0, 9, (32, 32), 0),
    ("blurry", 4, 1.0, 9, (32, 32), 0),
    (None, 2, 1.0, 5, (32, 32), 0),
    ("dark", 3, 4.0, 5, (32, 32), 1),
    ("noise", 5, 6.0, 9, (32, 32), 2),
    (None, 4, 3.0, 5, (32, 32), 3),
    ("grey", 3, 2.0, 9, (32, 48), 1),
]
MAX_SEQUENCE_LENGTH = 64  # as model_repository/text_to_video configures it (the pipeline's default: 512)
# Scheduler setups: the pipeline's scheduler (None: as built) and the other choices offered.
SETUPS = {
    "flow-euler": (None, None),
    "unipc": (
        # Wan2.1-T2V-1.3B-Diffusers' scheduler config, shift 3.0.
        lambda: UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        ),
        "DPMSolverMultistepScheduler",
    ),
}


class ShapeRecorder:
    """The adapter, writing down the shapes of the jobs of each forward."""

    def __init__(self, adapter: WanAdapter) -> None:
        self.adapter = adapter
        self.shapes: list[set[tuple[int, ...]]] = []

    def step(self, jobs: list[Job], previews=None) -> Any:
        self.shapes.append({job.spec.params.shape for job in jobs})
        return self.adapter.step(jobs, previews)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.adapter, name)


@pytest.fixture(scope="module", params=list(SETUPS))
def wan(request):
    make_scheduler, choices = SETUPS[request.param]
    return load_family("tiny-wan", choices, make_scheduler)


def video_request(i: int, negative, steps, guidance, frames, size, scheduler: str) -> ImageParams:
    height, width = size
    return ImageParams(
        f"video prompt {i}",
        negative,
        40 + i,
        0,
        height,
        width,
        steps,
        guidance,
        None,
        scheduler,
        num_frames=frames,
    )


def reference(pipe, schedulers, request: ImageParams) -> tuple[np.ndarray, torch.Tensor]:
    """The pipeline's own video for the request: its uint8 frames and its final latents."""
    pipe.scheduler = schedulers[request.scheduler]
    seen: dict[str, torch.Tensor] = {}

    def keep_latents(pipe: Any, i: int, t: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        seen["latents"] = tensors["latents"]  # after the last step: what the pipeline decodes
        return {}

    kwargs = {
        **call_arguments(request),
        "num_frames": request.num_frames,
        "guidance_scale": request.guidance_scale,
        "output_type": "np",
        "callback_on_step_end": keep_latents,
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
    }
    if request.negative_prompt is not None:
        kwargs["negative_prompt"] = [request.negative_prompt]
    return to_uint8(pipe(**kwargs).frames[0]), seen["latents"]


def test_every_video_equals_the_pipelines_own_amid_traffic(wan):
    pipe, facts, schedulers = wan
    adapter = step_adapter_for(pipe, facts, schedulers, MAX_SEQUENCE_LENGTH)
    assert isinstance(adapter, WanAdapter), facts.class_name
    recorder, host = ShapeRecorder(adapter), Host("frames")
    names = schedulers.names
    requests = [video_request(i, *spec[:5], names[i % len(names)]) for i, spec in enumerate(REQUESTS)]
    # A neighbour that is cancelled after its second step; previews of the first video at every step.
    victim = video_request(99, None, 6, 5.0, 9, (32, 32), names[0])
    arrivals = [(spec[5], request) for spec, request in zip(REQUESTS, requests, strict=True)]
    jobs = run_engine(recorder, arrivals, host, victim, first_preview_every=1)
    assert all(len(shapes) == 1 for shapes in recorder.shapes), "a forward mixed frame counts or sizes"
    assert max(host.forwards) >= 3, "videos did not share forwards"
    forwards = zip(host.forwards, host.model_rows, strict=True)
    assert any(videos < rows < 2 * videos for videos, rows in forwards), "no mixed-guidance forward"
    assert jobs[4].stats.first_forward > 1, "a late video did not join mid-way"
    # Previews: the middle latent frame [C, h, w] of the first video, at each of its steps.
    assert len(host.previews) == jobs[0].run.total_steps and host.previews[0].shape == (16, 4, 4)
    worst = 0
    for request, job in zip(requests, jobs, strict=True):
        (final,) = job.request.channel.finals
        served = final["frames"]
        assert served.dtype == np.uint8
        assert served.shape == (request.num_frames, request.height, request.width, 3)
        expected, latents = reference(pipe, schedulers, request)
        difference = int(np.abs(served.astype(int) - expected.astype(int)).max())
        worst = max(worst, difference)
        assert difference <= 1, (request.scheduler, request)
        torch.testing.assert_close(job.state.latents, latents, rtol=0, atol=1e-4)
    print(f"max uint8 difference ({', '.join(names)}): {worst}")

"""The latent step adapters against the diffusers pipelines themselves, in process, CPU fp32.

For each adapted family (SD 1.x, SDXL, FLUX.1, SD3), six requests with different prompts, negative prompts
(present or not), step counts, guidance scales, schedulers, sizes and arrival steps run through the step
engine; one more is cancelled half-way. Each finished image must equal ``pipeline(...)`` for the same
arguments and generator to one uint8 level, and requests must have shared forwards.
"""

from __future__ import annotations

import numpy as np
import pytest
from diffusers import DiffusionPipeline

from tests.unit.recording import RecordingChannel
from triton_diffusion.adapters.diffusers_pipeline import SchedulerChoices, row_generator
from triton_diffusion.adapters.latent_steps import ImageRequest
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.engine.jobs import Job, StepReport
from triton_diffusion.engine.requests import TrackedRequest
from triton_diffusion.engine.step_engine import EngineLimits, StepEngine
from triton_diffusion.families import PipelineFacts
from triton_diffusion.serving.server_process import WEIGHTS
from triton_diffusion.tiny_models import build_missing

FAMILIES = {
    "tiny-sd": "EulerDiscreteScheduler,DPMSolverMultistepScheduler",
    "tiny-sdxl": "DDIMScheduler,DPMSolverMultistepScheduler",
    "tiny-flux": None,
    "tiny-sd3": None,
}
# (negative prompt, steps, guidance, true CFG, (height, width), arrives at engine step); 96x64 and 64x96
# have one packed length but other positions (FLUX's image ids).
REQUESTS = [
    (None, 4, 7.5, 1.0, (64, 64), 0),
    ("blurry", 3, 1.0, 2.0, (96, 64), 0),
    (None, 5, 3.0, 3.0, (64, 64), 2),
    ("dark", 4, 5.0, 1.0, (64, 64), 3),
    (None, 2, 7.5, 2.0, (64, 96), 3),
    ("noise", 6, 2.0, 4.0, (64, 64), 5),
]


class Host:
    """Renders the engine's reports as the engine host does, minimally."""

    def __init__(self) -> None:
        self.forwards: list[int] = []

    def render(self, report: StepReport) -> None:
        for finished in report.finished:
            finished.job.request.finish({"image": finished.output})
        self.forwards.extend(forward.images for forward in report.forwards)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    name = request.param
    build_missing(WEIGHTS, only=[name])
    pipe = DiffusionPipeline.from_pretrained(WEIGHTS / name, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    facts = PipelineFacts.of(pipe)
    schedulers = SchedulerChoices(pipe, facts, FAMILIES[name], name)
    return pipe, facts, schedulers


def reference(pipe, facts, schedulers, request: ImageRequest):
    pipe.scheduler = schedulers[request.scheduler]
    kwargs = {
        "prompt": [request.prompt],
        "height": request.height,
        "width": request.width,
        "num_inference_steps": request.steps,
        "generator": [row_generator(request.seed, request.image_index)],
    }
    if request.negative_prompt is not None:
        kwargs["negative_prompt"] = [request.negative_prompt]
    if facts.uses_guidance_scale:
        kwargs["guidance_scale"] = request.guidance_scale
    if facts.accepts("true_cfg_scale"):
        kwargs["true_cfg_scale"] = request.true_cfg_scale
    return pipe(**kwargs).images[0]


def test_every_image_equals_the_pipelines_own_amid_traffic(family):
    pipe, facts, schedulers = family
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    assert adapter is not None, facts.class_name
    host = Host()
    engine = StepEngine(adapter, EngineLimits(8, 8))
    names = schedulers.names
    picks = [names[i % len(names)] for i in range(len(REQUESTS))]  # mixed schedulers where there are
    requests = [
        ImageRequest(f"prompt {i}", negative, 10 + i, 0, *size, steps, guidance, cfg, picks[i])
        for i, (negative, steps, guidance, cfg, size, _) in enumerate(REQUESTS)
    ]
    jobs = [Job(TrackedRequest(str(i), RecordingChannel()), r) for i, r in enumerate(requests)]
    # A neighbour that is cancelled after its second step.
    cancel = {"now": False}
    victim = Job(
        TrackedRequest("victim", RecordingChannel(cancelled=lambda: cancel["now"])),
        ImageRequest("cancel me", None, 99, 0, 64, 64, 6, 7.5, 2.0, names[0]),
    )
    arrivals = [(spec[5], job) for spec, job in zip(REQUESTS, jobs, strict=True)] + [(0, victim)]
    arrivals.sort(key=lambda arrival: arrival[0])
    step = 0
    while arrivals or engine.active:
        while arrivals and arrivals[0][0] <= step:
            engine.add(arrivals.pop(0)[1])
        host.render(engine.step())
        step += 1
        cancel["now"] = victim.steps_done >= 2
    assert victim.request.channel.finals[0].code.value == "CANCELLED" and victim.steps_done == 2
    assert max(host.forwards) >= 3, "requests did not share forwards"
    assert jobs[5].first_forward > 1, "the last request did not join mid-way"
    for request, job in zip(requests, jobs, strict=True):
        (final,) = job.request.channel.finals
        served = np.asarray(final["image"], dtype=int)
        expected = np.asarray(reference(pipe, facts, schedulers, request), dtype=int)
        assert served.shape == (request.height, request.width, 3)
        assert np.abs(served - expected).max() <= 1, (facts.class_name, request)

"""The DiT step adapter (adapters/dit.py) against the diffusers pipelines themselves, in process, CPU fp32.

For PixArt-Sigma and Sana, requests with short and long prompts (so rows of one forward carry different
text attention masks), negative prompts present or not, other step counts, guidance scales with and
without CFG, sizes (other aspect-ratio bins, and two sizes of one bin that share forwards and are resized
back apart) and arrival steps run through the step engine; one more is cancelled half-way. Each finished
image must equal ``pipeline(...)`` for the same arguments and generator (the pipeline alone, so a row
fused with rows of other prompt lengths equals the row alone) to one uint8 level.
"""

from __future__ import annotations

import numpy as np
import pytest
from diffusers import DiffusionPipeline

from tests.unit.recording import RecordingChannel
from tests.unit.test_latent_steps import Host, reference
from triton_diffusion.adapters.diffusers_pipeline import SchedulerChoices
from triton_diffusion.adapters.dit import DiTAdapter
from triton_diffusion.adapters.latent_steps import ImageRequest
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.requests import TrackedRequest
from triton_diffusion.engine.step_engine import EngineLimits, StepEngine
from triton_diffusion.families import PipelineFacts
from triton_diffusion.serving.server_process import WEIGHTS
from triton_diffusion.tiny_models import build_missing

# weights -> scheduler_choices (PixArt also with Euler: per-row scale_model_input and init_noise_sigma).
FAMILIES = {
    "tiny-pixart-sigma": "DPMSolverMultistepScheduler,EulerDiscreteScheduler",
    "tiny-sana": None,
}
SHORT = "a cat"
LONG = (
    "a lighthouse on a rocky coast at dusk with waves crashing, gulls circling above, warm light from "
    "the lamp, storm clouds far away and a small red boat returning to the harbour"
)
# (prompt, negative prompt, steps, guidance, (height, width), arrives at engine step). 64x64 and 128x128
# render at one bin (they share forwards) and are resized back to their own sizes; 64x96 and 96x64 are
# other bins. Guidance 1.0 runs without CFG.
REQUESTS = [
    (SHORT, None, 4, 4.5, (64, 64), 0),
    (LONG, "blurry", 3, 1.0, (64, 64), 0),
    (LONG, None, 5, 3.0, (128, 128), 0),
    ("a red tram", "dark, noisy", 4, 1.0, (64, 64), 2),
    (SHORT, None, 2, 7.5, (64, 96), 1),
    ("two green apples on a table", "noise", 3, 2.0, (96, 64), 0),
    (SHORT + " on a sofa", None, 6, 5.0, (64, 64), 3),
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    name = request.param
    build_missing(WEIGHTS, only=[name])
    pipe = DiffusionPipeline.from_pretrained(WEIGHTS / name, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    facts = PipelineFacts.of(pipe)
    schedulers = SchedulerChoices(pipe, facts, FAMILIES[name], name)
    return pipe, facts, schedulers


def test_every_image_equals_the_pipelines_own_amid_rows_of_other_prompt_lengths(family):
    pipe, facts, schedulers = family
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    assert isinstance(adapter, DiTAdapter), facts.class_name
    assert facts.default("use_resolution_binning") and adapter.bins is not None
    host = Host()
    engine = StepEngine(adapter, EngineLimits(8, 8))
    names = schedulers.names
    requests = [
        ImageRequest(prompt, negative, 10 + i, 0, *size, steps, guidance, None, names[i % len(names)])
        for i, (prompt, negative, steps, guidance, size, _) in enumerate(REQUESTS)
    ]
    jobs = [Job(TrackedRequest(str(i), RecordingChannel()), r) for i, r in enumerate(requests)]
    cancel = {"now": False}  # a neighbour that is cancelled after its second step
    victim = Job(
        TrackedRequest("victim", RecordingChannel(cancelled=lambda: cancel["now"])),
        ImageRequest(LONG, None, 99, 0, 64, 64, 6, 4.5, None, names[0]),
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
    assert max(host.forwards) >= 4, "requests did not share forwards"
    assert jobs[6].first_forward > 1, "the last request did not join mid-way"
    # The square jobs of 64 and 128 pixels render at one bin: one shape group, so they shared forwards.
    assert jobs[0].group == jobs[2].group != (64, 64) and jobs[4].group != jobs[5].group
    # Short and long prompts: rows of one forward had different text lengths (padding masked per row).
    tokens = {int(job.state.conditional["encoder_attention_mask"].sum()) for job in jobs[:3]}
    assert len(tokens) == 2 and jobs[0].most_shared >= 3
    for request, job in zip(requests, jobs, strict=True):
        (final,) = job.request.channel.finals
        served = np.asarray(final["image"], dtype=int)
        expected = np.asarray(reference(pipe, facts, schedulers, request), dtype=int)
        assert served.shape == (request.height, request.width, 3)
        assert np.abs(served - expected).max() <= 1, (facts.class_name, request)

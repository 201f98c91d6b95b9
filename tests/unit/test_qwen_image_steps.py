"""The Qwen-Image step adapter (adapters/qwen_image.py) against ``QwenImagePipeline`` itself, in process,
CPU fp32.

Requests with short and long prompts (rows of one forward have other text lengths: padded, masked per
row, and no mask where no row is padded), negative prompts present or not, true CFG on and off per row,
step counts, sizes (96x64 and 64x96: one packed length, other image positions) and arrival steps run
through the step engine; one more is cancelled half-way. Each image must equal ``pipeline(...)`` for the
same arguments and generator, alone, to one uint8 level.
"""

from __future__ import annotations

import numpy as np
import pytest
from diffusers import DiffusionPipeline

from tests.unit.recording import RecordingChannel
from tests.unit.test_latent_steps import Host, reference
from triton_diffusion.adapters.diffusers_pipeline import SchedulerChoices
from triton_diffusion.adapters.latent_steps import ImageRequest
from triton_diffusion.adapters.qwen_image import QwenImageAdapter
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.requests import TrackedRequest
from triton_diffusion.engine.step_engine import EngineLimits, StepEngine
from triton_diffusion.families import PipelineFacts
from triton_diffusion.serving.server_process import WEIGHTS
from triton_diffusion.tiny_models import build_missing

NAME = "tiny-qwen-image"
SHORT = "a cat"
LONG = (
    "a lighthouse on a rocky coast at dusk with waves crashing, gulls circling above, warm light from "
    "the lamp, storm clouds far away and a small red boat returning to the harbour"
)
# (prompt, negative prompt, steps, true CFG, (height, width), arrives at engine step). True CFG acts only
# with a negative prompt and a scale above 1.
REQUESTS = [
    (SHORT, None, 4, 4.0, (64, 64), 0),
    (LONG, "blurry", 3, 2.5, (64, 64), 0),
    (LONG, "dark", 5, 1.0, (64, 64), 0),
    ("a red tram", "dark, noisy, blurry, washed out, low contrast, grainy", 4, 3.0, (64, 64), 2),
    (SHORT, "noise", 2, 4.0, (96, 64), 1),
    ("two green apples on a table", None, 3, 1.0, (64, 96), 1),
    (SHORT + " on a sofa", None, 6, 4.0, (64, 64), 3),
]


@pytest.fixture(scope="module")
def family():
    build_missing(WEIGHTS, only=[NAME])
    pipe = DiffusionPipeline.from_pretrained(WEIGHTS / NAME, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    facts = PipelineFacts.of(pipe)
    return pipe, facts, SchedulerChoices(pipe, facts, None, NAME)


def test_every_image_equals_the_pipelines_own_amid_rows_of_other_prompt_lengths(family):
    pipe, facts, schedulers = family
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    assert isinstance(adapter, QwenImageAdapter)
    host = Host()
    engine = StepEngine(adapter, EngineLimits(8, 8))
    scheduler = schedulers.names[0]
    requests = [
        ImageRequest(prompt, negative, 10 + i, 0, *size, steps, None, cfg, scheduler)
        for i, (prompt, negative, steps, cfg, size, _) in enumerate(REQUESTS)
    ]
    jobs = [Job(TrackedRequest(str(i), RecordingChannel()), r) for i, r in enumerate(requests)]
    cancel = {"now": False}  # a neighbour that is cancelled after its second step
    victim = Job(
        TrackedRequest("victim", RecordingChannel(cancelled=lambda: cancel["now"])),
        ImageRequest(LONG, "blurry", 99, 0, 64, 64, 6, None, 4.0, scheduler),
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
    assert max(host.forwards) >= 4 and jobs[0].most_shared >= 4, "requests did not share forwards"
    assert jobs[6].first_forward > 1, "the last request did not join mid-way"
    assert [job.state.unconditional is not None for job in jobs] == [False, True, False, True, True] + [
        False,
        False,
    ]
    # Short and long prompts: rows of one forward had different text lengths.
    tokens = {int(job.state.conditional["encoder_hidden_states_mask"].sum()) for job in jobs[:3]}
    assert len(tokens) == 2
    for request, job in zip(requests, jobs, strict=True):
        (final,) = job.request.channel.finals
        served = np.asarray(final["image"], dtype=int)
        expected = np.asarray(reference(pipe, facts, schedulers, request), dtype=int)
        assert served.shape == (request.height, request.width, 3)
        assert np.abs(served - expected).max() <= 1, request

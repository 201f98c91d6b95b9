"""Pausing at a step boundary changes nothing: a job paused for a higher tier, its latents, scheduler state,
step cache and LoRA rows left as they were, resumes later and its image equals diffusers' own pipeline for
it alone (SD 1.x with a multistep solver, whose history a pause must keep; FLUX.1 with a step cache; SD 1.x
with LoRA adapters per row, against diffusers' ``set_adapters``), whoever ran while it waited."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from diffusers import DiffusionPipeline

from tests.unit.recording import RecordingChannel
from tests.unit.step_harness import (
    Host,
    assert_each_image_equals_the_pipelines_own,
    load_family,
    run_engine,
    served,
)
from tests.unit.test_step_caches import Family, check
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.ordering import Service
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.serving.server_process import WEIGHTS
from triton_diffusion.step_cache_spec import parse_step_cache
from triton_diffusion.tiny_models import build_missing

PRIORITY, DEFAULT, FLEX = 0, 1, 2


def run_with_a_late_priority_request(adapter, background: list[ImageParams], urgent: ImageParams):
    """Two running slots; the background jobs start at once, the urgent one arrives after their second
    step and pauses the lowest of them. Returns the jobs (background first) and the host."""
    engine = StepEngine(adapter, EngineLimits(2, 2, max_paused=2), service=Service())
    host = Host()
    jobs = [
        Job(TrackedRequest(str(i), RecordingChannel()), request, tier=FLEX if i == 0 else DEFAULT)
        for i, request in enumerate(background)
    ]
    late = Job(TrackedRequest("urgent", RecordingChannel()), urgent, tier=PRIORITY)
    for job in jobs:
        engine.add(job)
    step = 0
    while engine.active or step < 3:
        if step == 2:
            engine.add(late)
        host.render(engine.step())
        step += 1
    return [*jobs, late], host


def test_a_paused_sd_job_with_a_multistep_solver_equals_its_pipeline():
    family = load_family("tiny-sd", "DPMSolverMultistepScheduler")
    pipe, facts, schedulers = family
    adapter = step_adapter_for(pipe, facts, schedulers, None)

    def request(i: int, steps: int, scheduler: str) -> ImageParams:
        return ImageParams(f"a house {i}", None, 40 + i, 0, 64, 64, steps, 6.0, None, scheduler)

    background = [request(0, 8, "DPMSolverMultistepScheduler"), request(1, 6, schedulers.default)]
    urgent = request(2, 3, schedulers.default)
    jobs, _ = run_with_a_late_priority_request(adapter, background, urgent)
    paused = jobs[0]
    assert paused.queue.pauses == 1 and paused.queue.paused_s > 0, "the flex job was not paused"
    assert_each_image_equals_the_pipelines_own(family, [*background, urgent], jobs)


@pytest.fixture(scope="module")
def flux() -> Family:
    return Family("tiny-flux", deeper=True)


def test_a_paused_flux_job_keeps_its_step_cache_and_equals_diffusers(flux):
    background = [flux.request(0, "fbc:0.9"), flux.request(1, "taylorseer:2")]
    urgent = flux.request(2, "none", steps=3)
    jobs, _ = run_with_a_late_priority_request(flux.adapter, background, urgent)
    assert jobs[0].queue.pauses == 1 and jobs[0].stats.rows_reused > 0
    # Each within 1 uint8 of diffusers' own cached call, whose image the cache moves by more than 5 levels.
    check(flux, [*background, urgent], [served(job) for job in jobs])
    # The pause kept the state: the same job unpaused gives the same image.
    (alone,) = run_alone(flux.adapter, background[0])
    assert np.abs(served(alone) - served(jobs[0])).max() <= 1


def run_alone(adapter, request: ImageParams) -> list[Job]:
    return run_engine(adapter, [(0, replace(request, step_cache=parse_step_cache(request.step_cache.text)))])


def test_paused_sd_jobs_keep_their_lora_rows_and_each_equals_diffusers_set_adapters():
    from tests.unit.test_lora import reference as lora_reference
    from triton_diffusion.adapters.lora import load_loras

    adapters = {"ink": "tiny-sd-lora-ink", "neon": "tiny-sd-lora-neon"}
    build_missing(WEIGHTS, only=["tiny-sd", *adapters.values()])
    pipe, facts, schedulers = load_family("tiny-sd")
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    adapter.loras = load_loras(pipe, WEIGHTS, adapters, "tiny-sd")

    def request(steps: int, lora) -> ImageParams:
        return ImageParams("a red house", None, 7, 0, 64, 64, steps, 4.0, None, schedulers.default, lora=lora)

    # The same prompt and seed: only the adapters tell the rows apart. The flex job (ink) is paused for
    # the priority one (ink and neon, other scales) while the default job (no adapter) runs on.
    background = [request(6, (("ink", 1.0),)), request(5, ())]
    urgent = request(3, (("ink", 0.5), ("neon", 1.3)))
    jobs, _ = run_with_a_late_priority_request(adapter, background, urgent)
    assert jobs[0].queue.pauses == 1, "the flex job was not paused"
    assert max(job.stats.most_shared for job in jobs) == 2  # rows with other adapters shared its forwards
    images = [served(job) for job in jobs]
    assert np.abs(images[0] - images[1]).max() > 20, "the adapter does not visibly change the image"
    reference_pipe = DiffusionPipeline.from_pretrained(WEIGHTS / "tiny-sd", use_safetensors=True)
    reference_pipe.set_progress_bar_config(disable=True)
    for name, folder in adapters.items():  # diffusers' own way, from the same files
        reference_pipe.load_lora_weights(str(WEIGHTS / folder), adapter_name=name)
    for one, image in zip([*background, urgent], images, strict=True):
        expected = lora_reference(reference_pipe, facts, one)
        assert np.abs(image - expected).max() <= 1, one.lora

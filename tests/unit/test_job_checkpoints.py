"""A job checkpointed half-way, written to disk and restored onto a fresh start of its request, ends in the
uninterrupted job's image (adapters/job_checkpoints.py, recovery/checkpoint_store.py), CPU fp32.

Tiny SD with Euler, DPM-Solver++ (multistep: its history of model outputs is state), Euler ancestral
(stochastic: its step noise comes from the row's generator, whose state is saved), DDIM and UniPC; tiny
FLUX.1 (flow-matching Euler); an img2img job (its schedule trimmed: the scheduler's begin index) and an
inpainting job (its source blended back after every step). Each job runs k steps in a step engine beside a
neighbour, is snapshotted, goes through a CheckpointStore, and a fresh job of the same request (started
by ``adapter.prepare`` in another engine, beside a fresh neighbour) is restored and run to the end. So the
test can fail, resuming without the generator's state (Euler ancestral) or without the solver's history
(DPM-Solver) gives another image. Schedulers without a tiny pipeline (DDPM, Heun, KDPM2 ancestral, LMS,
PNDM, DEIS, single-step and SDE DPM-Solver) round-trip as schedulers alone.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import diffusers
import numpy as np
import pytest
import torch

from tests.unit.recording import RecordingChannel, step_as_worker
from tests.unit.step_harness import Host, job_of, load_family, served
from tests.unit.test_latent_loop import mask_image, source_image
from triton_diffusion.adapters.image_params import ImageParams, LatentJob
from triton_diffusion.adapters.job_checkpoints import (
    CheckpointMismatch,
    checkpoint_refusal,
    restore,
    snapshot,
    snapshot_if_able,
)
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.recovery.checkpoint_format import JobCheckpoint
from triton_diffusion.recovery.checkpoint_store import CheckpointStore

SD_SCHEDULERS = [
    "EulerDiscreteScheduler",
    "DPMSolverMultistepScheduler",
    "EulerAncestralDiscreteScheduler",
    "DDIMScheduler",
    "UniPCMultistepScheduler",
]
KEY = "resume-key-0123456789.0"
# The resumed job's last steps share forwards with another neighbour than the uninterrupted job's did (the
# uninterrupted job's last step runs alone), and CPU rounding differs with batch composition (by vendor and
# kernel: docs/contributing.md, "Exactness"): within 1 level, where the controls below move the image by
# more than 5.
TOLERANCE, CONTROL = 1, 5
Tamper = Callable[[LatentJob, LatentJob], None]  # (the restored job's state, its fresh start's copy)


@pytest.fixture(scope="module")
def sd() -> Any:
    pipe, facts, schedulers = load_family("tiny-sd", ",".join(SD_SCHEDULERS))
    return step_adapter_for(pipe, facts, schedulers, None)


@pytest.fixture(scope="module")
def flux() -> Any:
    pipe, facts, schedulers = load_family("tiny-flux")
    return step_adapter_for(pipe, facts, schedulers, None)


class Resuming:
    """The adapter, with the job ``target`` restored from ``checkpoint`` when it starts (what the engine
    does on resume), then ``tamper``ed with (a test's deliberately incomplete restore)."""

    def __init__(self, adapter: Any, checkpoint: JobCheckpoint, tamper: Tamper | None = None) -> None:
        self.adapter, self.checkpoint, self.tamper = adapter, checkpoint, tamper

    def __getattr__(self, name: str) -> Any:
        return getattr(self.adapter, name)

    def prepare(self, jobs: list[Job]) -> list[Any]:
        starts = self.adapter.prepare(jobs)
        for i, (job, start) in enumerate(zip(jobs, starts, strict=True)):
            if job.request.request_id == "target":
                fresh = copy.deepcopy(start.state)
                restore(start.state, self.checkpoint)
                if self.tamper is not None:
                    self.tamper(start.state, fresh)
                starts[i] = dataclasses.replace(
                    start, steps_done=self.checkpoint.step
                )  # it goes on from there
        return starts


def run(adapter: Any, jobs: list[Job], at_step: int | None = None) -> JobCheckpoint | None:
    """The jobs through one step engine to the end; the first's snapshot after ``at_step`` steps."""
    engine, host = StepEngine(adapter, EngineLimits(8, 8)), Host()
    engine.add(*jobs)
    checkpoint = None
    while engine.active:
        host.render(step_as_worker(engine))
        if at_step is not None and checkpoint is None and jobs[0].run.steps_done == at_step:
            checkpoint = snapshot(jobs[0].state, at_step)
    return checkpoint


def interrupted(adapter: Any, request: ImageParams, neighbour: ImageParams, k: int, tmp_path) -> Any:
    """The uninterrupted image of ``request`` (run beside ``neighbour``) and its checkpoint after ``k``
    steps, written to disk and read back."""
    target = job_of(adapter, "target", RecordingChannel(), request)
    checkpoint = run(adapter, [target, job_of(adapter, "neighbour", RecordingChannel(), neighbour)], k)
    assert checkpoint is not None and checkpoint.step == k
    store = CheckpointStore(tmp_path / "checkpoints", 1 << 30, 3600.0)
    store.put(KEY, "fields", checkpoint)
    stored = store.get(KEY)
    store.close()
    assert stored is not None and stored.fields_hash == "fields"
    return served(target), stored.checkpoint


def resumed(
    adapter: Any, request: ImageParams, neighbour: ImageParams, checkpoint: JobCheckpoint, tamper=None
) -> np.ndarray:
    """A fresh job of ``request`` restored from ``checkpoint`` in a fresh engine (beside a fresh
    neighbour), run to the end: its image."""
    resuming = Resuming(adapter, checkpoint, tamper)
    target = job_of(resuming, "target", RecordingChannel(), request)
    run(resuming, [target, job_of(resuming, "neighbour", RecordingChannel(), neighbour)])
    assert target.stats.forwards == target.run.total_steps - checkpoint.step
    return served(target)


def sd_request(scheduler: str, i: int = 0, steps: int = 6, **changes: Any) -> ImageParams:
    request = ImageParams(
        f"a lighthouse {i}", "fog" if i else None, 40 + i, 0, 64, 64, steps, 5.0, None, scheduler
    )
    return replace(request, **changes)


_RUNS: dict[Any, tuple[np.ndarray, JobCheckpoint]] = {}


def sd_run(sd: Any, scheduler: str, tmp_path) -> tuple[ImageParams, ImageParams, np.ndarray, JobCheckpoint]:
    """SD's uninterrupted job with ``scheduler`` (6 steps, beside a neighbour of its class with 5) and its
    checkpoint after 3 steps; computed once per scheduler."""
    request, neighbour = sd_request(scheduler), sd_request(scheduler, 1, steps=5)
    if scheduler not in _RUNS:
        _RUNS[scheduler] = interrupted(sd, request, neighbour, 3, tmp_path)
    return request, neighbour, *_RUNS[scheduler]


@pytest.mark.parametrize("scheduler", SD_SCHEDULERS)
def test_a_resumed_sd_job_ends_in_the_uninterrupted_image(sd, scheduler, tmp_path):
    request, neighbour, expected, checkpoint = sd_run(sd, scheduler, tmp_path)
    image = resumed(sd, request, neighbour, checkpoint)
    assert np.abs(image - expected).max() <= TOLERANCE, scheduler


def test_without_its_generator_state_a_stochastic_job_resumes_to_another_image(sd, tmp_path):
    request, neighbour, expected, checkpoint = sd_run(sd, "EulerAncestralDiscreteScheduler", tmp_path)

    def fresh_generator(state: LatentJob, fresh: LatentJob) -> None:  # the generator as the start left it
        state.step_kwargs["generator"][0].set_state(fresh.step_kwargs["generator"][0].get_state())

    image = resumed(sd, request, neighbour, checkpoint, fresh_generator)
    assert np.abs(image - expected).max() > CONTROL


def test_without_its_history_a_multistep_job_resumes_to_another_image(sd, tmp_path):
    request, neighbour, expected, checkpoint = sd_run(sd, "DPMSolverMultistepScheduler", tmp_path)

    def no_history(state: LatentJob, fresh: LatentJob) -> None:  # every other attribute restored
        state.scheduler.model_outputs = fresh.scheduler.model_outputs
        state.scheduler.lower_order_nums = fresh.scheduler.lower_order_nums

    image = resumed(sd, request, neighbour, checkpoint, no_history)
    assert np.abs(image - expected).max() > CONTROL


def test_a_resumed_flux_job_ends_in_the_uninterrupted_image(flux, tmp_path):
    scheduler = next(iter(flux.templates))  # its flow-matching Euler
    request = ImageParams("a red boat", "blurry", 7, 0, 64, 64, 5, 3.5, 2.0, scheduler)  # true CFG
    # Another size, packed into the same forwards.
    neighbour = replace(request, prompt="a green field", negative_prompt=None, seed=8, steps=4, height=96)
    expected, checkpoint = interrupted(flux, request, neighbour, 2, tmp_path)
    assert np.abs(resumed(flux, request, neighbour, checkpoint) - expected).max() <= TOLERANCE


@pytest.mark.parametrize(
    ("start", "scheduler", "strength"),
    [("image", "DPMSolverMultistepScheduler", 0.6), ("mask", "EulerAncestralDiscreteScheduler", 0.8)],
)
def test_a_resumed_image_conditioned_job_ends_in_the_uninterrupted_image(
    sd, start, scheduler, strength, tmp_path
):
    mask = mask_image() if start == "mask" else None
    request = sd_request(scheduler, steps=7, image=source_image(), strength=strength, mask_image=mask)
    neighbour = sd_request(scheduler, 1, steps=5)
    expected, checkpoint = interrupted(sd, request, neighbour, 2, tmp_path)
    # The trimmed schedule's begin index is set at the start: the fresh start of the resend sets it again.
    assert "_begin_index" not in checkpoint.meta["scheduler"]["attributes"]
    assert np.abs(resumed(sd, request, neighbour, checkpoint) - expected).max() <= TOLERANCE


# ---- schedulers without a tiny pipeline of their own: state round trips ------------------------------
ALONE = [
    ("DDPMScheduler", {}),
    ("HeunDiscreteScheduler", {}),
    ("KDPM2AncestralDiscreteScheduler", {}),
    ("LMSDiscreteScheduler", {}),
    ("PNDMScheduler", {}),
    ("DEISMultistepScheduler", {}),
    ("DPMSolverSinglestepScheduler", {}),
    ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
]


def scheduler_job(name: str, config: dict[str, Any], seed: int = 5) -> LatentJob:
    """A job of ``name`` at its start."""
    scheduler = getattr(diffusers, name)(**config)
    scheduler.set_timesteps(8)
    generator = torch.Generator().manual_seed(seed)
    kwargs = {"generator": [generator]} if "generator" in inspect.signature(scheduler.step).parameters else {}
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1)) * scheduler.init_noise_sigma
    return LatentJob(latents, scheduler, scheduler.timesteps, {}, None, 1.0, kwargs, {})


def denoise(state: LatentJob, begin: int, end: int) -> None:
    """Steps ``begin`` to ``end`` with a model that is a fixed function of its input."""
    for t in state.timesteps[begin:end]:
        x = state.scheduler.scale_model_input(state.latents, t)
        noise = torch.tanh(x * 0.7) + 0.1 * torch.cos(x + float(t) / 500)
        state.latents = state.scheduler.step(noise, t, state.latents, **state.step_kwargs, return_dict=False)[
            0
        ]


@pytest.mark.parametrize(("name", "config"), ALONE, ids=[n + ("-sde" if c else "") for n, c in ALONE])
def test_every_scheduler_state_round_trips(name, config):
    if name == "LMSDiscreteScheduler":
        pytest.importorskip("scipy")  # its coefficients integrate with scipy
    whole, part = scheduler_job(name, config), scheduler_job(name, config)
    total = len(whole.timesteps)
    denoise(whole, 0, total)
    denoise(part, 0, 5)
    assert checkpoint_refusal(part) is None
    checkpoint = snapshot(part, 5)
    fresh = scheduler_job(name, config)
    restore(fresh, checkpoint)
    denoise(fresh, 5, total)
    assert torch.equal(fresh.latents, whole.latents), name


def test_a_checkpoint_holds_the_named_state_and_none_of_the_tables():
    state = scheduler_job("DPMSolverMultistepScheduler", {})
    denoise(state, 0, 3)
    checkpoint = snapshot(state, 3)
    assert set(checkpoint.meta["scheduler"]["attributes"]) == {
        "_step_index",
        "lower_order_nums",
        "model_outputs",
    }
    scheduler_tensors = {name.split(".")[1] for name in checkpoint.tensors if name.startswith("scheduler.")}
    assert scheduler_tensors == {"model_outputs"}  # neither sigmas, alphas_t nor timesteps: the start's
    assert "sigmas" in vars(state.scheduler)


def test_an_unnamed_scheduler_is_not_checkpointed():
    class UnknownScheduler(diffusers.EulerDiscreteScheduler):
        pass

    state = scheduler_job("EulerDiscreteScheduler", {})
    state.scheduler.__class__ = UnknownScheduler
    assert "UnknownScheduler" in (checkpoint_refusal(state) or "")
    with pytest.raises(ValueError, match="UnknownScheduler"):
        snapshot(state, 0)


def test_a_checkpoint_without_named_state_or_with_other_state_is_refused():
    state = scheduler_job("EulerDiscreteScheduler", {})
    denoise(state, 0, 2)
    lacking = snapshot(state, 2)
    del lacking.meta["scheduler"]["attributes"]["_step_index"]
    with pytest.raises(CheckpointMismatch, match="_step_index"):
        restore(scheduler_job("EulerDiscreteScheduler", {}), lacking)
    other = snapshot(state, 2)
    other.meta["scheduler"]["attributes"]["sigmas"] = {"value": 1.0}  # a table: never from a file
    with pytest.raises(CheckpointMismatch, match="sigmas"):
        restore(scheduler_job("EulerDiscreteScheduler", {}), other)


def test_a_scheduler_value_that_cannot_be_written_is_refused_by_name():
    state = scheduler_job("EulerDiscreteScheduler", {})
    state.scheduler.is_scale_input_called = object()  # one of its named state's attributes
    assert "is_scale_input_called" in (checkpoint_refusal(state) or "")
    with pytest.raises(ValueError, match=r"scheduler\.is_scale_input_called.*object"):
        snapshot(state, 0)
    state.scheduler.is_scale_input_called = [torch.zeros(1), {"a": 1}]
    with pytest.raises(ValueError, match=r"scheduler\.is_scale_input_called\.1.*dict"):
        snapshot(state, 0)


def test_a_job_with_a_step_cache_is_refused():
    state = scheduler_job("EulerDiscreteScheduler", {})
    assert checkpoint_refusal(state) is None
    assert "step cache" in (checkpoint_refusal(replace(state, cache=object())) or "")
    assert checkpoint_refusal("not a latent job") is not None


def test_the_engine_s_snapshot_is_the_checked_one_or_none_where_it_is_refused():
    state = scheduler_job("EulerDiscreteScheduler", {})
    taken, checked = snapshot_if_able(state, 3), snapshot(state, 3)
    assert taken is not None and (taken.step, taken.meta) == (checked.step, checked.meta)
    assert taken.tensors.keys() == checked.tensors.keys()
    assert all(torch.equal(taken.tensors[name], checked.tensors[name]) for name in taken.tensors)
    assert snapshot_if_able(replace(state, cache=object()), 3) is None
    assert snapshot_if_able("not a latent job", 3) is None


def test_a_snapshot_is_a_copy_and_changes_nothing():
    state = scheduler_job("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"})
    denoise(state, 0, 3)
    generator = state.step_kwargs["generator"][0]
    before = (state.latents.clone(), generator.get_state(), state.scheduler.model_outputs[-1].clone())
    checkpoint = snapshot(state, 3)
    assert torch.equal(generator.get_state(), before[1])  # taking it drew nothing
    state.latents.add_(1.0)
    state.scheduler.model_outputs[-1].add_(1.0)
    generator.manual_seed(99)
    assert torch.equal(checkpoint.tensors["latents"], before[0])
    assert torch.equal(checkpoint.tensors["scheduler.model_outputs.1"], before[2])
    assert torch.equal(checkpoint.tensors["generator.0"], before[1])
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in checkpoint.tensors.values())


@pytest.mark.parametrize(
    ("other", "names"),
    [
        (lambda: scheduler_job("EulerAncestralDiscreteScheduler", {}), "scheduler: EulerDiscreteScheduler"),
        (
            lambda: replace(scheduler_job("EulerDiscreteScheduler", {}), latents=torch.zeros(1, 4, 8, 12)),
            "latents",
        ),
        (lambda: _with_steps(scheduler_job("EulerDiscreteScheduler", {}), 6), "timesteps"),
    ],
    ids=["scheduler", "latents", "timesteps"],
)
def test_a_checkpoint_that_does_not_fit_is_refused_and_changes_nothing(other, names):
    state = scheduler_job("EulerDiscreteScheduler", {})
    denoise(state, 0, 4)
    checkpoint = snapshot(state, 4)
    target = other()
    latents, attributes = target.latents, dict(vars(target.scheduler))
    with pytest.raises(CheckpointMismatch, match=names):
        restore(target, checkpoint)
    assert target.latents is latents and vars(target.scheduler) == attributes


def _with_steps(state: LatentJob, steps: int) -> LatentJob:
    state.scheduler.set_timesteps(steps)
    return replace(state, timesteps=state.scheduler.timesteps)

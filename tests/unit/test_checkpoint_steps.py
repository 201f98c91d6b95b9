"""Checkpoints in the step engine, with fake adapters (pure logic): the engine asks for a job's checkpoint
every ``checkpoint_every`` denoising steps (never after its last, never without a key) and reports it
for the host; a failed checkpoint costs nothing else; a job started from a checkpoint goes on from its
step (the scheduler applies JobStart.steps_done); the latent adapters' start restores a checkpoint, or
starts afresh when it does not fit (adapters/starts.py, job_checkpoints' functions faked)."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.unit.recording import step_as_worker, tracked
from triton_diffusion.adapters import job_checkpoints as job_checkpoints_module
from triton_diffusion.adapters import starts
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.job_checkpoints import CheckpointMismatch
from triton_diffusion.adapters.starts import JobStarts
from triton_diffusion.engine.jobs import ForwardResult, Job, JobStart, JobStep
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine


@dataclass
class Params:
    steps: int = 7
    resume_at: int = 0  # the step the adapter's "checkpoint" restores (0: none)


@dataclass
class CheckpointingAdapter:
    """Steps each job by one; a checkpoint is (job, step); ``fail_checkpoints`` makes taking them raise."""

    fail_checkpoints: bool = False
    asked: list[list[tuple[str, int]]] = field(default_factory=list)
    stepped_from: dict[str, list[int]] = field(default_factory=dict)

    def prepare(self, jobs: list[Job]) -> list[JobStart]:
        return [
            JobStart([0], "g", job.spec.params.steps, steps_done=job.spec.params.resume_at) for job in jobs
        ]

    def step(self, jobs: list[Job], previews: Any = None) -> ForwardResult:
        steps = []
        for job in jobs:
            self.stepped_from.setdefault(job.request.request_id, []).append(job.run.steps_done)
            step = job.run.steps_done + 1
            steps.append(JobStep(step, step == job.run.total_steps))
        return ForwardResult(steps, rows=len(jobs))

    def finish(self, jobs: list[Job]) -> list[Any]:
        return [f"out:{job.request.request_id}" for job in jobs]

    def checkpoint(self, jobs: list[Job]) -> list[Any]:
        self.asked.append([(job.request.request_id, job.run.steps_done) for job in jobs])
        if self.fail_checkpoints:
            raise RuntimeError("disk of the host full (simulated)")
        return [(job.request.request_id, job.run.steps_done) for job in jobs]


def run(adapter: CheckpointingAdapter, jobs: list[Job], every: int) -> list[Any]:
    """Every job through one engine; the checkpoints its reports carried, in order."""
    engine = StepEngine(adapter, EngineLimits(8, 8), checkpoint_every=every)
    engine.add(*jobs)
    taken: list[Any] = []
    for _ in range(100):
        if not engine.active:
            break
        report = step_as_worker(engine)
        taken += [(job.request.request_id, checkpoint) for job, checkpoint in report.checkpoints]
        for finished in report.finished:
            finished.job.request.finish({"out": finished.output})
    assert not engine.active
    return taken


def job(name: str, key: str | None, params: Params | None = None) -> Job:
    return Job(tracked(name), params or Params(), checkpoint_key=key)


def test_a_job_with_a_key_is_checkpointed_every_n_steps_but_not_after_its_last():
    adapter = CheckpointingAdapter()
    keyed, plain = job("keyed", "k.0"), job("plain", None)
    taken = run(adapter, [keyed, plain], every=2)
    assert taken == [("keyed", ("keyed", 2)), ("keyed", ("keyed", 4)), ("keyed", ("keyed", 6))]
    assert all(name == "keyed" for asked in adapter.asked for name, _ in asked)  # never the one without
    assert run(CheckpointingAdapter(), [job("even", "k.0", Params(steps=6))], every=3) == [
        ("even", ("even", 3))  # at 3; not at 6, its last (its answer is near)
    ]


def test_checkpoints_are_off_at_zero():
    adapter = CheckpointingAdapter()
    assert run(adapter, [job("keyed", "k.0")], every=0) == [] and adapter.asked == []


def test_a_failed_checkpoint_costs_only_itself():
    adapter = CheckpointingAdapter(fail_checkpoints=True)
    keyed = job("keyed", "k.0")
    assert run(adapter, [keyed], every=2) == []
    assert len(adapter.asked) == 3 and keyed.run.steps_done == 7
    assert keyed.request.channel.finals == [{"out": "out:keyed"}]


def test_a_job_started_from_a_checkpoint_goes_on_from_its_step():
    adapter = CheckpointingAdapter()
    resumed = job("resumed", "k.0", Params(steps=7, resume_at=4))
    taken = run(adapter, [resumed], every=2)
    assert adapter.stepped_from["resumed"] == [4, 5, 6]  # three forwards, not seven
    assert resumed.stats.resumed_from_step == 4 and resumed.run.steps_done == 7
    assert taken == [("resumed", ("resumed", 6))]
    fresh = job("fresh", None)
    run(CheckpointingAdapter(), [fresh], every=0)
    assert fresh.stats.resumed_from_step is None


# ---- the latent adapters' start (starts.py), its job_checkpoints functions faked --------------------------
@pytest.fixture
def job_checkpoints(monkeypatch):
    """starts.py's restore, and job_checkpoints' refusal and copy, faked (job states here are strings):
    what it restored is recorded; a checkpoint whose meta says "bad" does not fit."""
    fakes = types.SimpleNamespace(restored=[])

    def restore(state: Any, checkpoint: Any) -> None:
        if checkpoint.meta.get("bad"):
            raise CheckpointMismatch("latents [1, 4, 8, 8], the job's [1, 4, 16, 16]")
        fakes.restored.append((state, checkpoint))

    monkeypatch.setattr(starts, "restore", restore)
    refusal = lambda state: "a step cache" if state == "cached" else None  # noqa: E731
    monkeypatch.setattr(job_checkpoints_module, "checkpoint_refusal", refusal)
    monkeypatch.setattr(job_checkpoints_module, "_taken", lambda state, step: ("snapshot", state, step))
    return fakes


@dataclass
class Checkpoint:
    step: int
    tensors: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


class Starts(JobStarts):
    """A latent adapter's start, its jobs' states made up: each start counted (no adapter: nothing here
    reads it)."""

    def __init__(self) -> None:
        super().__init__(adapter=None)  # type: ignore[arg-type]
        self.started: list[ImageParams] = []

    def start_requests(self, requests: list[ImageParams]) -> list[JobStart]:
        self.started += requests
        return [JobStart(f"state of {r.prompt}", r.size, r.steps) for r in requests]


def image(prompt: str, resume: Any = None) -> ImageParams:
    return ImageParams(prompt, None, 1, 0, 64, 64, 12, 7.5, None, "DDIM", resume=resume)


def test_the_latent_start_restores_a_checkpoint_and_goes_on_after_its_step(job_checkpoints):
    starts = Starts()
    checkpoint = Checkpoint(6)
    jobs = [Job(tracked("a"), image("a", checkpoint)), Job(tracked("b"), image("b"))]
    resumed, plain = starts.prepare(jobs)
    assert (resumed.steps_done, resumed.warning, plain.steps_done) == (6, None, 0)
    assert job_checkpoints.restored == [("state of a", checkpoint)]
    assert image("a", checkpoint) == image("a") and "resume" not in repr(image("a", checkpoint))


def test_a_checkpoint_that_does_not_fit_starts_the_job_afresh_with_a_warning(job_checkpoints):
    starts = Starts()
    (start,) = starts.prepare([Job(tracked("a"), image("a", Checkpoint(6, meta={"bad": True})))])
    assert start.steps_done == 0 and "did not fit (latents [1, 4, 8, 8]" in (start.warning or "")
    assert len(starts.started) == 2 and starts.started[1].resume is None  # started again, cleanly


def test_the_latent_adapter_checkpoints_what_can_be_and_refuses_a_step_cache(job_checkpoints):
    starts = Starts()
    plain, cached = Job(tracked("a"), image("a")), Job(tracked("b"), image("b"))
    plain.state, plain.run.steps_done, cached.state, cached.run.steps_done = "state a", 4, "cached", 4
    assert starts.checkpoint([plain, cached]) == [("snapshot", "state a", 4), None]

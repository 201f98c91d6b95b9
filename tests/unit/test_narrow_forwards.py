"""Narrowed forwards (config ``narrow_forwards``: engine/forward_choice.py ``narrow``): where a job with a
deadline is late stepping in full forwards and in time in smaller ones, and the smaller forward costs
about as much per token, only it and the jobs before it in order step; the refusal estimate counts on it.

The engine here runs on a modelled clock: the adapter's forward advances it by what the forward costs
(``fixed + per_token x tokens``, a job being one token) and the stopwatch times by it, so what the engine
learns, the deadlines it checks and when jobs finish are all that cost line's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.unit.recording import step_as_worker, tracked
from tests.unit.test_step_engine import FakeAdapter, Host, Spec
from triton_diffusion.engine.estimates import WorkTimes
from triton_diffusion.engine.forward_choice import narrow, narrow_pays
from triton_diffusion.engine.jobs import Job, rows_and_tokens
from triton_diffusion.engine.ordering import AdmissionPacing, Service, make_policy
from triton_diffusion.engine.planner import RowCaps
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.errors import ErrorCode
from triton_diffusion.serving.engines import StepEngineKind
from triton_diffusion.settings import ModelConfig, ModelSettings

PRIORITY, DEFAULT = 0, 1
COMPUTE_BOUND = (0.0, 0.1)  # seconds: a forward's time grows with its rows (a GPU at large sizes)
FIXED_BOUND = (1.0, 0.01)  # a forward's fixed part dominates (a CPU at small sizes)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ModelledAdapter(FakeAdapter):
    """The fake adapter, whose forward takes ``fixed + per_token x tokens`` on the modelled clock."""

    def __init__(self, clock: Clock, cost: tuple[float, float]) -> None:
        super().__init__()
        self.clock, self.cost = clock, cost

    def step(self, jobs, previews=None):
        fixed, per_token = self.cost
        self.clock.now += fixed + per_token * sum(job.spec.tokens for job in jobs)
        return super().step(jobs, previews)


class ModelledStopwatch:
    """Times spans on the modelled clock (at once, as a CPU's)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def start(self):
        return self.clock.now, None

    def stop(self, mark, record):
        seconds = self.clock.now - mark[0]
        record(seconds)
        return seconds

    def settle(self, wait: bool = False, most: int | None = None) -> None:
        pass


class Modelled:
    """A step engine of 4 jobs a forward on the modelled clock, tiers and deadlines on (refuse late)."""

    def __init__(self, cost: tuple[float, float], narrow: bool, starvation_steps: int = 16) -> None:
        self.clock = Clock()
        self.adapter = ModelledAdapter(self.clock, cost)
        self.host = Host()
        limits = EngineLimits(4, 4, max_paused=4, starvation_steps=starvation_steps, narrow_forwards=narrow)
        service = Service(("priority", "default"), 0.0, True, "tier")
        self.engine = StepEngine(
            self.adapter, limits, make_policy("oldest"), AdmissionPacing(4), service, self.clock,
            stopwatch=ModelledStopwatch(self.clock),
        )  # fmt: skip
        fixed, per_token = cost
        for tokens in range(1, 5):  # what a warm engine has measured: its forwards' cost line
            self.engine.times.forward_ran(tokens, tokens, fixed + per_token * tokens, tokens)

    def job(self, name: str, tier: int, steps: int, deadline_s: float | None = None) -> Job:
        job = Job(tracked(name), Spec(steps=steps), tier=tier, planned_steps=steps, shape="64x64", tokens=1)
        job.request.entered = job.queue.ready_at = self.clock.now
        if deadline_s is not None:
            job.spec = replace(job.spec, deadline=self.clock.now + deadline_s)
        return job

    def step(self) -> None:
        self.host.render(step_as_worker(self.engine))

    def busy_with_background(self) -> list[Job]:
        """Three background jobs of 20 steps running: a full forward is 4 jobs with a fourth."""
        background = [self.job(f"background{i}", DEFAULT, 20) for i in range(3)]
        self.engine.add(*background)
        self.step()
        return background

    def forwards_of(self, name: str) -> list[list[str]]:
        return [forward for forward in self.adapter.forwards if name in forward]

    def narrowed(self) -> int:
        return sum(forward.narrowed for report in self.host.reports for forward in report.forwards)


def test_an_urgent_job_steps_in_narrowed_forwards_and_is_in_time_where_full_ones_would_refuse_it():
    """Compute-bound: 4 steps of full forwards (0.4 s each) take 1.6 s, alone 0.4 s; deadline 1 s. With
    narrowing it is answered by its deadline on the modelled clock; without, refused at once."""
    outcomes = {}
    for narrowing in (True, False):
        m = Modelled(COMPUTE_BOUND, narrowing)
        m.busy_with_background()
        urgent = m.job("urgent", PRIORITY, 4, deadline_s=1.0)
        m.engine.add(urgent)
        answered_at = None
        while m.engine.active:
            m.step()
            if answered_at is None and urgent.request.channel.finals:
                answered_at = m.clock.now
        in_time = answered_at is not None and answered_at <= (urgent.spec.deadline or 0.0)
        outcomes[narrowing] = (urgent.request.channel.finals, m.forwards_of("urgent"), m.narrowed(), in_time)
    finals, forwards, narrowed, in_time = outcomes[True]
    assert finals == [{"out": "out:urgent"}] and in_time
    assert len(forwards) == 4 and any(len(forward) < 4 for forward in forwards) and narrowed > 0
    assert all(forward[0] == "urgent" for forward in forwards)  # the jobs left out are those after it
    (refused,), forwards, narrowed, _ = outcomes[False]
    assert refused.code is ErrorCode.UNAVAILABLE and "deadline" in refused.message
    assert forwards == [] and narrowed == 0


def test_a_forward_is_not_narrowed_where_its_fixed_part_makes_a_smaller_one_dear_per_token():
    """Fixed-bound: alone 4 x 1.01 s, full 4 x 1.04 s; a deadline of 4.1 s is late full, in time alone,
    but a forward of one job costs four times as much per token: nothing is narrowed, the job refused."""
    m = Modelled(FIXED_BOUND, narrow=True)
    m.busy_with_background()
    urgent = m.job("urgent", PRIORITY, 4, deadline_s=4.1)
    m.engine.add(urgent)
    while m.engine.active:
        m.step()
    (refused,) = urgent.request.channel.finals
    assert refused.code is ErrorCode.UNAVAILABLE and m.narrowed() == 0
    assert all(len(forward) == 3 for forward in m.adapter.forwards)  # the background, full


def test_no_forward_is_narrowed_where_every_deadline_is_met_full():
    m = Modelled(COMPUTE_BOUND, narrow=True)
    m.busy_with_background()
    relaxed = m.job("relaxed", PRIORITY, 4, deadline_s=10.0)
    m.engine.add(relaxed)
    while m.engine.active:
        m.step()
    assert relaxed.request.channel.finals == [{"out": "out:relaxed"}] and m.narrowed() == 0
    assert [len(forward) for forward in m.forwards_of("relaxed")] == [4, 4, 4, 4]


@pytest.mark.parametrize("starvation_steps", [2, 16])
def test_narrowing_never_leaves_out_a_starved_job_and_keeps_the_urgent_one(starvation_steps):
    """An urgent job of 12 steps and 4 s (full forwards 4.8 s, alone 1.2 s) is in time narrowed; with a
    bound of 2 steps the background jobs starve and go first: those forwards hold them and it."""
    m = Modelled(COMPUTE_BOUND, narrow=True, starvation_steps=starvation_steps)
    background = m.busy_with_background()
    urgent = m.job("urgent", PRIORITY, 12, deadline_s=4.0)
    m.engine.add(urgent)
    waited: dict[str, int] = {job.request.request_id: 0 for job in background}
    most_waited = 0
    while m.engine.active and urgent.request.channel.finals == []:
        m.step()
        last = m.adapter.forwards[-1]
        for name in waited:
            waited[name] = 0 if name in last else waited[name] + 1
            most_waited = max(most_waited, waited[name])
        assert "urgent" in last or urgent.run.steps_done == 12  # every forward while it runs steps it
    assert urgent.request.channel.finals == [{"out": "out:urgent"}]
    # Each background job waits at most the bound (no narrowing past a starved job) and, with the large
    # bound, the narrowed forwards left them out for more steps than the small one lets them wait.
    assert most_waited <= starvation_steps
    assert (most_waited > 2) == (starvation_steps == 16)


def test_config_narrow_forwards_reaches_the_served_engine_of_images_off_by_default():
    """Config to the engine the server builds: off by default, on where set, never on the diffusion LM."""

    def limits(config: ModelConfig, images: bool = True) -> EngineLimits:
        settings = ModelSettings("m", Path("."), config, {}, 8, "CPU", 0)
        caps = RowCaps(4, {}) if images else None  # none: the diffusion LM's engine
        return StepEngineKind(FakeAdapter(), caps).build(settings, print).scheduler.limits

    assert limits(ModelConfig()).narrow_forwards is False
    assert limits(ModelConfig(narrow_forwards=True)).narrow_forwards is True
    on = ModelConfig(narrow_forwards=True)
    assert limits(on, images=False).narrow_forwards is False  # not its kind's parameter


def test_narrow_keeps_the_starved_and_narrows_only_for_a_job_it_brings_in_time():
    """``narrow`` itself, on a compute-bound line (a job's forward 0.1 s): an urgent job of 4 steps and
    0.5 s is in time only alone (within 90% of its time left; 1 job: 0.4 s, 2: 0.8 s); with two starved
    jobs to keep, no forward that
    keeps them brings it in time, so it stays full; one late even alone, or in time full, is not narrowed
    for, nor does one late even alone stop a narrowing for another."""
    times = WorkTimes()
    for tokens in range(1, 5):
        times.forward_ran(tokens, tokens, 0.1 * tokens, tokens)

    def made(name: str, deadline_s: float | None = None) -> Job:
        job = Job(tracked(name), Spec(steps=4), planned_steps=4, shape="64x64", tokens=1)
        job.spec = replace(job.spec, deadline=None if deadline_s is None else 1000.0 + deadline_s)
        return job

    def names(jobs: list[Job], keep: int = 0) -> list[str]:
        return [job.request.request_id for job in narrow(jobs, 1000.0, times, rows_and_tokens, keep)]

    others = [made(f"other{i}") for i in range(3)]
    assert names([made("urgent", 0.5), *others]) == ["urgent"]
    assert names([made("urgent", 1.0), *others]) == ["urgent", "other0"]  # 2 jobs: 0.8 s
    assert names([made("urgent", 0.85), *others]) == ["urgent"]  # 0.8 s is past 90% of 0.85 s
    assert len(names([made("urgent", 0.5), *others], keep=2)) == 4
    assert len(names([made("hopeless", 0.3), *others])) == 4  # late alone: 0.4 s
    assert names([made("hopeless", 0.3), made("urgent", 1.0), *others[:2]]) == ["hopeless", "urgent"]
    assert len(names([made("relaxed", 10.0), *others])) == 4
    assert len(narrow([made("urgent", 0.5), *others], 1000.0, WorkTimes(), rows_and_tokens, 0)) == 4
    # A fixed-bound line (1 s + 0.01 s a job): alone 4.04 s, full 4.16 s; late full, in time alone, but a
    # forward of one costs about 4 times as much per token: not narrowed.
    fixed = WorkTimes()
    for tokens in range(1, 5):
        fixed.forward_ran(tokens, tokens, 1.0 + 0.01 * tokens, tokens)
    assert len(narrow([made("urgent", 4.6), *others], 1000.0, fixed, rows_and_tokens, 0)) == 4


@pytest.mark.parametrize(("dearer", "pays"), [(1.04, True), (1.06, False)])
def test_narrowing_pays_only_within_its_margin_per_token(dearer, pays):
    """A forward of 1 token costing ``dearer`` x the per-token price of one of 4 (5% allowed)."""
    times = WorkTimes()
    times.forward_ran(1, 1, 0.1 * dearer, 1)
    times.forward_ran(4, 4, 0.4, 4)
    assert narrow_pays(times, 1, 4) is pays


def test_the_scheduler_keeps_its_starved_jobs_in_a_narrowed_forward():
    """Two running jobs starved (not stepped for ``starvation_steps``), the first with a deadline met only
    alone: the scheduler's forward keeps both (and the third), not the first alone."""
    m = Modelled(COMPUTE_BOUND, narrow=True, starvation_steps=2)
    jobs = [m.job("starved0", DEFAULT, 20), m.job("starved1", DEFAULT, 20), m.job("other", PRIORITY, 20)]
    m.engine.add(*jobs)
    m.step()
    scheduler = m.engine.scheduler
    jobs[0].spec = replace(jobs[0].spec, deadline=m.clock.now + 0.1 * jobs[0].remaining / 0.85)
    jobs[2].spec = replace(jobs[2].spec, deadline=m.clock.now + 60.0)
    for job in jobs[:2]:
        job.queue.waited_since = scheduler.step - 2
    assert {j.request.request_id for j in scheduler.next_forward(m.clock.now)} == {
        "starved0",
        "starved1",
        "other",
    }
    jobs[1].queue.waited_since = scheduler.step  # now only the first is starved: it goes alone
    assert [j.request.request_id for j in scheduler.next_forward(m.clock.now)] == ["starved0"]


def test_the_host_counts_narrowed_forwards_in_its_metric():
    """One count per narrowed forward (whatever it left out), none for a full one."""
    from tests.unit.test_step_engine import RaisingKind
    from triton_diffusion.engine.jobs import Forward, StepReport
    from triton_diffusion.serving.engine_host import EngineHost
    from triton_diffusion.serving.metrics import IMAGE_METRICS

    counted: list[str] = []

    class Metrics:
        def observe(self, name, value, **labels): ...

        def increment(self, name, value=1, **labels):
            counted.extend([name] * value)

        set = increment

    settings = ModelSettings("m", Path("."), ModelConfig(), {}, 8, "CPU", 0)
    engine = StepEngineKind(FakeAdapter())
    host = EngineHost(RaisingKind(raise_in={}), engine, settings, Metrics(), IMAGE_METRICS, lambda e: None)
    try:
        host.render(StepReport(forwards=[Forward(2, 2, 0.1, narrowed=2), Forward(4, 4, 0.1)]))
        host.responses.flush(10.0)
    finally:
        host.close()
    assert counted.count("triton_diffusion_forwards_narrowed_total") == 1

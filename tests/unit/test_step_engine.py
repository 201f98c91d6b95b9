"""The shared step engine with a fake adapter (pure logic): exactly one answer per request whatever raises,
on every thread; failure isolation; out-of-memory splits; scheduling policies without starvation; the
engine host's worker (restarts, device loss, the stall watchdog)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.faults import AcceleratorError, SimulatedOutOfMemoryError
from tests.unit.recording import RecordingChannel, deliver_errors, step_as_worker, tracked
from triton_diffusion.adapters.packed_rows import padded_counts
from triton_diffusion.engine.failures import DeviceLostError
from triton_diffusion.engine.forward_caps import CAP_RECOVERY_FORWARDS, EngineLimits, ForwardCaps
from triton_diffusion.engine.jobs import (
    Finished,
    ForwardResult,
    Job,
    JobSpec,
    JobStart,
    JobStep,
    Left,
    Packing,
    StepReport,
)
from triton_diffusion.engine.ordering import AdmissionPacing, make_policy
from triton_diffusion.engine.request_status import Abort
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.errors import RESEND, ErrorCode, RequestError
from triton_diffusion.serving.cancellations import ClientAborts
from triton_diffusion.serving.engine_worker import EngineWorker
from triton_diffusion.serving.requests import Stage, TrackedRequest


@dataclass
class Spec:
    group: str = "64x64"
    steps: int = 3
    fail_forward: bool = False  # any forward holding this job raises
    fail_finish: bool = False
    joins: str | None = None  # another group whose forwards it may step in (a packing adapter's jobs)
    grid: tuple[int, int, int] | None = None  # its rows and token grid, where a packed forward pads it


class FakeAdapter:
    def __init__(self, max_rows: int | None = None) -> None:
        self.max_rows = max_rows
        self.forwards: list[list[str]] = []
        self.finishes: list[list[str]] = []

    def prepare(self, jobs):
        return [
            JobStart([0], job.spec.params.group, job.spec.params.steps, also_joins=job.spec.params.joins)
            for job in jobs
        ]

    def computed(self, jobs):
        """A packing adapter's count (adapters/packed_rows.py): the canvas of the jobs' grids."""
        return padded_counts([job.spec.params.grid for job in jobs], [job.spec.tokens for job in jobs])

    def step(self, jobs, previews=None):
        names = [job.request.request_id for job in jobs]
        if self.max_rows is not None and len(jobs) > self.max_rows:
            raise SimulatedOutOfMemoryError(f"{len(jobs)} rows")
        if any(job.spec.params.fail_forward for job in jobs):
            raise RuntimeError("bad row")
        self.forwards.append(names)
        steps = []
        for job in jobs:
            job.state[0] += 1  # the adapter's own state: a step counter of its own
            steps.append(JobStep(job.state[0], job.state[0] == job.run.total_steps))
        return ForwardResult(steps, rows=len(jobs))

    def finish(self, jobs):
        if any(job.spec.params.fail_finish for job in jobs):
            raise RuntimeError("decode failed")
        self.finishes.append([job.request.request_id for job in jobs])
        return [f"out:{job.request.request_id}" for job in jobs]


class Host:
    """Renders engine reports as the engine host does, minimally: a finished job's request is answered
    with its output, and every departure is written down."""

    def __init__(self) -> None:
        self.left: list[tuple[str, str]] = []
        self.reports: list[StepReport] = []

    def render(self, report: StepReport) -> None:
        self.reports.append(report)
        for finished in report.finished:
            finished.job.request.finish({"out": finished.output})
        deliver_errors(report)
        self.left.extend((left.job.request.request_id, left.reason) for left in report.left)


class Engine:
    """A step engine with its host: each step's report is rendered at once."""

    def __init__(self, engine: StepEngine, host: Host) -> None:
        self.engine, self.host = engine, host

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self) -> None:
        self.host.render(step_as_worker(self.engine))


def engine_for(
    adapter, host=None, max_running=8, max_per_forward=8, policy="oldest", cap_for=None, pacing=None
):
    limits = EngineLimits(max_running, max_per_forward, cap_for, starvation_steps=4)
    engine = StepEngine(adapter, limits, make_policy(policy), pacing)
    return Engine(engine, host or Host())


def worker_for(engine: Engine, waiting_room: int, stall_s: float = 60.0, on_device_lost=None, on_stall=None):
    return EngineWorker(
        engine.engine,
        engine.engine.limits.max_running + waiting_room,
        engine.host.render,
        stall_s,
        on_device_lost=on_device_lost or (lambda error: None),
        on_stall=on_stall or (lambda error: None),
    )


def submit(worker: EngineWorker, *jobs: Job, max_wait_s: float = 60.0) -> list[float]:
    return worker.submit([(j.request, [j]) for j in jobs], max_wait_s)


def job(name: str, spec: Spec | None = None, tokens: int = 1, **channel) -> Job:
    """A job of the fake adapter: its group (what it will share forwards with) is also its shape."""
    spec = spec or Spec()
    return Job(tracked(name, **channel), spec, shape=spec.group, tokens=tokens)


def drain(engine: StepEngine, limit: int = 200) -> None:
    for _ in range(limit):
        if not engine.active:
            return
        engine.step()
    raise AssertionError("engine did not drain")


def answers(jobs):
    return {j.request.request_id: j.request.channel.finals for j in jobs}


class Gated(FakeAdapter):
    """The fake adapter, its forwards held until ``gate`` is set (the engine stays full meanwhile)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def step(self, jobs, previews=None):
        self.gate.wait(10)
        return super().step(jobs)


class RaisingKind:
    """A model kind whose own parts raise for some requests: its parsed request's jobs (read at submit),
    rendering a progress response, rendering the FINAL response."""

    def __init__(self, raise_in: dict[str, str]) -> None:
        self.raise_in = raise_in

    def _maybe_raise(self, where: str, record) -> None:
        self._raise_for(where, record.tracked.request_id)

    def _raise_for(self, where: str, name: str) -> None:
        if self.raise_in.get(name) == where:
            raise RuntimeError(f"kind {where} failed")

    def parsed(self, name: str) -> Any:
        kind = self

        class Parsed:
            progress = True
            values: dict = {}
            result_key = resume_key = None

            @property
            def jobs(self):
                kind._raise_for("jobs", name)
                return [JobSpec(Spec())]

            @property
            def summary(self):  # read when the request is admitted
                kind._raise_for("admitted", name)
                return ""

        return Parsed()

    def progress_outputs(self, record, stepped):
        self._maybe_raise("stepped", record)
        return {"step": stepped.step}

    def final_outputs(self, record, outputs, batch):
        self._maybe_raise("finished", record)
        return {"out": outputs[0]}


def test_every_request_gets_exactly_one_answer_whatever_its_model_kind_raises():
    from triton_diffusion.serving.engine_host import Admitted, EngineHost
    from triton_diffusion.serving.engines import StepEngineKind
    from triton_diffusion.serving.metrics import IMAGE_METRICS
    from triton_diffusion.settings import ModelConfig, ModelSettings

    class Metrics:
        def observe(self, *args, **kwargs): ...

        increment = set = observe

    settings = ModelSettings("m", Path("."), ModelConfig(), {}, 8, "CPU", 0)
    kind = RaisingKind(raise_in={"b": "finished", "c": "stepped", "d": "jobs", "f": "admitted"})
    engine_kind = StepEngineKind(FakeAdapter())
    host = EngineHost(kind, engine_kind, settings, Metrics(), IMAGE_METRICS, lambda error: None)
    requests = [tracked(name) for name in "abcdef"]
    try:
        host.submit([Admitted(request, kind.parsed(request.request_id)) for request in requests])
        deadline = time.monotonic() + 10
        while not all(r.ended for r in requests) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        host.close()
    got = {r.request_id: r.channel.finals for r in requests}
    assert all(len(finals) == 1 for finals in got.values()), got
    assert got["a"] == [{"out": "out:a"}] and got["e"] == [{"out": "out:e"}]
    for name in "bcdf":
        assert isinstance(got[name][0], RequestError) and got[name][0].code is ErrorCode.INTERNAL
    assert all(r.stage is Stage.ANSWERED for r in requests)
    assert len(requests[0].channel.partials) == Spec().steps  # progress went out for the others


def test_a_jobs_own_step_out_of_memory_is_answered_unavailable_as_a_forward_that_fails_alone():
    """The forward ran, then one job's own scheduler step ran out of memory: that job fails alone, and
    as out of memory (UNAVAILABLE: a later try may fit), not as a bug (INTERNAL)."""
    from dataclasses import replace

    from triton_diffusion.adapters.latent_loop import _own_failure
    from triton_diffusion.engine.failures import Failure

    class OwnStepOutOfMemory(FakeAdapter):
        def step(self, jobs, previews=None):
            result = super().step(jobs)
            oom = Failure.of(SimulatedOutOfMemoryError("the scheduler step's upcast"))
            steps = [
                replace(out, error=oom) if job.request.request_id == "oom" else out
                for out, job in zip(result.steps, jobs, strict=True)
            ]
            return replace(result, steps=steps)

    jobs = [job("oom"), job("ok")]
    engine = engine_for(OwnStepOutOfMemory())
    for j in jobs:
        engine.add(j)
    drain(engine)
    got = answers(jobs)
    assert got["ok"] == [{"out": "out:ok"}]
    (final,) = got["oom"]
    assert final.code is ErrorCode.UNAVAILABLE and final.message.startswith("denoising step failed"), final
    # The latent loop's own step keeps the kind of what it raised.
    assert _own_failure(SimulatedOutOfMemoryError("x")).oom and not _own_failure(IndexError("x")).oom


def test_a_failing_forward_is_bisected_and_fails_only_its_culprit():
    adapter = FakeAdapter()
    jobs = [job(f"j{i}", Spec(fail_forward=i == 5)) for i in range(8)]
    engine = engine_for(adapter)
    for j in jobs:
        engine.add(j)
    drain(engine)
    got = answers(jobs)
    assert got["j5"][0].code is ErrorCode.INTERNAL and "bad row" in got["j5"][0].message
    assert all(got[f"j{i}"] == [{"out": f"out:j{i}"}] for i in range(8) if i != 5)


@pytest.mark.parametrize(("failing", "images"), [(3, [2, 1]), (0, [1, 2])])
def test_a_split_forward_reports_the_schedulers_packing_and_narrowing_once(failing, images):
    """A forward the isolation rule splits (a failing row) is one decision of the scheduler: its packing
    and its narrowed count are reported with the first part applied, not once per part (nor lost where
    the first part tried fails)."""
    jobs = [job(f"j{i}", Spec(fail_forward=i == failing)) for i in range(4)]
    engine = engine_for(FakeAdapter())
    for j in jobs:
        engine.add(j)
    scheduler = engine.engine.scheduler
    chosen, decision = scheduler.next_forward, Packing(True, 1.0, 2.0)

    def decided(*args, **kwargs):
        batch = chosen(*args, **kwargs)
        scheduler.packing, scheduler.narrowed = decision, 2  # as if it packed, leaving two jobs out
        return batch

    scheduler.next_forward = decided
    engine.step()
    forwards = engine.host.reports[-1].forwards
    assert [f.images for f in forwards] == images  # the parts applied, in order (the failing one alone)
    assert [f.packing for f in forwards] == [decision, None] and [f.narrowed for f in forwards] == [2, 0]


def test_out_of_memory_splits_the_forward_and_lowers_the_groups_cap():
    adapter = FakeAdapter(max_rows=3)
    jobs = [job(f"j{i}") for i in range(8)]
    engine = engine_for(adapter)
    for j in jobs:
        engine.add(j)
    drain(engine)
    assert all(finals == [{"out": f"out:{name}"}] for name, finals in answers(jobs).items())
    assert max(len(f) for f in adapter.forwards) <= 3 and engine.scheduler.caps.jobs_for("64x64") <= 3
    # A job that does not fit alone is answered UNAVAILABLE; the others go on.
    lonely = FakeAdapter(max_rows=0)
    engine = engine_for(lonely)
    alone = job("alone")
    engine.add(alone)
    drain(engine)
    assert alone.request.channel.finals[0].code is ErrorCode.UNAVAILABLE


def test_a_learned_cap_recovers_after_good_forwards_once_memory_is_back():
    adapter = FakeAdapter(max_rows=2)  # memory is short at first
    engine = engine_for(adapter)
    for i in range(8):
        engine.add(job(f"a{i}", Spec(steps=2)))
    drain(engine)
    assert engine.scheduler.caps.jobs_for("64x64") == 2
    adapter.max_rows = None  # the other tenant left
    long_jobs = [job(f"b{i}", Spec(steps=2 * CAP_RECOVERY_FORWARDS)) for i in range(8)]
    for j in long_jobs:
        engine.add(j)
    drain(engine, limit=20 * CAP_RECOVERY_FORWARDS)
    assert engine.scheduler.caps.jobs_for("64x64") == 8 and max(len(f) for f in adapter.forwards) == 8
    assert all(len(j.request.channel.finals) == 1 for j in long_jobs)


class PackingAdapter(FakeAdapter):
    """Packs jobs of any size into one forward (padded to the longest), out of memory over ``max_tokens``
    of its jobs' tokens."""

    def __init__(self, max_tokens: int) -> None:
        super().__init__()
        self.max_tokens = max_tokens
        self.out_of_memory = 0

    def step(self, jobs, previews=None):
        tokens = [job.spec.tokens for job in jobs]
        if sum(tokens) > self.max_tokens:
            self.out_of_memory += 1
            raise SimulatedOutOfMemoryError(f"{sum(tokens)} tokens")
        result = super().step(jobs, previews)
        return ForwardResult(result.steps, result.rows, padded_tokens=len(jobs) * max(tokens) - sum(tokens))


def test_out_of_memory_learns_a_token_cap_that_keeps_mixed_forwards_within_memory():
    adapter = PackingAdapter(max_tokens=10)
    engine = engine_for(adapter)
    mixed = [job(f"m{i}", Spec(group="packed"), tokens=6 if i % 2 == 0 else 1) for i in range(8)]
    for j in mixed:
        engine.add(j)
    drain(engine)
    assert all(finals == [{"out": f"out:{name}"}] for name, finals in answers(mixed).items())
    caps = engine.scheduler.caps
    # 28 tokens, then 14 ran out of memory: half of those a forward, 2 jobs and 7 tokens.
    assert (caps.jobs_for("packed"), caps.tokens_for("packed")) == (2, 7)
    forwards = [f for report in engine.host.reports for f in report.forwards]
    assert forwards and all(f.tokens == 7 and f.padded_tokens == 5 for f in forwards)  # [6, 1], padded to 6
    # Large jobs now: the job cap alone would pair them (12 tokens: out of memory), the token cap does not.
    before = adapter.out_of_memory
    large = [job(f"l{i}", Spec(group="packed"), tokens=6) for i in range(4)]
    for j in large:
        engine.add(j)
    drain(engine)
    assert adapter.out_of_memory == before and all(len(f) == 1 for f in adapter.forwards[-12:])
    assert all(finals == [{"out": f"out:{name}"}] for name, finals in answers(large).items())


def test_a_learned_token_cap_recovers_like_the_job_cap():
    caps = ForwardCaps(EngineLimits(8, 8, max_tokens_per_forward=100))
    caps.out_of_memory("g", 1, 90)  # alone: nothing to learn (the job fails UNAVAILABLE)
    assert (caps.jobs_for("g"), caps.tokens_for("g")) == (8, 100)
    caps.out_of_memory("g", 4, 60)
    assert (caps.jobs_for("g"), caps.tokens_for("g")) == (2, 30) and caps.tokens_for("other") == 100
    # Forwards below the learned job cap and within half the token cap are not full: no recovery.
    for _ in range(3 * CAP_RECOVERY_FORWARDS):
        caps.ran("g", 1, 15)
    assert (caps.jobs_for("g"), caps.tokens_for("g")) == (2, 30)
    # Full by tokens (more than half the token cap, one job each): both double after enough of them.
    for _ in range(CAP_RECOVERY_FORWARDS - 1):
        caps.ran("g", 1, 16)
    assert (caps.jobs_for("g"), caps.tokens_for("g")) == (2, 30)
    caps.ran("g", 1, 16)
    assert (caps.jobs_for("g"), caps.tokens_for("g")) == (4, 60)
    # Full by jobs (few tokens): both reach the configured caps and are dropped.
    for _ in range(CAP_RECOVERY_FORWARDS):
        caps.ran("g", 4, 4)
    assert (caps.jobs_for("g"), caps.tokens_for("g")) == (8, 100)
    # Raising them failed: learned again, and the next raise waits twice as long.
    caps.out_of_memory("g", 8, 100)
    assert (caps.jobs_for("g"), caps.tokens_for("g")) == (4, 50)
    for _ in range(2 * CAP_RECOVERY_FORWARDS - 1):
        caps.ran("g", 4, 50)
    assert (caps.jobs_for("g"), caps.tokens_for("g")) == (4, 50)
    caps.ran("g", 4, 50)
    assert (caps.jobs_for("g"), caps.tokens_for("g")) == (8, 100)
    # With no token budget configured, a learned token cap is dropped with the job cap.
    caps = ForwardCaps(EngineLimits(8, 8))
    caps.out_of_memory("g", 4, 60)
    for _ in range(2 * CAP_RECOVERY_FORWARDS):
        caps.ran("g", 4, 60)
    assert (caps.jobs_for("g"), caps.tokens_for("g")) == (8, None)


def test_a_failing_decode_is_retried_job_by_job():
    adapter = FakeAdapter()
    jobs = [job("ok"), job("bad", Spec(fail_finish=True)), job("ok2")]
    engine = engine_for(adapter)
    for j in jobs:
        engine.add(j)
    drain(engine)
    got = answers(jobs)
    assert got["ok"] == [{"out": "out:ok"}] and got["ok2"] == [{"out": "out:ok2"}]
    assert got["bad"][0].code is ErrorCode.INTERNAL and "decode failed" in got["bad"][0].message


class PreparingAdapter(FakeAdapter):
    """Writes down who each admission started together."""

    def __init__(self) -> None:
        super().__init__()
        self.admissions: list[list[str]] = []

    def prepare(self, jobs):
        self.admissions.append([job.request.request_id for job in jobs])
        return super().prepare(jobs)


def test_a_busy_engine_admits_newcomers_as_a_cohort_and_an_idle_one_at_once():
    adapter = PreparingAdapter()
    engine = engine_for(adapter, max_running=4, pacing=AdmissionPacing(cohort=2, max_wait_steps=50))
    first = job("first", Spec(steps=2))
    engine.add(first)
    engine.step()  # idle: starts at the next step, alone
    assert adapter.admissions == [["first"]] and adapter.forwards == [["first"]]
    long = [job(f"long{i}", Spec(steps=6)) for i in range(3)]
    for j in long:
        engine.add(j)
    engine.step()  # room 3 >= 2: all three join, "first" finishes
    assert adapter.admissions[-1] == ["long0", "long1", "long2"]
    late = [job("late0"), job("late1"), job("late2")]
    engine.add(late[0])
    engine.step()  # one place free (< the cohort of 2): late0 waits
    assert adapter.admissions[-1] == ["long0", "long1", "long2"] and "late0" not in adapter.forwards[-1]
    engine.add(late[1])
    engine.add(late[2])
    drain(engine)
    # The long jobs left together: the late ones started in arrival order, as one cohort.
    assert adapter.admissions[2:] == [["late0", "late1", "late2"]]
    assert all(
        j.request.channel.finals == [{"out": f"out:{j.request.request_id}"}] for j in [first, *long, *late]
    )


def test_a_newcomer_never_waits_longer_than_the_pacings_bound():
    adapter = PreparingAdapter()
    engine = engine_for(adapter, max_running=4, pacing=AdmissionPacing(cohort=4, max_wait_steps=2))
    engine.add(job("long", Spec(steps=20)))
    engine.step()
    engine.add(job("newcomer"))
    engine.step()
    engine.step()  # waited through 1 step: still waiting for a cohort of 4 places (3 are free)
    assert adapter.admissions == [["long"]]
    engine.step()  # waited through 2 steps: admitted alone
    assert adapter.admissions == [["long"], ["newcomer"]] and "newcomer" in adapter.forwards[-1]


def test_eager_admission_is_the_default_of_a_bare_engine():
    adapter = PreparingAdapter()
    engine = engine_for(adapter, max_running=4)
    engine.add(job("a", Spec(steps=5)))
    engine.step()
    engine.add(job("b"))
    engine.step()
    assert adapter.admissions == [["a"], ["b"]]
    with pytest.raises(ValueError, match="cohort"):
        AdmissionPacing(cohort=0)


def test_cancelled_and_ended_requests_leave_at_the_next_step():
    adapter = FakeAdapter()
    steps = Spec(steps=6)
    cancelled_at = {"n": 0}
    victim = job("victim", steps, cancelled=lambda: cancelled_at["n"] >= 2)
    others = [job(f"o{i}", steps) for i in range(3)]
    engine = engine_for(adapter)
    for j in [victim, *others]:
        engine.add(j)
    for _ in range(2):
        engine.step()
        cancelled_at["n"] += 1
    engine.step()
    assert victim.request.channel.finals[0].code is ErrorCode.CANCELLED
    assert "victim" not in adapter.forwards[-1] and len(adapter.forwards[-1]) == 3
    drain(engine)
    assert all(j.request.channel.finals == [{"out": f"out:{j.request.request_id}"}] for j in others)


def test_policies_pick_groups_and_no_job_starves():
    big = [job(f"big{i}", Spec(group="128x128", steps=50)) for i in range(2)]

    def forwards_until_big_steps(policy: str) -> int:
        adapter = FakeAdapter()
        engine = engine_for(adapter, max_running=16, policy=policy)
        for j in big:
            j.request = tracked(j.request.request_id)
            j.run.steps_done = 0
            engine.add(j)
        for step in range(40):  # short 64x64 jobs keep arriving
            engine.add(job(f"s{step}", Spec(steps=1)))
            engine.step()
            if any("big0" in f for f in adapter.forwards):
                return step
        return 999

    # Fewest-remaining prefers the short jobs, but the big ones still step within the starvation limit.
    assert forwards_until_big_steps("fewest_remaining") <= 5
    assert forwards_until_big_steps("oldest") == 0  # the big jobs arrived first

    adapter = FakeAdapter()
    engine = engine_for(adapter, policy="round_robin")
    for i in range(2):
        engine.add(job(f"a{i}", Spec(group="A")))
        engine.add(job(f"b{i}", Spec(group="B")))
    engine.step()
    engine.step()
    assert [sorted(f) for f in adapter.forwards] == [["a0", "a1"], ["b0", "b1"]]

    adapter = FakeAdapter()
    engine = engine_for(adapter, policy="largest")
    engine.add(job("a0", Spec(group="A")))
    for i in range(3):
        engine.add(job(f"b{i}", Spec(group="B")))
    engine.step()
    assert sorted(adapter.forwards[0]) == ["b0", "b1", "b2"]


def test_caps_per_group_hold():
    adapter = FakeAdapter()
    engine = engine_for(adapter, cap_for=lambda group: 2 if group == "256x256" else 8)
    for i in range(4):
        engine.add(job(f"j{i}", Spec(group="256x256")))
    drain(engine)
    assert max(len(f) for f in adapter.forwards) == 2


def test_the_worker_restarts_its_loop_after_a_bug_and_answers_what_it_held():
    from triton_diffusion.engine.ordering import Oldest

    class BrokenPolicy(Oldest):
        def __init__(self):
            self.calls = 0

        def choose_group(self, groups, first):
            self.calls += 1
            if self.calls == 1:
                raise KeyError("a bug in the engine itself")
            return first.run.group

    adapter = FakeAdapter()
    limits = EngineLimits(8, 8)
    engine = Engine(StepEngine(adapter, limits, BrokenPolicy()), Host())
    worker = worker_for(engine, waiting_room=4)
    try:
        first = job("first")
        submit(worker, first)
        deadline = time.monotonic() + 5
        while not first.request.channel.finals and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.request.channel.finals[0].code is ErrorCode.INTERNAL
        later = job("later")
        submit(worker, later)
        while not later.request.channel.finals and time.monotonic() < deadline:
            time.sleep(0.01)
        assert later.request.channel.finals == [{"out": "out:later"}]
        assert worker.restarts == 1 and worker.alive
    finally:
        worker.close()


def test_a_failed_device_stops_the_worker_after_answering_everything_it_held():
    class LostDevice(FakeAdapter):
        def step(self, jobs, previews=None):
            if any(job.request.request_id == "xid" for job in jobs):
                raise AcceleratorError("CUDA error: an illegal memory access was encountered")
            return super().step(jobs)

    adapter = LostDevice()
    engine = engine_for(adapter, max_running=2, max_per_forward=1)
    lost = []
    worker = worker_for(engine, waiting_room=8, on_device_lost=lost.append)
    jobs = [job("a", Spec(steps=50)), job("xid"), job("waiting")]
    try:
        for j in jobs:
            submit(worker, j)
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lost and "illegal memory access" in lost[0] and not worker.alive
        for j in jobs:  # running, failing and waiting: one UNAVAILABLE answer each
            (final,) = j.request.channel.finals
            assert final.code is ErrorCode.UNAVAILABLE and "restarting" in final.message, final
            assert final.hint is None, final  # it may be the cause: never a retry hint
        after = job("after")
        assert submit(worker, after) == [-1.0]  # refused at once
        (final,) = after.request.channel.finals
        # It never ran, so it cannot be the cause: the client may resend it once the model is back.
        assert final.code is ErrorCode.UNAVAILABLE and final.hint == RESEND, final
        assert "illegal memory access" in final.message and "had not started" in final.message, final
        assert max(len(f) for f in adapter.forwards) == 1 and len(lost) == 1
    finally:
        worker.close()


def test_a_device_failure_while_decodes_are_retried_one_by_one_still_answers_every_job():
    class DecodeLosesDevice(FakeAdapter):
        def finish(self, jobs):
            if len(jobs) > 1:
                raise RuntimeError("an ordinary decode failure: retry one by one")
            if jobs[0].request.request_id == "b":
                raise AcceleratorError("CUDA error: unspecified launch failure")
            return super().finish(jobs)

    engine = engine_for(DecodeLosesDevice())
    jobs = [job(name) for name in "abc"]
    for j in jobs:
        engine.add(j)
    with pytest.raises(DeviceLostError):
        drain(engine)
    engine.host.render(engine.take_report())  # as the worker does: what the cut-short step finished
    got = answers(jobs)
    assert got["a"] == [{"out": "out:a"}]
    for name in "bc":  # c had left the running set: it must not be lost
        (final,) = got[name]
        assert final.code is ErrorCode.UNAVAILABLE, final


def test_a_stuck_engine_is_noticed_its_requests_answered_and_the_process_asked_to_exit():
    class Stuck(FakeAdapter):
        def step(self, jobs, previews=None):
            if any(job.request.request_id == "hang" for job in jobs):
                threading.Event().wait(30)  # a deadlock, or a kernel that never returns
            return super().step(jobs)

    engine = engine_for(Stuck(), max_running=2, max_per_forward=2)
    stalls = []
    worker = worker_for(engine, waiting_room=4, stall_s=0.4, on_stall=stalls.append)
    jobs = [job("quick", Spec(steps=1)), job("hang"), job("neighbour", Spec(steps=50)), job("waiting")]
    submit(worker, jobs[0])
    deadline = time.monotonic() + 5
    while not jobs[0].request.ended and time.monotonic() < deadline:
        time.sleep(0.01)
    submit(worker, *jobs[1:])
    while not stalls and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stalls and "reported nothing" in stalls[0] and len(stalls) == 1
    assert jobs[0].request.channel.finals == [{"out": "out:quick"}]  # done before the stall: untouched
    for j in jobs[1:]:  # running (stuck or not) and waiting: one UNAVAILABLE answer each
        (final,) = j.request.channel.finals
        assert final.code is ErrorCode.UNAVAILABLE and "restarting" in final.message, final
        assert final.hint is None, final  # it may be the cause: never a retry hint
    late = job("late")
    assert submit(worker, late) == [-1.0]
    (final,) = late.request.channel.finals
    assert final.code is ErrorCode.UNAVAILABLE and final.hint == RESEND and "stuck" in final.message, final


def test_a_full_engine_lets_a_request_with_a_deadline_in_without_waiting_up_to_its_room():
    # A wait in execute() holds up the requests Triton queues behind it; one with a deadline goes in, and
    # the scheduler refuses it at once where it cannot be in time (deadline_room, engine_host.py).
    adapter = Gated()
    engine = engine_for(adapter, max_running=2, max_per_forward=2)
    worker = worker_for(engine, waiting_room=0)  # room for 2 jobs, and 1 more for a deadline
    worker.deadline_room = 1
    due = time.perf_counter() + 60

    def job(name: str, deadline: float | None) -> Job:
        return Job(tracked(name), Spec(steps=1), tier=1, deadline=deadline)

    held = [job(f"held{i}", None) for i in range(2)]
    timed, plain, over = job("timed", due), job("plain", None), job("over", due)
    # A higher tier with a deadline goes in up to the engine's whole bound: twice the capacity plus the
    # deadline room (5 jobs).
    urgent = [Job(tracked(f"urgent{i}"), Spec(steps=1), tier=0, deadline=due) for i in range(3)]
    try:
        assert submit(worker, *held, max_wait_s=0.2) == [pytest.approx(0, abs=0.1)] * 2
        assert submit(worker, plain, max_wait_s=0.2) == [-1.0]  # no deadline: it waits for room, in vain
        assert submit(worker, timed, max_wait_s=0.2) == [pytest.approx(0, abs=0.1)]  # in at once
        assert submit(worker, over, max_wait_s=0.2) == [-1.0]  # past its room: it waits like any other
        assert submit(worker, *urgent, max_wait_s=0.2) == [pytest.approx(0, abs=0.1)] * 2 + [-1.0]
        adapter.gate.set()
        deadline = time.monotonic() + 5
        while not all(j.request.ended for j in [*held, timed, *urgent[:2]]) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        adapter.gate.set()
        worker.close()
    assert timed.request.channel.finals == [{"out": "out:timed"}]
    assert plain.request.channel.finals[0].code is ErrorCode.UNAVAILABLE
    assert over.request.channel.finals[0].code is ErrorCode.UNAVAILABLE
    assert [j.request.channel.finals for j in urgent[:2]] == [
        [{"out": "out:urgent0"}],
        [{"out": "out:urgent1"}],
    ]


def test_a_request_without_a_deadline_does_not_count_the_jobs_the_deadline_room_holds():
    # Three jobs with a deadline fill the capacity (2) and one of the room (2): a request without one counts
    # them only beyond 2 (1 job), and goes in; a second would count 1 + 1 + 1 > 2: it waits.
    adapter = Gated()
    engine = engine_for(adapter, max_running=2, max_per_forward=2)
    worker = worker_for(engine, waiting_room=0)
    worker.deadline_room = 2
    due = time.perf_counter() + 60
    timed = [Job(tracked(f"timed{i}"), Spec(steps=1), tier=1, deadline=due) for i in range(3)]
    plain = [Job(tracked(f"plain{i}"), Spec(steps=1), tier=1) for i in range(2)]
    try:
        assert submit(worker, *timed, max_wait_s=0.2) == [pytest.approx(0, abs=0.1)] * 3
        assert engine.with_deadline == 3
        assert submit(worker, plain[0], max_wait_s=0.2) == [pytest.approx(0, abs=0.1)]
        assert submit(worker, plain[1], max_wait_s=0.2) == [-1.0]  # 4 held, 2 of them the room's
        assert engine.active == 4  # never past the capacity and the room
        adapter.gate.set()
        deadline = time.monotonic() + 5
        while not all(j.request.ended for j in [*timed, plain[0]]) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        adapter.gate.set()
        worker.close()
    assert plain[0].request.channel.finals == [{"out": "out:plain0"}]


def test_a_lower_tier_filling_the_deadline_room_leaves_a_higher_tier_its_capacity_at_the_door():
    # Flex requests with deadlines fill the engine to capacity + deadline_room (2 + 4); a priority request
    # without a deadline still goes in at once, up to capacity (2) more.
    adapter = Gated()
    engine = engine_for(adapter, max_running=2, max_per_forward=2)
    worker = worker_for(engine, waiting_room=0)
    worker.deadline_room = 4
    due = time.perf_counter() + 60
    low = [Job(tracked(f"low{i}"), Spec(steps=1), tier=2, deadline=due) for i in range(6)]
    high = [Job(tracked(f"high{i}"), Spec(steps=1), tier=0) for i in range(3)]
    try:
        assert submit(worker, *low, max_wait_s=0.2) == [pytest.approx(0, abs=0.1)] * 6
        # Two priority jobs fit the 2 above the room; a third would pass the bound: it waits, in vain here.
        assert submit(worker, *high, max_wait_s=0.2) == [pytest.approx(0, abs=0.1)] * 2 + [-1.0]
        adapter.gate.set()
        deadline = time.monotonic() + 5
        while not all(j.request.ended for j in [*low, *high[:2]]) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        adapter.gate.set()
        worker.close()
    assert [j.request.channel.finals for j in high[:2]] == [[{"out": "out:high0"}], [{"out": "out:high1"}]]


@pytest.mark.parametrize(
    "config, room",
    [
        ({}, 12),  # unset: max_running + waiting_room
        ({"deadline_room": "0"}, 0),  # the wait kept
        ({"deadline_room": "5"}, 5),
        ({"deadline_policy": "best_effort"}, 0),  # unset and not read: nothing said
        ({"deadline_room": "5", "deadline_policy": "best_effort"}, 0),  # nothing refuses a late request
    ],
)
def test_the_host_gives_requests_with_a_deadline_their_room_where_the_scheduler_refuses_late_ones(
    config, room, caplog
):
    from triton_diffusion.serving.engine_host import EngineHost
    from triton_diffusion.serving.engines import StepEngineKind
    from triton_diffusion.serving.metrics import IMAGE_METRICS
    from triton_diffusion.settings import ModelConfig, ModelSettings

    class Metrics:
        def observe(self, *args, **kwargs): ...

        increment = set = observe

    parsed = ModelConfig.parse({"max_running": "8", "waiting_room": "4", **config}, ["image"], [], "m")
    settings = ModelSettings("m", Path("."), parsed, {}, 8, "CPU", 0)
    host = EngineHost(
        RaisingKind({}), StepEngineKind(FakeAdapter()), settings, Metrics(), IMAGE_METRICS, print
    )
    try:
        assert host.worker.capacity == 12 and host.worker.deadline_room == room
    finally:
        host.close()
    ignored = [r.message for r in caplog.records if "ignored" in r.message]
    # Set and not given: said at load, with why.
    assert ignored == (
        [
            "m: deadline_room 5 ignored: it needs the step engine with deadline_policy refuse "
            "(here: step engine, best_effort)"
        ]
        if "deadline_room" in config and config["deadline_room"] != "0" and not room
        else []
    )


def test_a_full_engine_lets_a_higher_tier_in_and_keeps_its_own_tier_waiting():
    adapter = Gated()
    engine = engine_for(adapter, max_running=2, max_per_forward=2)
    worker = worker_for(engine, waiting_room=0)  # room for 2 jobs
    low = [Job(tracked(f"low{i}"), Spec(steps=1), tier=2) for i in range(2)]
    high, same = Job(tracked("high"), Spec(steps=1), tier=0), Job(tracked("same"), Spec(steps=1), tier=2)
    try:
        assert submit(worker, *low, max_wait_s=0.2) == [pytest.approx(0, abs=0.1)] * 2
        assert submit(worker, high, max_wait_s=0.2)[0] >= 0  # outranks a job held: in at once
        assert submit(worker, same, max_wait_s=0.2) == [-1.0]  # the same tier waits for room
        adapter.gate.set()
        deadline = time.monotonic() + 5
        while not all(j.request.ended for j in [*low, high]) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        adapter.gate.set()
        worker.close()
    assert [j.request.channel.finals for j in [*low, high]] == [
        [{"out": f"out:{n}"}] for n in ("low0", "low1", "high")
    ]
    assert same.request.channel.finals[0].code is ErrorCode.UNAVAILABLE


def test_a_batch_larger_than_the_room_starts_at_once_and_the_rest_is_admitted_as_room_frees():
    engine = engine_for(FakeAdapter(), max_running=2, max_per_forward=2)
    worker = worker_for(engine, waiting_room=0)
    jobs = [job(f"j{i}", Spec(steps=2)) for i in range(5)]
    try:
        waited = submit(worker, *jobs, max_wait_s=5.0)  # one execute() batch, more than fits
        deadline = time.monotonic() + 5
        while not all(j.request.ended for j in jobs) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        worker.close()
    assert all(0 <= w < 2.0 for w in waited), waited  # nobody waited for the deadline
    assert all(j.request.channel.finals == [{"out": f"out:{j.request.request_id}"}] for j in jobs)


def test_a_slow_engine_is_not_taken_for_a_stuck_one():
    class Slow(FakeAdapter):
        def step(self, jobs, previews=None):
            time.sleep(0.1)
            return super().step(jobs)

    engine = engine_for(Slow())
    stalls = []
    worker = worker_for(engine, waiting_room=4, stall_s=0.6, on_stall=stalls.append)
    # 0.8 s in all, past the bound, each step far inside it (a busy machine's pause included)
    slow = job("slow", Spec(steps=8))
    try:
        submit(worker, slow)
        deadline = time.monotonic() + 10
        while not slow.request.ended and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        worker.close()
    assert not stalls and slow.request.channel.finals == [{"out": "out:slow"}]


def test_a_final_response_that_cannot_be_sent_becomes_an_error_response():
    request = TrackedRequest("x", RecordingChannel(fail_final=True))
    assert request.finish({"IMAGE": b"..."})
    assert len(request.channel.finals) == 1 and request.channel.finals[0].code is ErrorCode.INTERNAL
    assert "sending the response failed" in request.channel.finals[0].message
    assert not request.fail(RequestError(ErrorCode.CANCELLED, "late")) and request.stage is Stage.ANSWERED


@pytest.mark.parametrize("threads", [8])
def test_racing_answers_send_exactly_one_final(threads):
    for _ in range(50):
        request = tracked("race")
        barrier = threading.Barrier(threads)

        def answer(i, request=request, barrier=barrier):
            barrier.wait()
            if i % 2:
                request.finish({"i": i})
            else:
                request.fail(RequestError(ErrorCode.CANCELLED, str(i)))

        workers = [threading.Thread(target=answer, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert len(request.channel.finals) == 1


class HookedLock:
    """A request's lock that, the first time it is released, runs ``between`` on another thread (and waits
    for it): whatever another thread may do between two critical sections of one call happens there,
    every time."""

    def __init__(self, between) -> None:
        self._lock = threading.Lock()
        self._between = between
        self._fired = False

    def __enter__(self) -> HookedLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()
        if not self._fired:
            self._fired = True
            other = threading.Thread(target=self._between)
            other.start()
            other.join()


def test_fail_is_one_critical_section_so_an_end_or_a_delivery_racing_it_loses_no_final():
    stuck = RequestError(ErrorCode.UNAVAILABLE, "the engine is stuck; the model is restarting")
    decided = RequestError(ErrorCode.UNAVAILABLE, "deadline: the request's timeout of 300 ms passed")
    # An engine ends the request (a deadline) right after fail() first looks at it: one FINAL, fail's.
    request = tracked("ended-meanwhile")
    request._lock = HookedLock(lambda: request.end(decided))
    request.fail(stuck)
    assert request.channel.finals == [stuck] and request.stage is Stage.ANSWERED
    assert not request.deliver()  # the decision came too late: nothing more goes out
    # Ended before: fail() sends the engine's decision, and the response thread's delivery racing it
    # sends nothing more.
    request = tracked("delivered-meanwhile")
    request.end(decided)
    request._lock = HookedLock(request.deliver)
    request.fail(stuck)
    assert request.channel.finals == [decided] and request.stage is Stage.ANSWERED


def stuck_adapter(gate: threading.Event) -> FakeAdapter:
    class Stuck(FakeAdapter):
        def step(self, jobs, previews=None):
            if any(job.request.request_id == "hang" for job in jobs):
                gate.wait(30)  # a deadlock, or a kernel that never returns (released at the test's end)
            return super().step(jobs)

    return Stuck()


def test_a_stuck_engine_sends_the_answers_it_computed_before_failing_the_rest():
    from triton_diffusion.serving.responses import ResponseWorker

    gate, computed, stalled_seen, stalled = (threading.Event() for _ in range(4))
    responses = ResponseWorker()
    engine = engine_for(stuck_adapter(gate), max_running=2, max_per_forward=2)

    def render(report: StepReport) -> None:  # as the engine host: answers go out on the response thread
        for finished in report.finished:
            request, output = finished.job.request, finished.output
            responses.submit(request, lambda request=request, output=output: request.finish({"out": output}))
            computed.set()
        for left in report.left:
            if left.reason != "finished":
                responses.deliver(left.job.request)

    worker = EngineWorker(
        engine.engine,
        8,
        render,
        0.4,
        on_device_lost=lambda error: None,
        on_stall=lambda error: stalled.set(),
        flush_answers=lambda: responses.close(timeout_s=10),  # as EngineHost wires it
    )
    watched = worker.watchdog.on_stall
    worker.watchdog.on_stall = lambda error: (stalled_seen.set(), watched(error))
    # The response thread is busy (encoding a large image, say) until the watchdog fires: the quick
    # request's result, computed before the stall, waits behind it.
    responses.submit(None, lambda: stalled_seen.wait(30))
    quick, hang = job("quick", Spec(steps=1)), job("hang")
    try:
        submit(worker, quick)
        assert computed.wait(10), "the quick request was never computed"
        submit(worker, hang)
        assert stalled.wait(10), "the stuck engine was never noticed"
    finally:
        gate.set()
        worker.close()
    assert quick.request.channel.finals == [{"out": "out:quick"}]  # its result, not UNAVAILABLE
    (final,) = hang.request.channel.finals
    assert final.code is ErrorCode.UNAVAILABLE and "restarting" in final.message, final
    assert final.hint is None, final  # it may be the cause: never a retry hint


def test_a_send_stuck_in_triton_does_not_keep_a_stuck_engine_from_leaving(monkeypatch):
    import triton_diffusion.serving.engine_worker as engine_worker

    monkeypatch.setattr(engine_worker, "STALL_ANSWER_S", 0.2)
    gate, release, stalled = threading.Event(), threading.Event(), threading.Event()

    class StuckSend(RecordingChannel):
        def send_error(self, error: RequestError) -> None:
            release.wait(30)  # Triton never returns from this send (it holds the request's lock)
            super().send_error(error)

    engine = engine_for(stuck_adapter(gate), max_running=2, max_per_forward=2)
    worker = worker_for(engine, waiting_room=4, stall_s=0.4, on_stall=lambda error: stalled.set())
    hang = Job(TrackedRequest("hang", StuckSend()), Spec())
    try:
        submit(worker, hang)
        # The process is asked to leave (for its restart) although the answer's send never returned.
        assert stalled.wait(10), "the watchdog waited on a send stuck in Triton"
    finally:
        release.set()
        gate.set()
        worker.close()


def test_a_held_request_waits_before_its_second_forward_until_another_joins_it():
    from tests.faults import FaultInjection, FaultyStepAdapter

    adapter = FakeAdapter()
    faulty = FaultyStepAdapter(
        adapter, FaultInjection(hold_on_prompt="__hold__"), lambda job: job.request.request_id
    )
    engine = Engine(StepEngine(faulty, EngineLimits(8, 8)), Host())
    faulty.held = lambda: engine.engine.active  # as StepEngineKind.build wires it
    stepped = threading.Event()

    def render(report: StepReport) -> None:
        engine.host.render(report)
        if report.stepped:
            stepped.set()

    worker = EngineWorker(engine.engine, 8, render, 60.0, lambda error: None, lambda error: None)
    first, second = job("first __hold__", Spec(steps=5)), job("second", Spec(steps=2))
    try:
        submit(worker, first)
        assert stepped.wait(10), "the first request never stepped"
        submit(worker, second)  # however late: the first waits for it before its second forward
        deadline = time.monotonic() + 10
        while not (first.request.ended and second.request.ended) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        worker.close()
    # The second joins at the engine step after it arrives: forward 2 (it came before that step was
    # scheduled) or forward 3 (the first was held before forward 2 until it came); never later.
    assert adapter.forwards[0] == ["first __hold__"]
    joined = [i for i, forward in enumerate(adapter.forwards) if "second" in forward]
    assert joined and joined[0] in (1, 2), adapter.forwards
    assert sorted(adapter.forwards[joined[0]]) == ["first __hold__", "second"]
    assert first.stats.most_shared == second.stats.most_shared == 2
    # Held once, at most hold_s: a request nobody joins still finishes.
    briefly = FaultInjection(hold_on_prompt="__hold__", hold_s=0.05)
    alone = FaultyStepAdapter(FakeAdapter(), briefly, lambda job: job.request.request_id)
    solo = Engine(StepEngine(alone, EngineLimits(8, 8)), Host())
    alone.held = lambda: solo.engine.active
    lonely = job("lonely __hold__", Spec(steps=4))
    solo.add(lonely)
    drain(solo)
    assert lonely.request.channel.finals == [{"out": "out:lonely __hold__"}]


@dataclass(frozen=True)
class DataOnly:
    """A request that is data only: an engine that called any method of it (end, is_cancelled, start,
    ended) would raise AttributeError here."""

    request_id: str
    entered: float = 0.0


class Aborts:
    """An abort source: the requests named ``cancelled`` were cancelled by their clients, those named
    ``answered`` were ended by the host (with its error)."""

    def __init__(self, cancelled: tuple[str, ...] = (), answered: tuple[str, ...] = ()) -> None:
        self.cancelled, self.answered, self.asked = set(cancelled), set(answered), []

    def aborted(self, held):
        self.asked.extend(request.request_id for request in held)
        by_host = RequestError(ErrorCode.INTERNAL, "answered by the host")
        return [Abort(request) for request in held if request.request_id in self.cancelled] + [
            Abort(request, by_host) for request in held if request.request_id in self.answered
        ]


def test_the_step_engine_reads_requests_as_data_and_reports_every_end():
    # A failing forward, a cancellation and a request the host answered (aborts handed in as data), an
    # expired deadline and a finished job: the engine decides each end on its own record and reports it;
    # the request objects are only read. (A refusal for a deadline: test_scheduler.py.)
    adapter = FakeAdapter()
    aborts = Aborts(cancelled=("cancelled",), answered=("answered",))
    limits = EngineLimits(8, 8, starvation_steps=4)
    engine = StepEngine(adapter, limits, make_policy("oldest"))
    jobs = {
        name: Job(DataOnly(name), spec)
        for name, spec in [
            ("ok", Spec()),
            ("bad", Spec(fail_forward=True)),
            ("cancelled", Spec(steps=9)),
            ("answered", Spec(steps=9)),
        ]
    }
    expired = Job(DataOnly("late", entered=time.perf_counter()), Spec(), deadline=time.perf_counter() - 1)
    for each in [*jobs.values(), expired]:
        engine.add(each)
    left = {}
    for _ in range(20):
        engine.abort(aborts.aborted(engine.held_requests()))  # as the host's worker hands them in
        for departure in engine.step().left:
            left[departure.job.request.request_id] = (departure.reason, departure.error)
        if not engine.active:
            break
    assert {name: reason for name, (reason, _) in left.items()} == {
        "ok": "finished",
        "bad": "failed",
        "cancelled": "cancelled",
        "answered": "ended",
        "late": "expired",
    }
    assert (
        left["cancelled"][1].code is ErrorCode.CANCELLED
        and "cancelled after step" in left["cancelled"][1].message
    )
    assert left["bad"][1].code is ErrorCode.INTERNAL and left["ok"][1] is None
    assert "cancelled" in aborts.asked  # the engine asked its abort source, and only with data
    assert not engine.scheduler.requests._by_request  # every request's record left with its jobs


def test_a_step_report_that_cannot_be_rendered_answers_every_request_it_names():
    # A bug outside the per-job parts of rendering (here: counting deadline outcomes) would drop the whole
    # report, and a request whose last job finished in it would never be answered: each gets INTERNAL.
    from triton_diffusion.serving.engine_host import EngineHost, RequestRecord
    from triton_diffusion.serving.engines import StepEngineKind
    from triton_diffusion.serving.metrics import IMAGE_METRICS
    from triton_diffusion.settings import ModelConfig, ModelSettings

    class Metrics:
        def observe(self, *args, **kwargs): ...

        increment = set = observe

    settings = ModelSettings("m", Path("."), ModelConfig(), {}, 8, "CPU", 0)
    host = EngineHost(
        RaisingKind({}), StepEngineKind(FakeAdapter()), settings, Metrics(), IMAGE_METRICS, print
    )
    try:
        requests = [tracked(name) for name in "xy"]
        jobs = [Job(r, Spec(), RequestRecord(r, None)) for r in requests]
        report = StepReport(finished=[Finished(jobs[0], "out")], left=[Left(jobs[1], "finished")])

        def broken(left):
            raise RuntimeError("a bug")

        host._deadline_outcomes = broken
        host.render(report)
        host.responses.close()
    finally:
        host.close()
    for request in requests:
        (final,) = request.channel.finals
        assert isinstance(final, RequestError) and final.code is ErrorCode.INTERNAL, final


def test_a_client_is_asked_about_cancellation_at_most_once_per_poll_interval():
    # ClientAborts: each ask is a round trip to the server process, so a held request is asked at most
    # every poll_s (time from a fake clock); a request the host answered is dropped without asking.
    import triton_diffusion.serving.cancellations as cancellations

    now = {"t": 100.0}
    asks = {"a": 0, "b": 0}

    def counting(name):
        def ask():
            asks[name] += 1
            return False

        return ask

    requests = [tracked(name, cancelled=counting(name)) for name in "ab"]
    aborts = ClientAborts(poll_s=0.05)
    original = cancellations.time.perf_counter
    cancellations.time.perf_counter = lambda: now["t"]
    try:
        for _ in range(10):  # 10 engine steps 10 ms apart: 0.1 s, two poll intervals
            assert aborts.aborted(requests) == []
            now["t"] += 0.01
        assert asks == {"a": 2, "b": 2}
        requests[1].end(RequestError(ErrorCode.INTERNAL, "answered by the host"))
        (dropped,) = aborts.aborted(requests)
        assert dropped.request is requests[1] and dropped.error.code is ErrorCode.INTERNAL
        assert asks["b"] == 2  # not asked again: its answer is decided
    finally:
        cancellations.time.perf_counter = original


def test_a_hold_with_a_count_waits_until_the_engine_holds_that_many_jobs(monkeypatch):
    # "__hold__1of4": held after its first forward until the engine holds four jobs (it and three more),
    # so requests sent in parts all arrive while it runs. Three held do not release it; four do.
    import tests.faults as faults_module
    from tests.faults import FaultInjection, FaultyStepAdapter

    faults = FaultInjection(hold_on_prompt="__hold__", hold_s=0.05)
    assert (faults.hold_from("a __hold__1of4"), faults.hold_until("a __hold__1of4")) == (1, 4)
    assert (faults.hold_from("a __hold__"), faults.hold_until("a __hold__")) == (1, 0)
    waits = []
    monkeypatch.setattr(faults_module.time, "sleep", lambda s: waits.append(s))
    held = {"n": 3}
    faulty = FaultyStepAdapter(FakeAdapter(), faults, lambda job: job.request.request_id)
    faulty.held = lambda: held["n"]
    holder = job("h __hold__1of4", Spec(steps=3))
    holder.state, holder.run.steps_done, holder.run.total_steps = [1], 1, 3
    faulty.step([holder])  # it and two more held: it waits (until hold_s)
    assert waits, "three held released a hold for four"
    waits.clear()
    holder.state, holder.run.steps_done = [1], 1
    held["n"] = 4
    faulty.step([holder])  # four held: it goes on at once
    assert not waits

"""The model side of draining (serving/engine_host.py, drain.py DrainWatch; the engines' late_jobs and
checkpoint_now): once the drain file is there, new requests are refused UNAVAILABLE "draining", jobs the
estimate says can be done before the drain deadline finish, the others are checkpointed and answered
UNAVAILABLE naming their resume key (or "draining" alone where nothing could be checkpointed), and the
instance marks itself drained once nothing is held. A fake adapter and store; real threads."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.unit.recording import tracked
from tests.unit.test_job_resumes import FakeStore
from triton_diffusion.engine.jobs import ForwardResult, Job, JobSpec, JobStart, JobStep
from triton_diffusion.engine.request_engine import RequestEngine
from triton_diffusion.engine.request_status import NoAborts
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.errors import RESEND, ErrorCode, RequestError, Retry, RetryHint
from triton_diffusion.recovery import drain
from triton_diffusion.recovery.resumes import Resume, Resumes
from triton_diffusion.serving.engine_host import DRAIN_MARGIN_S, Admitted, EngineHost
from triton_diffusion.serving.engines import StepEngineKind
from triton_diffusion.serving.metrics import IMAGE_METRICS
from triton_diffusion.settings import ModelConfig, ModelSettings

KEY = "drain-key-0123456789"


@dataclass
class Spec:
    steps: int = 5
    cache: bool = False  # a step cache: no exact checkpoint
    delay_s: float = 0.0  # each forward holding it sleeps this long


class CheckpointingAdapter:
    """Steps a counter per job; checkpoints are the step counts (None for a job with a step cache)."""

    def __init__(self) -> None:
        self.prepared: list[str] = []
        self.checkpointed: list[list[str]] = []

    def prepare(self, jobs):
        self.prepared += [job.request.request_id for job in jobs]
        return [JobStart([0], "64x64", job.spec.params.steps) for job in jobs]

    def step(self, jobs, previews=None):
        time.sleep(max(job.spec.params.delay_s for job in jobs))
        steps = []
        for job in jobs:
            job.state[0] += 1
            steps.append(JobStep(job.state[0], job.state[0] == job.run.total_steps))
        return ForwardResult(steps, rows=len(jobs))

    def finish(self, jobs):
        return [f"out:{job.request.request_id}" for job in jobs]

    def checkpoint(self, jobs):
        self.checkpointed.append([job.request.request_id for job in jobs])
        return [None if job.spec.params.cache else {"step": job.run.steps_done} for job in jobs]


# ---- the engines' side: pure decisions --------------------------------------------------------------
def held(engine: StepEngine, name: str, steps: int, key: str | None = KEY) -> Job:
    job = Job(
        tracked(name), Spec(steps), shape="64x64", planned_steps=steps, checkpoint_key=key and f"{key}.0"
    )
    engine.add(job)
    return job


def test_late_jobs_are_those_the_estimate_says_cannot_be_done_in_time_in_the_order_they_go():
    engine = StepEngine(CheckpointingAdapter(), EngineLimits(1, 1))
    first, second, third = held(engine, "a", 10), held(engine, "b", 10), held(engine, "c", 100)
    assert engine.late_jobs(0.5) == []  # nothing measured yet: nothing known, nobody is late ...
    assert engine.late_jobs(0.0) == [first, second, third]  # ... unless no time is left at all
    engine.times.forward_ran(1, 1, 0.1)  # a forward of one job: 0.1 s
    # "a" goes first (1 s); "b" after it (2 s); "c" needs 10 s alone: late, and its work delays nobody.
    assert engine.late_jobs(2.5) == [third]
    assert engine.late_jobs(1.5) == [second, third]  # "b" waits behind "a": 2 s
    assert engine.late_jobs(20.0) == []
    second.status.end(RequestError(ErrorCode.CANCELLED, "gone"))
    assert engine.late_jobs(1.5) == [third]  # an ended job is neither late nor ahead of anyone


def test_checkpoint_now_returns_the_adapters_checkpoints_of_started_jobs_with_a_key_only():
    adapter = CheckpointingAdapter()
    engine = StepEngine(adapter, EngineLimits(4, 4), checkpoint_every=100)
    jobs = [held(engine, "a", 5), held(engine, "b", 5, key=None), held(engine, "c", 5)]
    jobs[2].spec = replace(jobs[2].spec, params=Spec(5, cache=True))
    waiting = held(engine, "w", 5)
    engine.step()  # admit and one forward: a, b, c at step 1 (w too: 4 running)
    engine.step()
    assert [job.run.steps_done for job in jobs] == [2, 2, 2]
    unstarted = Job(tracked("u"), Spec(), checkpoint_key=f"{KEY}.1")
    taken = engine.checkpoint_now([*jobs, unstarted])
    assert taken == [{"step": 2}, None, None, None]  # no key, a step cache, never started
    assert adapter.checkpointed == [["a", "c"]]  # one adapter call, for those that may have one
    off = StepEngine(CheckpointingAdapter(), EngineLimits(4, 4))  # checkpoints off: none asked
    assert off.checkpoint_now([waiting]) == [None]


def test_the_request_engine_lets_its_call_finish_and_hands_back_what_waits_without_checkpoints():
    engine = RequestEngine(
        lambda key, jobs, steps: [], SimpleNamespace(max_rows=4), lambda r: None, NoAborts()
    )
    jobs = [Job(tracked(name), Spec()) for name in "ab"]
    engine.add(*jobs)
    jobs[1].status.end(RequestError(ErrorCode.CANCELLED, "gone"))
    assert engine.late_jobs(100.0) == [jobs[0]]  # what waits would start another call: all of it
    assert engine.checkpoint_now(jobs) == [None, None]


# ---- the drain file, watched by an instance -----------------------------------------------------------
def test_the_drain_file_holds_the_deadline_and_is_looked_for_at_most_every_poll_interval(
    tmp_path, monkeypatch
):
    path = tmp_path / "d"
    looks = []
    real = drain.is_draining
    monkeypatch.setattr(drain, "is_draining", lambda p: looks.append(p) or real(p))
    now = [0.0]
    watch = drain.DrainWatch(path, "m", "m_1", poll_s=0.5, clock=lambda: now[0], wall=lambda: 1000.0)
    assert not watch.draining() and not watch.draining() and len(looks) == 1  # one stat per interval
    drain.request_drain(path, 30.0, clock=lambda: 990.0)
    assert not watch.draining()  # not looked yet
    now[0] = 0.5
    assert watch.draining() and watch.deadline == pytest.approx(1020.0) and watch.seconds_left() == 20.0
    assert watch.draining() and len(looks) == 2  # once seen, for good: no more stats
    assert watch.mark() and not watch.mark()
    assert (tmp_path / "d.m.m_1.done").is_file()
    path.write_text("not a time\n")  # written by hand: no time left
    assert drain.drain_deadline(path) == pytest.approx(path.stat().st_mtime)


def test_a_model_of_several_instances_is_drained_once_every_instance_marked_itself(tmp_path):
    path = tmp_path / "d"
    instances = {"a": ["a_0"], "b": ["b_0", "b_1"]}
    drain.mark_drained(path, "a", "a_0")
    drain.mark_drained(path, "b", "b_0")
    assert drain.not_drained(path, instances) == ["b"]  # b_1 still holds jobs
    drain.mark_drained(path, "b", "b_1")
    assert drain.not_drained(path, instances) == []
    assert drain.not_drained(tmp_path / "e", {"c": []}) == ["c"]
    drain.mark_drained(tmp_path / "e", "c")  # a model marked whole (no instance name)
    assert drain.wait_drained(tmp_path / "e", {"c": ["c_0", "c_1"]}, 1.0) == []


# ---- the host ---------------------------------------------------------------------------------------------
class Kind:
    def progress_outputs(self, record, stepped):
        return {"step": stepped.step}

    def final_outputs(self, record, outputs, service):
        return {"out": outputs[0]}


class Metrics:
    def observe(self, *args: Any, **kwargs: Any) -> None: ...

    increment = set = observe


@dataclass
class Parsed:
    jobs: list[JobSpec]
    progress: bool = True
    summary: str = ""
    values: dict = field(default_factory=dict)
    result_key: str | None = None
    resume_key: str | None = None


@pytest.fixture
def drained_host(tmp_path, monkeypatch):
    """A host with a drain file in its environment, checkpoints on (a fake store) and no poll interval."""
    path = tmp_path / "server.drain"
    monkeypatch.setenv(drain.ENV, str(path))
    config = ModelConfig(checkpoint_every_steps=1000, checkpoint_dir="ckpt")
    settings = ModelSettings("m", Path("."), config, {}, 8, "CPU", 0, instance="m_0")
    store = FakeStore()
    resumes = Resumes(store, 1000)
    engine_kind = StepEngineKind(CheckpointingAdapter())
    host = EngineHost(Kind(), engine_kind, settings, Metrics(), IMAGE_METRICS, print, resumes)
    assert host.drain is not None
    host.drain.poll_s = 0.0
    yield host, path, store
    host.close()


def send(host: EngineHost, name: str, spec: Spec, key: str | None = None) -> Any:
    request = tracked(name)
    checkpoint_key = None
    if key is not None:
        host.resumes.watch(request, Resume((), (), key, "hash"))
        checkpoint_key = f"{key}.0"
    parsed = Parsed([JobSpec(spec, planned_steps=spec.steps, checkpoint_key=checkpoint_key)])
    host.submit([Admitted(request, parsed)])
    return request


def wait_for(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def final(request) -> Any:
    (answer,) = request.channel.finals
    return answer


def test_draining_finishes_what_can_finish_checkpoints_the_rest_and_marks_once_nothing_is_held(drained_host):
    host, path, store = drained_host
    short = send(host, "short", Spec(60, delay_s=0.01), key="short-key-0123456789")
    late = send(host, "late", Spec(100000, delay_s=0.01), key=KEY)
    cached = send(host, "cached", Spec(100000, cache=True, delay_s=0.01), key="cache-key-0123456789")
    keyless = send(host, "keyless", Spec(100000, delay_s=0.01))
    requests = [short, late, cached, keyless]
    wait_for(lambda: all(len(r.channel.partials) >= 3 for r in requests), "every job stepped 3 times")
    drain.request_drain(path, DRAIN_MARGIN_S + 10.0)  # "short" needs ~1 s: it finishes; the others not
    wait_for(lambda: all(r.channel.finals for r in requests), "every request answered")
    assert final(short) == {"out": "out:short"}
    answer = final(late)
    assert isinstance(answer, RequestError) and answer.code is ErrorCode.UNAVAILABLE
    step = store.files[f"{KEY}.0"].checkpoint["step"]
    assert (
        step >= 3 and answer.message == f"draining: checkpointed at step {step}; resend with resume_key {KEY}"
    )
    assert answer.hint == RetryHint(Retry.RESUME, KEY, step)  # what a client acts on
    assert store.flushes >= 1  # on disk before the answer went out
    for request in (cached, keyless):  # nothing to resume from: the resend starts over
        answer = final(request)
        assert isinstance(answer, RequestError) and answer.code is ErrorCode.UNAVAILABLE
        assert answer.message == drain.DRAINING_MESSAGE and answer.hint == RESEND
    assert "cache-key-0123456789.0" not in store.files
    mark = path.with_name("server.drain.m.m_0.done")
    wait_for(mark.is_file, "the instance's mark")
    assert host.engine.active == 0 and all(len(r.channel.finals) == 1 for r in requests)
    # A request now is refused at once and never reaches the engine.
    newcomer = send(host, "new", Spec(3))
    answer = final(newcomer)
    assert answer.code is ErrorCode.UNAVAILABLE and answer.message == drain.DRAINING_MESSAGE
    assert answer.hint == RESEND
    assert "new" not in host.engine.adapter.prepared


def test_an_idle_instance_marks_itself_drained_without_a_request(drained_host):
    host, path, _ = drained_host
    drain.request_drain(path, 30.0)
    wait_for(path.with_name("server.drain.m.m_0.done").is_file, "the idle instance's mark")


def test_the_mark_waits_for_a_job_that_finishes_in_time(drained_host, monkeypatch):
    host, path, _ = drained_host
    marks: list = []
    real = drain.mark_drained
    request = send(host, "r", Spec(30, delay_s=0.02))
    monkeypatch.setattr(
        drain, "mark_drained", lambda *a: marks.append(list(request.channel.finals)) or real(*a)
    )
    wait_for(lambda: len(request.channel.partials) >= 2, "the job stepped")
    drain.request_drain(path, DRAIN_MARGIN_S + 30.0)  # 30 s: plenty for it
    wait_for(path.with_name("server.drain.m.m_0.done").is_file, "the mark")
    assert marks == [[{"out": "out:r"}]]  # written once, after its answer went out


def test_without_a_drain_file_nothing_is_polled(monkeypatch):
    monkeypatch.delenv(drain.ENV, raising=False)
    settings = ModelSettings("m", Path("."), ModelConfig(), {}, 8, "CPU", 0)
    host = EngineHost(
        Kind(), StepEngineKind(CheckpointingAdapter()), settings, Metrics(), IMAGE_METRICS, print
    )
    try:
        assert host.drain is None and host.worker.between_steps is None and host.worker.idle_tick_s is None
    finally:
        host.close()


def test_close_answers_what_it_held_then_marks_the_instance_finalized(drained_host):
    host, path, _ = drained_host
    request = send(host, "held", Spec(100000, delay_s=0.01))
    wait_for(lambda: len(request.channel.partials) >= 2, "the job stepped")
    mark = path.with_name("server.drain.m.m_0.finalized")
    assert not mark.exists()  # the launcher may end the server once it is there: not before the close
    answered_at_mark: list = []
    write = host.drain.mark_finalized
    host.drain.mark_finalized = lambda: answered_at_mark.append(len(request.channel.finals)) or write()
    host.close()
    assert mark.is_file() and answered_at_mark == [1]  # answered before the mark was written
    answer = final(request)
    assert isinstance(answer, RequestError) and answer.code is ErrorCode.UNAVAILABLE

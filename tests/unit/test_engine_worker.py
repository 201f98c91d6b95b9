"""Triton's unload waits for every request of a model to be released: a request the serving side still
referenced after its answer made every server stop wait its whole exit timeout (30 s). After its answer no
request stays referenced by the engine worker, either engine or the response thread, with nothing else
running (the state a model is in when it is unloaded)."""

from __future__ import annotations

import time
import weakref

import pytest

from tests.unit.recording import tracked
from tests.unit.test_executor import KEY
from tests.unit.test_step_engine import FakeAdapter, Spec, engine_for, worker_for
from triton_diffusion.engine.jobs import Job, StepReport
from triton_diffusion.engine.planner import RowCaps
from triton_diffusion.engine.request_engine import RequestEngine
from triton_diffusion.serving.cancellations import ClientAborts
from triton_diffusion.serving.engine_worker import EngineWorker
from triton_diffusion.serving.responses import ResponseWorker


def answer(report: StepReport) -> None:
    """Renders a report as the host does, keeping nothing: each finished job's request is answered."""
    for finished in report.finished:
        finished.job.request.finish({"out": finished.output})


def step_worker() -> EngineWorker:
    engine = engine_for(FakeAdapter())
    worker = worker_for(engine, waiting_room=4)
    worker.render = answer
    return worker


def request_worker() -> EngineWorker:
    def call(key, jobs, steps):
        return steps.scatter([f"img {job.request.request_id}" for job in steps.alive])

    engine = RequestEngine(call, RowCaps(8), lambda report: None, ClientAborts())
    return EngineWorker(engine, 12, answer, 60.0, on_device_lost=lambda e: None, on_stall=lambda e: None)


def released(refs: list[weakref.ref], within_s: float = 5.0) -> bool:
    """Whether every referent is gone (by reference counting alone, no collection: a stub collects too
    late for Triton), polled until ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all(r() is None for r in refs):
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("make", [step_worker, request_worker], ids=["step", "request"])
def test_an_answered_request_is_released(make):
    worker = make()
    if make is step_worker:
        jobs = [Job(tracked(f"r{i}"), Spec(steps=2), shape=Spec().group) for i in range(3)]
    else:  # as test_executor.py makes them: a compatibility key for a group
        jobs = [Job(tracked(f"r{i}"), None, group=KEY) for i in range(3)]
    try:
        worker.submit([(j.request, [j]) for j in jobs], 60.0)
        deadline = time.monotonic() + 5
        while not all(j.request.ended for j in jobs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(j.request.ended for j in jobs), "not answered"
        refs = [weakref.ref(j.request) for j in jobs]
        del jobs
        assert released(refs), [r() for r in refs]
    finally:
        worker.close()


def test_the_response_thread_keeps_no_request_after_sending():
    responses = ResponseWorker()
    try:
        request = tracked("sent")
        done: list = []
        responses.submit(request, lambda sent=request: done.append(sent.finish({"out": 1})))
        deadline = time.monotonic() + 5
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
        ref = weakref.ref(request)
        del request
        assert released([ref]), "the response thread still holds the request"
    finally:
        responses.close()

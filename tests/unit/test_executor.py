"""The executor with a fake pipeline object: bisection retry, OOM splits, one report per request."""

import gc
import weakref

import pytest

from tests.faults import AcceleratorError, SimulatedOutOfMemoryError
from tests.unit.recording import tracked
from triton_diffusion.compatibility import CompatibilityKey
from triton_diffusion.engine.executor import FusedCallExecutor
from triton_diffusion.engine.failures import DeviceLostError, is_device_lost
from triton_diffusion.engine.planner import PlannedRequest, RowCaps, plan_groups
from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.serving.cancellations import ClientAborts

KEY = CompatibilityKey((("height", 64),))


class FakePipeline:
    """Fails any call holding a 'bad' request; runs out of memory above `max_rows` rows."""

    def __init__(self, bad=(), max_rows=None):
        self.bad, self.max_rows, self.calls = set(bad), max_rows, []

    def __call__(self, key, rows):
        self.calls.append([(r.request_index, r.image_index) for r in rows])
        if self.max_rows is not None and len(rows) > self.max_rows:
            raise SimulatedOutOfMemoryError("too many rows")
        if any(r.request_index in self.bad for r in rows):
            raise ValueError("bad prompt")
        return [f"img{r.request_index}.{r.image_index}" for r in rows]


class Stats:
    def __init__(self, reports):
        self.fused_calls = len(reports)
        self.bisections = sum(r.bisected for r in reports)
        self.oom_splits = sum(r.oom_split for r in reports)


def executor_for(pipeline, tracked_requests, on_call=None) -> FusedCallExecutor:
    """The executor as the request-level engine wires it: a request's error is decided (``end``) and the
    host delivers it (here after the run, by :func:`deliver`); before a call, the host's aborts of its
    requests are taken (``before_call``: a cancelled one ends)."""
    aborts = ClientAborts()

    def before_call(indices):
        for abort in aborts.aborted([tracked_requests[i] for i in indices]):
            abort.request.end(RequestError(ErrorCode.CANCELLED, "cancelled before its call started"))

    end = lambda i, error: tracked_requests[i].end(error)  # noqa: E731
    return FusedCallExecutor(pipeline, end, on_call, before_call)


def deliver(tracked_requests) -> None:
    for request in tracked_requests.values():
        request.deliver()


def run(pipeline, rows_per_request, max_rows=8):
    requests = [PlannedRequest(i, KEY, n) for i, n in enumerate(rows_per_request)]
    calls = plan_groups(requests, RowCaps(max_rows).cap_for)
    reports = []
    tracked_requests = {r.index: tracked(str(r.index)) for r in requests}
    executor = executor_for(pipeline, tracked_requests, reports.append)
    done = {}

    def on_complete(i, outputs, records):
        assert tracked_requests[i].finish((outputs, records))  # the first answer
        done[i] = (outputs, records)

    executor.run(calls, tracked_requests, {r.index: r.rows for r in requests}, on_complete)
    deliver(tracked_requests)
    finals = {i: t.channel.finals for i, t in tracked_requests.items()}
    assert all(len(f) == 1 for f in finals.values()), finals  # exactly one answer per request
    failed = {i: f[0] for i, f in finals.items() if isinstance(f[0], RequestError)}
    return done, failed, Stats(reports)


def test_one_call_for_a_compatible_batch():
    pipeline = FakePipeline()
    done, failed, stats = run(pipeline, [1, 2, 1])
    assert not failed and stats.fused_calls == 1 and stats.bisections == 0
    assert done[1][0] == ["img1.0", "img1.1"]
    assert done[1][1][0].rows == 4 and done[1][1][0].requests == 3


def test_a_failing_request_fails_alone_after_bisection():
    pipeline = FakePipeline(bad={5})
    done, failed, stats = run(pipeline, [1] * 8)
    assert set(failed) == {5} and set(done) == {0, 1, 2, 3, 4, 6, 7}
    assert failed[5].code is ErrorCode.INTERNAL and "bad prompt" in failed[5].message
    assert stats.bisections == 3  # 8 -> 4 -> 2 -> 1
    assert done[0][0] == ["img0.0"]


def test_two_failing_requests_both_fail_and_the_rest_succeed():
    done, failed, _ = run(FakePipeline(bad={0, 7}), [1] * 8)
    assert set(failed) == {0, 7} and len(done) == 6


def test_out_of_memory_halves_the_call_until_it_fits():
    pipeline = FakePipeline(max_rows=2)
    done, failed, stats = run(pipeline, [1] * 6)
    assert not failed and len(done) == 6
    assert stats.oom_splits >= 2
    assert max(len(c) for c in pipeline.calls if c) > 2  # the first try held all rows


def test_out_of_memory_splits_the_rows_of_a_single_request():
    pipeline = FakePipeline(max_rows=1)
    done, failed, _ = run(pipeline, [4])
    assert not failed and done[0][0] == ["img0.0", "img0.1", "img0.2", "img0.3"]


def test_out_of_memory_on_one_row_is_reported_as_unavailable():
    done, failed, _ = run(FakePipeline(max_rows=0), [1, 1])
    assert set(failed) == {0, 1} and failed[0].code is ErrorCode.UNAVAILABLE


def test_a_failed_request_spanning_calls_is_reported_once_and_not_run_again():
    pipeline = FakePipeline(bad={1})
    done, failed, _ = run(pipeline, [2, 3, 2], max_rows=3)
    assert set(failed) == {1} and set(done) == {0, 2}
    assert all(1 not in {i for i, _ in call} for call in pipeline.calls[-1:])


def test_a_wrong_output_count_is_a_failure():
    def short(key, rows):
        return ["x"] * (len(rows) - 1) if len(rows) > 1 else ["x"]

    done, failed, _ = run(short, [1, 1, 1])
    assert set(done) == {0, 1, 2}  # bisected down to single rows, which return one output each


def test_a_request_ended_during_a_call_is_answered_once_and_its_rows_are_ignored():
    executor = None

    def pipeline(key, rows):
        if any(r.request_index == 1 for r in rows):  # what CallSteps does between two steps
            tracked_requests[1].end(RequestError(ErrorCode.CANCELLED, "cancelled after step 2/4"))
        return [None if r.request_index == 1 else "img" for r in rows]

    done = {}
    requests = [PlannedRequest(i, KEY, 2) for i in range(3)]
    tracked_requests = {r.index: tracked(str(r.index)) for r in requests}
    executor = executor_for(pipeline, tracked_requests)
    calls = plan_groups(requests, RowCaps(4).cap_for)  # request 1 spans both calls
    rows = {r.index: r.rows for r in requests}
    executor.run(calls, tracked_requests, rows, lambda i, o, c: done.setdefault(i, o))
    deliver(tracked_requests)
    assert set(done) == {0, 2}
    assert [e.code for e in tracked_requests[1].channel.finals] == [ErrorCode.CANCELLED]


def test_a_request_cancelled_while_waiting_for_a_later_call_never_starts():
    pipeline = FakePipeline()
    requests = [PlannedRequest(i, KEY, 1) for i in range(3)]
    tracked_requests = {0: tracked("0"), 1: tracked("1"), 2: tracked("2", cancelled=True)}
    calls = plan_groups(requests, RowCaps(2).cap_for)  # [0, 1] then [2]
    executor = executor_for(pipeline, tracked_requests)
    executor.run(calls, tracked_requests, {i: 1 for i in range(3)}, lambda i, o, c: None)
    deliver(tracked_requests)
    assert pipeline.calls == [[(0, 0), (1, 0)]]  # request 2 was asked before its call and never ran
    assert [e.code for e in tracked_requests[2].channel.finals] == [ErrorCode.CANCELLED]


class Activations:
    """Stands for the tensors a failed pipeline call held."""


def test_a_retry_starts_only_after_the_failed_calls_frames_are_released():
    alive_at_retry = []
    held = []

    def pipeline(key, rows):
        if len(rows) > 1:
            activations = Activations()  # a local of the failing call, like its intermediate tensors
            held.append(weakref.ref(activations))
            raise SimulatedOutOfMemoryError(f"{len(rows)} rows do not fit")
        gc.collect()
        alive_at_retry.append(held[0]() is not None)
        return ["img"]

    done, failed, stats = run(pipeline, [1, 1])
    assert not failed and len(done) == 2 and stats.oom_splits == 1
    assert alive_at_retry == [False, False]  # the failed call's frame was gone when the halves ran


def test_a_failed_device_is_not_retried_its_call_is_answered_unavailable_and_the_engine_stops():
    class LostDevice(FakePipeline):
        def __call__(self, key, rows):
            self.calls.append(rows)
            raise AcceleratorError("CUDA error: an illegal memory access was encountered")

    pipeline = LostDevice()
    requests = [PlannedRequest(i, KEY, 1) for i in range(4)]
    calls = plan_groups(requests, RowCaps(8).cap_for)
    held = {r.index: tracked(str(r.index)) for r in requests}
    with pytest.raises(DeviceLostError):
        executor_for(pipeline, held).run(calls, held, {r.index: 1 for r in requests}, lambda *a: None)
    deliver(held)
    assert len(pipeline.calls) == 1  # no bisection: every retry would fail too
    for request in held.values():
        (final,) = request.channel.finals
        assert final.code is ErrorCode.UNAVAILABLE and "restarting" in final.message and final.hint is None


def test_device_errors_are_told_apart():
    assert is_device_lost(AcceleratorError("CUDA error: misaligned address"))
    assert is_device_lost(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_device_lost(RuntimeError("shape mismatch"))
    assert not is_device_lost(SimulatedOutOfMemoryError("CUDA error: out of memory"))


def test_a_request_cancelled_inside_a_fused_call_leaves_the_engines_table():
    # The request-level engine's record of a request cancelled between two denoising steps of its call
    # goes with its jobs (a leak held its TrackedRequest and Triton sender for good).
    from triton_diffusion.engine.jobs import Job
    from triton_diffusion.engine.request_engine import RequestEngine

    cancelled = {"now": False}
    requests = {
        name: tracked(name, cancelled=(lambda: cancelled["now"]) if name == "a" else False) for name in "ab"
    }

    def call(key, jobs, steps):
        for step in (1, 2, 3):
            steps.on_step(step, 3)
            cancelled["now"] = True  # "a" is cancelled after its first step
        return steps.scatter([f"img {job.request.request_id}" for job in steps.alive])

    left = []
    engine = RequestEngine(call, RowCaps(8), lambda report: left.extend(report.left), ClientAborts())
    for request in requests.values():
        engine.add(Job(request, None, group=KEY))
    report = engine.step()
    assert [(entry.job.request.request_id, entry.reason) for entry in left] == [("a", "cancelled")]
    assert [finished.job.request.request_id for finished in report.finished] == ["b"]
    assert len(engine.requests) == 0 and not engine.active


def test_the_host_never_sends_progress_for_a_step_already_sent():
    """A fused call that fails past its first steps is run again from step 1 (bisected, or split out of
    memory) and reports those steps again: the host (engine_host.py) sends only steps past the last one
    sent, as it is handed here step by step."""
    from types import SimpleNamespace

    from triton_diffusion.engine.jobs import Job, JobSpec, Stepped
    from triton_diffusion.serving.engine_host import EngineHost, RequestRecord

    sent: list[int] = []
    host = object.__new__(EngineHost)  # _stepped reads only these
    host.names = SimpleNamespace(first_step_on_snapshot=False, first_step="first_step")
    host.tiers, host.metrics = ("default",), SimpleNamespace(observe=lambda *args, **labels: None)
    host.responses = SimpleNamespace(submit=lambda tracked, send: send())
    host.kind = SimpleNamespace(progress_outputs=lambda record, stepped: {"STEP": stepped.step})
    request = tracked("a")
    request.progress = lambda outputs: sent.append(outputs["STEP"])
    job = Job(request, None, RequestRecord(request, SimpleNamespace(progress=True)))
    job.spec = JobSpec(None)
    for step in (1, 2, 3, 1, 2, 3, 4, 5):  # steps 1-3, a failure, then the retried call from step 1
        host._stepped(Stepped(job, step, 5))
    assert sent == [1, 2, 3, 4, 5]

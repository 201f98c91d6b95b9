"""The engine's stopwatch (engine/stopwatch.py): on a GPU the cost model learns what a forward, a start and
a decode cost the device (its events), not how long the host's call took (a queued forward returns at
once, and the next call that waits absorbs it); a span is recorded once the device has passed it, in order,
never waiting in the engine loop; on a CPU at once, by the host's clock."""

from __future__ import annotations

import pytest

from tests.unit.test_step_engine import FakeAdapter, Spec, engine_for, job
from triton_diffusion.engine.stopwatch import MOST_PENDING, Stopwatch


class Device:
    """A fake GPU's timeline: an event recorded is stamped when the device reaches it (``at``), and the
    device has passed it once ``now`` is at or after its stamp."""

    def __init__(self) -> None:
        self.now = 0.0  # seconds the device has run up to
        self.queue_end = 0.0  # where the work queued so far ends
        self.waited = 0  # events waited for (synchronize on one not passed yet)

    def queue(self, seconds: float) -> None:
        self.queue_end += seconds

    def event(self) -> Event:
        return Event(self)


class Event:
    def __init__(self, device: Device) -> None:
        self.device, self.at = device, None

    def record(self) -> None:
        self.at = self.device.queue_end

    def query(self) -> bool:
        return self.device.now >= self.at

    def synchronize(self) -> None:
        if not self.query():
            self.device.waited += 1
            self.device.now = self.at

    def elapsed_time(self, end: Event) -> float:
        return (end.at - self.at) * 1000


def test_a_span_is_recorded_with_its_device_seconds_once_the_device_has_passed_it():
    device = Device()
    watch = Stopwatch(device.event)
    recorded: list[float] = []
    mark = watch.start()
    device.queue(0.5)  # a forward queued: the call returns at once
    host_s = watch.stop(mark, recorded.append)
    assert host_s < 0.1 and recorded == []  # the host waited for nothing; nothing learned yet
    watch.settle()
    assert recorded == []  # the device is still on it: never waited for in the engine loop
    device.now = 0.5
    watch.settle()
    assert recorded == [pytest.approx(0.5)] and device.waited == 0


def test_spans_are_recorded_in_order_and_work_queued_before_a_span_is_not_its_cost():
    device = Device()
    watch = Stopwatch(device.event)
    recorded: list[tuple[str, float]] = []
    for name, seconds in (("forward", 0.3), ("forward", 0.3), ("decode", 0.05)):
        mark = watch.start()
        device.queue(seconds)
        watch.stop(mark, lambda s, name=name: recorded.append((name, s)))
    device.now = 0.3  # the first passed only
    watch.settle()
    assert recorded == [("forward", pytest.approx(0.3))]
    device.now = 1.0
    watch.settle()
    # The decode's 0.05 s, not the 0.35 s a host clock around a call that waits would read.
    assert recorded[1:] == [("forward", pytest.approx(0.3)), ("decode", pytest.approx(0.05))]


def test_pending_spans_are_bounded_by_waiting_for_the_oldest():
    device = Device()
    watch = Stopwatch(device.event)
    recorded: list[float] = []
    for _ in range(MOST_PENDING + 3):
        mark = watch.start()
        device.queue(0.01)
        watch.stop(mark, recorded.append)
    assert len(watch.pending) == MOST_PENDING and len(recorded) == 3 and device.waited == 3


def test_a_device_error_drops_what_is_pending():
    class Broken(Event):
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    device = Device()
    watch = Stopwatch(lambda: Broken(device))
    recorded: list[float] = []
    watch.stop(watch.start(), recorded.append)
    watch.settle()
    assert recorded == [] and not watch.pending


def test_on_a_cpu_a_span_is_recorded_at_once_by_the_host_clock():
    watch = Stopwatch.on("cpu")
    recorded: list[float] = []
    host_s = watch.stop(watch.start(), recorded.append)
    assert recorded == [host_s] and watch.events is None
    assert Stopwatch.on(None).events is None


class GpuAdapter(FakeAdapter):
    """The fake adapter on a fake GPU: each forward queues ``forward_s`` of device work and returns at
    once; a decode waits for everything queued (a copy to the host), then does its own ``decode_s``."""

    def __init__(self, device: Device, forward_s: float, decode_s: float) -> None:
        super().__init__()
        self.device, self.gpu = "cuda:0", device
        self.forward_s, self.decode_s = forward_s, decode_s

    def step(self, jobs, previews=None):
        self.gpu.queue(self.forward_s)
        return super().step(jobs, previews)

    def finish(self, jobs):
        self.gpu.queue(self.decode_s)
        self.gpu.now = self.gpu.queue_end  # the copy to the host waits for the device
        return super().finish(jobs)


def test_the_engine_learns_the_devices_seconds_not_the_hosts():
    """A forward that returns at once but costs the device 0.2 s, and a decode of 0.01 s that waits for
    the forwards queued before it: the cost model prices a forward at 0.2 s and a decode at 0.01 s (the
    host's clock, around this fake's calls, reads both as about nothing; on a real GPU it reads a decode
    as every forward queued before it too)."""
    gpu = Device()
    adapter = GpuAdapter(gpu, forward_s=0.2, decode_s=0.01)
    engine = engine_for(adapter)
    engine.engine.stopwatch = Stopwatch(gpu.event)
    engine.add(job("a", Spec(steps=3)))
    engine.step()  # start and the first forward: queued, nothing learned yet
    assert not engine.times.measured
    gpu.now = gpu.queue_end  # the device catches up
    for _ in range(3):
        engine.step()
    assert engine.times.forward_s(1) == pytest.approx(0.2)
    assert engine.times.finish_s == pytest.approx(0.01)


def test_the_engine_picks_its_stopwatch_from_the_adapters_device():
    gpu = Device()
    assert engine_for(GpuAdapter(gpu, 0.2, 0.01)).engine.stopwatch.events is not None  # cuda:0: events
    assert engine_for(FakeAdapter()).engine.stopwatch.events is None  # no device: the host's clock
    assert Stopwatch.on("cuda:1").events is not None and Stopwatch.on("cpu").events is None


def test_a_forward_that_fails_records_no_span_and_each_half_that_runs_records_its_own():
    """isolate() bisects a failing forward: the failed attempt's span is never stopped, so the cost
    model learns only the forwards that ran (here the good job's, alone)."""
    gpu = Device()
    engine = engine_for(GpuAdapter(gpu, forward_s=0.2, decode_s=0.01))
    engine.engine.stopwatch = Stopwatch(gpu.event)
    ran: list[tuple[int, float]] = []
    engine.times.forward_ran = lambda jobs, tokens, seconds, *_: ran.append((jobs, seconds))
    engine.add(job("good", Spec(steps=2)), job("bad", Spec(steps=2, fail_forward=True)))
    engine.step()
    gpu.now = gpu.queue_end
    engine.step()
    assert ran and ran[0] == (1, pytest.approx(0.2))  # one job's forward, not the failed pair's


def test_each_forward_reports_its_device_seconds_by_its_span_once_the_device_has_passed_it():
    """The step report's ``timed`` (the step-seconds metric, the caches bench): a forward's report names
    its span, and its device seconds come in the report of the step that found the device past it."""
    gpu = Device()
    engine = engine_for(GpuAdapter(gpu, forward_s=0.2, decode_s=0.01))
    engine.engine.stopwatch = Stopwatch(gpu.event)
    engine.add(job("a", Spec(steps=3)))
    engine.step()
    first = engine.host.reports[-1]
    assert [f.span for f in first.forwards] == [1] and first.timed == []  # queued, not passed
    gpu.now = gpu.queue_end
    engine.step()
    second = engine.host.reports[-1]
    assert [f.span for f in second.forwards] == [2]
    assert second.timed == [(1, pytest.approx(0.2))]  # the first forward's, a step late
    gpu.now = gpu.queue_end
    engine.step()
    assert engine.host.reports[-1].timed[0] == (2, pytest.approx(0.2))


def test_on_a_cpu_each_forward_is_timed_in_its_own_report():
    engine = engine_for(FakeAdapter())
    engine.add(job("a", Spec(steps=2)))
    engine.step()
    report = engine.host.reports[-1]
    assert [span for span, _ in report.timed] == [f.span for f in report.forwards] == [1]


def test_the_engines_bench_reads_a_forward_by_the_stopwatch_as_the_device_spends_it():
    """The GPU check beside a synced host clock (scripts/benchmarks/engines.py ``stopwatch_median``):
    forwards run back to back with no sync between, each read as the device seconds it queued (0.2 s),
    though each call returns at once."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from benchmarks.engines import stopwatch_median

    gpu = Device()
    device_at: list[float] = []  # where the device was when each call was made

    def forward() -> None:
        device_at.append(gpu.now)
        gpu.queue(0.2)

    assert stopwatch_median(forward, Stopwatch(gpu.event), "cpu", repeats=5) == pytest.approx(0.2)
    assert len(device_at) == 6 and gpu.now == gpu.queue_end  # a warm-up, five timed; all settled at the end
    assert device_at[1:] == [0.0] * 5  # no wait between the timed calls: the device never caught up


def test_the_host_records_step_seconds_from_a_report_that_only_times_forwards():
    """On a GPU a step's report can carry nothing but the device seconds of forwards an earlier step ran
    (an idle engine's last forwards): the host records them in the step-seconds histogram all the same."""
    from pathlib import Path

    from tests.unit.test_step_engine import RaisingKind
    from triton_diffusion.engine.jobs import StepReport
    from triton_diffusion.serving.engine_host import EngineHost
    from triton_diffusion.serving.engines import StepEngineKind
    from triton_diffusion.serving.metrics import IMAGE_METRICS
    from triton_diffusion.settings import ModelConfig, ModelSettings

    observed: list[tuple[str, float]] = []

    class Metrics:
        def observe(self, name, value, **labels):
            observed.append((name, value))

        def increment(self, *args, **kwargs): ...

        set = increment

    settings = ModelSettings("m", Path("."), ModelConfig(), {}, 8, "CPU", 0)
    kind = RaisingKind(raise_in={})
    host = EngineHost(kind, StepEngineKind(FakeAdapter()), settings, Metrics(), IMAGE_METRICS, lambda e: None)
    try:
        host.render(StepReport(timed=[(1, 0.2), (2, 0.25)]))
        host.responses.flush(10.0)
    finally:
        host.close()
    assert [v for name, v in observed if name == "triton_diffusion_step_seconds"] == [0.2, 0.25]

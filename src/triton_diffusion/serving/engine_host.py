"""One engine host for every model kind: the engine's thread, bounded admission, a stall watchdog, and one
response thread that renders the engine's reports into Triton responses.

Threads:
- Triton's ``execute()`` thread reads and validates requests (triton_model.py) and calls :meth:`submit`,
  which turns each request into jobs (the model kind's ``jobs_for``) and hands them to the worker; it
  blocks while the running set and the waiting room are full, at most ``max_admission_wait_s`` from
  ``execute()`` entry, then answers UNAVAILABLE.
- The engine thread (:class:`EngineWorker`) runs ``report = engine.step()`` and :meth:`EngineHost.render`,
  which only sorts the report into work for the response thread (and logs), so the next step starts at
  once. Should the loop raise (a bug), what it held is answered INTERNAL and it starts again; after a
  failed device it answers what it held UNAVAILABLE and the process exits for a restart.
- The response thread (responses.py) encodes previews and outputs, sends progress and FINAL responses in
  order per request, and records metrics (each a round trip to the server).
- The watchdog thread notices an engine that has work but has reported nothing for ``engine_stall_s`` (or
  5x its slowest step, if longer): a deadlock or a kernel that never returns. It answers what the engine
  holds UNAVAILABLE and exits the process, so the launcher's supervisor restarts the server.

A model kind supplies only what is its own (:class:`HostedKind`): how a request becomes jobs, and how
progress and outputs become tensors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from triton_diffusion.engine.failures import DeviceLostError, device_lost_error
from triton_diffusion.engine.jobs import Job, Stepped, StepReport
from triton_diffusion.engine.planner import RowCaps
from triton_diffusion.engine.policies import AdmissionPacing, make_policy
from triton_diffusion.engine.request_engine import PipelineCall, RequestEngine
from triton_diffusion.engine.requests import TrackedRequest
from triton_diffusion.engine.step_engine import EngineLimits, StepAdapter, StepEngine
from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.faults import FaultInjection, FaultyStepAdapter
from triton_diffusion.serving.metrics import BatchingMetrics, MetricNames
from triton_diffusion.serving.responses import ResponseWorker
from triton_diffusion.settings import ModelSettings

log = logging.getLogger("triton_diffusion")

# The slowest step seen, times this, is the stall bound when it is longer than engine_stall_s.
STALL_FACTOR = 5


@dataclass(eq=False)
class RequestRecord:
    """What the host keeps per request while its jobs run (each job's ``record``)."""

    tracked: TrackedRequest
    parsed: Any  # the model kind's validated request
    outputs: list[Any]
    remaining: int  # jobs not finished yet
    progress: bool = False  # the kind renders progress responses for this request
    state: Any = None  # the kind's own per-request state (the LM's streamed text)
    first_step_seen: bool = False
    forwards: int = 0  # the most forwards one of its jobs took part in
    most_shared: int = 0  # the most images one of its jobs shared a forward with


class HostedKind(Protocol):
    """What a model kind supplies to the host."""

    def jobs_for(self, record: RequestRecord, engine: str) -> list[Job]:
        """The request's jobs (each with ``record`` set); may raise RequestError for this request."""

    def progress_outputs(self, record: RequestRecord, stepped: Stepped) -> Mapping[str, Any] | None:
        """A progress response for this step, or None (runs on the response thread, in order)."""

    def final_outputs(
        self, record: RequestRecord, outputs: list[Any], batch: dict[str, Any]
    ) -> Mapping[str, Any]:
        """The FINAL response's tensors (runs on the response thread)."""


class EngineWorker:
    """Runs an engine on its own thread, fed by ``execute()``; see the module docstring."""

    def __init__(
        self,
        engine: Any,
        capacity: int,
        render: Callable[[StepReport], None],
        stall_s: float,
        on_device_lost: Callable[[str], None],
        on_stall: Callable[[str], None],
        name: str = "engine",
    ) -> None:
        self.engine = engine
        self.capacity = capacity
        self.render = render
        self.stall_s = stall_s
        self.on_device_lost = on_device_lost
        self.on_stall = on_stall
        self.restarts = 0
        self.slowest_step_s = 0.0
        self._condition = threading.Condition()
        self._incoming: deque[Job] = deque()
        self._closed = False
        self._step_started: float | None = None  # monotonic time of the last report while in a step
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _in_system(self) -> int:
        return self.engine.active + len(self._incoming)

    def submit(self, requests: Sequence[tuple[TrackedRequest, list[Job]]], max_wait_s: float) -> list[float]:
        """Hand requests' jobs to the engine, in order and together, so the engine plans them at once. A
        request waits while the engine is full, at most ``max_wait_s`` from its ``execute()`` entry, then
        is answered UNAVAILABLE. Returns the seconds each waited (-1 for one refused)."""
        waited = []
        with self._condition:
            for tracked, jobs in requests:
                started = time.perf_counter()
                deadline = tracked.entered + max_wait_s
                refused = None
                while (
                    self._in_system() and self._in_system() + len(jobs) > self.capacity and not self._closed
                ):
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        refused = RequestError(
                            ErrorCode.UNAVAILABLE,
                            f"the model is at capacity: no room for this request within {max_wait_s:g} s",
                        )
                        break
                    self._condition.wait(remaining)
                if self._closed:
                    refused = RequestError(ErrorCode.UNAVAILABLE, "the model is shutting down")
                if refused is not None:
                    tracked.fail(refused)
                    waited.append(-1.0)
                    continue
                self._incoming.extend(jobs)
                self._condition.notify_all()  # an idle engine starts now, not after the whole batch
                waited.append(time.perf_counter() - started)
        return waited

    def close(self, timeout_s: float = 30.0) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join(timeout_s)

    # ---- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        import torch

        try:
            while True:
                try:
                    with torch.inference_mode():  # grad mode is per thread
                        self._loop()
                    return
                except DeviceLostError as exc:
                    self._render(self.engine.take_report())  # what the step did before the device failed
                    self._stop_for_device_loss(str(exc))
                    return
                except BaseException as exc:  # noqa: BLE001  (a bug in the loop: answer, restart)
                    log.exception("engine loop failed; answering what it held and restarting")
                    self.restarts += 1
                    self._render(self.engine.take_report())
                    self._fail_held(RequestError(ErrorCode.INTERNAL, f"engine failure: {exc!r}"))
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        return
        finally:
            with self._condition:
                self._closed = True
                self._condition.notify_all()
            self._fail_held(RequestError(ErrorCode.UNAVAILABLE, "the model is shutting down"))

    def _loop(self) -> None:
        while self._next_round():
            self._step_started = time.monotonic()
            try:
                report = self.engine.step()
                self._render(report)
            finally:
                self._step_started = None  # idle (or restarting) is never a stall

    def beat(self) -> None:
        """The engine reported progress (a step, or a denoising step inside a fused call)."""
        now = time.monotonic()
        started = self._step_started
        if started is not None:
            self.slowest_step_s = max(self.slowest_step_s, now - started)
            self._step_started = now

    def _render(self, report: StepReport) -> None:
        self.beat()
        try:
            self.render(report)
        except Exception:  # noqa: BLE001  (rendering is per request; this would be a bug in the host)
            log.exception("rendering an engine report failed")

    def _next_round(self) -> bool:
        """Wait for work; move submitted jobs into the engine. False once closed."""
        with self._condition:
            self._condition.notify_all()  # the last step may have made room
            while not self._closed and not self._incoming and not self.engine.active:
                self._condition.wait()
            if self._closed:
                return False
            while self._incoming:
                self.engine.add(self._incoming.popleft())
            return True

    def _stop_for_device_loss(self, error: str) -> None:
        log.error("engine: the accelerator failed (%s); answering what it held", error)
        with self._condition:
            self._closed = True  # later submits are refused: nothing can run on this device again
        self._fail_held(device_lost_error(error))
        self.on_device_lost(error)

    def _fail_held(self, error: RequestError) -> None:
        with self._condition:
            for job in self._incoming:
                self.engine.add(job)
            self._incoming.clear()
            self._condition.notify_all()
        try:
            self._render(self.engine.fail_all(error))
        except Exception:  # noqa: BLE001
            log.exception("answering held requests failed")

    # ---- the watchdog -----------------------------------------------------------------------------
    def stall_bound_s(self) -> float:
        return max(self.stall_s, STALL_FACTOR * self.slowest_step_s)

    def _watch(self) -> None:
        period = min(1.0, self.stall_s / 4)
        while self._thread.is_alive():
            time.sleep(period)
            started = self._step_started
            if started is None or time.monotonic() - started <= self.stall_bound_s():
                continue
            stalled = time.monotonic() - started
            error = f"the engine reported nothing for {stalled:.0f} s (bound {self.stall_bound_s():.0f} s)"
            log.critical("%s: it is stuck; answering what it holds and exiting for a restart", error)
            with self._condition:
                self._closed = True
                held = [*self._incoming, *self.engine.running, *self.engine.waiting, *self.engine.in_flight]
                self._condition.notify_all()
            for job in held:  # the engine thread is stuck: answered from here (exactly once, under lock)
                job.request.fail(RequestError(ErrorCode.UNAVAILABLE, f"{error}; the model is restarting"))
            self.on_stall(error)
            return


class EngineHost:
    """An engine (step or request-level) with its worker, response thread and metrics, for one model."""

    def __init__(
        self,
        kind: HostedKind,
        settings: ModelSettings,
        metrics: BatchingMetrics,
        names: MetricNames,
        on_exit: Callable[[str], None],  # answer what is queued, then leave the process (say why)
        *,
        adapter: StepAdapter | None = None,
        pipeline_call: PipelineCall | None = None,
        caps: RowCaps | None = None,
        default_running: int = 8,
        default_waiting: int = 4,
        default_cohort: int | None = None,
        prompt_of: Callable[[Job], str] = lambda job: "",
    ) -> None:
        config = settings.config
        self.kind = kind
        self.metrics = metrics
        self.names = names
        self.max_wait_s = config.max_admission_wait_s
        self.responses = ResponseWorker()
        faults = FaultInjection.from_config(config.fault_injection)
        if adapter is not None:
            if faults is not None:  # looked up once, here: the engine sees the failures a model would give
                adapter = FaultyStepAdapter(adapter, faults, prompt_of)
            caps = caps or RowCaps(config.max_running or default_running)  # the LM: every running job
            limits = EngineLimits(
                max_running=config.max_running or default_running,
                max_per_forward=caps.max_rows,
                # An image's group is (height, width), a video's (height, width, frames): caps are by size.
                cap_for=lambda group: (
                    caps.cap_for_size(*group)[0] if isinstance(group, tuple) else caps.max_rows
                ),
                cancel_poll_s=config.cancel_poll_ms / 1000,
            )
            policy = make_policy(config.scheduling_policy, config.starvation_steps)
            cohort = config.admission_cohort or default_cohort or max(1, limits.max_per_forward // 2)
            # At most half the running set: a busy engine must be able to see that many places free, or
            # every newcomer would wait the whole admission_max_wait_steps.
            cohort = min(cohort, max(1, limits.max_running // 2))
            pacing = AdmissionPacing(cohort, config.admission_max_wait_steps)
            self.engine: Any = StepEngine(adapter, limits, policy, pacing)
            running = limits.max_running
            log.info(
                "%s: step engine (%s), running %d, %d per forward, policy %s, admission cohort %d",
                settings.name,
                type(adapter).__name__,
                limits.max_running,
                limits.max_per_forward,
                policy.name,
                pacing.cohort,
            )
        else:
            assert pipeline_call is not None and caps is not None
            self.engine = RequestEngine(pipeline_call, caps, self._progress_in_call)
            running = caps.max_rows
        waiting = config.waiting_room if config.waiting_room is not None else default_waiting
        self.worker = EngineWorker(
            self.engine,
            running + waiting,
            self.render,
            config.engine_stall_s,
            on_device_lost=lambda error: on_exit(f"the accelerator failed ({error})"),
            on_stall=lambda error: on_exit(f"the engine is stuck ({error})"),
            name=f"{self.engine.name}-engine",
        )

    # ---- execute() thread -------------------------------------------------------------------------
    def submit(self, admitted: Sequence[tuple[TrackedRequest, Any]]) -> None:
        """Turn each valid request into jobs and hand them all to the engine together."""
        batch = []
        for tracked, parsed in admitted:
            record = RequestRecord(tracked, parsed, [], 0)
            try:
                jobs = self.kind.jobs_for(record, self.engine.name)
            except RequestError as error:
                tracked.fail(error)
                continue
            except Exception as exc:  # noqa: BLE001  (never the requests already in the engine)
                log.exception("request %s: making its jobs failed", tracked.request_id)
                tracked.fail(RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
                continue
            record.outputs, record.remaining = [None] * len(jobs), len(jobs)
            batch.append((tracked, jobs))
        for waited in self.worker.submit(batch, self.max_wait_s):
            if waited >= 0:
                self.metrics.observe(self.names.admission_wait, waited)

    def close(self) -> None:
        self.worker.close()  # what it held is answered UNAVAILABLE
        self.responses.close()

    def before_exit(self, reason: str) -> None:
        """Send what is queued for sending, then answer what 10 s did not send (the process leaves)."""
        self.responses.close(timeout_s=10)
        message = f"{reason}; the model is restarting, retry shortly"
        self.responses.fail_queued(RequestError(ErrorCode.UNAVAILABLE, message))

    # ---- the engine thread: reports into work for the response thread --------------------------------
    def render(self, report: StepReport) -> None:
        names, submit = self.names, self.responses.submit
        # Metrics go on the response thread's queue before the answers: a client that reads /metrics
        # after its answer sees the work that answered it.
        if report.forwards or report.calls or report.cuts or report.stepped:
            submit(None, lambda: self._record_metrics(report))
        for job in report.admitted:
            summary = getattr(job.params, "summary", None) or f"{job.total_steps} steps"
            log.info(
                "request %s image %d admitted: %s (%d running)",
                job.request.request_id,
                job.index,
                summary,
                report.running,
            )
        for stepped in report.stepped:
            self._stepped(stepped)
        for finished in report.finished:
            self._finished(finished.job, finished.output)
        for left in report.left:
            job = left.job
            if left.reason == "cancelled":
                submit(None, lambda: self.metrics.increment(names.cancelled))
            log.info(
                "request %s image %d left (%s) after %d/%d steps, %d forwards, shared with up to %d%s",
                job.request.request_id,
                job.index,
                left.reason,
                job.steps_done,
                job.total_steps,
                job.forwards,
                job.most_shared,
                f": {left.error.message}" if left.error is not None else "",
            )

    def _progress_in_call(self, report: StepReport) -> None:
        """A denoising step inside a fused call (request-level engine): progress, and a heartbeat."""
        self.worker.beat()
        self.render(report)

    def _stepped(self, stepped: Stepped) -> None:
        job = stepped.job
        record: RequestRecord = job.record
        if job.index != 0 or job.request.ended:
            return  # the first image speaks for its request
        if not record.first_step_seen and (
            stepped.snapshot is not None or not self.names.first_step_on_snapshot
        ):
            record.first_step_seen = True
            waited = time.perf_counter() - job.request.entered
            self.responses.submit(None, lambda: self.metrics.observe(self.names.first_step, waited))
        if record.progress:

            def send() -> None:
                outputs = self.kind.progress_outputs(record, stepped)
                if outputs is not None:
                    record.tracked.progress(outputs)

            self.responses.submit(job.request, send)

    def _finished(self, job: Job, output: Any) -> None:
        record: RequestRecord = job.record
        record.outputs[job.index] = output
        record.remaining -= 1
        record.forwards = max(record.forwards, job.forwards)
        record.most_shared = max(record.most_shared, job.most_shared)
        if record.remaining:
            return
        if self.engine.name == "step":
            batch: dict[str, Any] = {
                "engine": "step",
                "forwards": record.forwards,
                "most_rows_shared": record.most_shared,
            }
        else:
            batch = {"fused_calls": job.calls}
        outputs = list(record.outputs)

        def answer() -> None:
            record.tracked.finish(self.kind.final_outputs(record, outputs, batch))

        self.responses.submit(record.tracked, answer)

    def _record_metrics(self, report: StepReport) -> None:
        names, metrics = self.names, self.metrics
        for forward in report.forwards:
            if names.forward_images:
                metrics.observe(names.forward_images, forward.images)
            if names.forward_images_legacy:
                metrics.observe(names.forward_images_legacy, forward.images)
            metrics.observe(names.forward_model_rows, forward.model_rows)
            metrics.observe(names.step_seconds, forward.seconds)
            if names.forward_adapters and forward.adapters:
                metrics.observe(names.forward_adapters, forward.adapters)
            if names.forwards_total:
                metrics.increment(names.forwards_total)
        for call in report.calls:
            metrics.increment("triton_diffusion_fused_calls_total")
            if call.error is None:
                metrics.observe("triton_diffusion_fused_call_rows", call.rows)
                metrics.observe("triton_diffusion_pipeline_seconds", call.seconds)
            if call.bisected:
                metrics.increment("triton_diffusion_bisection_retries_total")
            if call.oom_split:
                metrics.increment("triton_diffusion_oom_splits_total")
        for reason in report.cuts:
            metrics.increment("triton_diffusion_groups_cut_total", reason=reason)
        metrics.set(names.running, report.running)

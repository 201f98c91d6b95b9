"""The engine's thread: bounded admission from ``execute()``, the loop that steps the engine, its restart
after a bug, and what happens when the device fails or the engine is stuck.

- Triton's ``execute()`` thread calls :meth:`EngineWorker.submit`, which hands each request's jobs straight
  to the engine (its scheduler owns every queue); it blocks while the engine holds ``capacity`` jobs, at
  most ``max_admission_wait_s`` from ``execute()`` entry, then answers UNAVAILABLE. A request of a higher
  service tier than a job held passes (up to twice ``capacity``, plus ``deadline_room``). Triton hands
  one instance's requests to ``execute()`` one batch at a time, so a request arriving while ``execute()``
  waits for room for another waits with it, a higher tier among them: with config ``deadline_room``, a
  request with a deadline (where the scheduler refuses late ones) takes up to that many jobs more before
  it waits, and one without a deadline does not count those.
- The engine thread hands the engine the aborts of the requests it holds (``engine.abort``: cancelled
  by their clients, or answered by the host), runs ``report = engine.step()`` and hands the report to
  ``render`` (the host sorts it
  into work for its response thread), so the next step starts at once. Should the loop raise (a bug),
  what it held is answered INTERNAL and it starts again; after a failed device it answers what it held
  UNAVAILABLE and the process exits for a restart.
- The stall watchdog (watchdog.py) answers what the engine holds UNAVAILABLE from its own thread when the
  engine thread is stuck, and exits the process.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

from triton_diffusion.engine.failures import DeviceLostError, device_lost_error
from triton_diffusion.engine.jobs import Job, StepReport
from triton_diffusion.engine.request_status import Abort, AbortSource, Request
from triton_diffusion.errors import RESEND, ErrorCode, RequestError
from triton_diffusion.serving.cancellations import ClientAborts
from triton_diffusion.serving.requests import Stage, TrackedRequest
from triton_diffusion.serving.watchdog import StallWatchdog

log = logging.getLogger("triton_diffusion")

# How long the watchdog waits for the stuck engine's requests to be answered before the process leaves.
STALL_ANSWER_S = 10.0


class Engine(Protocol):
    """What the worker runs: the step engine (engine/step_engine.py) or the request-level engine
    (engine/request_engine.py)."""

    def held_requests(self) -> list[Request]:
        """The requests an abort may name now (the engine thread)."""

    def abort(self, aborts: list[Abort]) -> None:
        """Drop these requests at the next step (the engine thread)."""

    def add(self, *jobs: Job) -> None:
        """Take a request's jobs, together (from any thread)."""

    @property
    def active(self) -> int:
        """Jobs held (from any thread)."""

    @property
    def with_deadline(self) -> int:
        """Of them, jobs with a deadline (from any thread)."""

    def outranks_held(self, tier: int) -> bool:
        """Whether a job of ``tier`` outranks a job held (from any thread)."""

    def step(self) -> StepReport: ...

    def take_report(self) -> StepReport:
        """What the step under way did, also after it raised."""

    def fail_all(self, error: RequestError) -> StepReport:
        """End every job held with ``error``."""


class EngineWorker:
    def __init__(
        self,
        engine: Engine,
        capacity: int,
        render: Callable[[StepReport], None],
        stall_s: float,
        on_device_lost: Callable[[str], None],
        on_stall: Callable[[str], None],
        name: str = "engine",
        flush_answers: Callable[[], object] = lambda: None,
        aborts: AbortSource | None = None,
        between_steps: Callable[[], None] | None = None,
        idle_tick_s: float | None = None,
        deadline_room: int = 0,
    ) -> None:
        self.engine = engine
        # Jobs beyond ``capacity`` a request with a deadline joins without waiting in execute() (0: it
        # waits like any other): a wait there holds up every request Triton queues behind it.
        self.deadline_room = deadline_room
        # Called on the engine thread before each step and, with ``idle_tick_s``, every that many seconds
        # while the engine holds nothing (the host's drain: engine_host.py). None: nothing is called.
        self.between_steps = between_steps
        self.idle_tick_s = idle_tick_s if between_steps is not None else None
        self.aborts = aborts or ClientAborts()  # asked before each step: the aborts handed to the engine
        self.capacity = capacity
        self.render = render
        self.on_device_lost = on_device_lost
        self.on_stall = on_stall
        self.flush_answers = flush_answers  # sends what the response thread holds (bounded)
        self.restarts = 0
        self._condition = threading.Condition()
        self._closed = False
        # What a request gets once closed (submit): shutting down, or restarting() once that began.
        self._refusal = RequestError(ErrorCode.UNAVAILABLE, "the model is shutting down")
        # Every request handed to the engine and not answered yet: the watchdog answers them when the
        # engine thread is stuck, wherever their jobs are (a queue, the adapter's hands, a report). Weak:
        # an answered request must be released (Triton's unload waits for every request of the model, so
        # one kept here made every stop wait its whole exit timeout); one not answered is held by its jobs.
        self._live: weakref.WeakSet[TrackedRequest] = weakref.WeakSet()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.watchdog = StallWatchdog(stall_s, self._thread.is_alive, self._stalled, f"{name}-watchdog")
        self._thread.start()
        self.watchdog.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, requests: Sequence[tuple[TrackedRequest, list[Job]]], max_wait_s: float) -> list[float]:
        """Hand requests' jobs to the engine, in order. A request waits while the engine is full, at most
        ``max_wait_s`` from its ``execute()`` entry, then is answered UNAVAILABLE. Returns the seconds each
        waited (-1 for one refused)."""
        waited = []
        with self._condition:
            for tracked, jobs in requests:
                started = time.perf_counter()
                deadline = tracked.entered + max_wait_s
                refused = None
                while self._full(jobs) and not self._closed:
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        refused = RequestError(
                            ErrorCode.UNAVAILABLE,
                            f"the model is at capacity: no room for this request within {max_wait_s:g} s",
                        )
                        break
                    self._condition.wait(remaining)
                if self._closed:
                    refused = self._refusal
                if refused is not None:
                    tracked.fail(refused)
                    waited.append(-1.0)
                    continue
                self._live.add(tracked)
                self.engine.add(*jobs)
                self._condition.notify_all()  # an idle engine starts now, not after the whole batch
                waited.append(time.perf_counter() - started)
        return waited

    def _full(self, jobs: list[Job]) -> bool:
        """No room for ``jobs``. A request's room is ``capacity`` jobs, ``deadline_room`` more where it has
        a deadline; one without a deadline counts the jobs without one and, of those with one, only the ones
        beyond ``deadline_room`` of them (so requests with a deadline filling their room do not take its
        place; all held stay within ``capacity + deadline_room`` for it). A request of a higher tier
        than a job held does not wait behind it: it may take up to ``capacity`` more than requests with a
        deadline may fill (the scheduler pauses or passes the lower jobs)."""
        held, count = self.engine.active, len(jobs)
        if not held or held + count <= self.capacity:
            return False
        with_deadline = all(job.spec.deadline is not None for job in jobs)
        if with_deadline and held + count <= self.capacity + self.deadline_room:
            return False
        room_held = min(self.deadline_room, self.engine.with_deadline) if self.deadline_room else 0
        if not with_deadline and held - room_held + count <= self.capacity:
            return False
        tier = min((job.spec.tier for job in jobs), default=0)
        return held + count > 2 * self.capacity + self.deadline_room or not self.engine.outranks_held(tier)

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop the engine thread (what it held is answered). False where ``timeout_s`` ended the wait."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

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
            if self.between_steps is not None:
                self.between_steps()
                if not self.engine.active:
                    continue
            self._step()

    def _step(self) -> None:
        """One engine step. Its own frame, so nothing of it (the requests held) stays referenced while the
        loop waits for the next round: Triton's unload waits for every request to be released."""
        self.watchdog.step_started()
        try:
            held = self.engine.held_requests()
            if held:
                self.engine.abort(self.aborts.aborted(held))
            self._render(self.engine.step())
        finally:
            self.watchdog.step_ended()

    def beat(self) -> None:
        """The engine reported progress from inside a step (a denoising step of a fused call)."""
        self.watchdog.beat()

    def _render(self, report: StepReport) -> None:
        self.watchdog.beat()
        try:
            self.render(report)
        except Exception:  # noqa: BLE001  (rendering is per request; this would be a bug in the host)
            log.exception("rendering an engine report failed")

    def _next_round(self) -> bool:
        """Wait for work (at most ``idle_tick_s`` when set: the host looks between steps, idle too). False
        once closed."""
        with self._condition:
            self._condition.notify_all()  # the last step may have made room
            while not self._closed and not self.engine.active:
                if self.idle_tick_s is None:
                    self._condition.wait()
                elif not self._condition.wait(self.idle_tick_s):
                    break  # idle: a round with nothing to step, for between_steps
            return not self._closed

    def _stop_for_device_loss(self, error: str) -> None:
        log.error("engine: the accelerator failed (%s); answering what it held", error)
        with self._condition:
            self._closed = True  # later submits are refused: nothing can run on this device again
            self._refusal = restarting(f"the accelerator failed ({error})")
        self._fail_held(device_lost_error(error))
        self.on_device_lost(error)

    def _fail_held(self, error: RequestError) -> None:
        with self._condition:
            self._condition.notify_all()
        try:
            self._render(self.engine.fail_all(error))
        except Exception:  # noqa: BLE001
            log.exception("answering held requests failed")

    def _stalled(self, error: str) -> None:
        """The watchdog's thread: the engine thread is stuck, so what it holds is answered from here
        (exactly once: a request's answer is claimed under its lock), then the process is asked to exit."""
        with self._condition:
            self._closed = True
            self._refusal = restarting(f"the engine is stuck ({error})")
            self._condition.notify_all()
            live = [r for r in self._live if r.stage is not Stage.ANSWERED]
        failure = RequestError(ErrorCode.UNAVAILABLE, f"{error}; the model is restarting")
        try:
            self.flush_answers()  # results already computed go out first, not UNAVAILABLE in their place
            # From a thread of its own, bounded: a send stuck in Triton holds its request's lock, and
            # the process must leave for its restart whatever happens here.
            answering = threading.Thread(target=_fail_each, args=(live, failure), daemon=True)
            answering.start()
            answering.join(STALL_ANSWER_S)
        finally:
            self.on_stall(error)


def restarting(why: str) -> RequestError:
    """The answer to a request that waited for room, or came, after the model began restarting for
    ``why``: it never ran, so it cannot be the cause, and its resend (once the model is ready again) is
    safe; unlike the requests the engine held (errors.py Retry)."""
    return RequestError(
        ErrorCode.UNAVAILABLE, f"{why}; the model is restarting and this request had not started", RESEND
    )


def _fail_each(requests: list[TrackedRequest], error: RequestError) -> None:
    for tracked in requests:  # no-op for one answered already; an ended one gets its decided error
        tracked.fail(error)

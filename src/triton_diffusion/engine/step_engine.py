"""Step-level continuous batching, one engine for every model kind, each through a step adapter.

The engine keeps a running set of jobs: an image row with its own latents, timesteps and scheduler, or a
diffusion-LM request with its own block schedule. Every engine step:

1. admits waiting jobs while the running set has room; the adapter prepares them together (one text
   encoder call for everyone admitted, each row's noise from its own generator);
2. drops jobs whose request has ended (answered elsewhere) and asks running requests whether they were
   cancelled (at most once per ``cancel_poll_s``: each ask is a round trip to the server);
3. lets the scheduling policy (policies.py) pick one group of jobs that can share a forward (same latent
   shape), at most the group's cap;
4. runs one forward for them and each job's own step (``adapter.step``);
5. hands the jobs that finished to ``adapter.finish`` together (one VAE decode), then to the listener.

A job joins at any step and leaves the moment it is done. Failures stay with the jobs that cause them: a
failing forward is bisected until the culprit is alone; an out-of-memory forward is split in halves and
the group's cap lowered (a job fails with UNAVAILABLE only if it does not fit alone); a listener that
raises costs its own request only. A failed device (device_errors.py) is not retried: the engine raises
:class:`DeviceLostError`. Every request is answered through its TrackedRequest, exactly once.

:class:`EngineWorker` runs the engine on its own thread with bounded admission, and restarts the loop
should it ever die, after answering what it held; after a device failure it answers what it held
UNAVAILABLE, stops and calls ``on_device_lost`` (the serving layer exits the process for a restart).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from triton_diffusion.engine.device_errors import (
    DeviceLostError,
    device_lost_error,
    free_accelerator_memory,
    is_device_lost,
    is_out_of_memory,
)
from triton_diffusion.engine.policies import SchedulingPolicy, make_policy
from triton_diffusion.engine.requests import TrackedRequest
from triton_diffusion.errors import ErrorCode, RequestError

log = logging.getLogger("triton_diffusion")

# Full forwards of a group at an out-of-memory-learned cap before the cap is doubled again (at first).
CAP_RECOVERY_FORWARDS = 50


@dataclass(eq=False)
class Job:
    """One unit of the running set. ``request`` answers the client; ``params`` is what the adapter needs
    to prepare the job; ``context`` is the listener's. The rest is filled in by the adapter (``state``,
    ``group``, ``total_steps``) and by the engine (progress and the report each request gets back)."""

    request: TrackedRequest
    params: Any
    context: Any = None  # what the listener keeps per job (the model kind's own bookkeeping)
    index: int = 0  # which row of its request (image i of num_images_per_prompt)
    state: Any = None
    group: Hashable = None  # jobs of one group can share a forward
    total_steps: int = 0
    steps_done: int = 0
    failure: str | None = None  # set by the adapter when this job's own step failed
    arrival: int = 0  # admission order
    waited_since: int = 0  # the engine step at which it last stepped (or was admitted)
    first_forward: int | None = None  # the engine forward it first took part in
    forwards: int = 0  # forwards it took part in
    most_shared: int = 0  # the most jobs it shared one forward with
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None

    @property
    def remaining(self) -> int:
        return max(self.total_steps - self.steps_done, 0)


class StepAdapter(Protocol):
    """What a model kind provides to the engine."""

    def prepare(self, jobs: list[Job]) -> None:
        """Admission work for these jobs, together: set ``state``, ``group`` and ``total_steps``."""

    def rows(self, job: Job) -> int:
        """Rows the job adds to a forward (2 with classifier-free guidance)."""

    def step(self, jobs: list[Job]) -> list[Job]:
        """One shared forward and each job's own step; returns the jobs that are now done. Raising means
        no job advanced; a failure of one job's own step sets its ``failure`` instead."""

    def finish(self, jobs: list[Job]) -> list[Any]:
        """The outputs of done jobs of one group, together (one decode), one per job."""


class EngineListener(Protocol):
    """How the engine reports (the Triton model sends responses and metrics from here)."""

    def on_admitted(self, job: Job) -> None: ...

    def on_stepped(self, job: Job) -> None: ...  # after each of the job's steps: progress, previews

    def on_finished(self, job: Job, output: Any) -> None: ...  # the job's output: answer (off-thread)

    def on_left(self, job: Job, reason: str) -> None: ...  # finished, cancelled, failed, ended

    def on_forward(self, jobs: list[Job], rows: int, seconds: float) -> None: ...


@dataclass
class EngineLimits:
    max_running: int  # jobs in the running set
    max_per_forward: int  # jobs per forward
    cap_for: Callable[[Hashable], int] | None = None  # a lower cap for some groups (resolutions)
    cancel_poll_s: float = 0.0  # ask each running request about cancellation at most this often

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_per_forward < 1:
            raise ValueError(f"max_running and max_per_forward must be >= 1, got {self}")


class StepEngine:
    """The running set and one step at a time. Not thread-safe: one thread (the worker's) steps it."""

    def __init__(
        self,
        adapter: StepAdapter,
        listener: EngineListener,
        limits: EngineLimits,
        policy: SchedulingPolicy | None = None,
    ) -> None:
        self.adapter = adapter
        self.listener = listener
        self.limits = limits
        self.policy = policy or make_policy("oldest")
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.steps = 0  # engine steps so far
        self.forwards = 0  # forwards run
        self._arrivals = itertools.count()
        self._learned_caps: dict[Hashable, int] = {}  # lowered after out-of-memory
        self._good_forwards: dict[Hashable, int] = {}  # full forwards at the learned cap since it changed
        self._recovery_wait: dict[Hashable, int] = {}  # full forwards to wait before raising it again
        self._raised_from: dict[Hashable, int] = {}  # groups whose cap was raised and not yet re-proven
        self._last_poll: dict[int, float] = {}  # id(request) -> when it was last asked

    # ---- the running set ------------------------------------------------------------------------
    def add(self, job: Job) -> None:
        self.waiting.append(job)

    @property
    def active(self) -> int:
        return len(self.waiting) + len(self.running)

    def cap_for(self, group: Hashable) -> int:
        cap = self.limits.max_per_forward
        if self.limits.cap_for is not None:
            cap = min(cap, self.limits.cap_for(group))
        return min(cap, self._learned_caps.get(group, cap))

    def step(self) -> None:
        """Admit, drop what ended, run one forward for the policy's pick, finish what is done."""
        self.steps += 1
        self._admit()
        self._drop_ended()
        batch = self.policy.pick(self.running, self.cap_for, self.steps)
        if batch:
            self._forward(list(batch))

    def _admit(self) -> None:
        admitted: list[Job] = []
        while self.waiting and len(self.running) + len(admitted) < self.limits.max_running:
            job = self.waiting.popleft()
            if job.request.ended:
                self._leave(job, "ended")
                continue
            admitted.append(job)
        if not admitted:
            return
        try:
            prepared = self._guarded(self.adapter.prepare, admitted, "preparing")
        except DeviceLostError:
            # Still held (those not failed alone already): answered by whoever stops the engine.
            self.waiting.extendleft(reversed([job for job in admitted if not job.request.ended]))
            raise
        now = time.perf_counter()
        for job in prepared:
            job.arrival = next(self._arrivals)
            job.waited_since = self.steps
            job.admitted_at = now
            job.request.start()
            self.running.append(job)
            self._notify(self.listener.on_admitted, job)

    def _drop_ended(self) -> None:
        now = time.perf_counter()
        cancelled: set[int] = set()
        polled: set[int] = set()
        for job in list(self.running):
            request, key = job.request, id(job.request)
            due = now - self._last_poll.get(key, 0.0) >= self.limits.cancel_poll_s
            if not request.ended and key not in polled and due:
                polled.add(key)
                self._last_poll[key] = now
                if request.is_cancelled():
                    cancelled.add(key)
                    progress = f"{job.steps_done}/{job.total_steps}"
                    log.info("request %s cancelled after step %s", request.request_id, progress)
                    request.fail(RequestError(ErrorCode.CANCELLED, f"cancelled after step {progress}"))
            if request.ended:
                self._leave(job, "cancelled" if key in cancelled else "ended")

    # ---- one forward ------------------------------------------------------------------------------
    def _forward(self, batch: list[Job]) -> None:
        started = time.perf_counter()
        error: str | None = None
        oom = lost = False
        try:
            done = self.adapter.step(batch)
        except Exception as exc:  # noqa: BLE001  (isolate: bisect or split, never fatal)
            # Only text leaves the handler, so the failed forward's activations are freed before a retry.
            error, oom, lost = f"{type(exc).__name__}: {exc}", is_out_of_memory(exc), is_device_lost(exc)
        if lost:
            raise DeviceLostError(error)
        if error is not None:
            self._retry(batch, error, oom)
            return
        self.forwards += 1
        self._relax_learned_cap(batch[0].group, len(batch))
        rows = sum(self.adapter.rows(job) for job in batch)
        for job in batch:
            if job.first_forward is None:
                job.first_forward = self.forwards
            job.forwards += 1
            job.most_shared = max(job.most_shared, len(batch))
            job.waited_since = self.steps
            if job.failure is not None:
                job.request.fail(RequestError(ErrorCode.INTERNAL, f"denoising step failed: {job.failure}"))
                self._leave(job, "failed")
                continue
            job.steps_done += 1
            self._notify(self.listener.on_stepped, job)
        finished = [job for job in done if job in self.running]
        for job in finished:
            self.running.remove(job)
        try:
            self.listener.on_forward(batch, rows, time.perf_counter() - started)
        except Exception:  # noqa: BLE001  (metrics never cost a request)
            log.exception("on_forward failed")
        if finished:
            self._finish(finished)

    def _relax_learned_cap(self, group: Hashable, rows: int) -> None:
        # An out-of-memory may be transient (another process held memory for a while), so a learned cap
        # doubles after enough full forwards at it and is dropped once it reaches the configured one. A
        # real limit is re-learned by the next out-of-memory (one split forward), and each time it is the
        # wait before the next try doubles, so a real limit is probed ever more rarely.
        learned = self._learned_caps.get(group)
        if learned is None or rows < learned:
            return
        good = self._good_forwards.get(group, 0) + 1
        if good < self._recovery_wait.get(group, CAP_RECOVERY_FORWARDS):
            self._good_forwards[group] = good
            return
        self._good_forwards[group] = 0
        self._raised_from[group] = learned
        del self._learned_caps[group]
        if learned * 2 < self.cap_for(group):
            self._learned_caps[group] = learned * 2
        log.info("forwards of group %s capped at %d again", group, self.cap_for(group))

    def _retry(self, batch: list[Job], error: str, oom: bool) -> None:
        log.warning("forward of %d job(s) failed: %s", len(batch), error)
        if oom:
            free_accelerator_memory()
        if len(batch) > 1:
            if oom:
                group = batch[0].group
                if self._raised_from.pop(group, None) is not None:  # raising it failed: wait longer
                    wait = self._recovery_wait.get(group, CAP_RECOVERY_FORWARDS)
                    self._recovery_wait[group] = wait * 2
                self._learned_caps[group] = min(self.cap_for(group), len(batch) // 2)
                self._good_forwards[group] = 0
                log.warning("out of memory: forwards of group %s capped at %d", group, len(batch) // 2)
            half = len(batch) // 2
            self._forward(batch[:half])
            self._forward(batch[half:])
            return
        (job,) = batch
        code = ErrorCode.UNAVAILABLE if oom else ErrorCode.INTERNAL
        job.request.fail(RequestError(code, f"denoising step failed: {error}"))
        self._leave(job, "failed")

    def _finish(self, jobs: list[Job]) -> None:
        """Outputs for jobs that left the running set done: one batched call, job by job if it fails."""
        live = [job for job in jobs if not job.request.ended]
        for job in jobs:
            if job.request.ended:
                self._leave(job, "ended", in_running=False)
        if not live:
            return
        error, oom, lost = None, False, None
        try:
            outputs = self.adapter.finish(live)
            if len(outputs) != len(live):
                raise RuntimeError(f"finish returned {len(outputs)} outputs for {len(live)} jobs")
        except Exception as exc:  # noqa: BLE001
            error, oom = f"{type(exc).__name__}: {exc}", is_out_of_memory(exc)
            lost = error if is_device_lost(exc) else None
        if lost is not None:  # these jobs left the running set: answer them here
            for job in live:
                job.request.fail(device_lost_error(lost))
                self._leave(job, "failed", in_running=False)
            raise DeviceLostError(lost)
        if error is not None:
            if oom:
                free_accelerator_memory()
            if len(live) > 1:
                for position, job in enumerate(live):  # one at a time: only a job failing alone fails
                    try:
                        self._finish([job])
                    except DeviceLostError as lost_device:  # the rest left the running set: answer them
                        for rest in live[position + 1 :]:
                            rest.request.fail(device_lost_error(str(lost_device)))
                            self._leave(rest, "failed", in_running=False)
                        raise
                return
            code = ErrorCode.UNAVAILABLE if oom else ErrorCode.INTERNAL
            live[0].request.fail(RequestError(code, f"decoding failed: {error}"))
            self._leave(live[0], "failed", in_running=False)
            return
        for job, output in zip(live, outputs, strict=True):
            self._notify(self.listener.on_finished, job, output)
            self._leave(job, "finished", in_running=False)

    # ---- isolation helpers ----------------------------------------------------------------------
    def _guarded(self, work: Callable[[list[Job]], None], jobs: list[Job], what: str) -> list[Job]:
        """Run batched work; if it raises, run it job by job and fail the jobs that fail alone."""
        try:
            work(jobs)
            return jobs
        except Exception as exc:  # noqa: BLE001
            error, oom, lost = f"{type(exc).__name__}: {exc}", is_out_of_memory(exc), is_device_lost(exc)
        if lost:
            raise DeviceLostError(error)
        if oom:
            free_accelerator_memory()
        if len(jobs) == 1:
            code = ErrorCode.UNAVAILABLE if oom else ErrorCode.INTERNAL
            jobs[0].request.fail(RequestError(code, f"{what} failed: {error}"))
            self._leave(jobs[0], "failed", in_running=False)
            return []
        return [ok for job in jobs for ok in self._guarded(work, [job], what)]

    def _notify(self, callback: Callable[..., None], job: Job, *args: Any) -> None:
        try:
            callback(job, *args)
        except Exception as exc:  # noqa: BLE001  (a listener failure ends this request only)
            log.exception("request %s: %s failed", job.request.request_id, callback.__name__)
            job.request.fail(RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))

    def _leave(self, job: Job, reason: str, in_running: bool = True) -> None:
        if in_running and job in self.running:
            self.running.remove(job)
        self._last_poll.pop(id(job.request), None)
        try:
            self.listener.on_left(job, reason)
        except Exception:  # noqa: BLE001
            log.exception("request %s: on_left failed", job.request.request_id)

    def fail_all(self, error: RequestError) -> None:
        """Answer every running and waiting job's request with ``error`` and forget them."""
        ended = self.running + list(self.waiting)
        self.running, self.waiting = [], deque()
        for job in ended:
            job.request.fail(error)
            self._leave(job, "failed", in_running=False)


class EngineWorker:
    """Runs a :class:`StepEngine` on its own thread, fed by Triton's ``execute()``.

    :meth:`submit` blocks while the running set and the waiting room are full, so the rest stays in
    Triton's queue (where its queue policy applies). Should the loop itself ever raise (a bug), the jobs
    it held are answered with INTERNAL and the loop starts again; the model keeps serving.
    """

    def __init__(
        self,
        engine: StepEngine,
        waiting_room: int,
        name: str = "step-engine",
        on_device_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_device_lost = on_device_lost
        self.capacity = engine.limits.max_running + waiting_room
        self._condition = threading.Condition()
        self._incoming: deque[Job] = deque()
        self._closed = False
        self.restarts = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _in_system(self) -> int:
        return self.engine.active + len(self._incoming)

    def submit(self, jobs: Sequence[Job], timeout_s: float | None = None) -> float:
        """Hand one request's jobs to the engine; blocks while full, at most ``timeout_s`` (then
        UNAVAILABLE). Returns the seconds it waited."""
        started = time.perf_counter()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._condition:
            while self._in_system() and self._in_system() + len(jobs) > self.capacity and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise RequestError(
                        ErrorCode.UNAVAILABLE,
                        f"the model is at capacity: no room for this request within {timeout_s:g} s",
                    )
                self._condition.wait(remaining)
            if self._closed:
                raise RequestError(ErrorCode.UNAVAILABLE, "the model is shutting down")
            self._incoming.extend(jobs)
            self._condition.notify_all()
        return time.perf_counter() - started

    def close(self, timeout_s: float = 30.0) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        import torch

        try:
            while True:
                try:
                    with torch.inference_mode():  # grad mode is per thread
                        self._loop()
                    return
                except DeviceLostError as exc:
                    self._stop_for_device_loss(str(exc))
                    return
                except BaseException as exc:  # noqa: BLE001  (a bug in the loop: answer, restart)
                    log.exception("step engine loop failed; answering what it held and restarting")
                    self.restarts += 1
                    self._fail_held(RequestError(ErrorCode.INTERNAL, f"engine failure: {exc!r}"))
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        return
        finally:
            with self._condition:
                self._closed = True
                self._condition.notify_all()
            self._fail_held(RequestError(ErrorCode.UNAVAILABLE, "the model is shutting down"))

    def _stop_for_device_loss(self, error: str) -> None:
        log.error("step engine: the accelerator failed (%s); answering what it held", error)
        with self._condition:
            self._closed = True  # later submits are refused: nothing can run on this device again
        self._fail_held(device_lost_error(error))
        if self.on_device_lost is not None:
            self.on_device_lost(error)

    def _fail_held(self, error: RequestError) -> None:
        with self._condition:
            self.engine.waiting.extend(self._incoming)
            self._incoming.clear()
            self._condition.notify_all()
        try:
            self.engine.fail_all(error)
        except Exception:  # noqa: BLE001
            log.exception("answering held requests failed")

    def _loop(self) -> None:
        while self._next_round():
            self.engine.step()

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

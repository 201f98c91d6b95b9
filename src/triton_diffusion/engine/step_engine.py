"""Step-level continuous batching, one engine for every model kind, each through a step adapter.

The engine keeps a running set of jobs: an image with its own latents, timesteps and scheduler, or a
diffusion-LM request with its own block schedule. Every engine step (:meth:`StepEngine.step`):

1. admits waiting jobs while the running set has room, when the admission pacing says so (policies.py:
   newcomers to a busy engine join as a cohort); the adapter starts them together (one text encoder
   call for everyone admitted, each image's noise from its own generator);
2. drops jobs whose request has ended (answered elsewhere) and asks running requests whether they were
   cancelled (at most once per ``cancel_poll_s``: each ask is a round trip to the server);
3. lets the scheduling policy (policies.py) pick one group of jobs that can share a forward (same latent
   shape), at most the group's cap;
4. runs one forward for them and each job's own scheduler step (``adapter.step``);
5. hands the jobs that finished to ``adapter.finish`` together (one VAE decode).

and returns a :class:`StepReport` of what happened; it never calls into serving. A job joins at any step
and leaves the moment it is done. Failures stay with the jobs that cause them (one classifier,
failures.py): a failing forward is bisected until the culprit is alone; an out-of-memory forward is split
in halves and the group's cap lowered (a job fails with UNAVAILABLE only if it does not fit alone). A
failed device is not retried: the engine raises :class:`DeviceLostError`. Every request is answered
through its TrackedRequest, exactly once.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from triton_diffusion.engine.failures import (
    DeviceLostError,
    Failure,
    device_lost_error,
    free_accelerator_memory,
)
from triton_diffusion.engine.jobs import Finished, Forward, Job, Left, Stepped, StepReport
from triton_diffusion.engine.policies import AdmissionPacing, SchedulingPolicy, make_policy
from triton_diffusion.errors import ErrorCode, RequestError

log = logging.getLogger("triton_diffusion")

# Full forwards of a group at an out-of-memory-learned cap before the cap is doubled again (at first).
CAP_RECOVERY_FORWARDS = 50


class StepAdapter(Protocol):
    """What a model kind provides to the step engine."""

    def prepare(self, jobs: list[Job]) -> None:
        """Start these jobs, together: set ``state``, ``group`` and ``total_steps``."""

    def model_rows(self, job: Job) -> int:
        """Model rows the job adds to a forward (2 with classifier-free guidance)."""

    def step(self, jobs: list[Job]) -> list[Job]:
        """One shared forward and each job's own scheduler step; returns the jobs that are now done.
        Raising means no job advanced; a failure of one job's own step sets its ``failure`` instead."""

    def snapshot(self, job: Job) -> Any:
        """What the host needs of this job after its step (a preview latent, a finished block), or None."""

    def finish(self, jobs: list[Job]) -> list[Any]:
        """The outputs of done jobs of one group, together (one decode), one per job."""


@dataclass(frozen=True)
class EngineLimits:
    max_running: int  # jobs in the running set
    max_per_forward: int  # jobs per forward
    cap_for: Callable[[Hashable], int] | None = None  # a lower cap for some groups (resolutions)
    cancel_poll_s: float = 0.0  # ask each running request about cancellation at most this often

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_per_forward < 1:
            raise ValueError(f"max_running and max_per_forward must be >= 1, got {self}")


class StepEngine:
    """The running set and one step at a time. Not thread-safe: one thread (the host's) steps it."""

    name = "step"

    def __init__(
        self,
        adapter: StepAdapter,
        limits: EngineLimits,
        policy: SchedulingPolicy | None = None,
        pacing: AdmissionPacing | None = None,
    ):
        self.adapter = adapter
        self.limits = limits
        self.policy = policy or make_policy("oldest")
        self.pacing = pacing or AdmissionPacing()
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.steps = 0  # engine steps so far
        self.forwards = 0  # forwards run
        self.report = StepReport()  # what the step under way did so far
        self.in_flight: list[Job] = []  # being started or decoded: in neither list (the watchdog's view)
        self._arrivals = itertools.count()
        self._learned_caps: dict[Hashable, int] = {}  # lowered after out-of-memory
        self._good_forwards: dict[Hashable, int] = {}  # full forwards at the learned cap since it changed
        self._recovery_wait: dict[Hashable, int] = {}  # full forwards to wait before raising it again
        self._raised_from: dict[Hashable, int] = {}  # groups whose cap was raised and not yet re-proven
        self._last_poll: dict[int, float] = {}  # id(request) -> when it was last asked

    # ---- the running set ------------------------------------------------------------------------
    def add(self, job: Job) -> None:
        job.queued_at = self.steps
        self.waiting.append(job)

    @property
    def active(self) -> int:
        return len(self.waiting) + len(self.running)

    def cap_for(self, group: Hashable) -> int:
        cap = self.limits.max_per_forward
        if self.limits.cap_for is not None:
            cap = min(cap, self.limits.cap_for(group))
        return min(cap, self._learned_caps.get(group, cap))

    def step(self) -> StepReport:
        """Admit, drop what ended, run one forward for the policy's pick, finish what is done."""
        self.report = StepReport()
        self.steps += 1
        self._admit()
        self._drop_ended()
        batch = self.policy.pick(self.running, self.cap_for, self.steps)
        if batch:
            self._forward(list(batch))
        return self.take_report()

    def take_report(self) -> StepReport:
        """The report of the step under way (also of one cut short by a raise), handed over once."""
        report, self.report = self.report, StepReport()
        report.running = len(self.running)
        return report

    def _admit(self) -> None:
        room = self.limits.max_running - len(self.running)
        if not self.waiting or room <= 0:
            return
        sat_out = self.steps - 1 - self.waiting[0].queued_at  # engine steps the oldest waited through
        if not self.pacing.due(len(self.running), room, sat_out):
            return
        admitted: list[Job] = []
        while self.waiting and len(self.running) + len(admitted) < self.limits.max_running:
            job = self.waiting.popleft()
            if job.request.ended:
                self._leave(job, "ended")
                continue
            admitted.append(job)
        if not admitted:
            return
        self.in_flight = admitted
        try:
            prepared = self._guarded(self.adapter.prepare, admitted, "preparing")
        except DeviceLostError:
            # Still held (those not failed alone already): answered by whoever stops the engine.
            self.waiting.extendleft(reversed([job for job in admitted if not job.request.ended]))
            raise
        for job in prepared:
            job.arrival = next(self._arrivals)
            job.waited_since = self.steps
            job.request.start()
            self.running.append(job)
            self.report.admitted.append(job)
        self.in_flight = []

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
        failure: Failure | None = None
        try:
            done = self.adapter.step(batch)
        except Exception as exc:  # noqa: BLE001  (isolate: bisect or split, never fatal)
            # Only text leaves the handler, so the failed forward's activations are freed before a retry.
            failure = Failure.of(exc)
        if failure is not None:
            if failure.lost:
                raise DeviceLostError(failure.text)
            self._retry(batch, failure)
            return
        self.forwards += 1
        self._relax_learned_cap(batch[0].group, len(batch))
        model_rows = sum(self.adapter.model_rows(job) for job in batch)
        for job in batch:
            if job.first_forward is None:
                job.first_forward = self.forwards
            job.forwards += 1
            job.most_shared = max(job.most_shared, len(batch))
            job.waited_since = self.steps
            if job.failure is not None:
                self._fail(job, RequestError(ErrorCode.INTERNAL, f"denoising step failed: {job.failure}"))
                continue
            job.steps_done += 1
            self.report.stepped.append(
                Stepped(job, job.steps_done, job.total_steps, self.adapter.snapshot(job))
            )
        finished = [job for job in done if job in self.running]
        for job in finished:
            self.running.remove(job)
        adapters = self.adapter.distinct_adapters(batch) if hasattr(self.adapter, "distinct_adapters") else 0
        self.report.forwards.append(Forward(len(batch), model_rows, time.perf_counter() - started, adapters))
        if finished:
            self.in_flight = finished
            self._finish(finished)
            self.in_flight = []

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

    def _retry(self, batch: list[Job], failure: Failure) -> None:
        log.warning("forward of %d job(s) failed: %s", len(batch), failure.text)
        if failure.oom:
            free_accelerator_memory()
        if len(batch) > 1:
            if failure.oom:
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
        self._fail(batch[0], failure.request_error("denoising step"))

    def _finish(self, jobs: list[Job]) -> None:
        """Outputs for jobs that left the running set done: one batched call, job by job if it fails."""
        live = [job for job in jobs if not job.request.ended]
        for job in jobs:
            if job.request.ended:
                self._leave(job, "ended")
        if not live:
            return
        failure: Failure | None = None
        try:
            outputs = self.adapter.finish(live)
            if len(outputs) != len(live):
                raise RuntimeError(f"finish returned {len(outputs)} outputs for {len(live)} jobs")
        except Exception as exc:  # noqa: BLE001
            failure = Failure.of(exc)
        if failure is not None and failure.lost:  # these jobs left the running set: answer them here
            for job in live:
                self._fail(job, failure.request_error("decoding"))
            raise DeviceLostError(failure.text)
        if failure is not None:
            if failure.oom:
                free_accelerator_memory()
            if len(live) > 1:
                for position, job in enumerate(live):  # one at a time: only a job failing alone fails
                    try:
                        self._finish([job])
                    except DeviceLostError as lost_device:  # the rest left the running set: answer them
                        for rest in live[position + 1 :]:
                            self._fail(rest, device_lost_error(str(lost_device)))
                        raise
                return
            self._fail(live[0], failure.request_error("decoding"))
            return
        for job, output in zip(live, outputs, strict=True):
            self.report.finished.append(Finished(job, output))
            self._leave(job, "finished")

    # ---- isolation helpers ----------------------------------------------------------------------
    def _guarded(self, work: Callable[[list[Job]], None], jobs: list[Job], what: str) -> list[Job]:
        """Run batched work; if it raises, run it job by job and fail the jobs that fail alone."""
        try:
            work(jobs)
            return jobs
        except Exception as exc:  # noqa: BLE001
            failure = Failure.of(exc)
        if failure.lost:
            raise DeviceLostError(failure.text)
        if failure.oom:
            free_accelerator_memory()
        if len(jobs) == 1:
            self._fail(jobs[0], failure.request_error(what))
            return []
        return [ok for job in jobs for ok in self._guarded(work, [job], what)]

    def _fail(self, job: Job, error: RequestError) -> None:
        job.request.fail(error)
        self._leave(job, "failed", error)

    def _leave(self, job: Job, reason: str, error: RequestError | None = None) -> None:
        if job in self.running:
            self.running.remove(job)
        self._last_poll.pop(id(job.request), None)
        self.report.left.append(Left(job, reason, error))

    def fail_all(self, error: RequestError) -> StepReport:
        """Answer every running and waiting job's request with ``error`` and forget them."""
        ended = self.running + list(self.waiting)
        self.running, self.waiting = [], deque()
        for job in ended:
            self._fail(job, error)
        return self.take_report()

"""Step-level continuous batching, one engine for every model kind, each through a step adapter.

The engine core, as vLLM v1 draws it: each engine step (:meth:`StepEngine.step`) is

1. ``scheduler.schedule()`` (scheduler.py): who leaves (cancelled, ended, refused or expired for a
   deadline), who is admitted, who is paused for a higher tier and who resumes;
2. ``adapter.prepare(admitted)``: the newcomers started together (one text encoder call for everyone
   admitted, each image's noise from its own generator), each :class:`JobStart` applied to its job;
3. ``scheduler.next_forward()``: one group of running jobs that can share a forward, in order;
4. ``adapter.step(jobs)``: one forward for them and each job's own scheduler step, returning a
   :class:`JobStep` per job (advanced, done, failed with what, rows computed or reused, a snapshot),
   which the engine applies to the job;
5. ``adapter.finish(done)``: the jobs that took their last step decoded together (one VAE decode).

It returns a :class:`StepReport` of what happened; it never answers a request itself. A request whose
job fails is ended here (``TrackedRequest.end``) and its error goes out from the serving host's response
thread with every other answer, in the order decided. Failures stay with the jobs that cause them
(``failures.isolate``): a failing forward, start or decode is bisected until the culprit is alone; an
out-of-memory forward is split and the group's cap lowered (a job fails with UNAVAILABLE only if it does
not fit alone). A failed device is not retried: the engine raises :class:`DeviceLostError`, and whoever
runs it answers what it holds (:meth:`fail_all`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from triton_diffusion.engine.cancellation import CancellationPolls
from triton_diffusion.engine.estimates import WorkTimes
from triton_diffusion.engine.failures import DeviceLostError, Failure, device_lost_error, isolate
from triton_diffusion.engine.jobs import (
    Finished,
    Forward,
    ForwardResult,
    Job,
    JobStart,
    Left,
    Stepped,
    StepReport,
)
from triton_diffusion.engine.ordering import AdmissionPacing, Policy, Service
from triton_diffusion.engine.scheduler import EngineLimits, Scheduler
from triton_diffusion.errors import ErrorCode, RequestError

log = logging.getLogger("triton_diffusion")


class StepAdapter(Protocol):
    """What a model kind provides to the step engine (the latent families through
    adapters/latent_loop.py, the diffusion LM through adapters/diffusion_lm_adapter.py)."""

    def prepare(self, jobs: list[Job]) -> list[JobStart]:
        """Start these jobs, together: each one's state, group and denoising steps, in order."""

    def step(self, jobs: list[Job], previews: Sequence[bool] | None = None) -> ForwardResult:
        """One shared forward and each job's own step. ``previews[i]``: the host wants job i's snapshot for
        a preview after this step (a family may add snapshots of its own: the LM's finished blocks).
        Raising means no job advanced (the engine retries smaller); a failure of one job's own step is
        that job's JobStep ``error``."""

    def finish(self, jobs: list[Job]) -> list[Any]:
        """The outputs of done jobs of one group, together (one decode), one per job."""


class StepEngine:
    """The running set and one step at a time. One thread (the host's engine thread) steps it; jobs may
    be added from any thread."""

    def __init__(
        self,
        adapter: StepAdapter,
        limits: EngineLimits,
        policy: Policy | None = None,
        pacing: AdmissionPacing | None = None,
        service: Service | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.adapter = adapter
        self.limits = limits
        self.times = WorkTimes()
        self.scheduler = Scheduler(limits, policy, pacing, service, self.times, clock)
        self.polls = CancellationPolls(limits.cancel_poll_s)
        self.steps = 0  # engine steps so far
        self.forwards = 0  # forwards run
        self.report = StepReport()  # what the step under way did so far

    # ---- any thread -------------------------------------------------------------------------------
    def add(self, job: Job) -> None:
        self.scheduler.add(job)

    @property
    def active(self) -> int:
        return self.scheduler.active

    def outranks_held(self, tier: int) -> bool:
        return self.scheduler.outranks_held(tier)

    # ---- the engine thread --------------------------------------------------------------------------
    def cap_for(self, group: Any) -> int:
        return self.scheduler.caps.cap_for(group)

    def step(self) -> StepReport:
        """Schedule, start the admitted, run one forward for the next group, finish what is done."""
        self.report = StepReport()
        self.steps += 1
        scheduler = self.scheduler
        held = scheduler.running + scheduler.paused + scheduler.waiting  # a waiting client may leave too
        self.polls.end_cancelled(
            (job.request, f"after step {job.steps_done}/{job.total_steps or job.planned_steps}")
            for job in held
        )
        plan = scheduler.schedule(self.steps)
        for left in plan.leave:  # the scheduler ended the refused and expired ones
            self._leave(left.job, left.reason, left.error)
        self.report.paused.extend(plan.pause)
        self.report.resumed.extend(plan.resume)
        if plan.admit:
            self._start(plan.admit)
        batch = scheduler.next_forward()
        if batch:
            self._forward(batch)
        return self.take_report()

    def take_report(self) -> StepReport:
        """The report of the step under way (also of one cut short by a raise), handed over once."""
        report, self.report = self.report, StepReport()
        report.running = len(self.scheduler.running)
        report.paused_now = len(self.scheduler.paused)
        report.held = self.scheduler.active
        return report

    def fail_all(self, error: RequestError) -> StepReport:
        """End every job held (waiting, running, paused, ...) with ``error`` and forget them."""
        for job in self.scheduler.take_all():
            self._fail(job, error)
        return self.take_report()

    # ---- the steps ------------------------------------------------------------------------------------
    def _start(self, jobs: list[Job]) -> None:
        started = time.perf_counter()

        def work(part: list[Job]) -> list[JobStart]:
            starts = self.adapter.prepare(part)
            if len(starts) != len(part):
                raise RuntimeError(f"prepare returned {len(starts)} starts for {len(part)} jobs")
            return starts

        def done(part: list[Job], starts: list[JobStart]) -> None:
            for job, start in zip(part, starts, strict=True):
                job.begin(start)
                job.request.start()
            self.scheduler.started(part)
            self.report.admitted.extend(part)

        def fail(part: list[Job], failure: Failure) -> None:
            for job in part:
                self._fail(job, failure.request_error("preparing"))

        try:
            isolate(work, jobs, done=done, fail=fail)
        except DeviceLostError:
            # Those not answered yet are held again, and answered by whoever stops the engine.
            self.scheduler.put_back(jobs)
            raise
        self.times.started(len(jobs), time.perf_counter() - started)

    def _forward(self, batch: list[Job]) -> None:
        group = batch[0].group

        def work(part: list[Job]) -> tuple[ForwardResult, float]:
            started = time.perf_counter()
            result = self.adapter.step(part, [job.preview_due(job.steps_done + 1) for job in part])
            if len(result.steps) != len(part):
                raise RuntimeError(f"step returned {len(result.steps)} results for {len(part)} jobs")
            return result, time.perf_counter() - started

        def failed(part: list[Job], failure: Failure) -> None:
            log.warning("forward of %d job(s) failed: %s", len(part), failure.text)
            if failure.oom:
                self.scheduler.caps.out_of_memory(group, len(part))

        def fail(part: list[Job], failure: Failure) -> None:
            for job in part:
                self._fail(job, failure.request_error("denoising step"))

        isolate(work, batch, done=lambda part, ran: self._apply(part, *ran), fail=fail, failed=failed)

    def _apply(self, jobs: list[Job], result: ForwardResult, seconds: float) -> None:
        """One forward's per-job results, applied: counters, reports, failures, the jobs now done."""
        self.forwards += 1
        self.scheduler.caps.ran(jobs[0].group, len(jobs))
        self.times.forward_ran(len(jobs), seconds, jobs[0].group)
        self.scheduler.stepped(jobs)
        done, reused = [], 0
        for job, out in zip(jobs, result.steps, strict=True):
            if job.first_forward is None:
                job.first_forward = self.forwards
            job.forwards += 1
            job.most_shared = max(job.most_shared, len(jobs))
            if out.error is not None:
                self._fail(job, RequestError(ErrorCode.INTERNAL, f"denoising step failed: {out.error}"))
                continue
            job.steps_done = out.step
            job.rows_computed += out.rows_computed
            job.rows_reused += out.rows_reused
            reused += out.rows_reused
            stepped = Stepped(
                job, out.step, job.total_steps, out.snapshot, out.rows_computed, out.rows_reused
            )
            self.report.stepped.append(stepped)
            if out.done:
                done.append(job)
        self.report.forwards.append(Forward(len(jobs), result.rows, seconds, result.adapters, reused))
        if done:
            self.scheduler.done(done)
            self._finish(done)

    def _finish(self, jobs: list[Job]) -> None:
        """Outputs for jobs that took their last step: one batched call, split if it fails."""
        live = [job for job in jobs if not job.request.ended]
        for job in jobs:
            if job.request.ended:
                self._leave(job, "ended")
        if not live:
            return
        started = time.perf_counter()

        def work(part: list[Job]) -> list[Any]:
            outputs = self.adapter.finish(part)
            if len(outputs) != len(part):
                raise RuntimeError(f"finish returned {len(outputs)} outputs for {len(part)} jobs")
            return outputs

        def done(part: list[Job], outputs: list[Any]) -> None:
            for job, output in zip(part, outputs, strict=True):
                self.report.finished.append(Finished(job, output))
                self._leave(job, "finished")

        def fail(part: list[Job], failure: Failure) -> None:
            for job in part:
                self._fail(job, failure.request_error("decoding"))

        try:
            isolate(work, live, done=done, fail=fail)
        except DeviceLostError as lost:  # these left the running set: answer those not answered yet
            for job in live:
                if job in self.scheduler.finishing:
                    self._fail(job, device_lost_error(str(lost)))
            raise
        self.times.finished(len(live), time.perf_counter() - started)

    # ---- leaving ------------------------------------------------------------------------------------
    def _fail(self, job: Job, error: RequestError) -> None:
        job.request.end(error)
        self._leave(job, "failed", error)

    def _leave(self, job: Job, reason: str, error: RequestError | None = None) -> None:
        self.scheduler.remove(job)
        self.polls.forget(job.request)
        self.report.left.append(Left(job, reason, error))

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

With ``checkpoint_every`` set, a job that has a checkpoint key and just completed a multiple of that many
denoising steps (not its last) is handed to ``adapter.checkpoint`` after its forward: the adapter's CPU
copy of its state goes out in the report's ``checkpoints``, and the host stores it (the engine does no
I/O). A checkpoint that fails costs only itself: the job steps on.

It returns a :class:`StepReport` of what happened; it never answers a request, nor calls a method of one
(engine/request_status.py): cancellations come in as aborts the host's worker hands over before each step
(:meth:`StepEngine.abort`), a request's error is decided on the engine's own record of it, and both
leave in the report's ``left`` for the host to answer, in the order decided. The scheduler is the one
writer of job state (``started``, ``update``, ``end``). Failures stay with the jobs that cause them
(``failures.isolate``): a failing forward, start or decode is bisected until the culprit is alone; an
out-of-memory forward is split and the group's caps (jobs, tokens) lowered (a job fails with UNAVAILABLE
only if it does not fit alone). A failed device is not retried: the engine raises
:class:`DeviceLostError`, and whoever runs it answers what it holds (:meth:`fail_all`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol, cast, runtime_checkable

from triton_diffusion.engine.estimates import WorkTimes
from triton_diffusion.engine.failures import DeviceLostError, Failure, device_lost_error, isolate
from triton_diffusion.engine.jobs import (
    Computed,
    Finished,
    Forward,
    ForwardResult,
    Job,
    JobStart,
    Left,
    Packing,
    StepReport,
    forward_group,
    rows_and_tokens,
)
from triton_diffusion.engine.ordering import AdmissionPacing, Policy, Service
from triton_diffusion.engine.request_status import Abort, Request
from triton_diffusion.engine.scheduler import EngineLimits, Scheduler
from triton_diffusion.engine.stopwatch import Stopwatch
from triton_diffusion.errors import RequestError

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

    def finish(self, jobs: list[Job]) -> Sequence[object]:
        """The outputs of done jobs of one group, together (one decode), one per job."""


@runtime_checkable
class CountsComputed(Protocol):
    """What a step adapter adds whose forwards pad rows (a family that packs sizes: adapters/packed_rows.py):
    the size of a forward of these jobs, which the scheduler has no geometry to compute."""

    def computed(self, jobs: Sequence[Job]) -> tuple[int, int]:
        """The denoiser rows and the tokens a forward of these jobs computes, padding included."""


@runtime_checkable
class OnDevice(Protocol):
    """What a step adapter adds whose model is on a device (a torch device, or its name): the engine's
    stopwatch times its work there (engine/stopwatch.py)."""

    device: object


def computed_by(adapter: object) -> Computed:
    """A forward's rows and tokens as the adapter counts them, else a row per job and their own tokens."""
    return adapter.computed if isinstance(adapter, CountsComputed) else rows_and_tokens


class Checkpointing(Protocol):
    """What a step adapter adds to take checkpoints (adapters/starts.py for the latent families)."""

    def checkpoint(self, jobs: list[Job]) -> Sequence[object]:
        """Each job's resumable state now (CPU copies), or None for a job that cannot be checkpointed
        exactly (it would restart from its first step on resume), in order."""


class StepCaching(Protocol):
    """What a step adapter adds to give a running job a step cache for its steps left (the latent
    families whose denoiser serves one: adapters/latent_loop.py); the scheduler decides which
    (engine/degradation.py)."""

    def start_caches(self, jobs: list[Job]) -> list[str | None]:
        """Turn on each job's ``queue.cache_given`` from its next step (a fresh cache state); per job,
        None, or why it could not (it runs on without one)."""


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
        checkpoint_every: int = 0,
        times: WorkTimes | None = None,
        stopwatch: Stopwatch | None = None,
    ):
        self.adapter = adapter
        # What the cost model learns from: the device's seconds (a GPU's forward returns once queued).
        self.stopwatch = stopwatch or Stopwatch.on(adapter.device if isinstance(adapter, OnDevice) else None)
        # Denoising steps between two checkpoints of a job with a checkpoint key (0: none are taken); the
        # adapter must then be Checkpointing.
        self.checkpoint_every = checkpoint_every
        self.limits = limits
        self.times = times or WorkTimes()  # a calibration's at load (models/calibration.py), or none yet
        self.scheduler = Scheduler(limits, policy, pacing, service, self.times, clock, computed_by(adapter))
        self.steps = 0  # engine steps so far
        self.forwards = 0  # forwards run
        self.spans = 0  # forwards that returned, each timed: Forward.span
        self.report = StepReport()  # what the step under way did so far

    # ---- any thread -------------------------------------------------------------------------------
    def add(self, *jobs: Job) -> None:
        """Jobs, from any thread (a request's together)."""
        self.scheduler.add(*jobs)

    @property
    def active(self) -> int:
        return self.scheduler.active

    @property
    def with_deadline(self) -> int:
        return self.scheduler.with_deadline

    def outranks_held(self, tier: int) -> bool:
        return self.scheduler.outranks_held(tier)

    # ---- the engine thread --------------------------------------------------------------------------
    def held_requests(self) -> list[Request]:
        """The requests an abort may name now (held, not ended)."""
        return self.scheduler.held_requests()

    def abort(self, aborts: list[Abort]) -> None:
        """Drop these requests (cancelled, or answered by the host): their jobs leave at the next step."""
        self.scheduler.abort(aborts)

    def late_jobs(self, seconds: float) -> list[Job]:
        """The jobs held that the estimate says cannot be done within ``seconds`` (a drain: the host
        checkpoints and answers them; the others go on)."""
        return self.scheduler.late_jobs(seconds)

    def checkpoint_now(self, jobs: list[Job]) -> list[object]:
        """Each job's checkpoint now (the adapter's CPU copy, as ``checkpoint_every`` takes them), in
        order; None for a job that has none: no checkpoint key, checkpoints off, not started or done, one
        the adapter cannot checkpoint exactly (a step cache), or a checkpoint that failed. Only data comes
        back: the host stores it (a drain)."""
        due = [
            job
            for job in jobs
            if self.checkpoint_every
            and job.spec.checkpoint_key is not None
            and job.queue.cut is None  # a cut job's shorter schedule would not fit its request's resend
            and job.state is not None
            and 0 < job.run.steps_done < job.run.total_steps
        ]
        taken = dict(zip(map(id, due), self._take_checkpoints(due) or [], strict=False))
        return [taken.get(id(job)) for job in jobs]

    def step(self) -> StepReport:
        """Schedule, start the admitted, run one forward for the next group, finish what is done."""
        self.report = StepReport()
        self.steps += 1
        self.stopwatch.settle()  # the spans the device has passed, before the scheduler prices by them
        scheduler = self.scheduler
        plan = scheduler.schedule(self.steps)
        for left in plan.leave:  # aborted, ended, refused and expired: decided by the scheduler
            self._leave(left.job, left.reason, left.error)
        self.report.paused.extend(plan.pause)
        if plan.cache:  # the scheduler gave them their step cache (a deadline needs it): from this step on
            self._start_caches(plan.cache)
        if plan.admit:
            self._start(plan.admit)
        batch = scheduler.next_forward()
        if batch:
            self._forward(batch, scheduler.packing, scheduler.narrowed)
        self.stopwatch.settle()  # what a decode waited for is passed: the cost model has it while idle
        return self.take_report()

    def settle(self) -> StepReport:
        """Wait for the device to pass every forward, start and decode timed so far, and hand over the
        report they were recorded in (its ``timed``): a benchmark's end, never the serving loop."""
        self.stopwatch.settle(wait=True)
        return self.take_report()

    def take_report(self) -> StepReport:
        """The report of the step under way (also of one cut short by a raise), handed over once."""
        report, self.report = self.report, StepReport()
        report.running = len(self.scheduler.running)
        report.paused_now = len(self.scheduler.paused)
        return report

    def fail_all(self, error: RequestError) -> StepReport:
        """End every job held (waiting, running, paused, ...) with ``error`` and forget them."""
        for job in self.scheduler.take_all():
            self._fail(job, error)
        return self.take_report()

    # ---- the steps ------------------------------------------------------------------------------------
    def _start(self, jobs: list[Job]) -> None:
        started = self.stopwatch.start()

        def work(part: list[Job]) -> list[JobStart]:
            starts = self.adapter.prepare(part)
            if len(starts) != len(part):
                raise RuntimeError(f"prepare returned {len(starts)} starts for {len(part)} jobs")
            return starts

        def done(part: list[Job], starts: list[JobStart]) -> None:
            self.scheduler.started(part, starts)
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
        self.stopwatch.stop(started, lambda seconds: self.times.started(len(jobs), seconds))

    def _start_caches(self, jobs: list[Job]) -> None:
        """The adapter turns the given caches on; a job it could not give one (or all of them, where it
        raised) runs on without, and the scheduler forgets the decision."""
        try:
            why = cast(StepCaching, self.adapter).start_caches(jobs)
        except Exception as exc:  # a bug: these jobs go on as they were, the others are untouched
            why = [f"{type(exc).__name__}: {exc}"] * len(jobs)
        refused = [(job, reason) for job, reason in zip(jobs, why, strict=True) if reason is not None]
        if refused:
            self.scheduler.caches_refused(refused)

    def _forward(self, batch: list[Job], packing: Packing | None = None, narrowed: int = 0) -> None:
        group = forward_group(batch)

        def work(part: list[Job]) -> tuple[ForwardResult, float, int]:
            started = self.stopwatch.start()
            result = self.adapter.step(part, [job.preview_due(job.run.steps_done + 1) for job in part])
            if len(result.steps) != len(part):
                raise RuntimeError(f"step returned {len(result.steps)} results for {len(part)} jobs")
            # What it computed, padding included (a packed forward's): what its seconds are the cost of.
            computed, rows = sum(job.spec.tokens for job in part) + result.padded_tokens, result.rows
            self.spans += 1
            span = self.spans

            packed = result.padded_tokens > 0  # sizes on one padded grid (a DiT's size bins pad nothing)

            def timed(seconds: float) -> None:
                self.times.forward_ran(len(part), computed, seconds, rows, packed)
                self.report.timed.append((span, seconds))

            return result, self.stopwatch.stop(started, timed), span

        def failed(part: list[Job], failure: Failure) -> None:
            log.warning("forward of %d job(s) failed: %s", len(part), failure.text)
            if failure.oom:
                self.scheduler.caps.out_of_memory(group, len(part), self.scheduler.computed(part)[1])

        def fail(part: list[Job], failure: Failure) -> None:
            for job in part:
                self._fail(job, failure.request_error("denoising step"))

        def done(part: list[Job], ran: tuple[ForwardResult, float, int]) -> None:
            nonlocal packing, narrowed
            self._apply(part, *ran, packing, narrowed)
            packing, narrowed = None, 0  # decided once a forward: the parts of a split one report it once

        isolate(work, batch, done=done, fail=fail, failed=failed)

    def _apply(
        self,
        jobs: list[Job],
        result: ForwardResult,
        seconds: float,
        span: int,
        packing: Packing | None = None,
        narrowed: int = 0,
    ) -> None:
        """One forward's per-job results, applied by the scheduler, then reported; the done decoded."""
        self.forwards += 1
        tokens = sum(job.spec.tokens for job in jobs)
        outcome = self.scheduler.update(jobs, result, self.forwards)
        for job, error in outcome.failed:
            self._fail(job, error)
        self.report.stepped.extend(outcome.stepped)
        forward = Forward(
            len(jobs),
            result.rows,
            seconds,
            result.adapters,
            outcome.rows_reused,
            tokens=tokens,
            padded_tokens=result.padded_tokens,
            packing=packing,
            narrowed=narrowed,
            span=span,
        )
        self.report.forwards.append(forward)
        if self.checkpoint_every:
            self._checkpoint([stepped.job for stepped in outcome.stepped])
        if outcome.done:
            self._finish(outcome.done)

    def _checkpoint(self, stepped: list[Job]) -> None:
        """Checkpoints of the jobs just stepped that are due one: a checkpoint key, a multiple of
        ``checkpoint_every`` steps done, not done (a done job's answer is near), not ended."""
        every = self.checkpoint_every
        due = [
            job
            for job in stepped
            if job.spec.checkpoint_key is not None
            and job.queue.cut is None
            and 0 < job.run.steps_done < job.run.total_steps
            and job.run.steps_done % every == 0
            and not job.status.ended
        ]
        taken = self._take_checkpoints(due)
        if taken is None:
            return
        self.report.checkpoints.extend(
            (job, checkpoint) for job, checkpoint in zip(due, taken, strict=True) if checkpoint is not None
        )

    def _take_checkpoints(self, due: list[Job]) -> Sequence[object] | None:
        """The adapter's checkpoints of ``due``, in order; None when there are none or they failed (a
        failed device raises)."""
        if not due:
            return None
        adapter = cast(Checkpointing, self.adapter)  # checkpoint_every is set for one that is
        try:
            taken = adapter.checkpoint(due)
            if len(taken) != len(due):
                raise RuntimeError(f"checkpoint returned {len(taken)} checkpoints for {len(due)} jobs")
        except Exception as exc:  # noqa: BLE001  (a checkpoint is an extra: the jobs step on without it)
            failure = Failure.of(exc)
            if failure.lost:
                raise DeviceLostError(failure.text) from exc
            log.warning("checkpoint of %d job(s) failed: %s", len(due), failure.text)
            return None
        return taken

    def _finish(self, jobs: list[Job]) -> None:
        """Outputs for jobs that took their last step: one batched call, split if it fails."""
        live = [job for job in jobs if not job.status.ended]
        for job in jobs:
            if job.status.ended:
                self._leave(job, "ended")
        if not live:
            return
        started = self.stopwatch.start()

        def work(part: list[Job]) -> Sequence[object]:
            outputs = self.adapter.finish(part)
            if len(outputs) != len(part):
                raise RuntimeError(f"finish returned {len(outputs)} outputs for {len(part)} jobs")
            return outputs

        def done(part: list[Job], outputs: Sequence[object]) -> None:
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
        self.stopwatch.stop(started, lambda seconds: self.times.finished(len(live), seconds))

    # ---- leaving ------------------------------------------------------------------------------------
    def _fail(self, job: Job, error: RequestError) -> None:
        self.scheduler.end(job, error)
        decided = job.status.error or error  # an end decided before (a cancel) stands
        self._leave(job, "cancelled" if job.status.cancelled else "failed", decided)

    def _leave(self, job: Job, reason: str, error: RequestError | None = None) -> None:
        self.scheduler.remove(job)
        self.report.left.append(Left(job, reason, error))

"""The request-level engine: one fused diffusers call per compatible group, for pipelines without a step
adapter.

Each engine step takes every job waiting (one per image), plans the fused calls (planner.py: grouped by
compatibility key, capped in images, oldest first) and runs them (executor.py: bisection and out-of-memory
splits, so only a request that fails alone gets an error). Before each call and between two denoising
steps of a call, :class:`CallSteps` takes the aborts of the call's requests from the host's
:class:`AbortSource`, and hands the host a :class:`StepReport` of the step (progress, preview snapshots,
cancelled jobs) through ``on_progress``, so progress and cancellation work as on the step engine. The
step itself returns a report with the finished images and the jobs that failed. Like the step engine it
never answers a request nor calls one: it decides a request's error on its own record
(engine/request_status.py) and reports it; the host delivers it.

Draining (recovery/drain.py, on SIGTERM) on this engine: it has no checkpoints, so the host refuses new
requests UNAVAILABLE "draining", lets the engine step under way (its fused calls) finish, and answers the
jobs still waiting for a call UNAVAILABLE "draining" too (:meth:`RequestEngine.late_jobs`): their clients
resend them, from the start, after the restart or to another replica.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol, cast

from triton_diffusion.compatibility import CompatibilityKey
from triton_diffusion.engine.executor import CallRecord, CallReport, FusedCallExecutor
from triton_diffusion.engine.jobs import Finished, Job, Left, Stepped, StepReport
from triton_diffusion.engine.planner import PlannedRequest, Row, RowCaps, plan_groups
from triton_diffusion.engine.request_status import (
    Abort,
    AbortSource,
    NoAborts,
    Request,
    RequestStatus,
    RequestTable,
    apply_aborts,
    take_aborts,
)
from triton_diffusion.errors import ErrorCode, RequestError

log = logging.getLogger("triton_diffusion")


class CallAbandoned(Exception):
    """Raised from a pipeline's step callback when every row of its call has ended: the pipeline stops at
    once, without its remaining steps and without the VAE decode."""


class CallSteps:
    """The jobs of one running fused call, in tensor order, and what happens between two steps.

    The pipeline's step callback calls :meth:`on_step` after every denoising step: the aborts of the call's
    requests are taken (a cancelled one is ended at once), the jobs still running are reported
    as stepped (with a preview snapshot where due), and the positions of jobs whose request has ended are
    returned. The caller drops those rows (:meth:`compact`) where its loop allows it, or keeps computing
    them otherwise.
    """

    def __init__(
        self,
        jobs: list[Job],
        on_progress: Callable[[StepReport], None],
        left: set[int] | None = None,
        aborts: AbortSource | None = None,
    ) -> None:
        self.jobs = list(jobs)
        self.alive = list(jobs)
        self._on_progress = on_progress
        self._aborts = aborts or NoAborts()
        self._reported = left if left is not None else set()  # id() of jobs reported as left

    def on_step(self, step: int, total: int, snapshot: Callable[[int], object] | None = None) -> list[int]:
        report = StepReport(running=len(self.alive))
        take_aborts(self.alive, self._aborts, f"after step {step}/{total}")
        for position, job in enumerate(self.alive):
            status = job.status
            if status.ended:
                if id(job) not in self._reported:
                    self._reported.add(id(job))
                    reason = "cancelled" if status.cancelled else "ended"
                    report.left.append(Left(job, reason, status.error))
                continue
            job.reached(step, total)
            preview = snapshot(position) if snapshot is not None and job.preview_due(step) else None
            report.stepped.append(Stepped(job, step, total, preview))
        self._on_progress(report)
        return [p for p, job in enumerate(self.alive) if job.status.ended]

    def all_ended(self, ended_positions: list[int]) -> bool:
        return len(ended_positions) == len(self.alive)

    def compact(self, positions: list[int], after_step: int) -> None:
        drop = set(positions)
        self.alive = [job for position, job in enumerate(self.alive) if position not in drop]
        log.info(
            "compacted fused call after step %d: dropped %d row(s), %d go on",
            after_step,
            len(drop),
            len(self.alive),
        )

    def scatter(self, outputs: Sequence[object]) -> list[object]:
        """Outputs for the alive jobs, placed back in the call's order (None for dropped jobs)."""
        by_job = {id(job): output for job, output in zip(self.alive, outputs, strict=True)}
        return [by_job.get(id(job)) for job in self.jobs]


class PipelineCall(Protocol):
    """What a model kind provides to the request-level engine: one fused pipeline call over jobs of one
    compatibility key, one output per job in order (``steps.scatter`` helps)."""

    def __call__(self, key: CompatibilityKey, jobs: list[Job], steps: CallSteps) -> list[object]: ...


class RequestEngine:
    """Waiting jobs, planned and run as fused calls. One thread (the host's engine thread) steps it; jobs
    may be added from any thread. A job's ``group`` is its request's compatibility key."""

    def __init__(
        self,
        call: PipelineCall,
        caps: RowCaps,
        on_progress: Callable[[StepReport], None],
        aborts: AbortSource | None = None,
    ) -> None:
        self.call = call
        self.caps = caps
        self.on_progress = on_progress
        self.aborts = aborts or NoAborts()
        self.report = StepReport()
        self.requests = RequestTable()  # the engine's record of each request held
        self.executor = FusedCallExecutor(self._run_rows, self._end, self._on_call, self._before_call)
        self._waiting: list[Job] = []
        self._lock = threading.Lock()
        self._jobs: dict[tuple[int, int], Job] = {}  # (request index, image index) -> job, this step
        self._by_index: list[list[Job]] = []  # the jobs of each request of this step, by its index
        self._left: set[int] = set()  # jobs reported as left this step

    def add(self, *jobs: Job) -> None:
        """Jobs, from any thread (a request's together)."""
        self.requests.attach(*jobs)
        with self._lock:
            self._waiting.extend(jobs)

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._waiting) + len(self._jobs)

    @property
    def with_deadline(self) -> int:
        """No room for deadlines on this engine (the host gives it ``deadline_room`` 0): none counted."""
        return 0

    def outranks_held(self, tier: int) -> bool:
        """Fused calls are not paused: a higher tier waits for room like any request."""
        return False

    def held_requests(self) -> list[Request]:
        """None: this engine asks its AbortSource itself, before each call and between its steps."""
        return []

    def abort(self, aborts: list[Abort]) -> None:
        with self._lock:
            waiting = list(self._waiting)
        apply_aborts(waiting, aborts)

    def late_jobs(self, seconds: float) -> list[Job]:
        """A drain: every job waiting for a fused call (not ended). This engine has no checkpoints and no
        estimates: the fused call under way (the engine thread is between two steps when the host asks,
        so none) finishes, and a job waiting would start another, so the host answers each of them
        UNAVAILABLE "draining" (its client resends it after the restart, or to another replica)."""
        with self._lock:
            return [job for job in self._waiting if not job.status.ended]

    @staticmethod
    def checkpoint_now(jobs: list[Job]) -> list[object]:
        """No checkpoints here (a fused call's state is the pipeline's): None for each job."""
        return [None] * len(jobs)

    def take_report(self) -> StepReport:
        report, self.report = self.report, StepReport()
        report.running = len(self._jobs)
        return report

    def step(self) -> StepReport:
        """Plan every waiting job into fused calls and run them."""
        self.report = StepReport()
        with self._lock:
            waiting, self._waiting = self._waiting, []
        by_request: dict[int, list[Job]] = {}
        requests: dict[int, RequestStatus] = {}
        for job in waiting:
            if job.status.ended:
                self._gone(job, "cancelled" if job.status.cancelled else "ended", job.status.error)
                continue
            key = id(job.request)
            if key not in by_request:
                requests[len(requests)] = job.status
                by_request[key] = []
            by_request[key].append(job)
        self._by_index = list(by_request.values())
        self._left = set()
        with self._lock:
            self._jobs = {(i, job.spec.index): job for i, jobs in enumerate(self._by_index) for job in jobs}
        self.report.admitted.extend(self._jobs.values())
        try:
            planned = [  # a job's group here is its request's compatibility key
                PlannedRequest(i, cast(CompatibilityKey, jobs[0].run.group), len(jobs))
                for i, jobs in enumerate(self._by_index)
            ]
            calls = plan_groups(planned, self.caps.cap_for)
            for call in calls:  # why calls were cut short (metrics)
                if call.cut_reason != "drained":
                    self.report.cuts.append(call.cut_reason)
                if call.split_by:
                    self.report.cuts.append(f"key:{call.split_by}")

            def on_complete(index: int, outputs: list[object], records: list[CallRecord]) -> None:
                calls_seen = [{"id": c.call_id, "rows": c.rows, "requests": c.requests} for c in records]
                for job, output in zip(self._by_index[index], outputs, strict=True):
                    job.ran_in(calls_seen)
                    self.report.finished.append(Finished(job, output))
                    self._leave(job, "finished")

            rows = {i: len(jobs) for i, jobs in enumerate(self._by_index)}
            self.executor.run(calls, requests, rows, on_complete)
        finally:
            for job in self._jobs.values():
                if id(job) not in self._left and job.status.ended:
                    self._leave(job, "ended")
                elif id(job) in self._left:  # left inside a call (CallSteps reported it): out of the table
                    self.requests.detach(job)
            held = [job for job in self._jobs.values() if id(job) not in self._left]
            with self._lock:
                self._jobs = {}
                self._waiting[:0] = held  # only after a raise (a lost device, a bug): answered by the host
            # Nothing of this step kept past it: Triton's unload waits for every request to be released.
            self._by_index, self._left = [], set()
        return self.take_report()

    def fail_all(self, error: RequestError) -> StepReport:
        with self._lock:
            ended, self._waiting = self._waiting + list(self._jobs.values()), []
            self._jobs = {}
        for job in ended:
            job.status.end(error)  # an end decided before (a cancel) stands
            self._gone(job, "cancelled" if job.status.cancelled else "failed", job.status.error)
        return self.take_report()

    def _before_call(self, indices: list[int]) -> None:
        """Take the aborts of these requests before their call: a cancelled one leaves now."""
        jobs = [job for index in indices for job in self._by_index[index]]
        for status in take_aborts(jobs, self.aborts, "before its call started"):
            index = next(i for i in indices if self._by_index[i][0].status is status)
            assert status.error is not None
            self._end(index, status.error)

    def _end(self, index: int, error: RequestError) -> None:
        """The executor decided a request's error (or an abort ended it): end it, and its jobs leave."""
        jobs = self._by_index[index]
        jobs[0].status.end(error)
        reason = "cancelled" if error.code is ErrorCode.CANCELLED else "failed"
        for job in jobs:
            self._leave(job, reason, error)

    def _leave(self, job: Job, reason: str, error: RequestError | None = None) -> None:
        if id(job) not in self._left:
            self._left.add(id(job))
            self._gone(job, reason, error)

    def _gone(self, job: Job, reason: str, error: RequestError | None) -> None:
        self.requests.detach(job)
        self.report.left.append(Left(job, reason, error))

    def _run_rows(self, key: CompatibilityKey, rows: list[Row]) -> list[object]:
        jobs = [self._jobs[(row.request_index, row.image_index)] for row in rows]
        for job in jobs:
            job.took_part(len(jobs))
        steps = CallSteps(jobs, self.on_progress, self._left, self.aborts)
        try:
            return self.call(key, jobs, steps)
        except CallAbandoned:
            log.info("fused call abandoned: every row ended (no further steps, no decode)")
            return [None] * len(rows)

    def _on_call(self, report: CallReport) -> None:
        self.report.calls.append(report)

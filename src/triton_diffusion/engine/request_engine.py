"""The request-level engine: one fused diffusers call per compatible group, for pipelines without a step
adapter.

Each engine step takes every job waiting (one per image), plans the fused calls (planner.py: grouped by
compatibility key, capped in images, oldest first) and runs them (executor.py: bisection and out-of-memory
splits, so only a request that fails alone gets an error). Between two denoising steps of a call,
:class:`CallSteps` asks each request once whether it was cancelled (answering it at once), and hands the
host a :class:`StepReport` of the step (progress, preview snapshots) through ``on_progress``, so progress
and cancellation work as on the step engine. The step itself returns a report with the finished images.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from triton_diffusion.compatibility import CompatibilityKey
from triton_diffusion.engine.executor import CallRecord, CallReport, FusedCallExecutor
from triton_diffusion.engine.jobs import Finished, Job, Left, Stepped, StepReport
from triton_diffusion.engine.planner import PlannedRequest, Row, RowCaps, plan_groups
from triton_diffusion.engine.requests import TrackedRequest
from triton_diffusion.errors import ErrorCode, RequestError

log = logging.getLogger("triton_diffusion")


class CallAbandoned(Exception):
    """Raised from a pipeline's step callback when every row of its call has ended: the pipeline stops at
    once, without its remaining steps and without the VAE decode."""


class CallSteps:
    """The jobs of one running fused call, in tensor order, and what happens between two steps.

    The pipeline's step callback calls :meth:`on_step` after every denoising step: each request in the call
    is asked once whether it was cancelled (and answered at once if so), the jobs still running are
    reported as stepped (with a preview snapshot where due), and the positions of jobs whose request has
    ended are returned. The caller drops those rows (:meth:`compact`) where its loop allows it, or keeps
    computing them otherwise.
    """

    def __init__(self, jobs: list[Job], on_progress: Callable[[StepReport], None]) -> None:
        self.jobs = list(jobs)
        self.alive = list(jobs)
        self._on_progress = on_progress

    def on_step(self, step: int, total: int, snapshot: Callable[[int], Any] | None = None) -> list[int]:
        report = StepReport(running=len(self.alive))
        asked: dict[int, bool] = {}
        for position, job in enumerate(self.alive):
            request = job.request
            if request.ended:
                continue
            if id(request) not in asked:
                asked[id(request)] = request.is_cancelled()
                if asked[id(request)]:
                    log.info("request %s cancelled after step %d/%d", request.request_id, step, total)
                    request.fail(RequestError(ErrorCode.CANCELLED, f"cancelled after step {step}/{total}"))
            if request.ended:
                report.left.append(Left(job, "cancelled" if asked[id(request)] else "ended"))
                continue
            job.steps_done, job.total_steps = step, total
            due = snapshot is not None and job.preview_every and step % job.preview_every == 0
            report.stepped.append(Stepped(job, step, total, snapshot(position) if due else None))
        self._on_progress(report)
        return [p for p, job in enumerate(self.alive) if job.request.ended]

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

    def scatter(self, outputs: list[Any]) -> list[Any]:
        """Outputs for the alive jobs, placed back in the call's order (None for dropped jobs)."""
        by_job = {id(job): output for job, output in zip(self.alive, outputs, strict=True)}
        return [by_job.get(id(job)) for job in self.jobs]


class PipelineCall(Protocol):
    """What a model kind provides to the request-level engine: one fused pipeline call over jobs of one
    compatibility key, one output per job in order (``steps.scatter`` helps)."""

    def __call__(self, key: CompatibilityKey, jobs: list[Job], steps: CallSteps) -> list[Any]: ...


class RequestEngine:
    """Waiting jobs, planned and run as fused calls. Not thread-safe: one thread (the host's) steps it.
    A job's ``group`` is its request's compatibility key."""

    name = "request"

    def __init__(self, call: PipelineCall, caps: RowCaps, on_progress: Callable[[StepReport], None]) -> None:
        self.call = call
        self.caps = caps
        self.on_progress = on_progress
        self.waiting: list[Job] = []
        self.report = StepReport()
        self.executor = FusedCallExecutor(self._run_rows, self._on_call)
        self._jobs: dict[tuple[int, int], Job] = {}  # (request index, image index) -> job, this step

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    @property
    def active(self) -> int:
        return len(self.waiting) + len(self._jobs)

    @property
    def running(self) -> list[Job]:
        return list(self._jobs.values())

    in_flight: list[Job] = []  # every job of a round is in ``running``

    def take_report(self) -> StepReport:
        report, self.report = self.report, StepReport()
        report.running = len(self._jobs)
        return report

    def step(self) -> StepReport:
        """Plan every waiting job into fused calls and run them."""
        self.report = StepReport()
        waiting, self.waiting = self.waiting, []
        by_request: dict[int, list[Job]] = {}
        requests: dict[int, TrackedRequest] = {}
        for job in waiting:
            if job.request.ended:
                self.report.left.append(Left(job, "ended"))
                continue
            key = id(job.request)
            if key not in by_request:
                requests[len(requests)] = job.request
                by_request[key] = []
            by_request[key].append(job)
        jobs_by_index = list(by_request.values())
        self._jobs = {(i, job.index): job for i, jobs in enumerate(jobs_by_index) for job in jobs}
        self.report.admitted.extend(self._jobs.values())
        try:
            planned = [PlannedRequest(i, jobs[0].group, len(jobs)) for i, jobs in enumerate(jobs_by_index)]
            calls = plan_groups(planned, self.caps.cap_for)
            for call in calls:  # why calls were cut short (metrics)
                if call.cut_reason != "drained":
                    self.report.cuts.append(call.cut_reason)
                if call.split_by:
                    self.report.cuts.append(f"key:{call.split_by}")

            def on_complete(index: int, outputs: list[Any], records: list[CallRecord]) -> None:
                calls_seen = [{"id": c.call_id, "rows": c.rows, "requests": c.requests} for c in records]
                for job, output in zip(jobs_by_index[index], outputs, strict=True):
                    job.calls = calls_seen
                    self.report.finished.append(Finished(job, output))
                    self.report.left.append(Left(job, "finished"))

            rows = {i: len(jobs) for i, jobs in enumerate(jobs_by_index)}
            self.executor.run(calls, requests, rows, on_complete)
        finally:
            finished = {id(entry.job) for entry in self.report.finished}
            gone = {id(entry.job) for entry in self.report.left}
            for job in self._jobs.values():
                if id(job) not in finished and id(job) not in gone and job.request.ended:
                    self.report.left.append(Left(job, "ended"))
            held = [job for job in self._jobs.values() if not job.request.ended and id(job) not in finished]
            self._jobs = {}
            self.waiting[:0] = held  # only after a raise (a lost device, a bug): answered by the host
        return self.take_report()

    def fail_all(self, error: RequestError) -> StepReport:
        ended, self.waiting = self.waiting + list(self._jobs.values()), []
        self._jobs = {}
        for job in ended:
            job.request.fail(error)
            self.report.left.append(Left(job, "failed", error))
        return self.take_report()

    def _run_rows(self, key: CompatibilityKey, rows: list[Row]) -> list[Any]:
        jobs = [self._jobs[(row.request_index, row.image_index)] for row in rows]
        for job in jobs:
            job.forwards += 1
            job.most_shared = max(job.most_shared, len(jobs))
        steps = CallSteps(jobs, self.on_progress)
        try:
            return self.call(key, jobs, steps)
        except CallAbandoned:
            log.info("fused call abandoned: every row ended (no further steps, no decode)")
            return [None] * len(rows)

    def _on_call(self, report: CallReport) -> None:
        self.report.calls.append(report)

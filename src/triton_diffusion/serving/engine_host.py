"""One engine host for every model kind: the engine (a type the model picks, engines.py) on its worker
thread (engine_worker.py), and one response thread that renders the engine's reports into Triton
responses (responses.py): the one answer path.

A model kind supplies only what is its own (:class:`HostedKind`): its parsed requests already hold their
job specs (:class:`Parsed`, made when the request is read), and it says how progress and outputs become
tensors. What the model kept meets a request here (:meth:`EngineHost.read`, intake.py): the answer of an
earlier identical request, and its checkpoints. What a step report holds becomes, on the engine thread,
work for the response thread (nothing is encoded or sent here, so the next step starts at once), in the
order it happened: progress, FINAL responses, and the errors the engine decided. The jobs' checkpoints a
report carries go to the model's store (recovery/resumes.py), which writes them on its own thread.

Draining (recovery/drain.py: the launcher got SIGTERM), where the launcher set a drain file: between two
engine steps (and every half second while idle) the engine thread looks for it, a ``stat`` at most every
half second (:class:`DrainWatch`). Once it is there, new requests are answered UNAVAILABLE "draining"
at once; each engine step, the jobs the engine's estimate says cannot be done before the drain deadline
(less :data:`DRAIN_MARGIN_S`) are checkpointed (the engine returns the adapter's checkpoints, the host
stores and flushes them) and their requests answered UNAVAILABLE naming their resume key ("draining:
checkpointed at step 7; resend with resume_key ..."), or "draining" alone where nothing could be
checkpointed (no resume key, checkpoints off, a step cache: the resend starts over); the others go on.
Once the engine holds nothing, the answers are sent and this instance writes its mark.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, Protocol, cast

from triton_diffusion.engine.failures import DeviceLostError
from triton_diffusion.engine.jobs import Job, Left, Stepped, StepReport
from triton_diffusion.engine.request_status import Abort
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.errors import RESEND, ErrorCode, RequestError, Retry, RetryHint
from triton_diffusion.recovery.drain import DRAINING_MESSAGE, POLL_S, DrainWatch, drain_file_from_env
from triton_diffusion.recovery.resumes import Resume, Resumes
from triton_diffusion.serving.engine_worker import EngineWorker
from triton_diffusion.serving.engines import EngineKind
from triton_diffusion.serving.intake import Intake, Kept
from triton_diffusion.serving.metrics import BatchingMetrics, MetricNames
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.serving.responses import ResponseWorker
from triton_diffusion.serving.result_cache import ResultCache
from triton_diffusion.settings import ModelSettings

P = ParamSpec("P")  # a renderer's arguments (EngineHost._guarded)

log = logging.getLogger("triton_diffusion")

# The cost model's metrics are set at most this often (its fit is recomputed to set them).
COST_METRICS_EVERY_S = 1.0
# A job kept while draining must be done this long before the drain deadline: the time its answer, the
# other jobs' checkpoints and the mark take before the launcher stops the server.
DRAIN_MARGIN_S = 1.0


class Parsed(Kept, Protocol):
    """A model kind's validated request, as the host reads it: what the intake looks it up by (its jobs,
    values, result and resume keys: intake.py ``Kept``), and how it is served."""

    @property
    def progress(self) -> bool:
        """The kind renders progress responses for this request."""

    @property
    def summary(self) -> str:
        """What it asks for, for the admission log line."""


@dataclass(frozen=True)
class Admitted:
    """A request read and not answered from the result cache: what its jobs are made from."""

    tracked: TrackedRequest
    parsed: Parsed
    resume: Resume | None = None  # its checkpoints' lookup (None: nothing is checkpointed for it)


@dataclass(eq=False)
class RequestRecord:
    """What the host keeps per request while its jobs run (each job's ``record``)."""

    tracked: TrackedRequest
    parsed: Parsed  # the model kind's validated request (its own type: the kind reads it back as that)
    resume: Resume | None = None  # its checkpoints' lookup (intake.py)
    jobs: list[Job] = field(default_factory=list)
    outputs: list[object] = field(default_factory=list)  # each job's, from its engine (Finished.output)
    remaining: int = 0  # jobs not finished yet
    state: str | None = None  # the kind's own per-request state: the LM's text streamed so far
    first_step_seen: bool = False
    deadline_counted: bool = False  # its deadline outcome went into the metrics (once per request)
    # The last step a progress response went out for: never again one as low (a fused call retried after
    # a failure, or split out of memory, steps again from its first step; its client saw those already).
    progress_step: int = 0


def record_of(job: Job) -> RequestRecord:
    """The host's record of a job's request (made in :meth:`EngineHost.submit`): the engine holds it as
    ``object``, it reads no host types (a cast: no check at run time, as before)."""
    return cast(RequestRecord, job.record)


class HostedKind(Protocol):
    """What a model kind supplies to the host (both run on the response thread, in order)."""

    def progress_outputs(self, record: RequestRecord, stepped: Stepped) -> Mapping[str, Any] | None:
        """A progress response for this step, or None."""

    def final_outputs(
        self, record: RequestRecord, outputs: list[object], reported: dict[str, Any]
    ) -> Mapping[str, Any]:
        """The FINAL response's tensors; ``reported`` is what the host puts in BATCH beside the kind's own:
        ``service`` (the request's tier, deadline and pauses) and, for a request that gave a resume_key,
        its checkpoints (intake.py)."""


class EngineHost:
    """An engine with its worker, response thread and metrics, for one model."""

    def __init__(
        self,
        kind: HostedKind,
        engine_kind: EngineKind,
        settings: ModelSettings,
        metrics: BatchingMetrics,
        names: MetricNames,
        on_exit: Callable[[str], None],  # answer what is queued, then leave the process (say why)
        resumes: Resumes | None = None,  # where the jobs' checkpoints go (None: none are taken)
    ) -> None:
        config = settings.config
        self.kind = kind
        self.resumes = resumes
        results = ResultCache(int(config.result_cache_mb * 2**20))
        self.intake = Intake(settings.name, config.service_tiers, metrics, results, resumes)
        self.engine_kind = engine_kind
        self.tiers = config.service_tiers  # a job's tier is its rank here
        self.metrics = metrics
        self.names = names
        self.max_wait_s = config.max_admission_wait_s
        self.responses = ResponseWorker()
        self.engine = engine_kind.build(settings, self._progress_in_call)
        drain_file = drain_file_from_env()  # None (tritonserver run by hand, tests): never drains
        self.drain = DrainWatch(drain_file, settings.name, settings.instance) if drain_file else None
        self.draining = False  # set on the engine thread, read by execute()
        self._cost_published = 0.0  # when the cost model's metrics were last set (monotonic seconds)
        self._cost_parts: set[tuple[str, str]] = set()  # the cost gauges set (_record_cost): fit, part
        self._ratio_set = False
        if self.drain is not None:
            log.info("%s: drains on SIGTERM (drain file %s)", settings.instance or settings.name, drain_file)
        # Where the scheduler refuses late jobs (the step engine with deadline_policy refuse): what reads
        # deadline_room and the degrade settings. Set where nothing reads them: said once at load.
        refuses = engine_kind.name == "step" and config.deadline_policy == "refuse"
        unread = [
            f"{name} {value}"
            for name, value in (
                ("deadline_room", config.deadline_room),
                ("degrade_tiers", json.dumps(config.degrade_tiers) if config.degrade_tiers else None),
                (
                    "degrade_step_cache",
                    json.dumps(config.degrade_step_cache) if config.degrade_step_cache else None,
                ),
            )
            if value
        ]
        if unread and not refuses:
            log.warning(
                "%s: %s ignored: it needs the step engine with deadline_policy refuse (here: %s engine, %s)",
                settings.instance or settings.name,
                "; ".join(unread),
                engine_kind.name,
                config.deadline_policy,
            )
        self.worker = EngineWorker(
            self.engine,
            engine_kind.capacity(settings),
            self.render,
            config.engine_stall_s,
            on_device_lost=lambda error: on_exit(f"the accelerator failed ({error})"),
            on_stall=lambda error: on_exit(f"the engine is stuck ({error})"),
            name=f"{engine_kind.name}-engine",
            flush_answers=lambda: self.responses.close(timeout_s=10),
            aborts=engine_kind.aborts(settings),
            between_steps=self._drain_pass if self.drain is not None else None,
            idle_tick_s=POLL_S,
            deadline_room=engine_kind.deadline_room(settings),
        )

    def cost_model(self) -> dict[str, Any] | None:
        """The step engine's cost model as it stands (engine/estimates.py ``describe``): MODEL_INFO
        ``cost_model`` and the metrics; None on the request-level engine, which prices nothing."""
        return self.engine.times.describe() if isinstance(self.engine, StepEngine) else None

    def _record_cost(self, cost: dict[str, Any]) -> None:
        seconds: dict[tuple[str, str], float] = {}  # by fit and part
        for fit, name in (("tokens", "forward_by_tokens"), ("tokens_and_rows", "forward_by_tokens_and_rows")):
            for part, value in (cost[name] or {}).items():
                part_s = value / 1e3 if part != "per_1k_tokens_ms" else value / 1e6
                seconds[fit, "per_token" if part == "per_1k_tokens_ms" else part.removesuffix("_ms")] = part_s
        ratio = cost["packed_over_plane"]
        # A gauge set before whose value is unknown now reads NaN (Prometheus' unknown), not its last value.
        seconds |= dict.fromkeys(self._cost_parts - seconds.keys(), math.nan)
        if ratio is None and self._ratio_set:
            ratio = math.nan
        self._cost_parts |= seconds.keys()
        self._ratio_set = self._ratio_set or ratio is not None
        for (fit, part), value in seconds.items():
            self.metrics.set("triton_diffusion_forward_cost_seconds", value, fit=fit, part=part)
        if ratio is not None:
            self.metrics.set("triton_diffusion_packed_forward_cost_ratio", ratio)

    # ---- execute() thread -------------------------------------------------------------------------
    def read(self, tracked: TrackedRequest, parsed: Parsed) -> Admitted | None:
        """A request its kind parsed, as the model kept things: its checkpoints looked up (it is watched
        from now until answered), and where an identical request was answered before, that answer sent at
        once (None). Raises RequestError (INVALID_ARG naming resume_key) for this request only."""
        resume = self.intake.resume(tracked, parsed)
        answer = self.intake.cached(parsed)
        if answer is not None:
            tracked.finish(answer)
            return None
        return Admitted(tracked, parsed, resume)

    def answered(self, tracked: TrackedRequest, code: ErrorCode | None) -> None:
        """A request's FINAL response went out (once per request, whichever path answered it)."""
        self.intake.answered(tracked, code)

    def submit(self, admitted: Sequence[Admitted]) -> None:
        """Make each valid request's jobs from its specs and hand them all to the engine, in order (none
        while draining: each is answered UNAVAILABLE "draining", its client resends it elsewhere or
        later)."""
        if self.draining:
            refused = RequestError(ErrorCode.UNAVAILABLE, DRAINING_MESSAGE, RESEND)
            for entry in admitted:
                entry.tracked.fail(refused)
            return
        batch = []
        for tracked, parsed, resume in ((a.tracked, a.parsed, a.resume) for a in admitted):
            record = RequestRecord(tracked, parsed, resume)
            try:
                jobs = [Job.of(tracked, spec, record) for spec in Intake.specs(parsed, resume)]
            except Exception as exc:  # noqa: BLE001  (a bug in one request's kind: it alone is answered)
                log.exception("request %s: making its jobs failed", tracked.request_id)
                tracked.fail(RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
                continue
            record.jobs, record.outputs, record.remaining = jobs, [None] * len(jobs), len(jobs)
            batch.append((tracked, jobs))
        for waited in self.worker.submit(batch, self.max_wait_s):
            if waited >= 0:
                self.metrics.observe(self.names.admission_wait, waited)

    def close(self) -> None:
        stopped = self.worker.close()  # what it held is answered UNAVAILABLE
        sent = self.responses.close()
        if self.resumes is not None:
            self.resumes.close()
        # The launcher may end the server once the mark is there (recovery/drain.py): only when every
        # answer was handed to Triton; else Triton's own exit is waited for.
        if self.drain is not None and stopped and sent:
            try:
                self.drain.mark_finalized()
            except OSError:
                log.exception("could not write the finalized mark")

    def before_exit(self, reason: str) -> None:
        """Send what is queued for sending, then answer what 10 s did not send (the process leaves)."""
        self.responses.close(timeout_s=10)
        message = f"{reason}; the model is restarting, retry shortly"
        self.responses.fail_queued(RequestError(ErrorCode.UNAVAILABLE, message))

    # ---- the engine thread: draining ---------------------------------------------------------------
    def _drain_pass(self) -> None:
        """Between two engine steps: once the launcher asked for a drain, refuse new requests, checkpoint
        and answer the jobs that cannot be done in time, and mark this instance drained once nothing is
        held (its answers sent)."""
        watch = self.drain
        assert watch is not None
        if not watch.draining():
            return
        if not self.draining:
            self.draining = True
            held, left = self.engine.active, watch.seconds_left()
            log.warning("draining: new requests refused, %d job(s) held, %.1f s left", held, left)
        try:
            self._answer_late(watch.seconds_left() - DRAIN_MARGIN_S)
        except DeviceLostError:
            raise
        except Exception:  # noqa: BLE001  (a bug here: the drain time still bounds the stop)
            log.exception("draining: answering the jobs that cannot finish failed")
        if not self.engine.active and not watch.marked:
            self.responses.flush(max(watch.seconds_left(), 1.0))
            watch.mark()
            log.info("draining: nothing held any more; marked drained (%s)", watch.instance or watch.model)

    def _answer_late(self, seconds: float) -> None:
        """The requests of the jobs that cannot be done within ``seconds``: their jobs checkpointed (one
        adapter call for all; stored and flushed), then each answered UNAVAILABLE, naming its resume key
        where a checkpoint of it is on disk, and dropped from the engine (an abort with that error)."""
        records: dict[int, RequestRecord] = {}
        for job in self.engine.late_jobs(seconds):
            record = record_of(job)
            if not record.tracked.ended:
                records.setdefault(id(record), record)
        if not records:
            return
        keys = {id(r): self.resumes.resume_key(r.tracked) if self.resumes else None for r in records.values()}
        jobs = [job for r in records.values() if keys[id(r)] is not None for job in r.jobs]
        checkpoints = self.engine.checkpoint_now(jobs)
        taken = [(job, cp) for job, cp in zip(jobs, checkpoints, strict=True) if cp is not None]
        flushed = False
        if taken and self.resumes is not None:
            self.resumes.persist(StepReport(checkpoints=taken))
            assert self.drain is not None
            flushed = self.resumes.store.flush(max(self.drain.seconds_left(), 1.0))
            if not flushed:
                log.warning("draining: the checkpoints were not all written in time")
        aborts = []
        for record in records.values():
            steps = [job.run.steps_done for job, _ in taken if job.record is record]
            message, hint = DRAINING_MESSAGE, RESEND
            if steps and flushed:
                key = keys[id(record)]
                message = f"draining: checkpointed at step {min(steps)}; resend with resume_key {key}"
                hint = RetryHint(Retry.RESUME, key, min(steps))
            error = RequestError(ErrorCode.UNAVAILABLE, message, hint)
            tracked = record.tracked
            if tracked.end(error):
                self.responses.deliver(tracked)
                log.info("request %s answered while draining: %s", tracked.request_id, message)
            aborts.append(Abort(tracked, tracked.error or error))
        self.engine.abort(aborts)

    # ---- the engine thread: reports into work for the response thread --------------------------------
    def render(self, report: StepReport) -> None:
        """Sort a step report into work for the response thread. Should that raise outside the per-job
        parts (a bug), every request the report names is answered INTERNAL: its jobs may have left the
        engine, and nothing else would answer it (the engine drops the others' jobs at its next abort
        check)."""
        try:
            self._render(report)
        except Exception as exc:  # noqa: BLE001
            log.exception("rendering a step report failed; answering its requests")
            error = RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            jobs = [*report.admitted, *(s.job for s in report.stepped), *(f.job for f in report.finished)]
            for job in [*jobs, *(left.job for left in report.left)]:
                tracked = record_of(job).tracked
                tracked.end(error)
                self.responses.deliver(tracked)

    def _render(self, report: StepReport) -> None:
        submit = self.responses.submit
        for left in report.left:  # the engine's decisions first: nothing more goes out for those requests
            if left.error is not None:
                record_of(left.job).tracked.end(left.error)  # once a request: later ones are no-ops
        deadlines = self._deadline_outcomes(report.left)
        # Metrics go on the response thread's queue before the answers: a client that reads /metrics
        # after its answer sees the work that answered it.
        if any(
            (
                report.forwards,
                report.timed,
                report.calls,
                report.cuts,
                report.stepped,
                report.left,
                report.paused,
            )
        ):
            submit(None, lambda: self._record_metrics(report, deadlines))
        now = time.monotonic()
        if report.forwards and now - self._cost_published >= COST_METRICS_EVERY_S:
            self._cost_published, cost = now, self.cost_model()  # read here: the engine thread's tables
            if cost is not None:
                submit(None, lambda: self._record_cost(cost))
        for job in report.admitted:
            self._guarded(job, self._admitted, job, report.running)
        for job in report.paused:
            request_id, step = job.request.request_id, job.run.steps_done
            log.info("request %s image %d paused at step %d", request_id, job.spec.index, step)
        for stepped in report.stepped:
            self._guarded(stepped.job, self._stepped, stepped)
        for finished in report.finished:
            self._guarded(finished.job, self._finished, finished.job, finished.output)
        for left in report.left:
            self._guarded(left.job, self._left, left)
        if self.resumes is not None and (report.checkpoints or report.stepped):
            try:
                self.resumes.persist(report)
            except Exception:  # noqa: BLE001  (a checkpoint lost costs no request its answer)
                log.exception("storing checkpoints failed")

    @staticmethod
    def _admitted(job: Job, running: int) -> None:
        record = record_of(job)
        record.tracked.start()
        summary = record.parsed.summary or f"{job.run.total_steps} steps"
        log.info(
            "request %s image %d admitted: %s (%d running)",
            job.request.request_id,
            job.spec.index,
            summary,
            running,
        )

    def _guarded(self, job: Job, render: Callable[P, None], *args: P.args, **kwargs: P.kwargs) -> None:
        """Render one job's part of a report: should it raise (a bug), its request alone is answered."""
        try:
            render(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            log.exception("request %s: rendering its step failed", job.request.request_id)
            # Ended here, answered on the response thread: the engine thread never sends. The engine
            # drops the request's other jobs at its next abort check (ClientAborts).
            tracked = record_of(job).tracked
            tracked.end(RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
            self.responses.deliver(tracked)

    def _left(self, left: Left) -> None:
        job = left.job
        tracked = record_of(job).tracked
        if left.reason != "finished":
            self.responses.deliver(tracked)  # the error the engine decided, if not out yet
        log.info(
            "request %s image %d left (%s) after %d/%d steps, %d forwards, shared with up to %d%s",
            job.request.request_id,
            job.spec.index,
            left.reason,
            job.run.steps_done,
            job.run.total_steps,
            job.stats.forwards,
            job.stats.most_shared,
            f": {left.error.message}" if left.error is not None else "",
        )

    @staticmethod
    def _deadline_outcomes(left: list[Left]) -> list[str]:
        """``missed`` or ``refused`` for each request these departures end for its deadline (once a
        request, whichever of its images leaves first)."""
        outcomes = []
        for departure in left:
            record = record_of(departure.job)
            if departure.reason in ("expired", "refused") and not record.deadline_counted:
                record.deadline_counted = True
                outcomes.append("missed" if departure.reason == "expired" else "refused")
        return outcomes

    def _progress_in_call(self, report: StepReport) -> None:
        """A denoising step inside a fused call (request-level engine): progress, and a heartbeat."""
        self.worker.beat()
        self.render(report)

    def _stepped(self, stepped: Stepped) -> None:
        job = stepped.job
        record = record_of(job)
        if job.spec.index != 0 or record.tracked.ended:
            return  # the first image speaks for its request
        if not record.first_step_seen and (
            stepped.snapshot is not None or not self.names.first_step_on_snapshot
        ):
            record.first_step_seen = True
            waited = time.perf_counter() - job.request.entered
            tier = self.tiers[job.spec.tier]

            def observe() -> None:
                self.metrics.observe(self.names.first_step, waited)
                self.metrics.observe("triton_diffusion_tier_first_step_seconds", waited, tier=tier)

            self.responses.submit(None, observe)
        if record.parsed.progress and stepped.step > record.progress_step:
            record.progress_step = stepped.step

            def send() -> None:
                outputs = self.kind.progress_outputs(record, stepped)
                if outputs is not None:
                    record.tracked.progress(outputs)

            self.responses.submit(record.tracked, send)

    def _keep(self, record: RequestRecord, final: Mapping[str, Any]) -> None:
        """Keep an answer sent for the identical requests after it; a failure here is logged, never the
        request's (it was answered)."""
        try:
            self.intake.keep(record.parsed, record.jobs, final)
        except Exception:  # noqa: BLE001
            log.exception(
                "request %s: keeping its answer in the result cache failed", record.tracked.request_id
            )

    def _finished(self, job: Job, output: object) -> None:
        record = record_of(job)
        record.outputs[job.spec.index] = output
        record.remaining -= 1
        if record.remaining:
            return
        service = self.service_report(record.jobs)
        outputs = list(record.outputs)
        latency = time.perf_counter() - job.request.entered
        tier = self.tiers[job.spec.tier]

        def answer() -> None:
            checkpoints = self.intake.report(record.parsed, record.resume, record.jobs)
            final = self.kind.final_outputs(record, outputs, {"service": service, **checkpoints})
            if record.tracked.finish(final):
                self._keep(record, final)
                self.metrics.observe("triton_diffusion_tier_latency_seconds", latency, tier=tier)
                if any(j.degraded for j in record.jobs):  # fewer steps, or a cache (engine/degradation.py)
                    self.metrics.increment("triton_diffusion_degraded_total", tier=tier)
                cut = [j.queue.cut.asked - j.queue.cut.steps for j in record.jobs if j.queue.cut is not None]
                if cut:
                    self.metrics.increment("triton_diffusion_degraded_steps_total", sum(cut), tier=tier)
                cached = sum(j.queue.cache_given is not None for j in record.jobs)
                if cached:
                    self.metrics.increment("triton_diffusion_degraded_caches_total", cached, tier=tier)
                if job.spec.deadline is not None and not record.deadline_counted:  # in time, or late
                    record.deadline_counted = True  # (deadline_policy best_effort)
                    met = job.request.entered + latency <= job.spec.deadline
                    self.metrics.increment(
                        "triton_diffusion_deadlines_total", outcome="met" if met else "missed"
                    )

        self.responses.submit(record.tracked, answer)

    def service_report(self, jobs: list[Job]) -> dict[str, Any]:
        """BATCH's service part: the request's tier, its deadline, and how often and long its images
        were paused (in all, the longest)."""
        job = jobs[0]
        report: dict[str, Any] = {
            "tier": self.tiers[job.spec.tier],
            "paused_times": sum(j.queue.pauses for j in jobs),
        }
        report["paused_s"] = round(max(j.queue.paused_s for j in jobs), 3)
        if job.spec.deadline is not None:
            report["deadline_ms"] = round((job.spec.deadline - job.request.entered) * 1000, 1)
        return report

    def _record_metrics(self, report: StepReport, deadlines: list[str]) -> None:
        names, metrics = self.names, self.metrics
        for forward in report.forwards:
            if names.forward_images:
                metrics.observe(names.forward_images, forward.images)
            metrics.observe(names.forward_model_rows, forward.rows)
            if names.forward_adapters and forward.adapters:
                metrics.observe(names.forward_adapters, forward.adapters)
            if names.forwards_total:
                metrics.increment(names.forwards_total)
            if forward.packing is not None:
                decision = "packed" if forward.packing.packed else "by_size"
                metrics.increment("triton_diffusion_packing_decisions_total", decision=decision)
            if forward.narrowed:
                metrics.increment("triton_diffusion_forwards_narrowed_total")
        for _, seconds in report.timed:  # the device's seconds (on a GPU the host's are its launch)
            metrics.observe(names.step_seconds, seconds)
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
        for left in report.left:
            if left.reason == "cancelled":
                metrics.increment(names.cancelled)
        for outcome in deadlines:
            metrics.increment("triton_diffusion_deadlines_total", outcome=outcome)
        if report.paused:
            metrics.increment("triton_diffusion_preemptions_total", len(report.paused))
        if names.cache_rows and report.stepped:  # summed per method first: each metric call is a round trip
            rows: dict[tuple[str, str], int] = {}
            for stepped in report.stepped:
                given = stepped.job.queue.cache_given  # a cache given for its steps left counts as its own
                method = given.step_cache.partition(":")[0] if given else stepped.job.spec.cache_method
                rows[method, "computed"] = rows.get((method, "computed"), 0) + stepped.rows_computed
                rows[method, "reused"] = rows.get((method, "reused"), 0) + stepped.rows_reused
            for (method, outcome), count in rows.items():
                if count:
                    metrics.increment(names.cache_rows, count, method=method, outcome=outcome)
        metrics.set(names.running, report.running)
        metrics.set("triton_diffusion_paused_jobs", report.paused_now)

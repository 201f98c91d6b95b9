"""The shared Triton Python model: read + validate each request -> plan -> fused calls -> one FINAL each.

A model kind (text-to-image, ...) subclasses :class:`BatchedDiffusionModel` and says which fields it
accepts, how to load its pipeline, how to run a list of rows in one call and how to answer a request.
Everything about batching lives here and in ``engine/``; all work runs inside ``execute()``, so Triton's
queue statistics stay right and its dynamic batcher keeps forming batches. Between two denoising steps,
:class:`StepReporter` sends progress and answers cancelled requests at once.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from triton_diffusion.adapters.diffusers_pipeline import row_seed
from triton_diffusion.compatibility import CompatibilityKey, compatibility_key
from triton_diffusion.engine.device_errors import DeviceLostError, device_lost_error, exit_for_restart
from triton_diffusion.engine.executor import CallRecord, CallReport, FusedCallExecutor
from triton_diffusion.engine.planner import PlannedRequest, Row, RowCaps, plan_groups
from triton_diffusion.engine.requests import TrackedRequest
from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.fields import Field, FieldSet, Role
from triton_diffusion.serving.metrics import FAMILIES
from triton_diffusion.settings import ModelSettings

log = logging.getLogger("triton_diffusion")

# Fields and outputs every denoising model has: per-step progress responses before the FINAL one.
PROGRESS_FIELDS = [
    Field("progress", bool, False, Role.AFTER_SPLIT, doc="send STEP/TOTAL_STEPS after every denoising step"),
    Field(
        "preview_every",
        int,
        0,
        Role.AFTER_SPLIT,
        minimum=0,
        maximum=1000,
        doc="with progress: a low-resolution PREVIEW image every N steps (0 = never)",
    ),
]
PROGRESS_OUTPUTS = [
    ("STEP", "TYPE_INT32", [1]),
    ("TOTAL_STEPS", "TYPE_INT32", [1]),
    ("PREVIEW", "TYPE_STRING", [1]),
]


@dataclass(frozen=True)
class ParsedRequest:
    index: int
    values: dict[str, Any]
    key: CompatibilityKey
    rows: int


@dataclass(frozen=True)
class RowInput:
    """One row of a fused call: the request's validated values and which of its images this row is."""

    values: dict[str, Any]
    image_index: int


@dataclass
class _LiveRequest:
    tracked: TrackedRequest
    parsed: ParsedRequest
    first_step_seen: bool = False


class CallAbandoned(Exception):
    """Raised from the step callback when every row of a call has ended: the pipeline stops at once,
    without its remaining steps and without the VAE decode."""


class StepReporter:
    """The rows of one running fused call, in tensor order, and what happens between two steps.

    The pipeline adapter calls :meth:`on_step` after every denoising step. It polls each request's
    cancellation once, answers a cancelled request at once (CANCELLED + FINAL), sends progress to the
    requests that asked, and returns the positions of rows whose request has ended. The adapter drops
    those rows (:meth:`compact`) where its loop allows it, or keeps computing them otherwise.
    """

    def __init__(self, model: BatchedDiffusionModel, rows: list[Row]) -> None:
        self._model = model
        self.rows = list(rows)
        self.alive = list(rows)

    def on_step(self, step: int, total: int, preview: Callable[[int], bytes] | None = None) -> list[int]:
        return self._model._between_steps(self, step, total, preview)

    def all_ended(self, ended_positions: list[int]) -> bool:
        return len(ended_positions) == len(self.alive)

    def compact(self, positions: list[int], after_step: int) -> None:
        drop = set(positions)
        self.alive = [row for position, row in enumerate(self.alive) if position not in drop]
        log.info(
            "compacted fused call after step %d: dropped %d row(s), %d go on",
            after_step,
            len(drop),
            len(self.alive),
        )

    def scatter(self, outputs: Sequence[Any]) -> list[Any]:
        """Outputs for the alive rows, placed back in the call's row order (None for dropped rows)."""
        by_row = dict(zip(self.alive, outputs, strict=True))
        return [by_row.get(row) for row in self.rows]


def batch_output(report: dict[str, Any]) -> np.ndarray:
    """The BATCH output: JSON of how the request was batched (its key and its fused calls, or for the
    step engine its shape group, the forwards it took part in and the most rows it shared one with)."""
    return np.array([[json.dumps(report).encode()]], dtype=object)


def seed_output(seed: int, count: int) -> np.ndarray:
    return np.array([[row_seed(seed, i) for i in range(count)]], dtype=np.int64)


class TritonModel:
    """What every model kind shares: Triton's entry points, reading and validating each request on its
    own (whatever raises answers that request alone), and the answered-exactly-once tracking."""

    FIELDS: ClassVar[FieldSet]
    OUTPUTS: ClassVar[list[tuple[str, str, list[int]]]]
    METRIC_FAMILIES: ClassVar[dict[str, tuple[str, str]]] = FAMILIES

    # ---- what a model kind provides -------------------------------------------------------------
    def setup(self, settings: ModelSettings) -> None:
        """Load the model; set ``self.fields`` (FIELDS configured with this model's defaults and limits)."""
        raise NotImplementedError

    def parse(self, index: int, raw: dict[str, Any], tracked: TrackedRequest) -> Any:
        """Validate one request's raw fields. Raises RequestError for this request only."""
        raise NotImplementedError

    def run(self, admitted: list[tuple[TrackedRequest, Any]]) -> None:
        """Serve the valid requests of one execute() (or hand them to the engine)."""
        raise NotImplementedError

    # ---- Triton entry points ----------------------------------------------------------------------
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config: Any) -> Any:
        from triton_diffusion.serving.triton_io import add_io_to_config

        return add_io_to_config(auto_complete_model_config, cls.FIELDS, cls.OUTPUTS)

    def initialize(self, args: dict[str, str]) -> None:
        from triton_diffusion.serving.triton_io import batching_metrics, install_log_handler

        install_log_handler()
        self.settings = ModelSettings.from_triton_args(args)
        self.metrics = batching_metrics(self.settings.name, self.METRIC_FAMILIES)
        self.setup(self.settings)

    def execute(self, requests: Sequence[Any]) -> None:
        entered = time.perf_counter()
        self.metrics.observe("triton_diffusion_execute_requests", len(requests))
        tracked: list[TrackedRequest] = []
        try:
            admitted = []
            for index, request in enumerate(requests):
                target, parsed = self._read(index, request, entered)
                tracked.append(target)
                if parsed is not None:
                    admitted.append((target, parsed))
            log.info("execute: %d requests ids=%s", len(requests), [t.request_id for t in tracked])
            self.run(admitted)
        except DeviceLostError as exc:  # nothing can run here again: answer everyone, then restart
            for target in tracked:
                target.fail(device_lost_error(str(exc)))
            self.exit_for_restart(str(exc))
        except Exception as exc:  # noqa: BLE001  (every request must still get its FINAL response)
            log.exception("execute failed")
            error = RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            for index, request in enumerate(requests):
                try:
                    target = tracked[index] if index < len(tracked) else self._track(request, entered)
                    target.fail(error)  # a no-op for requests answered already
                except Exception:  # noqa: BLE001
                    log.exception("could not answer request %d of the batch", index)
        return None

    def finalize(self) -> None:
        log.info("%s unloaded", self.settings.name)

    def before_exit(self, error: str) -> None:
        """Send what is queued for sending before the process leaves (see :meth:`exit_for_restart`)."""

    def exit_for_restart(self, error: str) -> None:
        """The accelerator failed: every request held was answered; leave so the supervisor restarts."""
        try:
            self.before_exit(error)
        finally:
            exit_for_restart(error)

    # ---- reading requests -------------------------------------------------------------------------
    def _track(self, request: Any, entered: float) -> TrackedRequest:
        from triton_diffusion.serving.triton_io import TritonChannel, request_id

        return TrackedRequest(request_id(request), TritonChannel(request), self._on_answered, entered)

    def _read(self, index: int, request: Any, entered: float) -> tuple[TrackedRequest, Any]:
        """Track the request, read and validate it. Whatever raises answers this request alone."""
        from triton_diffusion.serving.triton_io import read_raw_fields

        tracked = self._track(request, entered)
        try:
            return tracked, self.parse(index, read_raw_fields(request, self.fields), tracked)
        except RequestError as error:
            tracked.fail(error)
        except Exception as exc:  # noqa: BLE001  (a bug while reading one request fails it alone)
            log.exception("request %s: could not be read", tracked.request_id)
            error = RequestError(ErrorCode.INTERNAL, f"reading the request failed: {type(exc).__name__}")
            tracked.fail(error)
        return tracked, None

    def _on_answered(self, tracked: TrackedRequest, code: ErrorCode | None) -> None:
        if code is not None:
            self.metrics.increment("triton_diffusion_requests_failed_total", code=code.value)


class BatchedDiffusionModel(TritonModel):
    """Image and video models. With a step adapter for the loaded pipeline (and ``engine`` auto or step),
    requests go to the step engine (serving/step_serving.py); otherwise one fused diffusers call per
    compatible group runs inside ``execute()`` (the request-level engine, below)."""

    step_adapter: Any = None  # set by load() when the pipeline has one and the config wants it

    # ---- what a model kind provides -------------------------------------------------------------
    def load(self, settings: ModelSettings) -> FieldSet:
        """Load the pipeline; return FIELDS configured with this model's defaults and limits."""
        raise NotImplementedError

    def rows_for(self, values: dict[str, Any]) -> int:
        return 1

    def resolve(self, values: dict[str, Any]) -> dict[str, Any]:
        """Work a request needs before planning (decode an image, resolve its size): whatever this
        sets can be part of the compatibility key. Raises RequestError for this request only."""
        return values

    def run_rows(self, key: CompatibilityKey, rows: list[RowInput], steps: StepReporter) -> list[Any]:
        """One fused pipeline call; one output per row, in row order (``steps.scatter`` helps)."""
        raise NotImplementedError

    def respond(self, request: ParsedRequest, outputs: list[Any]) -> dict[str, np.ndarray]:
        """The outputs of a request whose rows are all done (SEED and BATCH are added here)."""
        raise NotImplementedError

    def response(self, request: ParsedRequest, outputs: list[Any], report: dict[str, Any]) -> dict[str, Any]:
        return {
            **self.respond(request, outputs),
            "SEED": seed_output(request.values["seed"], len(outputs)),
            "BATCH": batch_output(report),
        }

    def setup(self, settings: ModelSettings) -> None:
        self.fields = self.load(settings)
        self.caps = RowCaps.from_config(settings.max_rows_per_call(), settings.get("max_rows_by_resolution"))
        self.step_serving = None
        if self.step_adapter is not None:
            from triton_diffusion.serving.step_serving import ImageStepServing

            self.step_serving = ImageStepServing(self, self.step_adapter, settings, self.caps)
        self.executor = FusedCallExecutor(self._run_planned_rows, self._on_call)
        self._live: dict[int, _LiveRequest] = {}
        log.info(
            "%s ready: engine=%s max_rows_per_call=%d caps_by_resolution=%s",
            settings.name,
            "step" if self.step_serving else "request",
            self.caps.max_rows,
            dict(self.caps.by_resolution),
        )

    def finalize(self) -> None:
        if self.step_serving is not None:
            self.step_serving.close()
        super().finalize()

    def before_exit(self, error: str) -> None:
        if self.step_serving is not None:
            self.step_serving.responses.close(timeout_s=10)
            self.step_serving.responses.fail_queued(device_lost_error(error))  # what 10 s did not send

    def parse(self, index: int, raw: dict[str, Any], tracked: TrackedRequest) -> ParsedRequest:
        values = self.resolve(self.fields.parse(raw))
        if "seed" in values and values["seed"] is None:
            values["seed"] = random.randrange(2**32)  # drawn here so the response can return it
        return ParsedRequest(index, values, compatibility_key(self.fields, values), self.rows_for(values))

    def run(self, admitted: list[tuple[TrackedRequest, ParsedRequest]]) -> None:
        if self.step_serving is not None:
            for tracked, parsed in admitted:
                try:
                    self.step_serving.submit(tracked, parsed)
                except Exception as exc:  # noqa: BLE001  (never the requests already in the engine)
                    log.exception("request %s: handing it to the step engine failed", tracked.request_id)
                    tracked.fail(RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
            return
        self._run_request_level(admitted)

    # ---- the request-level engine -----------------------------------------------------------------
    def _run_request_level(self, admitted: list[tuple[TrackedRequest, ParsedRequest]]) -> None:
        self._live = {parsed.index: _LiveRequest(tracked, parsed) for tracked, parsed in admitted}
        try:
            self._run_planned()
        finally:
            self._live = {}
            self.metrics.set("triton_diffusion_rows_in_flight", 0)

    def _run_planned(self) -> None:
        def on_complete(index: int, outputs: list[Any], calls: list[CallRecord]) -> None:
            live = self._live[index]
            report = {
                "key": live.parsed.key.as_dict(),
                "fused_calls": [{"id": c.call_id, "rows": c.rows, "requests": c.requests} for c in calls],
            }
            try:
                response = self.response(live.parsed, outputs, report)
            except RequestError as error:
                live.tracked.fail(error)
                return
            except Exception as exc:  # noqa: BLE001  (an encoding failure fails this request only)
                live.tracked.fail(RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
                return
            live.tracked.finish(response)

        planned = [PlannedRequest(i, live.parsed.key, live.parsed.rows) for i, live in self._live.items()]
        calls = plan_groups(planned, self.caps.cap_for)
        for call in calls:
            if call.cut_reason != "drained":
                self.metrics.increment("triton_diffusion_groups_cut_total", reason=call.cut_reason)
            if call.split_by:
                self.metrics.increment("triton_diffusion_groups_cut_total", reason=f"key:{call.split_by}")
        requests = {i: live.tracked for i, live in self._live.items()}
        self.executor.run(calls, requests, {p.index: p.rows for p in planned}, on_complete)

    def _run_planned_rows(self, key: CompatibilityKey, rows: list[Row]) -> list[Any]:
        self.metrics.set("triton_diffusion_rows_in_flight", len(rows))
        inputs = [RowInput(self._live[r.request_index].parsed.values, r.image_index) for r in rows]
        steps = StepReporter(self, rows)
        try:
            return self.run_rows(key, inputs, steps)
        except CallAbandoned:
            log.info("fused call abandoned: every row ended (no further steps, no decode)")
            return [None] * len(rows)

    def _on_call(self, report: CallReport) -> None:
        self.metrics.increment("triton_diffusion_fused_calls_total")
        if report.error is None:
            self.metrics.observe("triton_diffusion_fused_call_rows", report.rows)
            self.metrics.observe("triton_diffusion_pipeline_seconds", report.seconds)
        if report.bisected:
            self.metrics.increment("triton_diffusion_bisection_retries_total")
        if report.oom_split:
            self.metrics.increment("triton_diffusion_oom_splits_total")

    def _between_steps(
        self, steps: StepReporter, step: int, total: int, preview: Callable[[int], bytes] | None
    ) -> list[int]:
        from triton_diffusion.serving.triton_io import progress_outputs

        now = time.perf_counter()
        first_position: dict[int, int] = {}
        for position, row in enumerate(steps.alive):
            first_position.setdefault(row.request_index, position)
        for index, position in first_position.items():
            live = self._live[index]
            if live.tracked.ended:
                continue
            if not live.first_step_seen:
                live.first_step_seen = True
                self.metrics.observe("triton_diffusion_first_step_seconds", now - live.tracked.entered)
            if live.tracked.is_cancelled():
                cancelled_rows = sum(1 for r in steps.alive if r.request_index == index)
                self.metrics.increment("triton_diffusion_rows_cancelled_total", cancelled_rows)
                log.info("request %s cancelled after step %d/%d", live.tracked.request_id, step, total)
                live.tracked.fail(RequestError(ErrorCode.CANCELLED, f"cancelled after step {step}/{total}"))
                continue
            values = live.parsed.values
            if values.get("progress"):
                every = values.get("preview_every", 0)
                image = preview(position) if preview and every and step % every == 0 else None
                live.tracked.progress(progress_outputs(step, total, image))
        return [p for p, row in enumerate(steps.alive) if self.executor.is_ended(row.request_index)]

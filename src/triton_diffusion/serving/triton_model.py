"""The shared Triton Python model: parse -> plan -> fused calls -> one FINAL response per request.

A model kind (text-to-image, ...) subclasses :class:`BatchedDiffusionModel` and says which fields it
accepts, how to load its pipeline, how to run a list of rows in one call and how to answer a request.
Everything about batching lives here and in ``planner``/``executor``; all work runs inside
``execute()``, so Triton's queue statistics stay right and its dynamic batcher keeps forming batches.
Between two denoising steps, :class:`StepReporter` sends progress and answers cancelled requests at once.
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

from triton_diffusion.compatibility import CompatibilityKey, compatibility_key
from triton_diffusion.engine.executor import CallRecord, CallReport, FusedCallExecutor
from triton_diffusion.engine.planner import PlannedRequest, Row, RowCaps, plan_groups
from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.fields import Field, FieldSet, Role
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
    request: Any  # the pb_utils InferenceRequest
    parsed: ParsedRequest
    entered: float  # perf_counter() at execute() entry
    first_step_seen: bool = False


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


def batch_report(request: ParsedRequest, calls: list[CallRecord]) -> np.ndarray:
    """The BATCH output: the request's compatibility key and the fused calls its rows went through."""
    report = {
        "key": request.key.as_dict(),
        "fused_calls": [{"id": c.call_id, "rows": c.rows, "requests": c.requests} for c in calls],
    }
    return np.array([[json.dumps(report).encode()]], dtype=object)


class BatchedDiffusionModel:
    FIELDS: ClassVar[FieldSet]
    OUTPUTS: ClassVar[list[tuple[str, str, list[int]]]]

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

    def respond(
        self, request: ParsedRequest, outputs: list[Any], calls: list[CallRecord]
    ) -> dict[str, np.ndarray]:
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
        self.metrics = batching_metrics(self.settings.name)
        settings = self.settings
        self.fields = self.load(settings)
        self.caps = RowCaps.from_config(settings.max_rows_per_call(), settings.get("max_rows_by_resolution"))
        self.executor = FusedCallExecutor(self._run_planned_rows, self._on_call)
        self._live: dict[int, _LiveRequest] = {}
        log.info(
            "%s ready: max_rows_per_call=%d caps_by_resolution=%s",
            settings.name,
            self.caps.max_rows,
            dict(self.caps.by_resolution),
        )

    def execute(self, requests: Sequence[Any]) -> None:
        from triton_diffusion.serving.triton_io import send_error

        answered: set[int] = set()
        try:
            self._execute(requests, answered)
        except Exception as exc:  # noqa: BLE001  (every request must still get its FINAL response)
            log.exception("execute failed")
            error = RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            for index, request in enumerate(requests):
                if index not in answered:
                    self.metrics.increment("triton_diffusion_requests_failed_total", code=error.code.value)
                    send_error(request, error)
        finally:
            self._live = {}
            self.metrics.set("triton_diffusion_rows_in_flight", 0)
        return None

    def finalize(self) -> None:
        log.info("%s unloaded", self.settings.name)

    # ---- the batching path ------------------------------------------------------------------------
    def parse(self, index: int, raw: dict[str, Any]) -> ParsedRequest:
        values = self.resolve(self.fields.parse(raw))
        if "seed" in values and values["seed"] is None:
            values["seed"] = random.randrange(2**32)  # drawn here so the response can return it
        return ParsedRequest(index, values, compatibility_key(self.fields, values), self.rows_for(values))

    def _execute(self, requests: Sequence[Any], answered: set[int]) -> None:
        from triton_diffusion.serving.triton_io import read_raw_fields, send_error, send_final

        entered = time.perf_counter()
        self.metrics.observe("triton_diffusion_execute_requests", len(requests))
        log.info("execute: %d requests ids=%s", len(requests), [r.request_id() for r in requests])

        def answer_error(index: int, error: RequestError) -> None:
            answered.add(index)
            self.metrics.increment("triton_diffusion_requests_failed_total", code=error.code.value)
            send_error(requests[index], error)

        for index, request in enumerate(requests):
            try:
                parsed = self.parse(index, read_raw_fields(request, self.fields))
            except RequestError as error:
                answer_error(index, error)
                continue
            self._live[index] = _LiveRequest(request, parsed, entered)

        def on_complete(index: int, outputs: list[Any], calls: list[CallRecord]) -> None:
            try:
                response = self.respond(self._live[index].parsed, outputs, calls)
            except RequestError as error:
                answer_error(index, error)
                return
            except Exception as exc:  # noqa: BLE001  (an encoding failure fails this request only)
                answer_error(index, RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
                return
            answered.add(index)
            send_final(requests[index], response)

        planned = [PlannedRequest(i, live.parsed.key, live.parsed.rows) for i, live in self._live.items()]
        calls = plan_groups(planned, self.caps.cap_for)
        for call in calls:
            if call.cut_reason != "drained":
                self.metrics.increment("triton_diffusion_groups_cut_total", reason=call.cut_reason)
            if call.split_by:
                self.metrics.increment("triton_diffusion_groups_cut_total", reason=f"key:{call.split_by}")
        self.executor.run(calls, {p.index: p.rows for p in planned}, on_complete, answer_error)

    def _run_planned_rows(self, key: CompatibilityKey, rows: list[Row]) -> list[Any]:
        self.metrics.set("triton_diffusion_rows_in_flight", len(rows))
        inputs = [RowInput(self._live[r.request_index].parsed.values, r.image_index) for r in rows]
        return self.run_rows(key, inputs, StepReporter(self, rows))

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
        from triton_diffusion.serving.triton_io import send_progress

        now = time.perf_counter()
        first_position: dict[int, int] = {}
        for position, row in enumerate(steps.alive):
            first_position.setdefault(row.request_index, position)
        for index, position in first_position.items():
            if self.executor.is_ended(index):
                continue
            live = self._live[index]
            if not live.first_step_seen:
                live.first_step_seen = True
                self.metrics.observe("triton_diffusion_first_step_seconds", now - live.entered)
            if live.request.is_cancelled():
                cancelled_rows = sum(1 for r in steps.alive if r.request_index == index)
                self.metrics.increment("triton_diffusion_rows_cancelled_total", cancelled_rows)
                log.info("request %s cancelled after step %d/%d", live.request.request_id(), step, total)
                self.executor.fail(
                    index, RequestError(ErrorCode.CANCELLED, f"cancelled after step {step}/{total}")
                )
                continue
            values = live.parsed.values
            if values.get("progress"):
                every = values.get("preview_every", 0)
                image = preview(position) if preview and every and step % every == 0 else None
                send_progress(live.request, step, total, image)
        return [p for p, row in enumerate(steps.alive) if self.executor.is_ended(row.request_index)]

"""Run planned fused calls with failure isolation (the request-level engine).

Each call runs the pipeline once over its rows. If the call raises, its requests are bisected (split at a
request boundary near the middle) and each half is retried, so only the request that really fails gets
an error. Out-of-memory is handled the same way and, for a single request with several images, by
halving its rows, since every row keeps its own generator and so its own result. Retries start only
after the failed call's exception is gone (its traceback would keep the call's activations alive) and,
after an out-of-memory error, once the accelerator's cache is freed. A failed device (failures.py)
is not retried: the call's requests are answered UNAVAILABLE and :class:`DeviceLostError` is raised.

Before each call, the requests in it are asked once whether they were cancelled. A request can also end
while a call runs (cancelled between two denoising steps): it is answered at once, its rows' outputs are
ignored and its remaining rows are never run.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from triton_diffusion.compatibility import CompatibilityKey
from triton_diffusion.engine.failures import DeviceLostError, Failure, free_accelerator_memory
from triton_diffusion.engine.planner import FusedCall, Row
from triton_diffusion.engine.requests import TrackedRequest
from triton_diffusion.errors import ErrorCode, RequestError

log = logging.getLogger("triton_diffusion")

# (key, rows) -> one output per row, in row order; None for a row dropped because its request ended.
RunRows = Callable[[CompatibilityKey, list[Row]], list[Any]]


@dataclass(frozen=True)
class CallRecord:
    """What one request learns about a pipeline call its rows went through (sent in the BATCH output)."""

    call_id: int
    rows: int
    requests: int


@dataclass(frozen=True)
class CallReport:
    """One pipeline call as it happened, for the log line and the metrics."""

    call_id: int
    call: FusedCall
    rows: int
    requests: int
    retry: bool
    seconds: float
    error: str | None = None  # "ExceptionType: message"
    bisected: bool = False
    oom_split: bool = False


@dataclass
class _Pending:
    rows: int
    outputs: dict[int, Any] = field(default_factory=dict)
    calls: list[CallRecord] = field(default_factory=list)


class FusedCallExecutor:
    """Runs fused calls; each request is answered exactly once through its :class:`TrackedRequest`."""

    def __init__(self, run_rows: RunRows, on_call: Callable[[CallReport], None] | None = None) -> None:
        self.run_rows = run_rows
        self.on_call = on_call
        self._call_ids = itertools.count(1)
        self._requests: Mapping[int, TrackedRequest] = {}
        self._pending: dict[int, _Pending] = {}

    def is_ended(self, index: int) -> bool:
        return self._requests[index].ended

    def fail(self, index: int, error: RequestError) -> None:
        """Answer a request with an error now (also from inside a running call); later rows are skipped."""
        self._requests[index].fail(error)

    def run(
        self,
        calls: list[FusedCall],
        requests: Mapping[int, TrackedRequest],
        request_rows: Mapping[int, int],
        on_complete: Callable[[int, list[Any], list[CallRecord]], None],
    ) -> None:
        """Run every call; ``on_complete`` gets each request whose rows all succeeded (it answers it)."""
        self._requests = requests
        self._pending = {index: _Pending(rows) for index, rows in request_rows.items()}
        for call in calls:
            self._attempt(call, call.rows, on_complete, retry=False)

    def _live(self, rows: list[Row]) -> list[Row]:
        return [r for r in rows if not self.is_ended(r.request_index)]

    def _cancel_asked(self, rows: list[Row]) -> None:
        for index in dict.fromkeys(r.request_index for r in rows):
            if self._requests[index].is_cancelled():
                log.info("request %s cancelled before its call started", self._requests[index].request_id)
                self.fail(index, RequestError(ErrorCode.CANCELLED, "cancelled before its call started"))

    def _attempt(self, call: FusedCall, rows: list[Row], on_complete: Callable, retry: bool) -> None:
        self._cancel_asked(self._live(rows))
        rows = self._live(rows)
        if not rows:
            return
        call_id = next(self._call_ids)
        started = time.perf_counter()
        requests = list(dict.fromkeys(r.request_index for r in rows))
        for index in requests:
            self._requests[index].start()
        failure: Failure | None = None
        try:
            outputs = self.run_rows(call.key, rows)
            if len(outputs) != len(rows):
                raise RuntimeError(f"pipeline returned {len(outputs)} outputs for {len(rows)} rows")
        except Exception as exc:  # noqa: BLE001  (isolate: any failure is bisected, never fatal)
            # Only text leaves the handler: the exception's traceback holds the call's frames (and on a
            # GPU its activations) alive until it is dropped here.
            failure = Failure.of(exc)
        if failure is not None and failure.lost:  # sticky: no retry can succeed in this process
            for index in requests:
                self.fail(index, failure.request_error("pipeline call"))
            raise DeviceLostError(failure.text)
        if failure is not None:
            self._retry_after_failure(call, rows, requests, on_complete, retry, call_id, started, failure)
            return
        seconds = time.perf_counter() - started
        self._report(CallReport(call_id, call, len(rows), len(requests), retry, seconds))
        record = CallRecord(call_id, len(rows), len(requests))
        for row, output in zip(rows, outputs, strict=True):
            state = self._pending[row.request_index]
            if self.is_ended(row.request_index):
                continue
            if output is None:
                self.fail(row.request_index, RequestError(ErrorCode.INTERNAL, "pipeline dropped a row"))
                continue
            state.outputs[row.image_index] = output
            if not state.calls or state.calls[-1].call_id != call_id:
                state.calls.append(record)
        for index in requests:
            state = self._pending[index]
            if not self.is_ended(index) and len(state.outputs) == state.rows:
                on_complete(index, [state.outputs[i] for i in range(state.rows)], state.calls)

    def _retry_after_failure(
        self,
        call: FusedCall,
        rows: list[Row],
        requests: list[int],
        on_complete: Callable,
        retry: bool,
        call_id: int,
        started: float,
        failure: Failure,
    ) -> None:
        error, oom = failure.text, failure.oom
        live = self._live(rows)
        live_requests = list(dict.fromkeys(r.request_index for r in live))
        bisect = len(live_requests) > 1
        split_rows = not bisect and oom and len(live) > 1
        seconds = time.perf_counter() - started
        oom_split = oom and (bisect or split_rows)
        self._report(
            CallReport(call_id, call, len(rows), len(requests), retry, seconds, error, bisect, oom_split)
        )
        if oom:
            free_accelerator_memory()
        if bisect:
            split = _request_boundary_near_middle(live)
            halves = [live[:split], live[split:]]
        elif split_rows:
            halves = [live[: len(live) // 2], live[len(live) // 2 :]]
        else:
            for index in live_requests:
                self.fail(index, failure.request_error("pipeline call"))
            return
        for half in halves:
            self._attempt(call, half, on_complete, retry=True)

    def _report(self, report: CallReport) -> None:
        call, error = report.call, report.error
        # One line per pipeline call, in the spirit of SGLang's batching metrics log line.
        log.info(
            "fused call %d: rows=%d/%d requests=%d key=%s cut=%s split_by=%s retry=%s ms=%.1f%s",
            report.call_id,
            report.rows,
            call.cap,
            report.requests,
            call.key,
            call.cut_reason,
            call.split_by or "-",
            report.retry,
            report.seconds * 1000,
            f" error={error}" if error else "",
        )
        if self.on_call is not None:
            self.on_call(report)


def _request_boundary_near_middle(rows: list[Row]) -> int:
    boundaries = [i for i in range(1, len(rows)) if rows[i].request_index != rows[i - 1].request_index]
    return min(boundaries, key=lambda i: abs(i - len(rows) / 2))

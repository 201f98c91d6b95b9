"""Run planned fused calls with failure isolation (the request-level engine).

Each call runs the pipeline once over its rows (``failures.isolate``, the one isolation of both engines).
If the call raises, its requests are bisected (split at a request boundary near the middle) and each half
is retried, so only the request that really fails gets an error. Out-of-memory is handled the same way
and, for a single request with several images, by halving its rows, since every row keeps its own
generator and so its own result. Retries start only after the failed call's exception is gone and, after
an out-of-memory error, once the accelerator's cache is freed. A failed device is not retried:
:class:`DeviceLostError` is raised and the engine's owner answers what it holds.

Before each call, the engine takes the aborts of the requests in it (``before_call``). A request can also end
while a call runs (cancelled between two denoising steps): its rows' outputs are ignored and its
remaining rows are never run. Requests are never answered here: ``end`` decides a request's error and the
engine reports it; ``on_complete`` hands over a request whose rows all succeeded.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from triton_diffusion.compatibility import CompatibilityKey
from triton_diffusion.engine.failures import DeviceLostError, Failure, device_lost_error, isolate
from triton_diffusion.engine.planner import FusedCall, Row
from triton_diffusion.engine.request_status import RequestStatus
from triton_diffusion.errors import ErrorCode, RequestError

log = logging.getLogger("triton_diffusion")

# (key, rows) -> one output per row, in row order; None for a row dropped because its request ended.
RunRows = Callable[[CompatibilityKey, list[Row]], list[object]]


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
    outputs: dict[int, object] = field(default_factory=dict)
    calls: list[CallRecord] = field(default_factory=list)


@dataclass
class _Attempt:
    """The call under way: its id, when it started and the live rows it runs."""

    call_id: int
    started: float
    rows: list[Row]
    requests: list[int]


class FusedCallExecutor:
    def __init__(
        self,
        run_rows: RunRows,
        end: Callable[[int, RequestError], None],
        on_call: Callable[[CallReport], None] | None = None,
        before_call: Callable[[list[int]], None] = lambda indices: None,
    ) -> None:
        self.run_rows = run_rows
        self.end = end  # decide a request's error (by its index); the engine reports it
        self.on_call = on_call
        self.before_call = before_call  # the engine takes the aborts of these requests (by index)
        self._call_ids = itertools.count(1)
        self._requests: Mapping[int, RequestStatus] = {}
        self._pending: dict[int, _Pending] = {}
        self._attempt: _Attempt | None = None

    def is_ended(self, index: int) -> bool:
        return self._requests[index].ended

    def run(
        self,
        calls: list[FusedCall],
        requests: Mapping[int, RequestStatus],
        request_rows: Mapping[int, int],
        on_complete: Callable[[int, list[object], list[CallRecord]], None],
    ) -> None:
        """Run every call; ``on_complete`` gets each request whose rows all succeeded."""
        self._requests = requests
        self._pending = {index: _Pending(rows) for index, rows in request_rows.items()}
        try:
            for call in calls:
                self._run_call(call, on_complete)
        finally:  # nothing of these requests kept past the step (Triton's unload waits for each release)
            self._requests, self._pending, self._attempt = {}, {}, None

    def _live(self, rows: list[Row]) -> list[Row]:
        return [r for r in rows if not self.is_ended(r.request_index)]

    def _run_call(self, call: FusedCall, on_complete: Callable) -> None:
        def work(rows: list[Row]) -> list[object]:
            indices = dict.fromkeys(r.request_index for r in rows)
            self.before_call([index for index in indices if not self.is_ended(index)])
            live = self._live(rows)
            requests = list(dict.fromkeys(r.request_index for r in live))
            self._attempt = _Attempt(next(self._call_ids), time.perf_counter(), live, requests)
            if not live:
                return []
            outputs = self.run_rows(call.key, live)
            if len(outputs) != len(live):
                raise RuntimeError(f"pipeline returned {len(outputs)} outputs for {len(live)} rows")
            return outputs

        def done(rows: list[Row], outputs: list[object]) -> None:
            attempt = self._attempt
            assert attempt is not None  # work() set it
            if not attempt.rows:
                return
            seconds = time.perf_counter() - attempt.started
            retry = rows is not call.rows
            rows_run, requests_run = len(attempt.rows), len(attempt.requests)
            self._report(CallReport(attempt.call_id, call, rows_run, requests_run, retry, seconds))
            self._collect(attempt, outputs, on_complete)

        def split(rows: list[Row], failure: Failure) -> list[list[Row]] | None:
            live = self._live(rows)
            if len({r.request_index for r in live}) > 1:  # bisect at a request boundary
                middle = _request_boundary_near_middle(live)
                return [live[:middle], live[middle:]]
            if failure.oom and len(live) > 1:  # one request's images: each row has its own generator
                return [live[: len(live) // 2], live[len(live) // 2 :]]
            return None

        def failed(rows: list[Row], failure: Failure) -> None:
            attempt = self._attempt
            assert attempt is not None  # work() set it
            live = self._live(rows)
            bisect = len({r.request_index for r in live}) > 1
            oom_split = failure.oom and (bisect or len(live) > 1)
            seconds = time.perf_counter() - attempt.started
            retry = rows is not call.rows
            report = CallReport(
                attempt.call_id,
                call,
                len(attempt.rows),
                len(attempt.requests),
                retry,
                seconds,
                failure.text,
                bisect,
                oom_split,
            )
            self._report(report)

        def fail(rows: list[Row], failure: Failure) -> None:
            for index in dict.fromkeys(r.request_index for r in self._live(rows)):
                self.end(index, failure.request_error("pipeline call"))

        try:
            isolate(work, call.rows, done=done, fail=fail, split=split, failed=failed)
        except DeviceLostError as lost:  # sticky: no retry can succeed; the call's requests are told why
            for index in dict.fromkeys(r.request_index for r in self._live(call.rows)):
                self.end(index, device_lost_error(str(lost)))
            raise

    def _collect(
        self,
        attempt: _Attempt,
        outputs: list[object],
        on_complete: Callable[[int, list[object], list[CallRecord]], None],
    ) -> None:
        record = CallRecord(attempt.call_id, len(attempt.rows), len(attempt.requests))
        for row, output in zip(attempt.rows, outputs, strict=True):
            state = self._pending[row.request_index]
            if self.is_ended(row.request_index):
                continue
            if output is None:
                self.end(row.request_index, RequestError(ErrorCode.INTERNAL, "pipeline dropped a row"))
                continue
            state.outputs[row.image_index] = output
            if not state.calls or state.calls[-1].call_id != attempt.call_id:
                state.calls.append(record)
        for index in attempt.requests:
            state = self._pending[index]
            if not self.is_ended(index) and len(state.outputs) == state.rows:
                on_complete(index, [state.outputs[i] for i in range(state.rows)], state.calls)

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

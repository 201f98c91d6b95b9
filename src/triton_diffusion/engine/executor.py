"""Run planned fused calls with failure isolation.

Each call runs the pipeline once over its rows. If the call raises, its requests are bisected (split at a
request boundary near the middle) and each half is retried, so only the request that really fails gets
an error. Out-of-memory is handled the same way and, for a single request with several images, by
halving its rows, since every row keeps its own generator and so its own result.

A request can also end while a call runs (cancelled between two denoising steps): ``fail`` answers it at
once, its rows' outputs are ignored and its remaining rows are never run.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from triton_diffusion.compatibility import CompatibilityKey
from triton_diffusion.engine.planner import FusedCall, Row
from triton_diffusion.errors import ErrorCode, RequestError

log = logging.getLogger("triton_diffusion")

# (key, rows) -> one output per row, in row order; None for a row dropped because its request ended.
RunRows = Callable[[CompatibilityKey, list[Row]], list[Any]]


def is_out_of_memory(exc: BaseException) -> bool:
    # torch.OutOfMemoryError (CUDA) or a host MemoryError; matched by name to keep this module torch-free.
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


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
    error: BaseException | None = None
    bisected: bool = False
    oom_split: bool = False


@dataclass
class _Pending:
    rows: int
    outputs: dict[int, Any] = field(default_factory=dict)
    calls: list[CallRecord] = field(default_factory=list)
    ended: bool = False  # failed or cancelled: answered already


class FusedCallExecutor:
    """Runs fused calls and reports each request exactly once: complete (all rows) or failed."""

    def __init__(self, run_rows: RunRows, on_call: Callable[[CallReport], None] | None = None) -> None:
        self.run_rows = run_rows
        self.on_call = on_call
        self._call_ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._on_error: Callable[[int, RequestError], None] = lambda index, error: None

    def is_ended(self, index: int) -> bool:
        return self._pending[index].ended

    def fail(self, index: int, error: RequestError) -> None:
        """Answer a request with an error now (also from inside a running call); later rows are skipped."""
        state = self._pending[index]
        if not state.ended:
            state.ended = True
            self._on_error(index, error)

    def run(
        self,
        calls: list[FusedCall],
        request_rows: Mapping[int, int],
        on_complete: Callable[[int, list[Any], list[CallRecord]], None],
        on_error: Callable[[int, RequestError], None],
    ) -> None:
        self._pending = {index: _Pending(rows) for index, rows in request_rows.items()}
        self._on_error = on_error
        for call in calls:
            self._attempt(call, call.rows, on_complete, retry=False)

    def _live(self, rows: list[Row]) -> list[Row]:
        return [r for r in rows if not self._pending[r.request_index].ended]

    def _attempt(self, call: FusedCall, rows: list[Row], on_complete: Callable, retry: bool) -> None:
        rows = self._live(rows)
        if not rows:
            return
        call_id = next(self._call_ids)
        started = time.perf_counter()
        requests = list(dict.fromkeys(r.request_index for r in rows))
        try:
            outputs = self.run_rows(call.key, rows)
            if len(outputs) != len(rows):
                raise RuntimeError(f"pipeline returned {len(outputs)} outputs for {len(rows)} rows")
        except Exception as exc:  # noqa: BLE001  (isolate: any failure is bisected, never fatal)
            oom = is_out_of_memory(exc)
            live = self._live(rows)
            live_requests = list(dict.fromkeys(r.request_index for r in live))
            bisect = len(live_requests) > 1
            split_rows = not bisect and oom and len(live) > 1
            self._report(
                CallReport(
                    call_id,
                    call,
                    len(rows),
                    len(requests),
                    retry,
                    time.perf_counter() - started,
                    exc,
                    bisect,
                    oom and (bisect or split_rows),
                )
            )
            if bisect:
                split = _request_boundary_near_middle(live)
                self._attempt(call, live[:split], on_complete, retry=True)
                self._attempt(call, live[split:], on_complete, retry=True)
            elif split_rows:
                half = len(live) // 2
                self._attempt(call, live[:half], on_complete, retry=True)
                self._attempt(call, live[half:], on_complete, retry=True)
            elif live_requests:
                code = ErrorCode.UNAVAILABLE if oom else ErrorCode.INTERNAL
                self.fail(
                    live_requests[0], RequestError(code, f"pipeline call failed: {type(exc).__name__}: {exc}")
                )
            return
        self._report(
            CallReport(call_id, call, len(rows), len(requests), retry, time.perf_counter() - started)
        )
        record = CallRecord(call_id, len(rows), len(requests))
        for row, output in zip(rows, outputs, strict=True):
            state = self._pending[row.request_index]
            if state.ended:
                continue
            if output is None:
                self.fail(row.request_index, RequestError(ErrorCode.INTERNAL, "pipeline dropped a row"))
                continue
            state.outputs[row.image_index] = output
            if not state.calls or state.calls[-1].call_id != call_id:
                state.calls.append(record)
        for index in requests:
            state = self._pending[index]
            if not state.ended and len(state.outputs) == state.rows:
                state.ended = True
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
            f" error={type(error).__name__}: {error}" if error else "",
        )
        if self.on_call is not None:
            self.on_call(report)


def _request_boundary_near_middle(rows: list[Row]) -> int:
    boundaries = [i for i in range(1, len(rows)) if rows[i].request_index != rows[i - 1].request_index]
    return min(boundaries, key=lambda i: abs(i - len(rows) / 2))

"""Run planned fused calls with failure isolation.

Each call runs the pipeline once over its rows. If the call raises, its requests are bisected (split at a
request boundary near the middle) and each half is retried, so only the request that really fails gets
an error. Out-of-memory is handled the same way and, for a single request with several images, by
halving its rows, since every row keeps its own generator and so its own result.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from triton_diffusion.compatibility import CompatibilityKey
from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.planner import FusedCall, Row

log = logging.getLogger("triton_diffusion")

# (key, rows) -> one output per row, in row order.
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
    key: CompatibilityKey


@dataclass
class ExecutorStats:
    fused_calls: int = 0
    bisections: int = 0
    oom_splits: int = 0


@dataclass
class _Pending:
    rows: int
    outputs: dict[int, Any] = field(default_factory=dict)
    calls: list[CallRecord] = field(default_factory=list)
    failed: bool = False


class FusedCallExecutor:
    """Runs fused calls and reports each request exactly once: complete (all rows) or failed."""

    def __init__(self, run_rows: RunRows) -> None:
        self.run_rows = run_rows
        self.stats = ExecutorStats()
        self._call_ids = itertools.count(1)

    def run(
        self,
        calls: list[FusedCall],
        request_rows: Mapping[int, int],
        on_complete: Callable[[int, list[Any], list[CallRecord]], None],
        on_error: Callable[[int, RequestError], None],
    ) -> None:
        pending = {index: _Pending(rows) for index, rows in request_rows.items()}

        def fail(index: int, error: RequestError) -> None:
            if not pending[index].failed:
                pending[index].failed = True
                on_error(index, error)

        def attempt(call: FusedCall, rows: list[Row], retry: bool) -> None:
            call_id = next(self._call_ids)
            self.stats.fused_calls += 1
            started = time.perf_counter()
            requests = list(dict.fromkeys(r.request_index for r in rows))
            try:
                outputs = self.run_rows(call.key, rows)
                if len(outputs) != len(rows):
                    raise RuntimeError(f"pipeline returned {len(outputs)} outputs for {len(rows)} rows")
            except Exception as exc:  # noqa: BLE001  (isolate: any failure is bisected, never fatal)
                self._log_call(call_id, call, rows, requests, started, retry, error=exc)
                oom = is_out_of_memory(exc)
                if len(requests) > 1:
                    self.stats.bisections += 1
                    self.stats.oom_splits += int(oom)
                    split = _request_boundary_near_middle(rows)
                    attempt(call, rows[:split], True)
                    attempt(call, [r for r in rows[split:] if not pending[r.request_index].failed], True)
                elif oom and len(rows) > 1:
                    self.stats.oom_splits += 1
                    half = len(rows) // 2
                    attempt(call, rows[:half], True)
                    if not pending[requests[0]].failed:
                        attempt(call, rows[half:], True)
                else:
                    code = ErrorCode.UNAVAILABLE if oom else ErrorCode.INTERNAL
                    fail(
                        requests[0], RequestError(code, f"pipeline call failed: {type(exc).__name__}: {exc}")
                    )
                return
            self._log_call(call_id, call, rows, requests, started, retry)
            record = CallRecord(call_id, len(rows), len(requests), call.key)
            for row, output in zip(rows, outputs, strict=True):
                state = pending[row.request_index]
                state.outputs[row.image_index] = output
                if not state.calls or state.calls[-1].call_id != call_id:
                    state.calls.append(record)
            for index in requests:
                state = pending[index]
                if len(state.outputs) == state.rows:
                    on_complete(index, [state.outputs[i] for i in range(state.rows)], state.calls)

        for call in calls:
            rows = [r for r in call.rows if not pending[r.request_index].failed]
            if rows:
                attempt(call, rows, retry=False)

    def _log_call(
        self,
        call_id: int,
        call: FusedCall,
        rows: list[Row],
        requests: list[int],
        started: float,
        retry: bool,
        error: BaseException | None = None,
    ) -> None:
        # One line per pipeline call, in the spirit of SGLang's batching metrics log line.
        log.info(
            "fused call %d: rows=%d/%d requests=%d key=%s cut=%s split_by=%s retry=%s ms=%.1f%s",
            call_id,
            len(rows),
            call.cap,
            len(requests),
            call.key,
            call.cut_reason,
            call.split_by or "-",
            retry,
            (time.perf_counter() - started) * 1000,
            f" error={type(error).__name__}: {error}" if error else "",
        )


def _request_boundary_near_middle(rows: list[Row]) -> int:
    boundaries = [i for i in range(1, len(rows)) if rows[i].request_index != rows[i - 1].request_index]
    return min(boundaries, key=lambda i: abs(i - len(rows) / 2))

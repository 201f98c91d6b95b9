"""One classifier for every failure of a model call, used by both engines, and what to do about it.

* Out of memory: the call was too big; free the cache and retry smaller (the engines split the work).
* Device lost: a CUDA error other than out-of-memory (illegal address, launch failure, ECC error) is
  sticky: every later call in this process fails too. Retrying or bisecting is pointless; the requests
  held are answered UNAVAILABLE and the process exits, so the launcher's supervisor restarts the server
  with a fresh CUDA context (docs/operations/reliability.md). A device error counts as that only if a
  probe on the device fails as well.
* Anything else: this call's own problem (a bad input, a bug).

:func:`isolate` is failure isolation, written once for every batched call of both engines (a forward, a
start, a decode, a fused pipeline call): a batch that fails is split and each part retried, until the
culprit is alone; only what fails alone fails; out of memory frees the cache first; a lost device stops.

Exceptions are matched by name so this module stays torch-free.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from triton_diffusion.errors import ErrorCode, RequestError

log = logging.getLogger("triton_diffusion")

# The stub's exit status when it leaves because its device failed (EX_SOFTWARE).
DEVICE_LOST_EXIT_CODE = 70


class DeviceLostError(RuntimeError):
    """Raised out of an engine when its accelerator failed; carries the original error's text."""


def is_out_of_memory(exc: BaseException) -> bool:
    # torch.OutOfMemoryError (the caching allocator), a host MemoryError, or a raw CUDA allocation
    # (pinned host memory, cuBLAS workspaces) failing with "CUDA error: out of memory".
    return (
        isinstance(exc, MemoryError)
        or type(exc).__name__ == "OutOfMemoryError"
        or (isinstance(exc, RuntimeError) and "out of memory" in str(exc))
    )


# Prefixes of the errors a failed device raises (torch, cuDNN, cuBLAS, Triton kernels).
_DEVICE_ERROR_MARKERS = ("CUDA error", "cuDNN error", "CUBLAS_STATUS", "Triton Error [CUDA]")


def is_device_lost(exc: BaseException) -> bool:
    """A device error that the device itself confirms: some CUDA errors come from one bad launch (an
    invalid configuration for a huge shape, a cuBLAS shape it does not support) and leave the device
    working, and a request must never be able to restart the server on demand. So a candidate counts
    only if a tiny probe on the device fails too."""
    if is_out_of_memory(exc):
        return False
    text = str(exc)
    # torch >= 2.8 raises torch.AcceleratorError for CUDA errors; older releases a RuntimeError.
    candidate = type(exc).__name__ == "AcceleratorError" or (
        isinstance(exc, RuntimeError) and any(marker in text for marker in _DEVICE_ERROR_MARKERS)
    )
    return candidate and not _device_still_works()


# The device this process's model runs on (adapters/devices.py instance_device): the check below asks it
# by name, whichever thread asks (torch's current device is per thread, and a new thread's is cuda:0).
_PROBED = "cuda"


def probe_device(device: str) -> None:
    global _PROBED
    _PROBED = device


def _device_still_works() -> bool:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return False  # no device to ask (a simulated error on a CPU host): trust the error
    try:
        torch.cuda.synchronize(_PROBED)
        probe = torch.ones(1, device=_PROBED) + 1
        return float(probe.item()) == 2.0
    except Exception:  # noqa: BLE001  (any failure here is the answer)
        return False


def device_lost_error(error: str) -> RequestError:
    return RequestError(
        ErrorCode.UNAVAILABLE, f"the accelerator failed ({error}); the model is restarting, retry shortly"
    )


class FailureKind(str, Enum):
    ORDINARY = "ordinary"  # this call's own problem (a bad input, a bug): retried smaller to find it
    OUT_OF_MEMORY = "out_of_memory"  # too big: free the cache, retry smaller; alone it is UNAVAILABLE
    DEVICE_LOST = "device_lost"  # sticky: nothing can run in this process again


@dataclass(frozen=True)
class Failure:
    """What a failed call raised, as text (the exception itself would keep the call's frames, and on a
    GPU its activations, alive until dropped) and what kind of failure it is."""

    kind: FailureKind
    text: str  # "ExceptionType: message"

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        text = f"{type(exc).__name__}: {exc}"
        if is_out_of_memory(exc):
            return cls(FailureKind.OUT_OF_MEMORY, text)
        if is_device_lost(exc):
            return cls(FailureKind.DEVICE_LOST, text)
        return cls(FailureKind.ORDINARY, text)

    @property
    def oom(self) -> bool:
        return self.kind is FailureKind.OUT_OF_MEMORY

    @property
    def lost(self) -> bool:
        return self.kind is FailureKind.DEVICE_LOST

    def request_error(self, what: str) -> RequestError:
        """The answer for a request that failed alone: the one mapping from failure kind to error code."""
        if self.lost:
            return device_lost_error(self.text)
        code = ErrorCode.UNAVAILABLE if self.oom else ErrorCode.INTERNAL
        return RequestError(code, f"{what} failed: {self.text}")


T = TypeVar("T")
R = TypeVar("R")  # what the work returns, handed to ``done``


def halves(items: list[T], failure: Failure) -> list[list[T]] | None:
    """The default split of a failed batch: two halves (None once it is a single item)."""
    if len(items) < 2:
        return None
    middle = len(items) // 2
    return [items[:middle], items[middle:]]


def isolate(
    work: Callable[[list[T]], R],
    items: list[T],
    *,
    done: Callable[[list[T], R], None],
    fail: Callable[[list[T], Failure], None],
    split: Callable[[list[T], Failure], list[list[T]] | None] = halves,
    failed: Callable[[list[T], Failure], None] | None = None,
) -> None:
    """Run ``work`` over ``items``; on success ``done(items, result)``. If it raises: ``failed(items,
    failure)`` (to log, count or learn a cap), the accelerator's cache freed after out of memory, then each
    part of ``split(items, failure)`` retried the same way, in order; where it cannot be split (one item,
    or a split that returns None) ``fail(items, failure)`` answers them. A lost device raises
    :class:`DeviceLostError` at once: nothing can run in this process again, and the caller answers what it
    holds. Only text leaves the handler, so a failed call's activations are freed before any retry."""
    try:
        result = work(items)
    except Exception as exc:  # noqa: BLE001  (isolate: any failure is split and retried, never fatal)
        failure = Failure.of(exc)
    else:
        done(items, result)
        return
    if failure.lost:
        raise DeviceLostError(failure.text)
    if failed is not None:
        failed(items, failure)
    if failure.oom:
        free_accelerator_memory()
    parts = split(items, failure)
    if not parts:
        fail(items, failure)
        return
    for part in parts:
        isolate(work, part, done=done, fail=fail, split=split, failed=failed)


def free_accelerator_memory() -> None:
    """Return cached blocks to the device after an out-of-memory error, before the smaller retry."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001  (a failed device says so at the next call, where it is handled)
        log.exception("freeing the accelerator's cache failed")


def exit_for_restart(reason: str) -> None:
    """Leave the process now (no cleanup can be trusted with a failed device or a stuck thread); the
    supervisor restarts the server. ``reason`` says why ("the accelerator failed (...)")."""
    message = f"{reason}: exiting so the server restarts with a fresh process and device"
    log.critical(message)
    # Triton's log lines leave the stub on a background thread: say it on stderr too, and give them a moment.
    print(f"triton_diffusion: {message}", file=sys.stderr, flush=True)
    time.sleep(0.5)
    os._exit(DEVICE_LOST_EXIT_CODE)

"""Which exceptions from a model call mean what for the accelerator, and what to do about them.

* Out of memory: the call was too big; free the cache and retry smaller (the engines split the work).
* Device lost: a CUDA error other than out-of-memory (illegal address, launch failure, ECC error) is
  sticky: every later call in this process fails too. Retrying or bisecting is pointless; the requests
  held are answered UNAVAILABLE and the process exits, so the launcher's supervisor restarts the server
  with a fresh CUDA context (README "Reliability").

Exceptions are matched by name so this module stays torch-free.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from triton_diffusion.errors import ErrorCode, RequestError

log = logging.getLogger("triton_diffusion")

# The stub's exit status when it leaves because its device failed (EX_SOFTWARE).
DEVICE_LOST_EXIT_CODE = 70


class DeviceLostError(RuntimeError):
    """Raised out of an engine when its accelerator failed; carries the original error's text."""


def is_out_of_memory(exc: BaseException) -> bool:
    # torch.OutOfMemoryError (CUDA) or a host MemoryError.
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def is_device_lost(exc: BaseException) -> bool:
    if is_out_of_memory(exc):
        return False
    # torch >= 2.8 raises torch.AcceleratorError for CUDA errors; older releases a RuntimeError.
    return type(exc).__name__ == "AcceleratorError" or (
        isinstance(exc, RuntimeError) and str(exc).startswith("CUDA error")
    )


def device_lost_error(error: str) -> RequestError:
    return RequestError(
        ErrorCode.UNAVAILABLE, f"the accelerator failed ({error}); the model is restarting, retry shortly"
    )


def free_accelerator_memory() -> None:
    """Return cached blocks to the device after an out-of-memory error, before the smaller retry."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def exit_for_restart(error: str) -> None:
    """Leave the process now (no cleanup can be trusted with a failed device); the supervisor restarts."""
    message = f"the accelerator failed ({error}): exiting so the server restarts with a fresh device"
    log.critical(message)
    # Triton's log lines leave the stub on a background thread: say it on stderr too, and give them a moment.
    print(f"triton_diffusion: {message}", file=sys.stderr, flush=True)
    time.sleep(0.5)
    os._exit(DEVICE_LOST_EXIT_CODE)

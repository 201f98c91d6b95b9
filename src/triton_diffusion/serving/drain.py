"""Draining on SIGTERM: the contract between the launcher and the models it serves, through files.

Why files: the launcher and the models' engine hosts are different processes (tritonserver starts the
Python backend stubs, the launcher only starts tritonserver), and Triton offers no call that reaches a
model's code outside a request. An environment variable set on tritonserver reaches every stub (they
inherit it), and a file is the cheapest thing each can poll.

The sequence (launcher.py, supervisor.py; the engine host on the model side):

1. At start the launcher picks the drain file's path (:func:`drain_path`), removes a stale one and the
   ``.done`` marks beside it (:func:`clear`), and starts tritonserver with ``TRITON_DIFFUSION_DRAIN_FILE``
   set to it.
2. On SIGTERM it writes the file (:func:`request_drain`) and reports not ready (the orchestrator sends no
   new traffic here).
3. Each model's engine host polls :func:`is_draining` (a ``stat``, every half second or so). Once the file
   exists it refuses new requests with UNAVAILABLE ("draining: resend to another replica or after
   restart"), lets the jobs that can finish within the drain time finish, checkpoints the others and
   answers them UNAVAILABLE naming their resume key, then calls :func:`mark_drained` (``<drain
   file>.<model>.done``).
4. The launcher waits for every model's mark (:func:`wait_drained`) or the drain time, whichever comes
   first, then sends tritonserver SIGTERM as it always did and does not restart it.

A model that knows nothing of draining never writes its mark: the launcher just waits the drain time.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

ENV = "TRITON_DIFFUSION_DRAIN_FILE"
# What a model answers for a request it refuses while draining: clients resend these (the project's
# client does, with the same resume key), so the words are part of the contract.
DRAINING_MESSAGE = "draining: resend to another replica or after restart"
POLL_S = 0.5  # how often a model looks for the file, and the launcher for the models' marks


def drain_file_from_env(environ: Mapping[str, str] | None = None) -> Path | None:
    """The drain file the launcher gave this process's server, None when it was started without one
    (``tritonserver`` run by hand, tests): such a model never drains."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    return Path(value) if value else None


def drain_path(http_port: str, environ: Mapping[str, str] | None = None) -> Path:
    """Where the launcher keeps its drain file: the one named in the launcher's own environment, else one
    per HTTP port in the temporary directory (two servers on one machine never share a port, so never a
    drain file; a shared volume would drain every replica at once: keep it local to the pod)."""
    return drain_file_from_env(environ) or Path(tempfile.gettempdir()) / f"triton-diffusion-{http_port}.drain"


def done_path(path: Path, model: str) -> Path:
    return path.with_name(f"{path.name}.{model}.done")


def is_draining(path: Path | None) -> bool:
    """The launcher asked the server to drain. One ``stat``: cheap enough to ask every engine step."""
    return path is not None and path.exists()


def request_drain(path: Path) -> None:
    """Ask every model to drain (the launcher, on SIGTERM). Written whole then renamed, so a model never
    sees a half-written file (its contents are informational: when it was asked)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(f"{time.time():.3f}\n")
    partial.replace(path)


def mark_drained(path: Path, model: str) -> None:
    """A model has nothing running any more (finished, or checkpointed and answered): the launcher need
    not wait for it."""
    done_path(path, model).write_text(f"{time.time():.3f}\n")


def not_drained(path: Path, models: Iterable[str]) -> list[str]:
    """The models that have not marked themselves drained yet."""
    return [model for model in models if not done_path(path, model).exists()]


def wait_drained(
    path: Path,
    models: Iterable[str],
    timeout_s: float,
    give_up: Callable[[], bool] = lambda: False,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[str]:
    """Wait until every model has marked itself drained, ``timeout_s`` passed or ``give_up()`` says
    there is no point waiting (the server exited, a second signal). Returns the models still not
    drained (empty: all drained)."""
    models = sorted(set(models))
    deadline = clock() + timeout_s
    while True:
        pending = not_drained(path, models)
        if not pending or give_up():
            return pending
        left = deadline - clock()
        if left <= 0:
            return pending
        sleep(min(POLL_S, left))


def clear(path: Path) -> None:
    """Remove a drain file and the models' marks left by an earlier run (a launcher killed while
    draining): a server started with one would refuse every request."""
    for stale in [path, path.with_name(path.name + ".partial"), *path.parent.glob(f"{path.name}.*.done")]:
        try:
            stale.unlink()
        except FileNotFoundError:
            pass

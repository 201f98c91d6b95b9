"""Draining on SIGTERM: the contract between the launcher and the models it serves, through files.

Why files: the launcher and the models' engine hosts are different processes (tritonserver starts the
Python backend stubs, the launcher only starts tritonserver), and Triton offers no call that reaches a
model's code outside a request. An environment variable set on tritonserver reaches every stub (they
inherit it), and a file is the cheapest thing each can poll.

The sequence (launcher.py, supervisor.py; the engine host on the model side):

1. At start the launcher picks the drain file's path (:func:`drain_path`), removes a stale one and the
   ``.done`` marks beside it (:func:`clear`), and starts tritonserver with ``TRITON_DIFFUSION_DRAIN_FILE``
   set to it.
2. On SIGTERM it writes the file (:func:`request_drain`: its content is the drain deadline, a unix time,
   now + ``--drain-s``) and reports not ready (the orchestrator sends no new traffic here).
3. Each model instance's engine host polls the file (:class:`DrainWatch`: a ``stat`` at most every half
   second, between engine steps). Once the file exists it refuses new requests with UNAVAILABLE
   ("draining: resend to another replica or after restart"), lets the jobs that can finish before the
   drain deadline (:func:`drain_deadline`) finish, checkpoints the others and answers them UNAVAILABLE
   naming their resume key, then, holding nothing any more, calls :func:`mark_drained`: ``<drain
   file>.<model>.<instance>.done``, one mark per instance (a model of several instances is drained once
   every one is).
4. The launcher waits for every model's marks (:func:`wait_drained`: a model is drained when each of its
   instances marked itself, or the model marked itself whole, ``<drain file>.<model>.done``) or the drain
   time, whichever comes first, then sends tritonserver SIGTERM as it always did and does not restart it.

A model that knows nothing of draining never writes its mark: the launcher just waits the drain time.

One more mark serves every stop, drained or not: Triton unloads a model on SIGTERM once every request of
it was answered (each holds the model), then calls its ``finalize``, which answers anything still held
and writes ``<drain file>.<model>.<instance>.finalized`` (:func:`mark_finalized`). Triton's own exit then
still waits for each stub process to end and looks for loaded models once a second; once every instance
whose stub lives marked itself finalized, nothing of them is left to answer, so the launcher ends the
server (:func:`not_finalized`; supervisor.py, also on a crash restart).
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

log = logging.getLogger("triton_diffusion")

ENV = "TRITON_DIFFUSION_DRAIN_FILE"
# What a model answers for a request it refuses while draining, for people: clients resend it by its retry
# hint (errors.py RetryHint), never by these words.
DRAINING_MESSAGE = "draining: resend to another replica or after restart"
POLL_S = 0.5  # how often a model looks for the file, and the launcher for the models' marks


def drain_file_from_env(environ: Mapping[str, str] | None = None) -> Path | None:
    """The drain file the launcher gave this process's server, None when it was started without one
    (``tritonserver`` run by hand, tests): such a model never drains."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    return Path(value) if value else None


def drain_path(http_port: str, environ: Mapping[str, str] | None = None) -> Path:
    """Where the launcher keeps its drain file: the one named in the launcher's own environment, else one
    per HTTP port in this user's own folder of the temporary directory (two servers on one machine never
    share a port, so never a drain file; a shared volume would drain every replica at once: keep it local
    to the pod)."""
    return drain_file_from_env(environ) or private_folder() / f"triton-diffusion-{http_port}.drain"


def private_folder(base: Path | None = None) -> Path:
    """This user's folder for drain files under ``base`` (the temporary directory), readable and writable
    by this user only: anyone who could write there could drain this server (every request refused) or
    leave a file it cannot remove. Where the usual one is not that (a link or a file put there, another
    user's, open to others), a new folder of a random name instead, said in the log."""
    base = base or Path(tempfile.gettempdir())
    try:
        return _own_folder(base / f"triton-diffusion-{os.getuid()}")
    except RuntimeError as refused:
        folder = Path(tempfile.mkdtemp(prefix=f"triton-diffusion-{os.getuid()}-", dir=base))
        log.warning("%s; the drain file goes in %s instead (or set %s)", refused, folder, ENV)
        return folder


def _own_folder(folder: Path) -> Path:
    """``folder``, made where missing; RuntimeError saying why where it is not this user's alone."""
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass  # ours from before, or what the checks below refuse
    found = folder.lstat()
    why = None
    if stat.S_ISLNK(found.st_mode) or not stat.S_ISDIR(found.st_mode):
        why = "a link or a file, not a folder"
    elif found.st_uid != os.getuid():
        why = "another user's"
    elif found.st_mode & 0o077:
        why = "open to other users"
    if why is not None:
        raise RuntimeError(f"{folder}: {why}")
    return folder


def mark_path(path: Path, model: str, instance: str | None = None, mark: str = "done") -> Path:
    """A model's mark (``instance`` None: the whole model), or one instance's: ``done`` (drained) or
    ``finalized``."""
    name = model if instance is None else f"{model}.{instance}"
    return path.with_name(f"{path.name}.{name}.{mark}")


def is_draining(path: Path | None) -> bool:
    """The launcher asked the server to drain. One ``stat``: cheap enough to ask every engine step."""
    return path is not None and path.exists()


def request_drain(path: Path, drain_s: float = 0.0, clock: Callable[[], float] = time.time) -> None:
    """Ask every model to drain (the launcher, on SIGTERM) within ``drain_s``: the file holds the drain
    deadline, a unix time (what a model's jobs must be done by). Written whole then renamed, so a model
    never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(f"{clock() + drain_s:.3f}\n")
    partial.replace(path)


def drain_deadline(path: Path) -> float:
    """The drain deadline the launcher wrote (a unix time). A file that does not hold one (written by hand,
    an older launcher) gives its modification time: no time left, every job is checkpointed at once."""
    try:
        return float(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        try:
            return path.stat().st_mtime
        except OSError:
            return time.time()


def mark_drained(path: Path, model: str, instance: str | None = None) -> None:
    """A model instance (``instance`` None: the whole model) has nothing running any more (finished, or
    checkpointed and answered): the launcher need not wait for it."""
    mark_path(path, model, instance).write_text(f"{time.time():.3f}\n")


def mark_finalized(path: Path, model: str, instance: str | None = None) -> None:
    """A model instance was unloaded and its ``finalize`` answered anything still held: nothing of it needs
    the server."""
    mark_path(path, model, instance, "finalized").write_text(f"{time.time():.3f}\n")


def not_finalized(path: Path, instances: Mapping[str, Iterable[str]]) -> list[str]:
    """The instances (of ``{model: [instance, ...]}``) that have not marked themselves finalized."""
    return [
        name
        for model, names in sorted(instances.items())
        for name in sorted(names)
        if not mark_path(path, model, name, "finalized").exists()
    ]


def not_drained(path: Path, models: Iterable[str] | Mapping[str, Iterable[str]]) -> list[str]:
    """The models that have not marked themselves drained yet. With each model's instances (a mapping),
    a model is drained once its own mark or every instance's mark is there."""
    instances = models if isinstance(models, Mapping) else {model: () for model in models}
    pending = []
    for model, names in instances.items():
        names = list(names)
        whole = mark_path(path, model).exists()
        if not whole and not (names and all(mark_path(path, model, name).exists() for name in names)):
            pending.append(model)
    return pending


def wait_drained(
    path: Path,
    models: Iterable[str] | Mapping[str, Iterable[str]],
    timeout_s: float,
    give_up: Callable[[], bool] = lambda: False,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[str]:
    """Wait until every model has marked itself drained, ``timeout_s`` passed or ``give_up()`` says
    there is no point waiting (the server exited, a second signal). Returns the models still not
    drained (empty: all drained). ``models`` may map each model to its instances (:func:`not_drained`)."""
    if isinstance(models, Mapping):
        watched = {model: sorted(set(models[model])) for model in sorted(models)}
    else:
        watched = {model: [] for model in sorted(set(models))}
    deadline = clock() + timeout_s
    while True:
        pending = not_drained(path, watched)
        if not pending or give_up():
            return pending
        left = deadline - clock()
        if left <= 0:
            return pending
        sleep(min(POLL_S, left))


def clear(path: Path) -> None:
    """Remove a drain file and the models' marks left by an earlier run (a launcher killed while
    draining, a server restarted): a server started with one would refuse every request, or look
    finalized."""
    marks = [*path.parent.glob(f"{path.name}.*.done"), *path.parent.glob(f"{path.name}.*.finalized")]
    for stale in [path, path.with_name(path.name + ".partial"), *marks]:
        try:
            stale.unlink()
        except FileNotFoundError:
            pass


class DrainWatch:
    """One model instance's side of the contract (the engine host, on its engine thread): whether the
    launcher asked for a drain, a ``stat`` at most every ``poll_s``; the seconds left until its deadline;
    the instance's mark, written once."""

    def __init__(
        self,
        path: Path,
        model: str,
        instance: str | None = None,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.path, self.model, self.instance = path, model, instance or None
        self.poll_s, self.clock, self.wall = poll_s, clock, wall
        self.deadline: float | None = None  # the drain deadline (unix time) once draining
        self.marked = False
        self._next_look = float("-inf")

    def draining(self) -> bool:
        """The launcher asked for a drain (once seen, for good)."""
        if self.deadline is not None:
            return True
        now = self.clock()
        if now < self._next_look:
            return False
        self._next_look = now + self.poll_s
        if not is_draining(self.path):
            return False
        self.deadline = drain_deadline(self.path)
        return True

    def seconds_left(self) -> float:
        """Until the drain deadline (negative once it passed); only while draining."""
        assert self.deadline is not None
        return self.deadline - self.wall()

    def mark_finalized(self) -> None:
        """Triton unloaded this instance (every request of it answered) and its ``finalize`` ran."""
        mark_finalized(self.path, self.model, self.instance)

    def mark(self) -> bool:
        """Write this instance's mark (once). False if it was written before."""
        if self.marked:
            return False
        self.marked = True
        mark_drained(self.path, self.model, self.instance)
        return True

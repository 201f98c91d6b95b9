"""Self-healing: notice a dead Python backend stub (or a crashed server) within a second and restart the
server, in place.

Triton 2.51 never restarts a Python backend stub that died (OOM killer, a segfault in a native library, a
CUDA fault, ``kill -9``): its model keeps reporting ready while every request fails with "Stub process
... is not healthy", and the requests the dead stub was working on are never answered (the step engine
returns from ``execute()`` early, so nothing in Triton waits for them; unloading that model hangs on them
too). The one remedy that leaves no request hanging and no shared memory behind is a new server process:
the launcher runs tritonserver as its child and :class:`Supervisor` beside it.

Every ``interval_s`` the supervisor lists the server's stub processes (from /proc: each stub's command
line names its model file and instance). Once the server is ready it knows which stubs must live. When
one is gone (or the server itself exited unasked), it logs it, counts it, reports not ready, stops the
server (SIGTERM, then SIGKILL once every live instance marked itself finalized, at once where none
lives and every ready model is a watched one, or after ``grace_s``: the dead model's requests would hold
a graceful exit up to its exit timeout), removes the shared-memory
regions the killed stubs leave, and starts the server again. Meanwhile clients get UNAVAILABLE (gRPC)
or a refused connection (HTTP) at once, never a hang.

Every stop ends the server once each model instance whose stub lives marked itself finalized (drain.py:
Triton unloaded it, every request of it answered, and its ``finalize`` ran): Triton 2.51 would still
wait for every stub process to exit and look for loaded models only once a second, seconds in which
nothing is left to answer. Only where every model the server made ready is one of those stubs' (a model
of another backend writes no mark: then Triton's own exit is waited for).

It serves ``/healthz`` (liveness: false once the server has not come back within ``liveness_grace_s``,
so an orchestrator restarts the container), ``/readyz`` (the server is ready and not restarting) and
``/metrics`` (``triton_diffusion_server_restarts_total`` by reason and model, ``triton_diffusion_up``)
on its own port.

On SIGTERM with a drain file and a drain time (drain.py) it drains before it stops: it reports not
ready, writes the file (the drain deadline: now + ``drain_s``), waits until every model it watches has
marked itself drained (each of its instances, or the model whole) or ``drain_s`` passed, and only then
sends tritonserver SIGTERM. A second signal, or a server that exits meanwhile, ends the wait at once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from triton_diffusion.recovery import drain

log = logging.getLogger("triton_diffusion.supervisor")

STUB_NAME = "triton_python_backend_stub"
SHM_DIR = Path("/dev/shm")
# Between the last finalized mark and the server's end: the answers the models handed Triton in their
# finalize leave through its HTTP and gRPC frontends. A margin, not a guarantee: a client whose answer is
# cut off sees its connection closed, an UNAVAILABLE its retry resends, as after any crash.
SETTLE_S = 0.2


@dataclass(frozen=True)
class Stub:
    pid: int
    model: str
    instance: str
    shm_region: str  # its shared-memory region under /dev/shm


def descendants(root: int, proc: Path = Path("/proc")) -> set[int]:
    """Every live process below ``root`` (zombies count as dead)."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; split after the last ')'.
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def list_stubs(server_pid: int, proc: Path = Path("/proc")) -> list[Stub]:
    """The Python backend stubs under the server. A stub's command line is
    ``<stub> <repo>/<model>/<version>/model.py <shm region> ... <instance name> <runtime>``."""
    stubs = []
    for pid in descendants(server_pid, proc):
        try:
            raw = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in raw if a]
        if len(argv) < 4 or not argv[0].endswith(STUB_NAME):
            continue
        stubs.append(Stub(pid, Path(argv[1]).parent.parent.name, argv[-2], argv[2]))
    return stubs


def stubless(ready_models: Iterable[str], stubs: Iterable[Stub]) -> list[str]:
    """The ready models without a stub: each Python-backend model instance has one, so a model without any
    lost its stub (Triton still calls the model ready)."""
    served = {stub.model for stub in stubs}
    return sorted(set(ready_models) - served)


class Supervisor:
    """Runs the server command, watches it and its stubs, restarts it when either dies."""

    def __init__(
        self,
        start: Callable[[], subprocess.Popen],
        http_url: str,
        interval_s: float = 0.5,
        grace_s: float = 5.0,
        liveness_grace_s: float = 300.0,
        exit_timeout_s: float = 30.0,
        drain_file: Path | None = None,  # also where the models' finalized marks are (drain.py)
        drain_s: float = 30.0,  # 0: SIGTERM does not drain
        announce: Callable[[list[str]], None] | None = None,
        front_restarts: Callable[[], int] | None = None,  # the OpenAI front's restarts (companion.py)
    ) -> None:
        self.start = start
        self.front_restarts = front_restarts
        self.announce = announce  # told the models each time the server becomes ready
        self.http_url = http_url.rstrip("/")
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.liveness_grace_s = liveness_grace_s
        self.exit_timeout_s = exit_timeout_s
        self.drain_file = drain_file
        self.drain_s = drain_s
        self.stopping = threading.Event()
        self.hurry = threading.Event()  # a second signal while draining: stop now
        self.stop_signal: int = signal.SIGTERM
        self.watched_models: list[str] = []  # the models of the stubs watched (the server was ready)
        self.watched_instances: dict[str, list[str]] = {}  # each watched model's instances (drain marks)
        self.process: subprocess.Popen | None = None
        self._listed: list[Stub] = []  # the server's stubs at the latest look (a stop ends what is left)
        # Every model the server made ready has a watched stub (no model of another backend, which writes
        # no finalized mark): only then may the marks end the server.
        self.marks_cover = False
        self.restarts: Counter = Counter()  # (reason, model) -> count
        self._lock = threading.Lock()
        self._ready = False
        self._down_since: float | None = time.monotonic()

    # ---- the watch loop -----------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until asked to stop; returns the server's last exit status (0 where the finalized marks
        ended it: :meth:`_end`)."""
        last_restart = 0.0
        while True:
            if self.drain_file is not None:
                drain.clear(self.drain_file)  # the marks of the server before, if any
            self.process = self.start()
            status = self._watch(self.process)
            if self.stopping.is_set():
                return status
            if time.monotonic() - last_restart < 30 and self.stopping.wait(5):  # crashing at once: no spin
                return status
            if self.stopping.is_set():
                return status
            last_restart = time.monotonic()

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Shut down (SIGTERM/SIGINT to the launcher); no restart afterwards. The watch loop forwards the
        signal (after draining, for SIGTERM with a drain file); a second signal cuts a drain short. Safe
        in a signal handler: it only sets events."""
        if self.stopping.is_set():
            self.hurry.set()
        else:
            self.stop_signal = signum
        self.stopping.set()

    def _watch(self, process: subprocess.Popen) -> int:
        expected: dict[str, Stub] | None = None  # instance -> stub, once the server is ready
        seen: dict[str, Stub] = {}  # the latest listing: a server dying while loading leaves these
        self.watched_models = []  # none until this server is ready: a loading model has nothing to drain
        self.watched_instances = {}
        self._listed = []
        self.marks_cover = False
        while True:
            status = process.poll()
            if status is not None:
                if not self.stopping.is_set():
                    self._restarting("server exited", ["-"], f"tritonserver exited with status {status}")
                    self._kill_stubs({**seen, **(expected or {})}.values())
                return status
            if self.stopping.wait(self.interval_s):
                return self._shut_down(process)
            try:
                stubs = {s.instance: s for s in list_stubs(process.pid)}
            except Exception:  # noqa: BLE001  (an odd /proc entry: look again next time)
                log.exception("supervisor: listing the server's processes failed")
                continue
            seen = stubs
            self._listed = list(stubs.values())
            if expected is None:
                if self._server_ready():
                    # A stub that died between Triton's readiness and this first listing is in no
                    # listing, and its model still reports ready: every ready model must have a stub.
                    ready_models = self._ready_models()
                    python_models = self._python_models(ready_models)  # others have no stub to watch
                    missing = stubless(python_models, stubs.values())
                    if missing:
                        detail = (
                            f"Python backend stub of {', '.join(missing)} died as the server became ready"
                        )
                        self._restarting("stub died", missing, detail)
                        return self._stop_server(process, stubs.values())
                    expected = stubs
                    self.watched_models = sorted({s.model for s in stubs.values()})
                    # (An index that did not answer lists no model: then nothing is known to be covered.)
                    self.marks_cover = bool(ready_models) and set(ready_models) <= set(python_models)
                    self.watched_instances = {
                        model: sorted(s.instance for s in stubs.values() if s.model == model)
                        for model in self.watched_models
                    }
                    self._set_ready(True)
                    names = ", ".join(sorted(stubs)) or "-"
                    log.info("supervisor: server ready, watching stubs %s", names)
                    if self.announce is not None:
                        try:
                            self.announce(self.watched_models)
                        except Exception:  # noqa: BLE001  (a closed stderr must not end the watch)
                            log.exception("supervisor: announcing readiness failed")
                continue
            dead = [s for name, s in expected.items() if name not in stubs]
            if dead:
                models = sorted({s.model for s in dead})
                detail = f"Python backend stub {', '.join(s.instance for s in dead)} died"
                self._restarting("stub died", models, detail)
                return self._stop_server(process, expected.values(), {s.instance for s in dead})

    def _shut_down(self, process: subprocess.Popen) -> int:
        """Drain (SIGTERM, a drain file and time, models that were serving), forward the signal, then wait
        for the server's exit or every model's finalized mark (:meth:`_end`). Not ready from the first:
        a stopping server takes no new traffic, drained or not."""
        self._set_ready(False)
        if (
            self.stop_signal == signal.SIGTERM
            and self.drain_file is not None
            and self.drain_s > 0
            and self.watched_models
        ):
            self.drain_models(process)
        if process.poll() is None:
            process.send_signal(self.stop_signal)
        # Triton 2.51 sometimes hangs in its own abort handler after the exit timeout, holding client
        # connections open: past its exit timeout and a margin it is killed, so clients get an error.
        status = self._end(process, self.exit_timeout_s + 10, self.watched_instances)
        self._kill_stubs(self._listed)
        return status

    def drain_models(self, process: subprocess.Popen) -> list[str]:
        """Not ready (no new traffic), the drain file written, then wait for every watched model's mark,
        ``drain_s``, a second signal or the server's exit. Returns the models that did not drain."""
        assert self.drain_file is not None
        self._set_ready(False)
        models = ", ".join(self.watched_models)
        log.info("supervisor: draining %s (at most %.0f s) before stopping the server", models, self.drain_s)
        drain.request_drain(self.drain_file, self.drain_s)
        started = time.monotonic()
        pending = drain.wait_drained(
            self.drain_file,
            self.watched_instances or self.watched_models,
            self.drain_s,
            give_up=lambda: self.hurry.is_set() or process.poll() is not None,
        )
        seconds = time.monotonic() - started
        if pending:
            still = ", ".join(pending)
            log.warning("supervisor: %s not drained after %.1f s; stopping anyway", still, seconds)
        else:
            log.info("supervisor: every model drained in %.1f s", seconds)
        return pending

    def _end(self, process: subprocess.Popen, timeout_s: float, live: dict[str, list[str]]) -> int:
        """After the server's signal: its exit status once it exits; once every instance in ``live``
        marked itself finalized, the server ended after ``SETTLE_S`` (status 0: nothing of it was left to
        answer); past ``timeout_s``, killed (its status, negative: the signal)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = process.poll()
            if status is not None:
                return status
            marks = self.drain_file if self.marks_cover and live else None
            if marks is not None and not drain.not_finalized(marks, live):
                time.sleep(SETTLE_S)
                if process.poll() is not None:
                    return process.wait()
                log.info("supervisor: every model finalized; ending the server")
                process.kill()
                process.wait()
                return 0
            if time.monotonic() >= deadline:
                log.error("supervisor: tritonserver did not exit within %.0f s; killing it", timeout_s)
                process.kill()
                return process.wait()
            time.sleep(0.05)

    def _restarting(self, reason: str, models: list[str], detail: str) -> None:
        self._set_ready(False)
        with self._lock:
            for model in models:
                self.restarts[(reason, model)] += 1
        log.error("supervisor: %s; restarting the server (not ready until it is back)", detail)

    def _stop_server(self, process: subprocess.Popen, stubs, dead: Collection[str] = ()) -> int:
        """A restart's stop: SIGTERM, ended once every instance but the ``dead`` ones (which never will)
        marked itself finalized, at once where every watched instance is dead and every ready model is a
        watched one, or after ``grace_s``."""
        process.send_signal(signal.SIGTERM)
        live = {model: [i for i in names if i not in dead] for model, names in self.watched_instances.items()}
        live = {model: names for model, names in live.items() if names}
        if dead and not live and self.marks_cover and self.watched_instances:
            # Nothing of the server can answer (Triton 2.51 never answers a dead stub's requests): its
            # graceful exit, up to its exit timeout, would only hold the restart until grace_s cuts it.
            log.info("supervisor: no instance of the server lives; ending it")
            process.kill()
            status = process.wait()
        else:
            status = self._end(process, self.grace_s, live)
        self._kill_stubs(stubs)
        return status

    @staticmethod
    def _kill_stubs(stubs) -> None:
        """The stubs of a server that is gone: end any still running (they would hold GPU memory until
        they notice), and remove their shared-memory regions (a killed process never unlinks its own)."""
        for stub in stubs:
            try:
                # Only if the pid is still that stub: a pid can be reused once its process is gone.
                if stub.shm_region.encode() in (Path("/proc") / str(stub.pid) / "cmdline").read_bytes():
                    os.kill(stub.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                (SHM_DIR / stub.shm_region).unlink()
            except OSError:
                pass

    def _ready_models(self) -> list[str]:
        """The models Triton's repository index says are ready (none where it does not answer)."""
        index = urllib.request.Request(f"{self.http_url}/v2/repository/index", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(index, timeout=2) as response:
                entries = json.loads(response.read())
        except (OSError, ValueError):
            return []
        return sorted({e["name"] for e in entries if isinstance(e, dict) and e.get("state") == "READY"})

    def _python_models(self, models: list[str]) -> list[str]:
        """Of ``models``, those of Triton's Python backend (by their config): only they have stubs. One
        whose config does not answer counts as one (its stub is looked for)."""
        found = []
        for model in models:
            try:
                url = f"{self.http_url}/v2/models/{model}/config"
                with urllib.request.urlopen(url, timeout=2) as response:
                    backend = json.loads(response.read()).get("backend", "python")
            except (OSError, ValueError, AttributeError):
                backend = "python"
            if backend == "python":
                found.append(model)
        return found

    def _server_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _set_ready(self, ready: bool) -> None:
        with self._lock:
            was_down = self._down_since
            self._ready = ready
            self._down_since = None if ready else (self._down_since or time.monotonic())
        if ready and was_down is not None and sum(self.restarts.values()) > 0:
            seconds = time.monotonic() - was_down
            log.info("supervisor: the server serves again, %.1f s after it went down", seconds)

    # ---- health and metrics -------------------------------------------------------------------------
    def alive(self) -> bool:
        with self._lock:
            return self._down_since is None or time.monotonic() - self._down_since < self.liveness_grace_s

    def ready(self) -> bool:
        with self._lock:
            return self._ready

    def metrics_text(self) -> str:
        with self._lock:
            restarts, up = dict(self.restarts), int(self._ready)
        lines = [
            "# HELP triton_diffusion_server_restarts_total Server restarts by the supervisor (reason, model)",
            "# TYPE triton_diffusion_server_restarts_total counter",
        ]
        lines += [
            f'triton_diffusion_server_restarts_total{{reason="{reason}",model="{model}"}} {count}'
            for (reason, model), count in sorted(restarts.items())
        ]
        lines += [
            "# HELP triton_diffusion_up 1 while the server is ready and not restarting",
            "# TYPE triton_diffusion_up gauge",
            f"triton_diffusion_up {up}",
        ]
        if self.front_restarts is not None:  # a front that keeps exiting (a bad key file, a taken port)
            lines += [
                "# HELP triton_diffusion_front_restarts_total OpenAI front restarts after it exited",
                "# TYPE triton_diffusion_front_restarts_total counter",
                f"triton_diffusion_front_restarts_total {self.front_restarts()}",
            ]
        return "\n".join(lines) + "\n"

    def serve_health(self, port: int, address: str = "0.0.0.0") -> ThreadingHTTPServer:
        supervisor = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802  (http.server's naming)
                routes = {
                    "/healthz": lambda: (200, "ok\n") if supervisor.alive() else (503, "down too long\n"),
                    "/readyz": lambda: (200, "ok\n") if supervisor.ready() else (503, "not ready\n"),
                    "/metrics": lambda: (200, supervisor.metrics_text()),
                }
                status, body = routes.get(self.path, lambda: (404, "not found\n"))()
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        server = ThreadingHTTPServer((address, port), Handler)
        threading.Thread(target=server.serve_forever, name="supervisor-health", daemon=True).start()
        return server

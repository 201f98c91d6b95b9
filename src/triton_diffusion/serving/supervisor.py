"""Self-healing: notice a dead Python backend stub within a second and load its model again.

Triton 2.51 never restarts a Python backend stub that died (OOM killer, a segfault in a native library, a
CUDA fault, ``kill -9``): its model keeps reporting ready while every request fails with "Stub process
... is not healthy". The launcher therefore runs tritonserver with explicit model control and this
supervisor beside it. Every ``interval_s`` it lists the server's stub processes (from /proc: each stub's
command line names its model file and instance). When a loaded model's stub is gone, it logs it, counts
it, **unloads** the model (Triton's own readiness, per model and for the server, turns false at once, so
load balancers drain the pod, and new requests are refused at once instead of failing slowly) and
**loads** it again from the repository. The model repository API is restricted to a header only the
supervisor knows (``--http-restricted-api``), so clients cannot load or unload models.

It also serves ``/healthz`` (liveness: false once a model has been down for longer than
``liveness_grace_s``, so an orchestrator restarts the container if loading keeps failing), ``/readyz``
(every model up) and ``/metrics`` (``triton_diffusion_stub_restarts_total``,
``triton_diffusion_model_up``) on its own port.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

log = logging.getLogger("triton_diffusion.supervisor")

ADMIN_HEADER = "triton-diffusion-admin"
STUB_NAME = "triton_python_backend_stub"


def admin_arguments(secret: str) -> list[str]:
    """tritonserver arguments: explicit model control, every model loaded at start, and the model
    repository API behind a header only the supervisor sends."""
    return [
        "--model-control-mode=explicit",
        "--load-model=*",
        f"--http-restricted-api=model-repository:{ADMIN_HEADER}={secret}",
        f"--grpc-restricted-protocol=model-repository:{ADMIN_HEADER}={secret}",
    ]


def new_secret() -> str:
    return secrets.token_hex(16)


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
            argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in argv if a]
        if len(argv) < 3 or not argv[0].endswith(STUB_NAME):
            continue
        model = Path(argv[1]).parent.parent.name
        stubs.append(Stub(pid, model, argv[-2], argv[2]))
    return stubs


@dataclass
class ModelWatch:
    instances: set[str] = field(default_factory=set)
    up: bool = True
    down_since: float | None = None
    restarts: int = 0


class Supervisor:
    def __init__(
        self,
        server_pid: int,
        http_url: str,
        secret: str,
        interval_s: float = 0.5,
        liveness_grace_s: float = 120.0,
        load_timeout_s: float = 300.0,
    ) -> None:
        self.server_pid = server_pid
        self.http_url = http_url.rstrip("/")
        self.secret = secret
        self.interval_s = interval_s
        self.liveness_grace_s = liveness_grace_s
        self.load_timeout_s = load_timeout_s
        self.models: dict[str, ModelWatch] = {}
        self.stopping = threading.Event()
        self._lock = threading.Lock()

    # ---- talking to Triton ------------------------------------------------------------------------
    def _post(self, path: str, timeout_s: float) -> tuple[int, str]:
        request = urllib.request.Request(
            self.http_url + path, data=b"{}", method="POST", headers={ADMIN_HEADER: self.secret}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status, response.read().decode(errors="replace")
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")

    def ready_models(self) -> set[str]:
        status, body = self._post("/v2/repository/index", 10)
        if status != 200:
            raise RuntimeError(f"repository index: HTTP {status} {body[:200]}")
        return {m["name"] for m in json.loads(body) if m.get("state") == "READY"}

    # ---- the watch loop -----------------------------------------------------------------------------
    def run(self) -> None:
        """Watch until stopped. Models are watched from the moment they are first seen READY."""
        while not self.stopping.wait(self.interval_s):
            try:
                self.tick()
            except (OSError, RuntimeError, ValueError) as exc:  # server starting or stopping
                log.debug("supervisor tick: %s", exc)

    def tick(self) -> None:
        stubs = list_stubs(self.server_pid)
        running: dict[str, set[str]] = {}
        for stub in stubs:
            running.setdefault(stub.model, set()).add(stub.instance)
        for name in self.ready_models() - set(self.models):
            if name in running:
                self.models[name] = ModelWatch(instances=set(running[name]))
                log.info("supervisor: watching model %s (instances %s)", name, sorted(running[name]))
        for name, watch in list(self.models.items()):
            dead = watch.instances - running.get(name, set())
            if watch.up and dead and not self.stopping.is_set():
                self.recover(name, watch, sorted(dead))

    def recover(self, name: str, watch: ModelWatch, dead: list[str]) -> None:
        started = time.monotonic()
        with self._lock:
            watch.up, watch.down_since, watch.restarts = False, started, watch.restarts + 1
        log.error(
            "supervisor: model %s: Python backend stub %s died; unloading it (readiness false) and "
            "loading it again (restart %d)",
            name,
            ", ".join(dead),
            watch.restarts,
        )
        status, body = self._post(f"/v2/repository/models/{name}/unload", 30)
        if status != 200:
            log.error("supervisor: unloading %s failed: HTTP %d %s", name, status, body[:300])
        delay = 1.0
        while not self.stopping.is_set():
            status, body = self._post(f"/v2/repository/models/{name}/load", self.load_timeout_s)
            if status == 200:
                break
            reason = f"HTTP {status} {body[:200]}"
            log.error("supervisor: loading %s failed: %s; trying again in %.0f s", name, reason, delay)
            if self.stopping.wait(delay):
                return
            delay = min(delay * 2, 30.0)
        if self.stopping.is_set():
            return
        instances = {s.instance for s in list_stubs(self.server_pid) if s.model == name}
        with self._lock:
            watch.instances = instances or watch.instances
            watch.up, watch.down_since = True, None
        seconds = time.monotonic() - started
        log.info("supervisor: model %s serves again, %.1f s after its stub died", name, seconds)

    # ---- health and metrics -------------------------------------------------------------------------
    def alive(self) -> bool:
        now = time.monotonic()
        with self._lock:
            down = [now - w.down_since for w in self.models.values() if w.down_since is not None]
        return all(seconds < self.liveness_grace_s for seconds in down)

    def ready(self) -> bool:
        with self._lock:
            return bool(self.models) and all(w.up for w in self.models.values())

    def metrics_text(self) -> str:
        lines = [
            "# HELP triton_diffusion_stub_restarts_total Models loaded again after their stub process died",
            "# TYPE triton_diffusion_stub_restarts_total counter",
        ]
        with self._lock:
            watches = sorted(self.models.items())
            lines += [f'triton_diffusion_stub_restarts_total{{model="{n}"}} {w.restarts}' for n, w in watches]
            lines += [
                "# HELP triton_diffusion_model_up 1 while the model is loaded and its stub processes live",
                "# TYPE triton_diffusion_model_up gauge",
            ]
            lines += [f'triton_diffusion_model_up{{model="{n}"}} {int(w.up)}' for n, w in watches]
        return "\n".join(lines) + "\n"

    def serve_health(self, port: int, address: str = "0.0.0.0") -> ThreadingHTTPServer:
        supervisor = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802  (http.server's naming)
                routes = {
                    "/healthz": lambda: (200 if supervisor.alive() else 503, "ok\n"),
                    "/readyz": lambda: (200 if supervisor.ready() else 503, "ok\n"),
                    "/metrics": lambda: (200, supervisor.metrics_text()),
                }
                status, body = routes.get(self.path, lambda: (404, "not found\n"))()
                if status == 503:
                    body = "not ready\n"
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


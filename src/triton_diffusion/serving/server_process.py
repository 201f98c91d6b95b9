"""Start and stop a real tritonserver (through the project's launcher) for integration tests."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
WEIGHTS = REPO_ROOT / "weights"


# Ports are picked below the kernel's ephemeral range: a port the kernel hands out for bind(0) is also one it
# may give the next outgoing connection (a test's client), and two bind(0) calls a moment apart can return
# the same port (a CI run once saw tritonserver refuse an HTTP and a metrics port that were equal).
_LOWEST_PORT = 20000
# How each listener says its port is taken: tritonserver's HTTP, gRPC and metrics services ("Socket
# '0.0.0.0:N' already in use"), tritonserver given one port twice, and Python's servers (the supervisor's
# health port, the OpenAI front: "[Errno 98] Address already in use").
_PORT_CONFLICT = re.compile(
    r"Socket '[^']*' already in use|cannot listen to HTTP requests and metrics requests"
    r"|Errno 98|address already in use",
    re.IGNORECASE,
)
_PORT_ARG = re.compile(r"^--[\w-]*port=(\d+)$")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(count: int, avoid: Collection[int] = ()) -> list[int]:
    """``count`` distinct ports that can be bound now, none of ``avoid``, below the ephemeral range where it
    leaves room."""
    low, high = _LOWEST_PORT, _ephemeral_low()
    pick = random.SystemRandom()  # not the tests' seeded generator: parallel workers must not pick alike
    held: list[socket.socket] = []
    try:
        for _ in range(50 * count):
            if len(held) == count:
                break
            s = socket.socket()
            try:
                s.bind(("0.0.0.0", pick.randrange(low, high) if high - low > 1000 else 0))
            except OSError:
                s.close()
                continue
            if s.getsockname()[1] in avoid:
                s.close()
                continue
            held.append(s)
        if len(held) < count:
            raise RuntimeError(f"no {count} free ports found")
        return [s.getsockname()[1] for s in held]  # distinct: all are bound at once
    finally:
        for s in held:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def port_conflict(log: str) -> bool:
    """Whether a server's log says it could not listen on a port it was given."""
    return _PORT_CONFLICT.search(log) is not None


@dataclass
class RunningServer:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    health_port: int  # the supervisor's /healthz, /readyz, /metrics
    log_path: Path

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.health_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass  # killed below
        # A server that exits on its own (e.g. after --exit-timeout-secs) can leave Python backend stubs
        # behind in its process group: end them too.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def copy_model(source: str, target_repo: Path, name: str, edits: dict[str, str], extra: str = "") -> None:
    """Copy model_repository/<source> as <name>, replacing parameter values and appending config text."""
    target = target_repo / name
    shutil.copytree(REPO_ROOT / "model_repository" / source, target)
    config = (target / "config.pbtxt").read_text()
    for key, value in edits.items():
        # Only live lines: the shipped configs show optional parameters in comments.
        pattern = rf'(?m)(^parameters {{ key: "{re.escape(key)}" value: {{ string_value: )"[^"]*"'

        def replace(match: re.Match[str], value: str = value) -> str:
            return f'{match.group(1)}"{value}"'

        config, count = re.subn(pattern, replace, config)
        if count == 0:
            config += f'\nparameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
    (target / "config.pbtxt").write_text(config + extra)


def set_batching(
    target_repo: Path, name: str, queue_delay_us: int, max_batch_size: int | None = None
) -> None:
    """Set the dynamic batcher's queue delay and, optionally, max_batch_size of a copied model."""
    path = target_repo / name / "config.pbtxt"
    text = re.sub(
        r"max_queue_delay_microseconds: \d+",
        f"max_queue_delay_microseconds: {queue_delay_us}",
        path.read_text(),
    )
    if max_batch_size is not None:
        text = re.sub(r"(?m)^max_batch_size: \d+", f"max_batch_size: {max_batch_size}", text)
    path.write_text(text)


def start_server(
    repo: Path, log_path: Path, models: list[str], timeout_s: float = 180, extra_args: Sequence[str] = ()
) -> RunningServer:
    """The launcher on ``repo`` with ``models`` ready. A port taken between its pick and the server's bind
    (another test's server, an outgoing connection) is not the test's failure: it starts again on new ports,
    up to three times."""
    for attempt in range(3):
        server = _start_once(repo, log_path, models, timeout_s, extra_args)
        if isinstance(server, RunningServer):
            return server
        if attempt == 2:
            raise RuntimeError(server)
    raise AssertionError("unreachable")


def _start_once(
    repo: Path, log_path: Path, models: list[str], timeout_s: float, extra_args: Sequence[str]
) -> RunningServer | str:
    """A ready server, or why not as a string when a port was taken (so the caller tries new ports)."""
    given = {int(m.group(1)) for arg in extra_args if (m := _PORT_ARG.match(arg))}  # e.g. an OpenAI front's
    http, grpc, metrics, health = free_ports(4, avoid=given)
    launcher = Path(sys.executable).parent / "triton-diffusion-serve"
    command = [
        str(launcher),
        "--model-repository",
        str(repo),
        f"--http-port={http}",
        f"--grpc-port={grpc}",
        f"--metrics-port={metrics}",
        f"--health-port={health}",
        *extra_args,
    ]
    with open(log_path, "w") as log_file:  # the server writes to its own copy of the descriptor
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    server = RunningServer(process, http, grpc, metrics, health, log_path)
    deadline = time.monotonic() + timeout_s
    pending = list(models)
    while pending:
        exited = process.poll() is not None  # before the log: a launcher that exits has written why
        if port_conflict(server.log()):
            server.stop()
            return f"a port was taken:\n{server.log()[-4000:]}"
        if exited:
            raise RuntimeError(f"tritonserver exited with {process.returncode}:\n{server.log()[-4000:]}")
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"models {pending} not ready in {timeout_s} s:\n{server.log()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{server.http_url}/v2/models/{pending[0]}/ready", timeout=2):
                pending.pop(0)
        except OSError:
            time.sleep(0.5)
    return server


def read_metrics(server: RunningServer) -> dict[str, float]:
    """Prometheus text from the metrics port as {'name{labels}': value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values

"""How long the shipped model repository takes to start, to come back after a Python backend stub is
killed, and to stop when idle: the launcher (its supervisor and drain included) as a deployment runs it.

After one unrecorded start of each variant (the first start after the files were written compiles and
reads them), each round starts ``triton-diffusion-serve`` on ``<root>/model_repository`` (every shipped
model, the OpenAI front off), and times three things on the true clock:

- ``ready_s``: from the launch until the supervisor's ``/readyz`` answers 200 (every model loaded);
- ``crash_back_s``: from a ``kill -9`` of the ``text_to_image`` stub until ``/readyz`` answers 200 again
  (the supervisor notices, stops the server, starts a new one, every model loads again);
- ``stop_idle_s``: from SIGTERM to the launcher (what an orchestrator sends) until it has exited, the
  server idle for 2 s after it answered a request of each text-to-image model through the project's
  client (an answered request the serving side still holds makes Triton's unload wait its exit timeout).

``--before REV`` also serves an older commit, its rounds alternated with this one's: a temporary git
worktree of REV (its ``weights`` a link to ours), whose ``src`` goes first on the launcher's
``PYTHONPATH`` and on each of its model.py files' ``sys.path`` (their stubs'), and whose model repository
is served.

    python scripts/restart_times.py                          # now only; writes docs/cpu/restart_times.json
    python scripts/restart_times.py --before a98bd43         # the commit before the stop fix, and now

Rendered by scripts/tables/restart_times.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "src"))
import artefacts  # noqa: E402
from triton_diffusion_client import generate_one  # noqa: E402

from triton_diffusion.serving.server_process import free_ports  # noqa: E402
from triton_diffusion.serving.supervisor import list_stubs  # noqa: E402

OUT = REPO_ROOT / "docs" / "cpu" / "restart_times.json"
VICTIM = "text_to_image"
SERVED = ("text_to_image", "text_to_image_flux")  # answered before the idle stop


def ready(health_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{health_url}/readyz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> float:
    """Seconds until ``predicate()`` holds; raises past ``timeout_s``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"not within {timeout_s} s")
        time.sleep(interval_s)
    return time.monotonic() - started


def server_pid(launcher: int) -> int:
    """The tritonserver process the launcher's supervisor runs (its current one)."""
    for line in subprocess.run(
        ["ps", "-o", "pid=,comm=", "--ppid", str(launcher)], capture_output=True, text=True
    ).stdout.splitlines():
        pid, name = line.split(None, 1)
        if name.strip() == "tritonserver":
            return int(pid)
    raise RuntimeError("no tritonserver under the launcher")


def generate(grpc_url: str, model: str) -> str | None:
    """One small image through the project's client (a gRPC stream, progress on), as the front and the
    CLI send them; None when it came back, else the error."""
    request = {"prompt": "a red boat", "num_inference_steps": 4, "seed": 1, "progress": True}
    try:
        generate_one(request, f"restart-{model}", grpc_url, model, timeout_s=120, retries=0)
        return None
    except Exception as error:  # noqa: BLE001  (reported with the round)
        return f"{type(error).__name__}: {error}"


@contextlib.contextmanager
def launched(root: Path, log_path: Path) -> Iterator[tuple[subprocess.Popen, str, str]]:
    """``triton-diffusion-serve`` on ``root``'s model repository: (the launcher, its health URL, its gRPC
    URL); whatever is left of its session (its server, stubs) is killed on the way out."""
    health, grpc, http, metrics = free_ports(4)
    launcher = Path(sys.executable).parent / "triton-diffusion-serve"
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [
        str(launcher), "--model-repository", str(root / "model_repository"), f"--health-port={health}",
        f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
    ]  # fmt: skip
    with open(log_path, "a") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            yield process, f"http://127.0.0.1:{health}", f"127.0.0.1:{grpc}"
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def warm_up(root: Path, log_path: Path, timeout_s: float) -> None:
    """One start, not recorded: the first start after the files were written (a fresh worktree's bytecode
    compiled, its files read from disk) would be the first round's alone. Stopped as a round stops (SIGTERM
    to the launcher), so its supervisor removes what its stubs leave in /dev/shm."""
    with launched(root, log_path) as (process, health_url, _):
        wait_until(lambda: ready(health_url), timeout_s)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=timeout_s)


def one_round(root: Path, log_path: Path, timeout_s: float) -> dict[str, float]:
    started = time.monotonic()
    with launched(root, log_path) as (process, health_url, grpc_url):
        wait_until(lambda: ready(health_url), timeout_s)
        ready_s = time.monotonic() - started
        (stub,) = [s for s in list_stubs(server_pid(process.pid)) if s.model == VICTIM]
        old_server = server_pid(process.pid)
        killed = time.monotonic()
        os.kill(stub.pid, signal.SIGKILL)
        # Back: ready again, served by a new tritonserver (a poll that timed out is no restart).
        wait_until(lambda: not ready(health_url), timeout_s)
        wait_until(lambda: ready(health_url) and new_server(process.pid, old_server), timeout_s)
        crash_back_s = time.monotonic() - killed
        for model in SERVED:
            error = generate(grpc_url, model)
            if error is not None:
                raise RuntimeError(f"{model}: {error}")
        time.sleep(2)  # idle
        stopping = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=timeout_s)
        stop_idle_s = time.monotonic() - stopping
    return {
        "ready_s": round(ready_s, 2),
        "crash_back_s": round(crash_back_s, 2),
        "stop_idle_s": round(stop_idle_s, 2),
    }


def new_server(launcher: int, old: int) -> bool:
    try:
        return server_pid(launcher) != old
    except RuntimeError:
        return False


def served_commit(root: Path) -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="an older commit to serve too, its rounds alternated (before)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=240)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    # bench.py all ends a benchmark past its share with SIGTERM: exit through the finally blocks, so the
    # launcher (a session of its own) is killed and the worktree removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "prune"], check=False)  # a cut run's
    with contextlib.ExitStack() as stack:
        roots = {"now": REPO_ROOT}
        if args.before:
            roots["before"] = stack.enter_context(worktree(args.before))
        return measure(roots, args)


@contextlib.contextmanager
def worktree(revision: str) -> Iterator[Path]:
    """A temporary checkout of ``revision`` serving this checkout's weights, each of its model.py files
    importing its own ``src`` first (:func:`own_src`)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "before"
        git = ["git", "-C", str(REPO_ROOT), "worktree"]
        subprocess.run([*git, "add", "--detach", str(path), revision], check=True, capture_output=True)
        try:
            (path / "weights").symlink_to(REPO_ROOT / "weights")
            for model_py in (path / "model_repository").glob("*/1/model.py"):
                model_py.write_text(own_src(model_py.read_text(), path / "src"))
            yield path
        finally:
            subprocess.run([*git, "remove", "--force", str(path)], check=False, capture_output=True)


def own_src(model_py: str, src: Path) -> str:
    """A model.py that puts ``src`` first on its stub's ``sys.path`` before it imports anything: without
    it the older commit's stubs imported this checkout's package (the editable install's), not the one
    first on the launcher's PYTHONPATH (seen once the two differed: 365dc1a's model.py failed to import
    ``serve``); only its launcher ran its own."""
    header = f"import sys\n\nsys.path.insert(0, {str(src)!r})  # restart_times: the served commit's package\n"
    docstring = re.match(r'\s*("""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\')\n', model_py)
    at = docstring.end() if docstring else 0
    return model_py[:at] + header + model_py[at:]


def measure(roots: dict[str, Path], args: argparse.Namespace) -> int:
    artefact: dict[str, Any] = {
        "provenance": artefacts.provenance(),
        "setup": {"repository": "model_repository (every shipped model)", "victim": VICTIM,
                  "served_commits": {name: served_commit(root) for name, root in roots.items()},
                  "warm_up": "one start of each variant before round 0, not recorded"},
        "complete": False,
        "rows": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:  # noqa: SIM117
        tmp = os.environ.get("RESTART_TIMES_LOG_DIR", tmp)
        for variant, root in roots.items():
            warm_up(root, Path(tmp) / f"{variant}.log", args.timeout_s)
        for number in range(args.rounds):
            order = list(roots.items())[number % len(roots) :] + list(roots.items())[: number % len(roots)]
            for variant, root in order:  # rotated each round
                times = one_round(root, Path(tmp) / f"{variant}.log", args.timeout_s)
                row = {"variant": variant, "round": number, **times}
                print(row, flush=True)
                artefact["rows"].append(row)
                artefacts.write(args.out, artefact)
    artefact["complete"] = True
    artefacts.write(args.out, artefact)
    return 0


if __name__ == "__main__":
    sys.exit(main())

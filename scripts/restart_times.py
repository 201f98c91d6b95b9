"""How long the shipped model repository takes to start, to come back after a Python backend stub is
killed, and to stop when idle: the launcher (its supervisor and drain included) as a deployment runs it.

Each round starts ``triton-diffusion-serve`` on ``<root>/model_repository`` (every shipped model, the
OpenAI front off), and times three things on the true clock:

- ``ready_s``: from the launch until the supervisor's ``/readyz`` answers 200 (every model loaded);
- ``crash_back_s``: from a ``kill -9`` of the ``text_to_image`` stub until ``/readyz`` answers 200 again
  (the supervisor notices, stops the server, starts a new one, every model loads again);
- ``stop_idle_s``: from SIGTERM to the launcher (what an orchestrator sends) until it has exited, the
  server idle for 2 s after it answered a request of each text-to-image model (an answered request that
  the serving side still holds makes Triton's unload wait its exit timeout).

``--before ROOT`` also runs another checkout (an older commit), its rounds alternated with this one's: its
``src`` goes first on the ``PYTHONPATH`` of the launcher and its stubs, and its model repository is served
(its ``weights`` must be there, or a link to ours).

    python scripts/restart_times.py                                # writes docs/cpu/restart_times.json
    git worktree add /tmp/before 7c79fa8^ && ln -s $PWD/weights /tmp/before/weights
    python scripts/restart_times.py --before /tmp/before           # before and now, alternated

Rendered by scripts/tables/restart_times.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "src"))
import artefacts  # noqa: E402

from triton_diffusion.serving.server_process import free_port  # noqa: E402
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


def generate(http_url: str, model: str) -> str | None:
    """One small image through HTTP generate; None when it came back, else the error."""
    body = {"PROMPT": "a red boat", "parameters": {"num_inference_steps": 4, "seed": 1, "output_encoding": "base64"}}
    request = urllib.request.Request(
        f"{http_url}/v2/models/{model}/generate", data=json.dumps(body).encode(), method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return None if "IMAGE" in json.loads(response.read()) else "no IMAGE"
    except urllib.error.HTTPError as error:
        return error.read().decode(errors="replace")


def one_round(root: Path, log_path: Path, timeout_s: float) -> dict[str, float]:
    health, http = free_port(), free_port()
    http_url = f"http://127.0.0.1:{http}"
    launcher = Path(sys.executable).parent / "triton-diffusion-serve"
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [
        str(launcher), "--model-repository", str(root / "model_repository"), f"--health-port={health}",
        f"--http-port={http}", f"--grpc-port={free_port()}", f"--metrics-port={free_port()}",
    ]  # fmt: skip
    health_url = f"http://127.0.0.1:{health}"
    with open(log_path, "a") as log:
        started = time.monotonic()
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            wait_until(lambda: ready(health_url), timeout_s)
            ready_s = time.monotonic() - started
            (stub,) = [s for s in list_stubs(server_pid(process.pid)) if s.model == VICTIM]
            killed = time.monotonic()
            os.kill(stub.pid, signal.SIGKILL)
            wait_until(lambda: not ready(health_url), timeout_s)
            wait_until(lambda: ready(health_url), timeout_s)
            crash_back_s = time.monotonic() - killed
            for model in SERVED:
                error = generate(http_url, model)
                if error is not None:
                    raise RuntimeError(f"{model}: {error}")
            time.sleep(2)  # idle
            stopping = time.monotonic()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=timeout_s)
            stop_idle_s = time.monotonic() - stopping
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return {
        "ready_s": round(ready_s, 2),
        "crash_back_s": round(crash_back_s, 2),
        "stop_idle_s": round(stop_idle_s, 2),
    }


def served_commit(root: Path) -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="another checkout to serve too, alternated (before)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=240)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    roots = {"now": REPO_ROOT, **({"before": args.before.resolve()} if args.before else {})}
    artefact: dict[str, Any] = {
        "provenance": artefacts.provenance(),
        "setup": {"repository": "model_repository (every shipped model)", "victim": VICTIM,
                  "served_commits": {name: served_commit(root) for name, root in roots.items()}},
        "rows": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:  # noqa: SIM117
        tmp = os.environ.get("RESTART_TIMES_LOG_DIR", tmp)
        for number in range(args.rounds):
            order = list(roots.items())[number % len(roots) :] + list(roots.items())[: number % len(roots)]
            for variant, root in order:  # rotated each round
                times = one_round(root, Path(tmp) / f"{variant}.log", args.timeout_s)
                row = {"variant": variant, "round": number, **times}
                print(row, flush=True)
                artefact["rows"].append(row)
                artefacts.write(args.out, artefact)
    return 0


if __name__ == "__main__":
    sys.exit(main())

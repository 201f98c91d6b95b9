"""Soak: many concurrent gRPC streams and HTTP generate calls with mixed keys, for a bounded time, on
loopback against a server this script starts. Then it checks that nothing was lost:

- every request got exactly one final answer within its client deadline (lost = 0, hung = 0);
- the only errors are the deliberately provoked ones (every 10th request has an invalid height);
- the server's RSS (tritonserver + Python backend stubs) grew by less than --max-rss-growth-mb after
  warm-up, and /dev/shm/triton_python_backend_shm_region_* is back to its size after warm-up.

    .venv/bin/python scripts/soak.py --duration 300 --concurrency 16
Exit status 0 when every check holds; the figures are printed as JSON (and written with --json).
"""

from __future__ import annotations

import argparse
import base64
import glob
import json
import os
import random
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "client"))

from diffusion_client import StreamSession  # noqa: E402

from triton_diffusion.serving.server_process import WEIGHTS, copy_model, start_server  # noqa: E402
from triton_diffusion.tiny_models import build_missing  # noqa: E402

KEYS = [(64, 2), (64, 4), (128, 2), (128, 4)]  # (height, steps); width stays 64
SHM_GLOB = "/dev/shm/triton_python_backend_shm_region_*"


def rss_bytes(pid: int) -> int:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


def shm_bytes() -> int:
    return sum(os.path.getsize(path) for path in glob.glob(SHM_GLOB))


def http_generate(url: str, model: str, request: dict, timeout_s: float) -> str | None:
    """Returns None on success, else the error text."""
    fields = dict(request)
    body = {"PROMPT": fields.pop("prompt"), "parameters": {**fields, "output_encoding": "base64"}}
    http_request = urllib.request.Request(
        f"{url}/v2/models/{model}/generate", data=json.dumps(body).encode(), method="POST"
    )
    try:
        with urllib.request.urlopen(http_request, timeout=timeout_s) as response:
            image = base64.b64decode(json.loads(response.read())["IMAGE"])
            return None if image.startswith(b"\x89PNG") else "not a PNG"
    except urllib.error.HTTPError as error:
        return json.loads(error.read()).get("error", str(error))


class Load:
    """Workers that send requests until a deadline and count what comes back."""

    def __init__(self, server, model: str, concurrency: int, http_fraction: float, timeout_s: float) -> None:
        self.server, self.model, self.timeout_s = server, model, timeout_s
        self.concurrency, self.http_fraction = concurrency, http_fraction
        self.counts: Counter = Counter()
        self.unexpected: list[str] = []
        self.lock = threading.Lock()
        self.sequence = 0

    def _next(self, rng: random.Random) -> tuple[int, dict, bool]:
        with self.lock:
            self.sequence += 1
            number = self.sequence
        height, steps = rng.choice(KEYS)
        invalid = number % 10 == 0
        request = {
            "prompt": f"soak request {number}",
            "seed": number,
            "height": 100 if invalid else height,
            "width": 64,
            "num_inference_steps": steps,
        }
        return number, request, invalid

    def _record(self, error: str | None, invalid: bool, protocol: str) -> None:
        with self.lock:
            self.counts["sent"] += 1
            self.counts[f"sent_{protocol}"] += 1
            if error is None and not invalid:
                self.counts["ok"] += 1
            elif invalid and error is not None and error.startswith("height: "):
                self.counts["provoked_errors"] += 1
            elif error is not None and "no final response" in error:
                self.counts["lost"] += 1
            else:
                self.counts["unexpected"] += 1
                self.unexpected.append(f"{protocol}: {error}")

    def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds

        def worker(index: int) -> None:
            rng = random.Random(index)
            with StreamSession(self.server.grpc_url, self.model) as session:
                while time.monotonic() < deadline:
                    number, request, invalid = self._next(rng)
                    if rng.random() < self.http_fraction:
                        error = http_generate(self.server.http_url, self.model, request, self.timeout_s)
                        self._record(error, invalid, "http")
                    else:
                        result = session.generate(request, f"soak-{number}", self.timeout_s)
                        self._record(result.error, invalid, "grpc")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(self.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=seconds + 2 * self.timeout_s)
        with self.lock:
            self.counts["hung_workers"] += sum(thread.is_alive() for thread in threads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of soak after warm-up")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--http-fraction", type=float, default=0.3)
    parser.add_argument("--timeout", type=float, default=60.0, help="client deadline per request")
    parser.add_argument("--max-rss-growth-mb", type=float, default=200.0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    build_missing(WEIGHTS)
    model = "text_to_image"
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        copy_model(model, repo, model, {"model": str(WEIGHTS / "tiny-sd")})
        server = start_server(repo, Path(tmp) / "tritonserver.log", [model])
        try:
            Load(server, model, args.concurrency, args.http_fraction, args.timeout).run(args.warmup)
            rss_start, shm_start = rss_bytes(server.process.pid), shm_bytes()
            load = Load(server, model, args.concurrency, args.http_fraction, args.timeout)
            started = time.monotonic()
            load.run(args.duration)
            elapsed = time.monotonic() - started
            time.sleep(1.0)
            rss_end, shm_end = rss_bytes(server.process.pid), shm_bytes()
            server_alive = server.process.poll() is None
        finally:
            server.stop()

    report = {
        "duration_s": round(elapsed, 1),
        "concurrency": args.concurrency,
        "http_fraction": args.http_fraction,
        **dict(load.counts),
        "requests_per_s": round(load.counts["sent"] / elapsed, 2),
        "rss_start_mb": round(rss_start / 2**20, 1),
        "rss_end_mb": round(rss_end / 2**20, 1),
        "rss_growth_mb": round((rss_end - rss_start) / 2**20, 1),
        "shm_start_bytes": shm_start,
        "shm_end_bytes": shm_end,
        "server_alive": server_alive,
        "unexpected_examples": load.unexpected[:5],
    }
    checks = {
        "nothing lost": load.counts["lost"] == 0 and load.counts["hung_workers"] == 0,
        "no unexpected errors": load.counts["unexpected"] == 0,
        "provoked errors answered": load.counts["provoked_errors"] > 0,
        "rss growth bounded": report["rss_growth_mb"] < args.max_rss_growth_mb,
        "shared memory back to start": shm_end == shm_start,
        "server alive": server_alive,
    }
    report["checks"] = checks
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

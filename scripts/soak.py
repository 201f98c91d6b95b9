"""Soak: many concurrent gRPC streams and HTTP generate calls with mixed keys, for a bounded time, on
loopback against a server this script starts. Then it checks that nothing was lost:

- every request got exactly one final answer within its client deadline (lost = 0, hung = 0);
- the only errors are the deliberately provoked ones (every 10th request has an invalid height);
- the server's RSS (tritonserver + Python backend stubs) grew by less than --max-rss-growth-mb after
  warm-up, and /dev/shm/triton_python_backend_shm_region_* by less than --max-shm-growth-mb (a region
  grows to the high-water mark of responses in flight and never shrinks; a leak grows with requests).

Hostile mode (``--hostile 0.2``) makes every ``round(1 / share)``-th request hostile (with 0.2, the first
of every 5), cycling through four kinds (invalid UTF-8 in an HTTP parameter, a
megabyte-long scheduler, a megabyte-long unknown parameter name, wrong types); each must get its own short
INVALID_ARG while the rest are served. ``--requests N`` ends the soak once N requests have been sent
(``--duration`` then only bounds it): what it sends does not depend on how fast the machine is (a
``--kill-stub-at`` past the last request kills an idle stub).
``--kill-stub-at 20`` kills the model's Python backend process 20 s into the run: the launcher's
supervisor must bring it back (the recovery time is reported); requests refused meanwhile are counted
apart, and still none may be lost.

    .venv/bin/python scripts/soak.py --duration 300 --concurrency 16
    .venv/bin/python scripts/soak.py --duration 120 --concurrency 12 --hostile 0.2 --kill-stub-at 30
    .venv/bin/python scripts/soak.py --requests 60 --duration 240 --concurrency 6 --hostile 0.2
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
from triton_diffusion_client import ImageSession  # noqa: E402

from triton_diffusion.serving.server_process import WEIGHTS, copy_model, start_server  # noqa: E402
from triton_diffusion.serving.supervisor import list_stubs  # noqa: E402
from triton_diffusion.tiny_models import build_missing  # noqa: E402

KEYS = [(64, 2), (64, 4), (128, 2), (128, 4)]  # (height, steps); width stays 64
SHM_GLOB = "/dev/shm/triton_python_backend_shm_region_*"
# What clients are told while a model's process is dead and while the supervisor loads it again.
# (the supervisor restarts the server: connections are refused or dropped for those seconds).
RECOVERY_ERRORS = (
    "UNAVAILABLE",
    "Connection refused",
    "failed to connect",
    "Socket closed",
    "Connection reset",
    "Broken pipe",
    "Remote end closed",
    "Stub process",
    "is not ready",
)


def _recovery_error(error: str) -> bool:
    return any(phrase in error for phrase in RECOVERY_ERRORS)


def hostile_request(number: int, kind: int) -> tuple[dict, str, str]:
    """(request, protocol, the field its error must name) of ``kind`` (0..3). Every one must fail alone,
    briefly."""
    base = {"prompt": f"hostile {number}", "seed": number, "height": 64, "num_inference_steps": 2}
    if kind == 0:
        return {**base, "negative_prompt": "\udcff"}, "http-raw", "parameters"  # invalid UTF-8 on the wire
    if kind == 1:
        return {**base, "scheduler": "x" * 1_000_000}, "grpc", "scheduler"
    if kind == 2:
        return {**base, "y" * 1_000_000: 1}, "grpc", "unknown field"
    return {**base, "height": "64"}, "grpc", "height"


def http_generate_raw(url: str, model: str, request: dict, timeout_s: float) -> str | None:
    """HTTP generate with the request's strings written as raw bytes (surrogates become invalid UTF-8)."""
    fields = dict(request)
    body = {"PROMPT": fields.pop("prompt"), "parameters": {**fields, "output_encoding": "base64"}}
    data = json.dumps(body, ensure_ascii=False).encode("utf-8", errors="surrogateescape")
    http_request = urllib.request.Request(f"{url}/v2/models/{model}/generate", data=data, method="POST")
    try:
        with urllib.request.urlopen(http_request, timeout=timeout_s) as response:
            response.read()
            return None
    except urllib.error.HTTPError as error:
        return json.loads(error.read()).get("error", str(error))
    except OSError as error:  # refused or dropped: the server is restarting
        return f"{type(error).__name__}: {error}"


def rss_bytes(pid: int) -> int:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


_SHM_BEFORE: set[str] = set()  # regions other servers on this machine made before ours started


def shm_bytes() -> int:
    return sum(os.path.getsize(path) for path in glob.glob(SHM_GLOB) if path not in _SHM_BEFORE)


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
    except OSError as error:  # refused or dropped: the server is restarting
        return f"{type(error).__name__}: {error}"


class Load:
    """Workers that send requests until a deadline (or ``limit`` requests were sent) and count what comes
    back."""

    def __init__(
        self,
        server,
        model: str,
        concurrency: int,
        http_fraction: float,
        timeout_s: float,
        hostile: float = 0.0,
        limit: int | None = None,
    ) -> None:
        self.server, self.model, self.timeout_s = server, model, timeout_s
        self.concurrency, self.http_fraction, self.hostile = concurrency, http_fraction, hostile
        # Hostile requests on a cadence (every ``period``-th), not drawn: a short run still sends each kind.
        self.period = max(1, round(1 / hostile)) if hostile > 0 else 0
        self.limit = limit
        self.counts: Counter = Counter()
        self.unexpected: list[str] = []
        self.lock = threading.Lock()
        self.sequence = 0
        self.recovery_window: tuple[float, float] | None = None  # (kill, recovered) monotonic times

    def _next(self, rng: random.Random) -> tuple[int, dict, bool] | None:
        """The next request's number, body and whether it is invalid; None past ``limit``."""
        with self.lock:
            if self.limit is not None and self.sequence >= self.limit:
                return None
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

    def _during_recovery(self, sent: float) -> bool:
        window = self.recovery_window
        return window is not None and window[0] - self.timeout_s <= sent <= window[1] + 2

    def _record(
        self, error: str | None, invalid: bool, protocol: str, sent: float, expect: str = "height"
    ) -> bool:
        """Count one answer; True when it was a refusal while the model recovers (the client backs off)."""
        with self.lock:
            self.counts["sent"] += 1
            self.counts[f"sent_{protocol}"] += 1
            if error is None and not invalid:
                self.counts["ok"] += 1
            elif invalid and error is not None and expect in error and len(error) < 1000:
                self.counts["provoked_errors"] += 1
            elif error is not None and "no final response" in error:
                self.counts["lost"] += 1
            elif error is not None and self._during_recovery(sent) and _recovery_error(error):
                self.counts["refused_during_recovery"] += 1
                return True
            else:
                self.counts["unexpected"] += 1
                self.unexpected.append(f"{protocol}: {str(error)[:300]}")
        return False

    def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds

        def one(session: ImageSession, rng: random.Random, picked: tuple[int, dict, bool]) -> bool:
            """Send one request; True when it was refused while the server came back."""
            number, request, invalid = picked
            sent = time.monotonic()
            try:
                if self.period and number % self.period == 1 % self.period:  # the 1st, the 1 + period-th ...
                    request, protocol, expect = hostile_request(number, (number // self.period) % 4)
                    if protocol == "http-raw":
                        error = http_generate_raw(self.server.http_url, self.model, request, self.timeout_s)
                    else:
                        error = session.generate(request, f"hostile-{number}", self.timeout_s).error
                    return self._record(error, True, f"hostile_{protocol}", sent, expect)
                if rng.random() < self.http_fraction:
                    error = http_generate(self.server.http_url, self.model, request, self.timeout_s)
                    return self._record(error, invalid, "http", sent)
                result = session.generate(request, f"soak-{number}", self.timeout_s)
                return self._record(result.error, invalid, "grpc", sent)
            except Exception as exc:  # noqa: BLE001  (a connection that broke: counted, not fatal)
                return self._record(f"{type(exc).__name__}: {exc}", invalid, "exception", sent)

        def worker(index: int) -> None:
            rng = random.Random(index)
            while time.monotonic() < deadline:
                with ImageSession(self.server.grpc_url, self.model) as session:
                    while time.monotonic() < deadline:
                        picked = self._next(rng)
                        if picked is None:  # every request of the limit sent
                            return
                        if one(session, rng, picked):
                            time.sleep(0.25)  # a retrying client backs off while the server comes back
                            break  # and opens a new stream: the old one broke with the server

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(self.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=seconds + 2 * self.timeout_s)
        with self.lock:
            self.counts["hung_workers"] += sum(thread.is_alive() for thread in threads)


class StubKiller(threading.Thread):
    """Kills the model's Python backend stub at a given time into the run, then times the recovery: until
    Triton reports the model ready again and a request succeeds."""

    def __init__(self, server, model: str, at_s: float, load: Load) -> None:
        super().__init__(daemon=True)
        self.server, self.model, self.at_s, self.load = server, model, at_s, load
        self.recovery_s: float | None = None

    def _ready(self) -> bool:
        url = f"{self.server.http_url}/v2/models/{self.model}/ready"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def run(self) -> None:
        time.sleep(self.at_s)
        (stub,) = [s for s in list_stubs(self.server.process.pid) if s.model == self.model]
        killed = time.monotonic()
        self.load.recovery_window = (killed, killed + 120)
        os.kill(stub.pid, 9)
        while time.monotonic() - killed < 120:
            time.sleep(0.1)
            if time.monotonic() - killed > 1.5 and self._ready():
                request = {"prompt": "after recovery", "seed": 1, "num_inference_steps": 2}
                if http_generate(self.server.http_url, self.model, request, 30) is None:
                    self.recovery_s = round(time.monotonic() - killed, 1)
                    break
        self.load.recovery_window = (killed, time.monotonic())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of soak after warm-up")
    parser.add_argument("--requests", type=int, help="end once this many were sent (--duration: at most)")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--http-fraction", type=float, default=0.3)
    parser.add_argument("--timeout", type=float, default=60.0, help="client deadline per request")
    parser.add_argument("--max-rss-growth-mb", type=float, default=200.0)
    parser.add_argument("--max-shm-growth-mb", type=float, default=8.0)
    parser.add_argument("--hostile", type=float, default=0.0, help="share of hostile requests")
    parser.add_argument("--kill-stub-at", type=float, help="kill -9 the model's stub this many seconds in")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    build_missing(WEIGHTS)
    model = "text_to_image"
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        copy_model(model, repo, model, {"model": str(WEIGHTS / "tiny-sd")})
        _SHM_BEFORE.update(glob.glob(SHM_GLOB))
        server = start_server(repo, Path(tmp) / "tritonserver.log", [model])
        try:
            Load(server, model, args.concurrency, args.http_fraction, args.timeout).run(args.warmup)
            rss_start, shm_start = rss_bytes(server.process.pid), shm_bytes()
            load = Load(
                server, model, args.concurrency, args.http_fraction, args.timeout, args.hostile, args.requests
            )
            killer = None
            if args.kill_stub_at is not None:
                killer = StubKiller(server, model, args.kill_stub_at, load)
                killer.start()
            started = time.monotonic()
            load.run(args.duration)
            elapsed = time.monotonic() - started
            if killer is not None:
                killer.join(timeout=60)
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
    if killer is not None:
        report["stub_killed_at_s"] = args.kill_stub_at
        report["recovery_s"] = killer.recovery_s

    checks = {
        "nothing lost": load.counts["lost"] == 0 and load.counts["hung_workers"] == 0,
        "no unexpected errors": load.counts["unexpected"] == 0,
        "provoked errors answered": load.counts["provoked_errors"] > 0,
        "rss growth bounded": report["rss_growth_mb"] < args.max_rss_growth_mb,
        "shared memory growth bounded": shm_end - shm_start <= args.max_shm_growth_mb * 2**20,
        "server alive": server_alive,
    }
    if killer is not None:
        checks["recovered within 60 s"] = killer.recovery_s is not None and killer.recovery_s < 60
        # The restarted server's regions grow with the load from their first size again (the killed
        # server's are removed): reported, not held to the size before the kill.
        del checks["shared memory growth bounded"]
    report["checks"] = checks
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

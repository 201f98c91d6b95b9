"""The real server, as the through-server image benchmarks (``server``) drive it: ``ServerVariant`` starts
one model configuration on a tritonserver of its own (a temporary copy of the model repository) and runs
traffic against it; ``drive`` sends requests with the project's gRPC client, closed loop or Poisson
arrivals on the true clock; ``drive_front`` sends them through the OpenAI front (the official ``openai``
client or Python's ``http.client``); ``summarize`` makes a run's ``RunStats``; ``MemorySampler`` keeps the
peak memory of the server and its Python backend stubs.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import queue
import random
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
from triton_diffusion_client import GenerateResult, ImageSession, generate_one

from benchmarks.arrivals import poisson_arrivals
from benchmarks.common import PROMPTS, WARM_UP_FRACTION, mean, metric_delta, percentile
from triton_diffusion.serving.server_process import copy_model, read_metrics, set_batching, start_server


@dataclass
class RunStats:
    variant: str
    concurrency: int | None
    rate: float | None
    requests: int
    images: int
    errors: int
    duration_s: float
    requests_per_s: float
    images_per_s: float
    latency_mean_s: float
    latency_p50_s: float
    latency_p95_s: float
    latency_p99_s: float
    first_progress_mean_s: float | None
    peak_memory_mb: float
    mean_rows_per_call: float | None
    traffic: str = "homogeneous"
    # CPU milliseconds per request of the OpenAI front, the server (Triton and its stubs) and this
    # client, where measured (--openai): on one machine all three share the cores.
    cpu_ms_per_request: dict[str, float] | None = None
    round: int = 0  # of the benchmark's alternated rounds (--rounds)
    arrival_seed: int | None = None  # Poisson: the seed of its arrival times


class MemorySampler:
    """Peak RSS of a process and its children (the server and its Python backend stubs)."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                processes = [self.process, *self.process.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in processes))
            except psutil.Error:
                pass
            self._stop.wait(0.1)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def make_requests(
    count: int, shapes: list[tuple[int, int, int]], progress: bool, seed: int = 0, guidance=(None,)
) -> list[dict]:
    """``count`` requests over the shipped prompts; shape (height, width, steps) drawn from ``shapes``,
    guidance scale from ``guidance`` (None: the model's default)."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        height, width, steps = shapes[0] if len(shapes) == 1 else rng.choice(shapes)
        request = {
            "prompt": PROMPTS[i % len(PROMPTS)],
            "seed": i,
            "height": height,
            "width": width,
            "num_inference_steps": steps,
        }
        scale = rng.choice(guidance)
        if scale is not None:
            request["guidance_scale"] = scale
        if progress:
            request["progress"] = True
        requests.append(request)
    return requests


def drive(
    url: str, model: str, requests: list[dict], concurrency: int | None, rate: float | None, seed: int = 1
):
    """Closed loop (``concurrency`` workers, each sends its next request when the last one is answered) or
    open loop (Poisson arrivals at ``rate`` requests/s, drawn from ``seed``). Returns the results and the
    duration.

    Open loop on the true clock: a request's latency and time to first progress run from its scheduled
    arrival (a thread that starts late is charged its lateness), and the first WARM_UP_FRACTION of the
    requests (an empty server filling up) are left out; the duration then runs from the first measured
    arrival to the last measured answer."""
    results: list[GenerateResult | None] = [None] * len(requests)
    todo: queue.Queue = queue.Queue()
    for item in enumerate(requests):
        todo.put(item)

    def send(index: int, request: dict) -> None:
        results[index] = generate_one(request, f"bench-{index}", url, model, 600.0)

    sessions = [ImageSession(url, model) for _ in range(concurrency or 0)]  # connected before the clock
    started = time.perf_counter()
    arrivals: list[float] = []
    late = [0.0] * len(requests)
    if rate is None:

        def worker(session: ImageSession) -> None:
            with session:
                while True:
                    try:
                        index, request = todo.get_nowait()
                    except queue.Empty:
                        return
                    results[index] = session.generate(request, f"bench-{index}", 600.0)

        threads = [threading.Thread(target=worker, args=(session,)) for session in sessions]
    else:
        threads = []
        arrivals = poisson_arrivals(len(requests), rate, seed)
        for index, (request, at) in enumerate(zip(requests, arrivals, strict=True)):

            def delayed(index: int = index, request: dict = request, at: float = at) -> None:
                time.sleep(max(0.0, started + at - time.perf_counter()))
                send(index, request)
                # All that came before generate()'s own clock (a late thread, the channel) is charged.
                late[index] = time.perf_counter() - (started + at) - results[index].latency_s

            threads.append(threading.Thread(target=delayed))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if rate is None:
        return [r for r in results if r is not None], time.perf_counter() - started
    measured, end = [], 0.0
    warm_up = math.floor(len(requests) * WARM_UP_FRACTION)
    for index, result in enumerate(results):
        if result is None or index < warm_up:
            continue
        first = result.first_progress_s
        result = replace(
            result,
            latency_s=result.latency_s + late[index],
            first_progress_s=None if first is None else first + late[index],
        )
        measured.append(result)
        end = max(end, arrivals[index] + result.latency_s)
    return measured, end - arrivals[warm_up]


class OfficialClient:
    """The front through the official ``openai`` client (httpx and pydantic): what applications use."""

    def __init__(self, url: str) -> None:
        import openai

        self.errors = (openai.OpenAIError,)
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600.0)

    def images(self, model: str, body: dict, extra: dict) -> list[bytes]:
        response = self.client.images.generate(model=model, **body, extra_body=extra)
        return [base64.b64decode(d.b64_json) for d in response.data]

    def close(self) -> None:
        self.client.close()


class PlainHttpClient:
    """The front through Python's own ``http.client`` (one keep-alive connection, the same JSON body the
    official client sends): a client that costs less CPU than the official one, so on a machine shared by
    server and clients the figure is closer to the front's own overhead."""

    errors = (OSError, http.client.HTTPException, ValueError, KeyError)

    def __init__(self, url: str) -> None:
        address = urllib.parse.urlsplit(url)
        self.connection = http.client.HTTPConnection(address.hostname, address.port, timeout=600.0)

    def images(self, model: str, body: dict, extra: dict) -> list[bytes]:
        payload = json.dumps({"model": model, **body, **extra}).encode()
        try:
            self.connection.request(
                "POST", "/v1/images/generations", payload, {"Content-Type": "application/json"}
            )
            response = self.connection.getresponse()
            data = response.read()
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}: {data[:300]!r}")
            return [base64.b64decode(d["b64_json"]) for d in json.loads(data)["data"]]
        except self.errors:
            self.connection.close()  # a connection left mid-answer is reopened by the next request
            raise

    def close(self) -> None:
        self.connection.close()


FRONT_CLIENTS = {"openai": OfficialClient, "http": PlainHttpClient}


def drive_front(url: str, model: str, requests: list[dict], concurrency: int, client: str):
    """Closed loop through the OpenAI front (``/v1/images/generations``, b64_json), one client of kind
    ``client`` (FRONT_CLIENTS: its own connection) per worker. Returns the results and the duration."""
    results: list[GenerateResult | None] = [None] * len(requests)
    todo: queue.Queue = queue.Queue()
    for item in enumerate(requests):
        todo.put(item)
    clients = [FRONT_CLIENTS[client](url) for _ in range(concurrency)]

    def worker(front) -> None:
        while True:
            try:
                index, request = todo.get_nowait()
            except queue.Empty:
                return
            body = {
                "prompt": request["prompt"],
                "n": 1,
                "size": f"{request['width']}x{request['height']}",
                "response_format": "b64_json",
            }
            extra = {k: request[k] for k in ("seed", "num_inference_steps", "guidance_scale") if k in request}
            started = time.perf_counter()
            images, error = [], None
            try:
                images = front.images(model, body, extra)
            except front.errors as exc:
                error = str(exc)
            results[index] = GenerateResult(
                f"bench-{index}",
                request["prompt"],
                images=images,
                error=error,
                latency_s=time.perf_counter() - started,
            )

    threads = [threading.Thread(target=worker, args=(front,)) for front in clients]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    duration = time.perf_counter() - started
    for front in clients:
        front.close()
    return [r for r in results if r is not None], duration


def summarize(
    variant: str,
    concurrency: int | None,
    rate: float | None,
    results: list[GenerateResult],
    duration: float,
    peak_bytes: float,
    rows_per_call: float | None,
) -> RunStats:
    ok = [r for r in results if r.ok]
    latencies = [r.latency_s for r in ok]
    firsts = [r.first_progress_s for r in ok if r.first_progress_s is not None]
    images = sum(len(r.images) for r in ok)
    return RunStats(
        variant=variant,
        concurrency=concurrency,
        rate=rate,
        requests=len(results),
        images=images,
        errors=len(results) - len(ok),
        duration_s=duration,
        requests_per_s=len(ok) / duration,
        images_per_s=images / duration,
        latency_mean_s=mean(latencies),
        latency_p50_s=percentile(latencies, 0.5),
        latency_p95_s=percentile(latencies, 0.95),
        latency_p99_s=percentile(latencies, 0.99),
        first_progress_mean_s=mean(firsts) if firsts else None,
        peak_memory_mb=peak_bytes / 2**20,
        mean_rows_per_call=rows_per_call,
    )


class ServerVariant:
    """One model configuration on a real server, started for the runs and stopped afterwards."""

    def __init__(
        self,
        name: str,
        model: str,
        weights: Path,
        rows_per_call: int,
        queue_delay_us: int,
        triton_max_batch_size: int,
        extra_edits: dict[str, str] | None = None,
        openai_port: int | None = None,
    ) -> None:
        self.name, self.model = name, model
        self.tmp = tempfile.TemporaryDirectory(prefix=f"bench-{name}-")
        repo = Path(self.tmp.name) / "repo"
        repo.mkdir()
        edits = {"model": str(weights), "max_rows_per_call": str(rows_per_call), **(extra_edits or {})}
        copy_model(model, repo, model, edits)
        set_batching(repo, model, queue_delay_us, triton_max_batch_size)
        front = [f"--openai-port={openai_port}", "--openai-address=127.0.0.1"] if openai_port else []
        self.server = start_server(repo, Path(self.tmp.name) / "tritonserver.log", [model], extra_args=front)
        self.openai_url = f"http://127.0.0.1:{openai_port}" if openai_port else None
        if openai_port:
            wait_until_ready(f"{self.openai_url}/health")

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of the OpenAI front, the server (the launcher, Triton, its stubs) and this
        process (the client)."""
        totals = {"front": 0.0, "server": 0.0}
        launcher = psutil.Process(self.server.process.pid)
        for process in [launcher, *launcher.children(recursive=True)]:
            try:
                times = process.cpu_times()
                part = "front" if "openai_front" in " ".join(process.cmdline()) else "server"
            except psutil.Error:
                continue  # ended meanwhile
            totals[part] += times.user + times.system
        own = psutil.Process().cpu_times()
        totals["client"] = own.user + own.system
        return totals

    def warm_up(self, request: dict, batch: int) -> None:
        drive(self.server.grpc_url, self.model, [dict(request, seed=i) for i in range(batch)], batch, None)

    def run(
        self,
        requests: list[dict],
        concurrency: int | None,
        rate: float | None,
        front: str | None = None,
        seed: int = 1,
    ) -> RunStats:
        """One run of ``requests`` (Poisson at ``rate``: arrivals drawn from ``seed``)."""
        before = read_metrics(self.server)
        with MemorySampler(self.server.process.pid) as memory:
            if front:  # through the OpenAI front with a client of FRONT_CLIENTS
                results, duration = drive_front(self.openai_url, self.model, requests, concurrency, front)
            else:
                results, duration = drive(self.server.grpc_url, self.model, requests, concurrency, rate, seed)
        after = read_metrics(self.server)
        # Images per fused call (request-level) or per forward (step engine).
        prefix = "triton_diffusion_fused_call_rows"
        if self.name == "step":
            prefix = "triton_diffusion_forward_images"
        calls = metric_delta(before, after, f"{prefix}_count", self.model)
        rows = metric_delta(before, after, f"{prefix}_sum", self.model)
        stats = summarize(
            self.name, concurrency, rate, results, duration, memory.peak, rows / calls if calls else None
        )
        if front:
            stats.traffic = front
        print(
            f"  {self.name:10s} c={concurrency} rate={rate}: {stats.requests_per_s:.2f} req/s, "
            f"p95 {stats.latency_p95_s:.3f} s, first step {stats.first_progress_mean_s}, "
            f"rows/call {stats.mean_rows_per_call}, errors {stats.errors}",
            flush=True,
        )
        return stats

    def stop(self) -> None:
        self.server.stop()
        self.tmp.cleanup()


def wait_until_ready(url: str, timeout_s: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not ready in {timeout_s} s") from None
            time.sleep(0.3)

"""Benchmark on the real server: the two image engines side by side, and the in-process ceiling.

Variants, on the same model and machine:
  request    the request-level engine: one fused diffusers call per compatible group (engine request)
  step       the step engine: requests join a running denoising loop at the next step (engine step)
  singleton  (--singleton) the request-level engine with one row per call: no batching at all
  raw        the same diffusers pipeline called in-process, batch 1 and batch = max batch size, no server

Each server variant is started by this script (a temporary copy of the model repository), driven with the
project's gRPC client (closed loop at each --concurrency), then stopped. --mixed adds mixed traffic (steps
from {4, 8, 16} x guidance from {1, 5, 7.5}, closed loop at the top concurrency); --poisson adds Poisson
arrivals at 50/80/95% of the request-level engine's saturated throughput (mean/p95 latency and time to
the first step); --sweep the request-level engine's images-per-call x queue-delay grid; --openai the
OpenAI front's overhead (one step-engine server with the front: closed loop at the top concurrency through
the official ``openai`` client and through Python's ``http.client`` against gRPC direct, alternated).
Writes bench.json, bench.md and bench.png (throughput and p95 latency against concurrency) to --out.

    .venv/bin/python scripts/bench.py --concurrency 1,2,4,8,16 --requests 96 --mixed --poisson
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import math
import queue
import random
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when loaded by file path

import artefacts  # noqa: E402
from bench_common import (  # noqa: E402
    MIXED_GUIDANCE,
    MIXED_STEPS,
    POISSON_LOADS,
    PROMPTS,
    REPO_ROOT,
    WARM_UP_FRACTION,
    load_cell,
    machine_description,
    max_sequence_length,
    mean,
    metric_delta,
    number_cell,
    percentile,
    poisson_arrivals,
    poisson_label,
    pooled_throughput,
    ratio_table,
    step_request_ratios,
    write_plot,
)
from triton_diffusion_client import GenerateResult, ImageSession, generate_one  # noqa: E402

from triton_diffusion.serving.server_process import (  # noqa: E402
    WEIGHTS,
    copy_model,
    free_port,
    read_metrics,
    set_batching,
    start_server,
)
from triton_diffusion.tiny_models import ARCHITECTURES, build_missing  # noqa: E402

MODEL_FOR_ARCH = {"tiny-sd": "text_to_image", "tiny-flux": "text_to_image_flux", "sd15": "text_to_image"}


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


def drive(url: str, model: str, requests: list[dict], concurrency: int | None, rate: float | None):
    """Closed loop (``concurrency`` workers, each sends its next request when the last one is answered) or
    open loop (Poisson arrivals at ``rate`` requests/s). Returns the results and the duration.

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
        arrivals = poisson_arrivals(len(requests), rate)
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
        self, requests: list[dict], concurrency: int | None, rate: float | None, front: str | None = None
    ) -> RunStats:
        before = read_metrics(self.server)
        with MemorySampler(self.server.process.pid) as memory:
            if front:  # through the OpenAI front with a client of FRONT_CLIENTS
                results, duration = drive_front(self.openai_url, self.model, requests, concurrency, front)
            else:
                results, duration = drive(self.server.grpc_url, self.model, requests, concurrency, rate)
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


def run_front_overhead(
    args: argparse.Namespace, model: str, weights: Path, size_edits: dict, requests: list[dict], top: int
) -> list[RunStats]:
    """One step-engine server with the OpenAI front: gRPC direct and through the front with each client of
    FRONT_CLIENTS, alternated (two rounds each) at the top concurrency, so all see the same server and the
    same machine."""
    print(
        "[openai] the front's overhead: one step-engine server, gRPC direct and through the front", flush=True
    )
    variant = ServerVariant(
        "step",
        model,
        weights,
        args.max_batch_size,
        args.queue_delay_us,
        args.triton_max_batch_size,
        {**size_edits, **ENGINE_VARIANTS["step"]},
        openai_port=free_port(),
    )
    plain = [{k: v for k, v in r.items() if k != "progress"} for r in requests]
    try:
        variant.warm_up(plain[0], args.max_batch_size)
        for client in FRONT_CLIENTS:  # warm-up
            variant.run(plain[: args.max_batch_size], args.max_batch_size, None, front=client)
        runs = []
        for round_ in range(2):
            paths = [None, *FRONT_CLIENTS]  # gRPC direct, then through the front with each client
            for path in paths if round_ % 2 == 0 else paths[::-1]:  # each order in every other round
                before = variant.cpu_seconds()
                stats = variant.run(plain, top, None, front=path)
                after = variant.cpu_seconds()
                cpu = {part: 1000 * (after[part] - before[part]) / len(plain) for part in after}
                runs.append(replace(stats, traffic=path or "grpc", cpu_ms_per_request=cpu))
                shares = ", ".join(f"{part} {ms:.2f}" for part, ms in cpu.items())
                print(f"    CPU ms per request: {shares}", flush=True)
        return runs
    finally:
        variant.stop()


def run_raw(
    weights: Path, batch_sizes: list[int], images: int, height: int, width: int, steps: int, extra: dict
) -> list[dict]:
    """The ceiling: the same pipeline called in-process, no server."""
    import resource

    import torch
    from diffusers import DiffusionPipeline

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pipe = DiffusionPipeline.from_pretrained(weights, torch_dtype=dtype, use_safetensors=True).to(device)
    pipe.set_progress_bar_config(disable=True)
    out = []
    for batch in batch_sizes:

        def call(offset: int, batch: int = batch) -> None:
            prompts = [PROMPTS[(offset + i) % len(PROMPTS)] for i in range(batch)]
            generators = [torch.Generator("cpu").manual_seed(offset + i) for i in range(batch)]
            with torch.inference_mode():
                pipe(
                    prompt=prompts,
                    generator=generators,
                    height=height,
                    width=width,
                    num_inference_steps=steps,
                    output_type="pil",
                    **extra,
                )

        call(0)  # warm-up (torch.compile-free, but first calls allocate)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        calls = max(1, images // batch)
        started = time.perf_counter()
        for n in range(calls):
            call(n * batch)
        if device == "cuda":
            torch.cuda.synchronize()
        duration = time.perf_counter() - started
        peak = (
            torch.cuda.max_memory_allocated() / 2**20
            if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        )
        out.append(
            {
                "variant": f"raw-batch{batch}",
                "batch": batch,
                "images": calls * batch,
                "duration_s": duration,
                "images_per_s": calls * batch / duration,
                "latency_per_call_s": duration / calls,
                "peak_memory_mb": peak,
            }
        )
        print(f"  raw batch {batch}: {calls * batch / duration:.2f} images/s", flush=True)
    return out


def write_heatmap(
    cells: dict[tuple[int, int], float], sizes: list[int], delays: list[int], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [[cells[(size, delay)] for delay in delays] for size in sizes]
    fig, axis = plt.subplots(figsize=(6, 4))
    image = axis.imshow(grid, cmap="viridis", origin="lower")
    axis.set_xticks(range(len(delays)), [f"{d / 1000:g} ms" for d in delays])
    axis.set_yticks(range(len(sizes)), [str(s) for s in sizes])
    axis.set(xlabel="max_queue_delay", ylabel="images per fused call", title="Throughput (requests/s)")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            axis.text(j, i, f"{value:.1f}", ha="center", va="center", color="white")
    fig.colorbar(image)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict) -> str:
    lines = [
        f"Machine: {report['machine']}; model {report['model']} ({report['arch']}), "
        f"{report['height']}x{report['width']}, {report['steps']} steps, "
        f"{report['max_batch_size']} images per fused call or forward, Triton max_batch_size "
        f"{report['triton_max_batch_size']}, "
        f"queue delay {report['queue_delay_us'] / 1000:g} ms, {report['requests']} requests per run.",
        "",
        "| variant | traffic | concurrency / rate | req/s | images/s | mean (s) | p50 (s) | p95 (s) "
        "| p99 (s) | first step (s) | images per call or forward | peak memory (MB) | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        first = number_cell(r["first_progress_mean_s"])
        rows = number_cell(r["mean_rows_per_call"], 2)
        lines.append(
            f"| {r['variant']} | {r['traffic']} | {load_cell(r['concurrency'], r['rate'])} "
            f"| {r['requests_per_s']:.2f} "
            f"| {r['images_per_s']:.2f} | {r['latency_mean_s']:.3f} | {r['latency_p50_s']:.3f} "
            f"| {r['latency_p95_s']:.3f} | {r['latency_p99_s']:.3f} | {first} | {rows} "
            f"| {r['peak_memory_mb']:.0f} | {r['errors']} |"
        )
    for raw in report["raw"]:
        lines.append(
            f"| {raw['variant']} (in-process) | - | - | {raw['images_per_s']:.2f} "
            f"| {raw['images_per_s']:.2f} "
            f"| {raw['latency_per_call_s']:.3f} per call | - | - | - | - | {raw['batch']} "
            f"| {raw['peak_memory_mb']:.0f} | 0 |"
        )
    lines += ["", *ratio_table(report["ratios"])]
    if report.get("sweep"):
        s = report["sweep"]
        lines += [
            "",
            f"Sweep (request-level engine) at concurrency {s['concurrency']}: best images per call="
            f"{s['best']['max_batch_size']}, max_queue_delay={s['best']['queue_delay_us'] / 1000:g} ms "
            f"({s['best']['requests_per_s']:.2f} req/s).",
        ]
    return "\n".join(lines) + "\n"


ENGINE_VARIANTS = {
    "request": {"engine": "request"},
    "step": {"engine": "step"},
    "singleton": {"engine": "request", "max_rows_per_call": "1"},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--arch",
        choices=sorted(ARCHITECTURES),
        default="tiny-sd",
        help="random-weight architecture to build and serve (full-size ones for GPUs)",
    )
    parser.add_argument("--concurrency", default="1,2,4,8", help="comma-separated closed-loop concurrencies")
    parser.add_argument("--requests", type=int, default=64, help="requests per run")
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=8,
        help="images per fused call or forward (max_rows_per_call)",
    )
    parser.add_argument(
        "--triton-max-batch-size",
        type=int,
        default=32,
        help="requests Triton hands one execute() (the planner's window)",
    )
    parser.add_argument("--queue-delay-us", type=int, default=20000)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--progress", action="store_true", help="stream progress (reports time to first)")
    parser.add_argument("--singleton", action="store_true", help="also the unbatched request-level engine")
    parser.add_argument("--mixed", action="store_true", help="also mixed steps x guidance traffic")
    parser.add_argument("--poisson", action="store_true", help="also Poisson arrivals at 50/80/95%% load")
    parser.add_argument(
        "--poisson-requests",
        type=int,
        default=400,
        help="requests per Poisson run (steady state: the first 10%% are left out)",
    )
    parser.add_argument("--sweep", action="store_true", help="also sweep images per call x queue delay")
    parser.add_argument(
        "--openai", action="store_true", help="also the OpenAI front's overhead against gRPC direct"
    )
    parser.add_argument("--no-raw", action="store_true", help="skip the in-process ceiling")
    parser.add_argument(
        "--slo",
        action="store_true",
        help="instead: service tiers and deadlines through the server (bench_slo_server.py; its own "
        "options follow --slo-args)",
    )
    parser.add_argument("--slo-args", default="", help="options for bench_slo_server.py, as one string")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results")
    args = parser.parse_args(argv)
    if args.slo:
        import bench_slo_server

        bench_slo_server.main([*args.slo_args.split(), "--arch", args.arch, "--out", str(args.out)])
        return

    build_missing(WEIGHTS, only=[args.arch])
    weights = WEIGHTS / args.arch
    model = MODEL_FOR_ARCH[args.arch]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    top = max(concurrencies)
    shape = (args.height, args.width, args.steps)
    requests = make_requests(args.requests, [shape], args.progress)
    mixed_shapes = [(args.height, args.width, steps) for steps in MIXED_STEPS]
    mixed = make_requests(args.requests, mixed_shapes, True, seed=3, guidance=MIXED_GUIDANCE)
    size_edits = {
        "default_height": str(args.height),
        "default_width": str(args.width),
        "max_height": str(max(args.height, 2048)),
        "max_width": str(max(args.width, 2048)),
    }
    args.out.mkdir(parents=True, exist_ok=True)

    names = ["request", "step"] + (["singleton"] if args.singleton else [])
    variants = {}
    runs: list[RunStats] = []
    try:
        for name in names:
            print(f"[{name}] starting the server", flush=True)
            variant = ServerVariant(
                name,
                model,
                weights,
                args.max_batch_size,
                args.queue_delay_us,
                args.triton_max_batch_size,
                {**size_edits, **ENGINE_VARIANTS[name]},
            )
            variants[name] = variant
            variant.warm_up(requests[0], args.max_batch_size)
            for concurrency in concurrencies:
                runs.append(variant.run(requests, concurrency, None))
            if args.mixed and name != "singleton":
                for steps in MIXED_STEPS:
                    variant.warm_up(dict(mixed[0], num_inference_steps=steps), 2)
                runs.append(replace(variant.run(mixed, top, None), traffic="mixed"))
            if name != "step":
                variants.pop(name).stop()
        if args.poisson:
            saturated = max(
                r.requests_per_s for r in runs if r.variant == "request" and r.traffic == "homogeneous"
            )
            poisson_requests = make_requests(args.poisson_requests, [shape], True)
            request_variant = ServerVariant(
                "request",
                model,
                weights,
                args.max_batch_size,
                args.queue_delay_us,
                args.triton_max_batch_size,
                {**size_edits, **ENGINE_VARIANTS["request"]},
            )
            variants["request"] = request_variant
            request_variant.warm_up(requests[0], args.max_batch_size)
            for load in POISSON_LOADS:
                for name in ("request", "step"):
                    stats = variants[name].run(poisson_requests, None, load * saturated)
                    runs.append(replace(stats, traffic=poisson_label(load)))
    finally:
        for variant in variants.values():
            variant.stop()
    if args.openai:
        runs += run_front_overhead(args, model, weights, size_edits, requests, top)

    raw = []
    if not args.no_raw:
        print("[raw] in-process pipeline", flush=True)
        length = max_sequence_length(args.arch)
        extra = {"max_sequence_length": length} if length else {}
        raw = run_raw(
            weights, [1, args.max_batch_size], args.requests, args.height, args.width, args.steps, extra
        )

    report = {
        "machine": machine_description(),
        "arch": args.arch,
        "model": model,
        "height": args.height,
        "width": args.width,
        "steps": args.steps,
        "max_batch_size": args.max_batch_size,
        "triton_max_batch_size": args.triton_max_batch_size,
        "queue_delay_us": args.queue_delay_us,
        "requests": args.requests,
        "runs": [asdict(r) for r in runs],
        "raw": raw,
        "ratios": ratios(runs, raw, top),
    }
    if args.sweep:
        report["sweep"] = run_sweep(args, model, weights, size_edits, requests, top)

    artefacts.write(args.out / "bench.json", report)
    (args.out / "bench.md").write_text(markdown(report))
    write_plot([r for r in runs if r.traffic == "homogeneous"], args.out / "bench.png")
    print(markdown(report))
    print(f"wrote {args.out}/bench.json, bench.md, bench.png")


FRONT_CLIENT_LABELS = {"openai": "the official openai client", "http": "http.client"}


def front_ratios(
    grpc: list[RunStats], front: list[RunStats], label: str, top: int
) -> dict[str, tuple[float, str]]:
    """Through the front with one kind of client against gRPC direct, each path's rounds pooled (images
    over time, the worst round's p95), and the CPU per request that separates the front's cost and the
    client's from the server's work (on one machine all share the cores)."""

    def cpu(rs: list[RunStats], part: str) -> float:
        return sum(r.cpu_ms_per_request[part] for r in rs) / len(rs)

    return {
        f"OpenAI front ({label}) / gRPC direct throughput, step engine, c={top}": (
            pooled_throughput(front) / pooled_throughput(grpc),
            ">= 0.95",
        ),
        f"OpenAI front ({label}) / gRPC direct p95 latency, c={top}": (
            max(r.latency_p95_s for r in front) / max(r.latency_p95_s for r in grpc),
            "-",
        ),
        f"OpenAI front's own CPU / the server's, per request ({label})": (
            cpu(front, "front") / cpu(front, "server"),
            "-",
        ),
        f"{label}'s CPU over the gRPC client's, per request / the server's": (
            (cpu(front, "client") - cpu(grpc, "client")) / cpu(front, "server"),
            "-",
        ),
    }


def ratios(runs: list[RunStats], raw: list[dict], top: int) -> dict[str, tuple[float, str]]:
    def pick(variant: str, traffic: str = "homogeneous") -> RunStats | None:
        found = [r for r in runs if r.variant == variant and r.traffic == traffic]
        if traffic == "homogeneous":
            found = [r for r in found if r.concurrency == top]
        return found[-1] if found else None

    out = step_request_ratios(pick, top, "first_progress_mean_s")
    grpc = [r for r in runs if r.traffic == "grpc"]
    for client, label in FRONT_CLIENT_LABELS.items():
        front = [r for r in runs if r.traffic == client]
        if grpc and front:
            out.update(front_ratios(grpc, front, label, top))
    step, request = pick("step"), pick("request")
    if pick("singleton"):
        out[f"homogeneous c={top}: request / singleton throughput"] = (
            request.images_per_s / pick("singleton").images_per_s,
            "-",
        )
    if raw:
        batched = raw[-1]["images_per_s"]
        out[f"step c={top} / raw batch-{raw[-1]['batch']} (server and clients share the CPU)"] = (
            step.images_per_s / batched,
            "-",
        )
        out["raw batched / raw single (most batching can give)"] = (batched / raw[0]["images_per_s"], "-")
    return out


def run_sweep(
    args: argparse.Namespace,
    model: str,
    weights: Path,
    size_edits: dict,
    requests: list[dict],
    concurrency: int,
) -> dict:
    sizes = sorted({1, 2, 4, args.max_batch_size})
    delays = [0, 5000, 20000, 50000]
    cells: dict[tuple[int, int], float] = {}
    results = []
    for size in sizes:
        for delay in delays:
            variant = ServerVariant(
                f"b{size}-d{delay}",
                model,
                weights,
                size,
                delay,
                max(size, args.triton_max_batch_size),
                size_edits,
            )
            try:
                variant.warm_up(requests[0], size)
                stats = variant.run(requests, concurrency, None)
            finally:
                variant.stop()
            cells[(size, delay)] = stats.requests_per_s
            results.append(
                {
                    "max_batch_size": size,
                    "queue_delay_us": delay,
                    "requests_per_s": stats.requests_per_s,
                    "latency_p95_s": stats.latency_p95_s,
                }
            )
    write_heatmap(cells, sizes, delays, args.out / "sweep.png")
    best = max(results, key=lambda r: (r["requests_per_s"], -r["latency_p95_s"]))
    return {"concurrency": concurrency, "cells": results, "best": best}


if __name__ == "__main__":
    main()

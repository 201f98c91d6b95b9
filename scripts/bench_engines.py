"""The two image engines side by side in one process, on one pipeline, without Triton or client threads.

  request  the request-level engine: requests that arrived while the model was busy form the next batch
           (Triton's dynamic batcher, window --window), grouped by compatibility key, one diffusers
           ``pipeline(...)`` call per group of at most --cap rows (planner.plan_groups)
  step     the step engine: requests join a running denoising loop at the next step, one forward per
           step for the running set (--cap rows), each row with its own steps, guidance and scheduler
  raw      the pipeline alone: batch 1 and batch --cap calls back to back (the ceiling)

Traffic (a single-threaded event loop, so nothing but the engines competes for the machine):
  homogeneous  closed loop at each --concurrency (a client sends its next request when answered)
  mixed        closed loop at the top concurrency, steps from {4, 8, 16} x guidance from {1, 5, 7.5}
  poisson      open loop at 50/80/95% of the request-level engine's saturated throughput: mean and p95
               latency and time to the first denoising step
Also a profile of the step engine at full occupancy: model forward, text encoding, decode, and the
engine's own work (scheduling, per-row scheduler steps, guidance, bookkeeping) per step.

Works on CPU (the tiny models) and on a GPU (``--arch sd15 --height 512 --width 512``, bf16).

    .venv/bin/python scripts/bench_engines.py --concurrency 1,2,4,8,16 --requests 64
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

from triton_diffusion.adapters.diffusers_pipeline import SchedulerChoices, row_generator  # noqa: E402
from triton_diffusion.adapters.latent_steps import ImageRequest  # noqa: E402
from triton_diffusion.adapters.step_adapters import step_adapter_for  # noqa: E402
from triton_diffusion.compatibility import CompatibilityKey  # noqa: E402
from triton_diffusion.engine.planner import PlannedRequest, RowCaps, plan_groups  # noqa: E402
from triton_diffusion.engine.policies import make_policy  # noqa: E402
from triton_diffusion.engine.requests import TrackedRequest  # noqa: E402
from triton_diffusion.engine.step_engine import EngineLimits, Job, StepEngine  # noqa: E402
from triton_diffusion.families import PipelineFacts  # noqa: E402
from triton_diffusion.serving.server_process import WEIGHTS  # noqa: E402
from triton_diffusion.tiny_models import ARCHITECTURES, build_missing  # noqa: E402

PROMPTS = [
    line.strip()
    for line in (REPO_ROOT / "client" / "prompts.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]


@dataclass
class Timing:
    submitted: float
    first_step: float | None = None
    done: float | None = None


@dataclass
class Outcome:
    engine: str
    traffic: str
    concurrency: int | None
    rate: float | None
    requests: int
    duration_s: float
    images_per_s: float
    latency_mean_s: float
    latency_p95_s: float
    first_step_mean_s: float
    first_step_p95_s: float
    rows_per_forward: float | None = None
    extra: dict = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Channel:
    """No Triton here: nothing is sent, nothing is cancelled."""

    def send_partial(self, outputs):
        pass

    def send_final(self, outputs):
        pass

    def send_error(self, error):
        raise RuntimeError(error)

    def is_cancelled(self):
        return False


class Traffic:
    """Arrivals: a closed loop of ``concurrency`` clients, or Poisson arrivals at ``rate``."""

    def __init__(self, requests: list[ImageRequest], concurrency: int | None, rate: float | None) -> None:
        self.pending = list(enumerate(requests))
        self.concurrency, self.rate = concurrency, rate
        self.timings: dict[int, Timing] = {}
        self.start = time.perf_counter()
        self.next_at: list[float] = []
        if rate is not None:
            rng, at = random.Random(1), 0.0
            for _ in requests:
                at += rng.expovariate(rate)
                self.next_at.append(self.start + at)
        self.outstanding = 0

    def arrived(self) -> list[tuple[int, ImageRequest]]:
        """Requests that arrive now: a free client's next one, or those whose Poisson time has come."""
        now = time.perf_counter()
        out = []
        if self.rate is None:
            while self.pending and self.outstanding < self.concurrency:
                out.append(self.pending.pop(0))
                self.outstanding += 1
        else:
            while self.pending and self.next_at[len(self.timings) + len(out)] <= now:
                out.append(self.pending.pop(0))
        for index, _ in out:
            self.timings[index] = Timing(now)
        return out

    def wait_for_arrival(self) -> None:
        if self.rate is not None and self.pending:
            delay = self.next_at[len(self.timings)] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)

    def done(self, index: int) -> None:
        self.timings[index].done = time.perf_counter()
        self.outstanding -= 1

    def first_step(self, index: int) -> None:
        if self.timings[index].first_step is None:
            self.timings[index].first_step = time.perf_counter()

    @property
    def finished(self) -> bool:
        return not self.pending and all(t.done is not None for t in self.timings.values())


def key_of(request: ImageRequest) -> CompatibilityKey:
    items = (
        ("height", request.height),
        ("width", request.width),
        ("num_inference_steps", request.steps),
        ("guidance_scale", request.guidance_scale),
        ("scheduler", request.scheduler),
        ("has_negative_prompt", request.negative_prompt is not None),
    )
    return CompatibilityKey(items)


def run_request_level(bench: Bench, traffic: Traffic, window: int) -> list[int]:
    """Batches as Triton forms them for execute(): what arrived while the last batch ran."""
    caps = RowCaps(bench.cap)
    rows = []
    waiting: list[tuple[int, ImageRequest]] = []
    while not traffic.finished:
        waiting += traffic.arrived()
        if not waiting:
            traffic.wait_for_arrival()
            continue
        batch, waiting = waiting[:window], waiting[window:]
        planned = [PlannedRequest(i, key_of(r), 1) for i, (_, r) in enumerate(batch)]
        for call in plan_groups(planned, caps.cap_for):
            members = [batch[row.request_index] for row in call.rows]
            bench.pipeline_call(
                [r for _, r in members], on_first_step=lambda m=members: [traffic.first_step(i) for i, _ in m]
            )
            rows.append(len(members))
            for index, _ in members:
                traffic.done(index)
    return rows


class Listener:
    def __init__(self, traffic: Traffic) -> None:
        self.traffic = traffic
        self.rows: list[int] = []

    def on_admitted(self, job): ...

    def on_stepped(self, job):
        self.traffic.first_step(job.context)

    def on_finished(self, job, output):
        self.traffic.done(job.context)

    def on_left(self, job, reason): ...

    def on_forward(self, jobs, rows, seconds):
        self.rows.append(len(jobs))


def run_step_engine(bench: Bench, traffic: Traffic) -> list[int]:
    listener = Listener(traffic)
    limits = EngineLimits(bench.max_running, bench.cap)
    engine = StepEngine(bench.adapter, listener, limits, make_policy(bench.policy))
    while not traffic.finished:
        for index, request in traffic.arrived():
            engine.add(Job(TrackedRequest(str(index), Channel()), request, context=index))
        if engine.active:
            engine.step()
        else:
            traffic.wait_for_arrival()
    return listener.rows


class Bench:
    def __init__(self, arch: str, height: int, width: int, cap: int, device: str, dtype: torch.dtype) -> None:
        from diffusers import DiffusionPipeline

        build_missing(WEIGHTS, only=[arch])
        self.pipe = DiffusionPipeline.from_pretrained(WEIGHTS / arch, dtype=dtype, use_safetensors=True).to(
            device
        )
        self.pipe.set_progress_bar_config(disable=True)
        self.facts = PipelineFacts.of(self.pipe)
        self.schedulers = SchedulerChoices(self.pipe, self.facts, None, arch)
        self.adapter = step_adapter_for(
            self.pipe, self.facts, self.schedulers, 64 if "flux" in arch else None
        )
        self.height, self.width, self.cap, self.device = height, width, cap, device
        self.max_running, self.policy = cap, "oldest"

    def request(self, index: int, steps: int, guidance: float) -> ImageRequest:
        return ImageRequest(
            PROMPTS[index % len(PROMPTS)],
            None,
            index,
            0,
            self.height,
            self.width,
            steps,
            guidance,
            None,
            self.schedulers.default,
        )

    def pipeline_call(self, requests: list[ImageRequest], on_first_step=None) -> list:
        first = requests[0]
        seen = {"first": False}

        def callback(pipe, i, t, tensors):
            if not seen["first"] and on_first_step is not None:
                seen["first"] = True
                on_first_step()
            return {}

        kwargs = {
            "prompt": [r.prompt for r in requests],
            "generator": [row_generator(r.seed, 0) for r in requests],
            "height": first.height,
            "width": first.width,
            "num_inference_steps": first.steps,
            "callback_on_step_end": callback,
        }
        if self.facts.uses_guidance_scale:
            kwargs["guidance_scale"] = first.guidance_scale
        if "flux" in type(self.pipe).__name__.lower():
            kwargs["max_sequence_length"] = 64
        with torch.inference_mode():
            images = self.pipe(**kwargs).images
        sync(self.device)
        return images


def outcome(engine: str, traffic_name: str, traffic: Traffic, concurrency, rate, rows) -> Outcome:
    timings = list(traffic.timings.values())
    duration = max(t.done for t in timings) - traffic.start
    latencies = [t.done - t.submitted for t in timings]
    firsts = [t.first_step - t.submitted for t in timings]
    result = Outcome(
        engine,
        traffic_name,
        concurrency,
        rate,
        len(timings),
        duration,
        len(timings) / duration,
        statistics.fmean(latencies),
        percentile(latencies, 0.95),
        statistics.fmean(firsts),
        percentile(firsts, 0.95),
        statistics.fmean(rows) if rows else None,
    )
    print(
        f"  {engine:7s} {traffic_name:11s} c={concurrency} rate={rate and round(rate, 2)}: "
        f"{result.images_per_s:.2f} images/s, mean {result.latency_mean_s:.3f} s, "
        f"p95 {result.latency_p95_s:.3f} s, first step {result.first_step_mean_s:.3f} s, "
        f"rows per forward or call {result.rows_per_forward}",
        flush=True,
    )
    return result


def run(bench: Bench, engine: str, requests, concurrency, rate, traffic_name, window) -> Outcome:
    traffic = Traffic(requests, concurrency, rate)
    rows = (
        run_request_level(bench, traffic, window) if engine == "request" else run_step_engine(bench, traffic)
    )
    return outcome(engine, traffic_name, traffic, concurrency, rate, rows)


def profile_step_engine(bench: Bench, steps: int, forwards: int) -> dict:
    """Full occupancy: ``cap`` jobs running all the time. Splits each engine step into the model forward,
    text encoding + noise (admission), VAE decode + postprocess, and the engine's own work."""
    adapter, spent = bench.adapter, {"predict": 0.0, "prepare": 0.0, "finish": 0.0}
    originals = {name: getattr(adapter, name) for name in spent}

    def timed(name):
        def wrapper(*args, **kwargs):
            sync(bench.device)
            started = time.perf_counter()
            result = originals[name](*args, **kwargs)
            sync(bench.device)
            spent[name] += time.perf_counter() - started
            return result

        return wrapper

    for name in spent:
        setattr(adapter, name, timed(name))
    try:
        listener = Listener(Traffic([], 1, None))
        listener.traffic.first_step = listener.traffic.done = lambda index: None
        engine = StepEngine(adapter, listener, EngineLimits(bench.cap, bench.cap))
        counter = 0
        for _ in range(3):  # warm-up
            engine.add(Job(TrackedRequest("w", Channel()), bench.request(counter, steps, 7.5), context=0))
            counter += 1
        while engine.active:
            engine.step()
        for name in spent:
            spent[name] = 0.0
        sync(bench.device)
        started = time.perf_counter()
        for _ in range(forwards):
            while engine.active < bench.cap:
                engine.add(
                    Job(
                        TrackedRequest(str(counter), Channel()), bench.request(counter, steps, 7.5), context=0
                    )
                )
                counter += 1
            engine.step()
        sync(bench.device)
        total = time.perf_counter() - started
    finally:
        for name, original in originals.items():
            setattr(adapter, name, original)
    own = total - sum(spent.values())
    return {
        "forwards": forwards,
        "rows_per_forward": bench.cap,
        "step_ms": 1000 * total / forwards,
        "model_forward_ms": 1000 * spent["predict"] / forwards,
        "admission_ms": 1000 * spent["prepare"] / forwards,
        "decode_ms": 1000 * spent["finish"] / forwards,
        "own_ms": 1000 * own / forwards,
        "own_share_of_step": own / total,
    }


def raw_ceiling(bench: Bench, steps: int, images: int) -> dict:
    out = {}
    for batch in (1, bench.cap):
        requests = [bench.request(i, steps, 7.5) for i in range(batch)]
        bench.pipeline_call(requests)  # warm-up
        calls = max(1, images // batch)
        started = time.perf_counter()
        for _ in range(calls):
            bench.pipeline_call(requests)
        out[f"batch{batch}_images_per_s"] = calls * batch / (time.perf_counter() - started)
        print(f"  raw batch {batch}: {out[f'batch{batch}_images_per_s']:.2f} images/s", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="tiny-sd")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cap", type=int, default=8, help="rows per forward / per fused call")
    parser.add_argument(
        "--window", type=int, default=32, help="Triton's max_batch_size for the request engine"
    )
    parser.add_argument("--max-running", type=int, help="the step engine's running set (default: --cap)")
    parser.add_argument("--policy", default="oldest", help="the step engine's scheduling policy")
    parser.add_argument("--no-mixed", action="store_true")
    parser.add_argument("--no-poisson", action="store_true")
    parser.add_argument("--profile-forwards", type=int, default=40)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results")
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        args.dtype, torch.bfloat16 if device == "cuda" else torch.float32
    )
    bench = Bench(args.arch, args.height, args.width, args.cap, device, dtype)
    bench.max_running, bench.policy = args.max_running or args.cap, args.policy
    bench.max_running, bench.policy = args.max_running or args.cap, args.policy
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    top = max(concurrencies)
    report: dict = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
        + (torch.cuda.get_device_name() if device == "cuda" else "CPU"),
        "arch": args.arch,
        "dtype": str(dtype).replace("torch.", ""),
        "size": f"{args.width}x{args.height}",
        "steps": args.steps,
        "cap": args.cap,
        "window": args.window,
        "requests": args.requests,
        "runs": [],
    }
    homogeneous = [bench.request(i, args.steps, 7.5) for i in range(args.requests)]
    print("[warm-up]", flush=True)
    run(bench, "request", homogeneous[: args.cap], args.cap, None, "warm-up", args.window)
    run(bench, "step", homogeneous[: args.cap], args.cap, None, "warm-up", args.window)

    print("[homogeneous closed loop]", flush=True)
    for concurrency in concurrencies:
        for engine in ("request", "step"):
            report["runs"].append(
                run(bench, engine, homogeneous, concurrency, None, "homogeneous", args.window)
            )
    if not args.no_mixed:
        print("[mixed closed loop]", flush=True)
        rng = random.Random(5)
        mixed = [
            bench.request(i, rng.choice([4, 8, 16]), rng.choice([1.0, 5.0, 7.5]))
            for i in range(args.requests)
        ]
        for engine in ("request", "step"):
            report["runs"].append(run(bench, engine, mixed, top, None, "mixed", args.window))
    if not args.no_poisson:
        saturated = max(
            r.images_per_s for r in report["runs"] if r.engine == "request" and r.traffic == "homogeneous"
        )
        report["request_saturated_images_per_s"] = saturated
        print(f"[poisson, request-level saturation {saturated:.2f} images/s]", flush=True)
        for load in (0.5, 0.8, 0.95):
            for engine in ("request", "step"):
                outcome_ = run(
                    bench,
                    engine,
                    homogeneous,
                    None,
                    load * saturated,
                    f"poisson{int(load * 100)}",
                    args.window,
                )
                report["runs"].append(outcome_)
    print("[profile of the step engine at full occupancy]", flush=True)
    report["profile"] = profile_step_engine(bench, args.steps, args.profile_forwards)
    print("  " + json.dumps(report["profile"]), flush=True)
    print("[raw pipeline]", flush=True)
    report["raw"] = raw_ceiling(bench, args.steps, max(args.requests // 2, args.cap * 2))
    report["ratios"] = ratios(report)
    report["runs"] = [r.__dict__ for r in report["runs"]]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_engines.json").write_text(json.dumps(report, indent=2))
    (args.out / "bench_engines.md").write_text(markdown(report))
    print(markdown(report))


def ratios(report: dict) -> dict[str, tuple[float, str]]:
    runs = report["runs"]

    def pick(engine: str, traffic: str, concurrency=None):
        found = [r for r in runs if r.engine == engine and r.traffic == traffic]
        if concurrency is not None:
            found = [r for r in found if r.concurrency == concurrency]
        return found[-1] if found else None

    top = max(r.concurrency for r in runs if r.traffic == "homogeneous")
    out: dict[str, tuple[float, str]] = {}
    step, request = pick("step", "homogeneous", top), pick("request", "homogeneous", top)
    out[f"homogeneous c={top}: step / request throughput"] = (
        step.images_per_s / request.images_per_s,
        ">= 0.95",
    )
    out[f"homogeneous c={top}: step / raw batch-{report['cap']} throughput"] = (
        step.images_per_s / report["raw"][f"batch{report['cap']}_images_per_s"],
        ">= 0.95",
    )
    if pick("step", "mixed"):
        out["mixed: step / request throughput"] = (
            pick("step", "mixed").images_per_s / pick("request", "mixed").images_per_s,
            ">= 1.3",
        )
    if pick("step", "poisson80"):
        step80, request80 = pick("step", "poisson80"), pick("request", "poisson80")
        out["poisson 80%: step / request p95 latency"] = (
            step80.latency_p95_s / request80.latency_p95_s,
            "<= 0.7",
        )
        out["poisson 80%: step / request mean time to first step"] = (
            step80.first_step_mean_s / request80.first_step_mean_s,
            "<= 0.3",
        )
    out["profile: engine's own work / step time"] = (report["profile"]["own_share_of_step"], "< 0.05")
    return out


def markdown(report: dict) -> str:
    lines = [
        f"{report['machine']}; {report['arch']} {report['dtype']}, {report['size']}, {report['steps']} steps "
        f"(mixed: 4/8/16 steps x guidance 1/5/7.5), {report['cap']} rows per forward or call, "
        f"request window {report['window']}, {report['requests']} requests per run.",
        "",
        "| engine | traffic | concurrency / rate | images/s | mean (s) | p95 (s) | first step mean (s) "
        "| first step p95 (s) | rows per forward / call |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        load = r["concurrency"] if r["rate"] is None else f"{r['rate']:.2f}/s"
        rows = f"{r['rows_per_forward']:.2f}" if r["rows_per_forward"] else "-"
        lines.append(
            f"| {r['engine']} | {r['traffic']} | {load} | {r['images_per_s']:.2f} "
            f"| {r['latency_mean_s']:.3f} | {r['latency_p95_s']:.3f} | {r['first_step_mean_s']:.3f} "
            f"| {r['first_step_p95_s']:.3f} | {rows} |"
        )
    raw = report["raw"]
    lines += ["", "Raw pipeline: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in raw.items()), ""]
    p = report["profile"]
    lines += [
        f"Step engine at full occupancy ({p['rows_per_forward']} rows): {p['step_ms']:.1f} ms per step "
        f"= model forward {p['model_forward_ms']:.1f} + text encoding and noise {p['admission_ms']:.1f} "
        f"+ decode {p['decode_ms']:.1f} + the engine's own work {p['own_ms']:.2f} ms "
        f"({100 * p['own_share_of_step']:.1f}%).",
        "",
        "| ratio | value | target |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {value:.3f} | {target} |" for name, (value, target) in report["ratios"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

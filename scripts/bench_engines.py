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
  poisson      open loop at 50/80/95% of the request-level engine's saturated throughput, --poisson-requests
               (500) per run, both engines on the same arrival times (--arrival-seed), the first 10% by
               arrival left out (an empty system filling up is not steady state): mean and p95 latency,
               time to the first denoising step, offered against delivered images/s

The clock is the clients', not the loop's (bench_common.Traffic): the loop looks for arrivals only when it
is free (the request-level engine between whole pipeline calls, the step engine between steps), but a
Poisson request's latency runs from its scheduled arrival and a closed-loop client's next request from
its previous answer, so the wait behind a running call is counted for both engines.

Also a profile of the step engine at full occupancy: model forward, text encoding, decode, and the
engine's own work (scheduling, per-row scheduler steps, guidance, bookkeeping) per step.

Works on CPU (the tiny models) and on a GPU (``--arch sd15 --height 512 --width 512``, bf16).

    .venv/bin/python scripts/bench_engines.py --concurrency 1,2,4,8,16 --requests 64
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import random
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when loaded by file path

import artefacts  # noqa: E402
from bench_common import (  # noqa: E402
    DELIVERED_TARGET,
    MIXED_GUIDANCE,
    MIXED_STEPS,
    POISSON_LOADS,
    POISSON_TARGETS,
    PROMPTS,
    REPO_ROOT,
    TARGETS,
    WARM_UP_FRACTION,
    Traffic,
    alternated_rounds,
    load_cell,
    machine_description,
    max_sequence_length,
    mean,
    number_cell,
    percentile,
    poisson_arrivals,
    poisson_label,
    pooled_throughput,
    ratio_table,
)

from triton_diffusion.adapters.diffusers_pipeline import row_generator  # noqa: E402
from triton_diffusion.compatibility import compatibility_key  # noqa: E402
from triton_diffusion.engine.jobs import Job, StepReport  # noqa: E402
from triton_diffusion.engine.ordering import AdmissionPacing, make_policy  # noqa: E402
from triton_diffusion.engine.planner import RowCaps  # noqa: E402
from triton_diffusion.engine.request_engine import RequestEngine  # noqa: E402
from triton_diffusion.engine.scheduler import EngineLimits  # noqa: E402
from triton_diffusion.engine.step_engine import StepEngine  # noqa: E402
from triton_diffusion.models.image_to_image import ImageToImageModel  # noqa: E402
from triton_diffusion.models.text_to_image import TextToImageModel  # noqa: E402
from triton_diffusion.serving.requests import TrackedRequest  # noqa: E402
from triton_diffusion.serving.server_process import WEIGHTS  # noqa: E402
from triton_diffusion.serving.triton_model import RowInput  # noqa: E402
from triton_diffusion.settings import ModelConfig, ModelSettings  # noqa: E402
from triton_diffusion.tiny_models import ARCHITECTURES, build_missing  # noqa: E402


@dataclass
class Outcome:
    engine: str
    traffic: str
    concurrency: int | None
    rate: float | None
    requests: int  # all requests of the run
    duration_s: float  # the measured window: first measured arrival to last measured answer
    images_per_s: float  # delivered: measured requests answered per second of that window
    latency_mean_s: float
    latency_p95_s: float
    first_step_mean_s: float
    first_step_p95_s: float
    rows_per_forward: float | None = None
    offered_images_per_s: float | None = None  # Poisson: measured requests sent per second
    measured_requests: int | None = None  # those in the statistics (the first 10% of Poisson left out)
    extra: dict = field(default_factory=dict)


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


# How the engines are driven: run_request_level, run_step_engine and profile_step_engine, each over the
# served code (the model's own field parsing, compatibility key, step adapter and pipeline call) and the
# real engines. The clock lives in Traffic; a loop only takes ``traffic.arrived()`` when it is free,
# sleeps with ``traffic.wait_for_arrival()`` when idle, reports ``traffic.first_step(i)`` and
# ``traffic.done(i)``, and stops at ``traffic.finished``. Each returns the images of every call or forward.


class Recorder:
    """Renders the engines' reports into the traffic's clock (a job's ``record`` is its request index)."""

    def __init__(self, traffic: Traffic) -> None:
        self.traffic = traffic
        self.images: list[int] = []

    def render(self, report: StepReport) -> None:
        for stepped in report.stepped:
            self.traffic.first_step(stepped.job.record)
        for finished in report.finished:
            self.traffic.done(finished.job.record)
        self.images.extend(forward.images for forward in report.forwards)


def run_request_level(bench: Bench, traffic: Traffic, window: int) -> list[int]:
    """The request-level engine over batches as Triton forms them for execute(): what arrived while the
    last batch ran, at most ``window`` requests."""
    recorder = Recorder(traffic)
    engine = RequestEngine(bench.model.run_call, RowCaps(bench.cap), recorder.render)
    waiting: list[tuple[int, dict]] = []
    while not traffic.finished:
        waiting += traffic.arrived()
        if not waiting:
            traffic.wait_for_arrival()
            continue
        batch, waiting = waiting[:window], waiting[window:]
        for index, values in batch:
            engine.add(bench.job(index, values, "request"))
        recorder.render(engine.step())
        sync(bench.device)
    return recorder.images


def run_step_engine(
    bench: Bench, traffic: Traffic, cohort: int, clock: StageClock | None = None
) -> list[int]:
    recorder = Recorder(traffic)
    engine = bench.step_engine(cohort)
    while not traffic.finished:
        for index, values in traffic.arrived():
            engine.add(bench.job(index, values, "step"))
        if engine.active:
            started = time.perf_counter()
            report = engine.step()
            if clock is not None:
                clock.end_step(time.perf_counter() - started, len(engine.scheduler.waiting))
            recorder.render(report)
        else:
            traffic.wait_for_arrival()
    return recorder.images


class StageClock:
    """Where an engine step's time goes: the adapter's stages timed in place (text encoding and noise at
    admission, the model forward, the row math around it, the VAE decode), the engine's own work as the
    rest. ``with clock.timing(adapter):`` patches the adapter's methods for the run and restores them."""

    STAGES = ("prepare", "predict", "step", "finish")

    def __init__(self, device: str) -> None:
        self.device = device
        self.totals = {name: 0.0 for name in self.STAGES}
        self.calls = {name: 0 for name in self.STAGES}
        self.jobs = {name: 0 for name in self.STAGES}  # jobs (prepare, step, finish) in those calls
        self.step_s: list[float] = []
        self.waiting: list[int] = []

    @contextmanager
    def timing(self, adapter):
        # The forward is the captured graphs' call where the model has them (cuda_graphs).
        attributes = {name: name for name in self.STAGES}
        if getattr(adapter, "captured", None) is not None:
            attributes["predict"] = "captured"
        originals = {name: getattr(adapter, attributes[name]) for name in self.STAGES}
        own = {name for name in self.STAGES if attributes[name] in vars(adapter)}  # instance attributes

        def timed(name):
            def wrapper(*args, **kwargs):
                sync(self.device)
                started = time.perf_counter()
                result = originals[name](*args, **kwargs)
                sync(self.device)
                self.totals[name] += time.perf_counter() - started
                self.calls[name] += 1
                if name != "predict":
                    self.jobs[name] += len(args[0])
                return result

            return wrapper

        for name in self.STAGES:
            setattr(adapter, attributes[name], timed(name))
        try:
            yield self
        finally:
            for name in self.STAGES:
                if name in own:
                    setattr(adapter, attributes[name], originals[name])
                else:
                    delattr(adapter, attributes[name])  # the class's methods again

    def end_step(self, seconds: float, waiting: int) -> None:
        self.step_s.append(seconds)
        self.waiting.append(waiting)

    def summary(self) -> dict:
        steps = max(len(self.step_s), 1)
        total = sum(self.step_s)
        per_step = {name: 1000 * self.totals[name] / steps for name in self.STAGES}
        own = total - self.totals["prepare"] - self.totals["step"] - self.totals["finish"]
        return {
            "steps": len(self.step_s),
            "step_ms": 1000 * total / steps,
            "admission_ms": per_step["prepare"],
            "model_forward_ms": per_step["predict"],
            "row_math_ms": per_step["step"] - per_step["predict"],
            "decode_ms": per_step["finish"],
            "own_ms": 1000 * own / steps,
            # The "engine's own work": all but the forward, encoding and decoding.
            "own_share_of_step": (own + self.totals["step"] - self.totals["predict"]) / total
            if total
            else 0.0,
            "admissions_per_step": self.calls["prepare"] / steps,
            "jobs_per_admission": self.jobs["prepare"] / max(self.calls["prepare"], 1),
            "decodes_per_step": self.calls["finish"] / steps,
            "jobs_per_decode": self.jobs["finish"] / max(self.calls["finish"], 1),
            "jobs_per_forward": self.jobs["step"] / max(self.calls["step"], 1),
            "waiting_mean": mean(self.waiting),
        }


class Bench:
    """The served text-to-image model, loaded as Triton's stub would load it (TextToImageModel.load)."""

    def __init__(
        self,
        arch: str,
        height: int,
        width: int,
        cap: int,
        device: str,
        dtype: torch.dtype,
        cuda_graphs: bool = False,
    ) -> None:
        build_missing(WEIGHTS, only=[arch])
        config = ModelConfig(
            model=str(WEIGHTS / arch),
            dtype=str(dtype).removeprefix("torch."),
            max_sequence_length=max_sequence_length(arch),
            cuda_graphs=cuda_graphs,
        )
        kind = "GPU" if device.startswith("cuda") else "CPU"
        # The bench's size as the model's default: what cuda_graphs captures at load.
        sizes = {"default_height": str(height), "default_width": str(width)}
        self.settings = settings = ModelSettings(arch, WEIGHTS, config, sizes, cap, kind, 0)
        self.model = TextToImageModel()
        self.model.fields, self.adapter = self.model.load(settings)
        self.pipe = self.model.pipe
        self.height, self.width, self.cap, self.device = height, width, cap, device
        self.arch, self.dtype_name = arch, config.dtype
        self.max_running, self.policy = cap, "oldest"
        self.timeline = False  # on a GPU: time each step's stages under Poisson load (synchronising)
        self.cohort = max(1, cap // 2)  # the served default (EngineHost), for max_running >= cap

    def report_header(self, steps: int) -> dict:
        """What a report says of the machine and the model it measured."""
        return {
            "machine": machine_description(
                f"{torch.get_num_threads()} torch threads",
                torch.cuda.get_device_name() if self.device.startswith("cuda") else "CPU",
            ),
            "arch": self.arch,
            "dtype": self.dtype_name,
            "size": f"{self.width}x{self.height}",
            "steps": steps,
        }

    def step_engine(self, cohort: int) -> StepEngine:
        limits = EngineLimits(self.max_running, self.cap)
        pacing = AdmissionPacing(min(cohort, max(1, self.max_running // 2)))
        return StepEngine(self.adapter, limits, make_policy(self.policy), pacing)

    def request(self, index: int, steps: int, guidance: float) -> dict:
        """A request's validated fields, as execute() parses them."""
        return self.model.fields.parse(self.raw_request(index, steps, guidance))

    def raw_request(self, index: int, steps: int, guidance: float) -> dict:
        """A request as a client sends it."""
        raw = {
            "prompt": PROMPTS[index % len(PROMPTS)],
            "seed": index,
            "height": self.height,
            "width": self.width,
            "num_inference_steps": steps,
        }
        if self.model.fields["guidance_scale"].supported:
            raw["guidance_scale"] = guidance
        return raw

    def job(self, index: int, values: dict, engine: str) -> Job:
        tracked = TrackedRequest(str(index), Channel())
        if engine == "step":
            return Job(tracked, self.model.step_request(values, 0), record=index)
        key = compatibility_key(self.model.fields, values)
        return Job(tracked, RowInput(values, 0), record=index, group=key)

    def raw_pipeline_call(self, requests: list[dict]) -> list:
        """diffusers' own ``pipeline(...)`` for a batch of equal requests: the ceiling."""
        first = requests[0]
        kwargs = {
            "prompt": [r["prompt"] for r in requests],
            "generator": [row_generator(r["seed"], 0) for r in requests],
            "height": first["height"],
            "width": first["width"],
            "num_inference_steps": first["num_inference_steps"],
            **self.model.call_extras,
        }
        if self.model.fields["guidance_scale"].supported:
            kwargs["guidance_scale"] = first["guidance_scale"]
        with torch.inference_mode():
            images = self.pipe(**kwargs).images
        sync(self.device)
        return images


def outcome(
    engine: str,
    traffic_name: str,
    traffic: Traffic,
    concurrency: int | None,
    rate: float | None,
    rows: list[int],
) -> Outcome:
    measured = traffic.measure()
    result = Outcome(
        engine,
        traffic_name,
        concurrency,
        rate,
        measured.requests,
        measured.duration_s,
        measured.delivered_per_s,
        mean(measured.latencies),
        percentile(measured.latencies, 0.95),
        mean(measured.first_steps),
        percentile(measured.first_steps, 0.95),
        mean(rows) if rows else None,
        offered_images_per_s=measured.offered_per_s,
        measured_requests=measured.measured,
    )
    offered = f" (offered {result.offered_images_per_s:.2f})" if result.offered_images_per_s else ""
    print(
        f"  {engine:7s} {traffic_name:11s} c={concurrency} rate={rate and round(rate, 2)}: "
        f"{result.images_per_s:.2f} images/s{offered}, mean {result.latency_mean_s:.3f} s, "
        f"p95 {result.latency_p95_s:.3f} s, first step {result.first_step_mean_s:.3f} s, "
        f"rows per forward or call {result.rows_per_forward}, {measured.measured} of "
        f"{measured.requests} requests measured",
        flush=True,
    )
    return result


def run_closed(
    bench: Bench, engine: str, requests: list[dict], concurrency: int, traffic_name: str, window: int
) -> Outcome:
    """``concurrency`` clients, each sending its next request when its last one is answered."""
    traffic = Traffic(requests, concurrency=concurrency)
    rows = drive(bench, engine, traffic, window)
    return outcome(engine, traffic_name, traffic, concurrency, None, rows)


def run_poisson(
    bench: Bench,
    engine: str,
    requests: list[dict],
    rate: float,
    seed: int,
    traffic_name: str,
    window: int,
    warm_up_fraction: float,
) -> Outcome:
    """Poisson arrivals at ``rate``; the same ``seed`` gives both engines the same arrival times."""
    traffic = Traffic(
        requests, arrivals=poisson_arrivals(len(requests), rate, seed), warm_up_fraction=warm_up_fraction
    )
    # The timeline synchronises the device around every stage, which a GPU's step engine would not do
    # (it queues the next step while the last runs): on a GPU only with --timeline.
    timed = engine != "request" and (bench.device == "cpu" or bench.timeline)
    clock = StageClock(bench.device) if timed else None
    rows = drive(bench, engine, traffic, window, clock)
    result = outcome(engine, traffic_name, traffic, None, rate, rows)
    if clock is not None:
        result.extra["timeline"] = clock.summary()
        print("    timeline: " + timeline_line(result.extra["timeline"]), flush=True)
    return result


def timeline_line(t: dict) -> str:
    return (
        f"{t['step_ms']:.1f} ms a step = admission {t['admission_ms']:.1f} + forward "
        f"{t['model_forward_ms']:.1f} + row math {t['row_math_ms']:.2f} + decode {t['decode_ms']:.1f} + "
        f"engine {t['own_ms']:.2f} (row math and engine: {100 * t['own_share_of_step']:.1f}%); "
        f"{t['jobs_per_forward']:.2f} images a forward, "
        f"{t['admissions_per_step']:.2f} admissions of {t['jobs_per_admission']:.2f} and "
        f"{t['decodes_per_step']:.2f} decodes of {t['jobs_per_decode']:.2f} a step, "
        f"{t['waiting_mean']:.2f} waiting"
    )


# The step engine's variants: served (newcomers to a busy engine join as a cohort of half the forward's
# cap, AdmissionPacing) and eager (every newcomer joins at the next step, the engine before pacing).
STEP_COHORTS = {"step": None, "step-eager": 1}


def drive(
    bench: Bench, engine: str, traffic: Traffic, window: int, clock: StageClock | None = None
) -> list[int]:
    if engine == "request":
        return run_request_level(bench, traffic, window)
    cohort = STEP_COHORTS[engine] or bench.cohort
    if clock is None:
        return run_step_engine(bench, traffic, cohort)
    with clock.timing(bench.adapter):
        return run_step_engine(bench, traffic, cohort, clock)


# ---- text-only and image-conditioned requests of one size (issue 19) ----------------------------------
# Before: a text_to_image model and an image_to_image model, each its own copy of the weights on the
# request-level engine. After: one text_to_image model on the step engine takes both kinds (its img2img
# pipeline is built over the same modules) and runs them in the same forwards.
IMAGE_STRENGTH = 0.6


class ImageMix:
    """Half text-only, half img2img requests (strength IMAGE_STRENGTH from one source image), one size."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        config = ModelConfig(
            model=str(WEIGHTS / bench.arch),
            dtype=bench.dtype_name,
            engine="request",
            max_sequence_length=max_sequence_length(bench.arch),
        )
        kind = "GPU" if bench.device.startswith("cuda") else "CPU"
        settings = ModelSettings(f"{bench.arch}-img2img", WEIGHTS, config, {}, bench.cap, kind, 0)
        self.img2img = ImageToImageModel()  # the second model: loads the weights again
        self.img2img.fields, _ = self.img2img.load(settings)
        pixels = torch.Generator().manual_seed(0)
        noise = torch.rand(bench.height, bench.width, 3, generator=pixels).mul(255).to(torch.uint8)
        buffer = io.BytesIO()
        from PIL import Image

        Image.fromarray(noise.numpy()).save(buffer, format="PNG")
        self.source = buffer.getvalue()

    def items(self, count: int, steps: int) -> list[tuple[dict, dict]]:
        """Each request parsed by both setups: (the one text_to_image model's values, the two models')."""
        out = []
        model = self.bench.model
        for index in range(count):
            raw = self.bench.raw_request(index, steps, 7.5)
            if not index % 2:  # text-only: the same text_to_image fields in both setups
                values = model.resolve(model.fields.parse(raw))
                out.append((values, values))
                continue
            raw.update(image=self.source, strength=IMAGE_STRENGTH)
            one = model.resolve(model.fields.parse(raw))
            out.append((one, self.img2img.resolve(self.img2img.fields.parse(raw))))
        return out

    @staticmethod
    def conditioned(item: tuple[dict, dict]) -> bool:
        return item[0].get("image") is not None

    def run_one_model(self, traffic: Traffic) -> list[int]:
        """The step engine of the text_to_image model, both kinds in its forwards."""
        recorder = Recorder(traffic)
        engine = self.bench.step_engine(self.bench.cohort)
        while not traffic.finished:
            for index, (values, _) in traffic.arrived():
                engine.add(
                    Job(
                        TrackedRequest(str(index), Channel()),
                        self.bench.model.step_request(values, 0),
                        record=index,
                    )
                )
            if engine.active:
                recorder.render(engine.step())
            else:
                traffic.wait_for_arrival()
        return recorder.images

    def run_two_models(self, traffic: Traffic, window: int) -> list[int]:
        """Each kind to its own model's request-level engine. Two Triton models run side by side on the
        same cores (or GPU); in one process they take turns while both have work, one fused call's rows
        (``cap``) a turn, so neither waits behind several of the other's calls."""
        recorder = Recorder(traffic)
        models = {False: self.bench.model, True: self.img2img}
        engines = {
            kind: RequestEngine(m.run_call, RowCaps(self.bench.cap), recorder.render)
            for kind, m in models.items()
        }
        waiting: dict[bool, list] = {False: [], True: []}
        turn = False
        while not traffic.finished:
            for index, item in traffic.arrived():
                waiting[self.conditioned(item)].append((index, item[1]))
            if not (waiting[False] or waiting[True]):
                traffic.wait_for_arrival()
                continue
            kind = turn if waiting[turn] else not turn
            turn = not kind
            turn_rows = min(window, self.bench.cap)
            batch, waiting[kind] = waiting[kind][:turn_rows], waiting[kind][turn_rows:]
            for index, values in batch:
                key = compatibility_key(models[kind].fields, values)
                engines[kind].add(
                    Job(TrackedRequest(str(index), Channel()), RowInput(values, 0), record=index, group=key)
                )
            recorder.render(engines[kind].step())
            sync(self.bench.device)
        return recorder.images

    def run(
        self,
        engine: str,
        traffic: Traffic,
        name: str,
        concurrency: int | None,
        rate: float | None,
        window: int,
    ) -> Outcome:
        rows = self.run_two_models(traffic, window) if engine == "request" else self.run_one_model(traffic)
        return outcome(engine, name, traffic, concurrency, rate, rows)

    def resident_weights(self) -> dict[str, float]:
        """MiB of weights held for serving both kinds: each distinct tensor storage counted once (the
        memory they take on a GPU; on the CPU two loads of one safetensors file may share pages)."""
        one = [self.bench.pipe, *self.bench.adapter.pipelines.values()]
        return {
            "one_model_mib": weight_bytes(one) / 2**20,
            "two_models_mib": weight_bytes([self.bench.pipe, self.img2img.pipe]) / 2**20,
        }


def weight_bytes(pipelines: list) -> int:
    """Bytes of the distinct storages behind the pipelines' modules' parameters and buffers."""
    storages: dict[int, int] = {}
    for pipe in pipelines:
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                for tensor in [*component.parameters(), *component.buffers()]:
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run_image_mix(bench: Bench, args, top: int) -> tuple[list[Outcome], dict]:
    """Closed loop at the top concurrency, then Poisson at 80% of the two models' throughput."""
    mix = ImageMix(bench)
    memory = mix.resident_weights()
    print(
        f"  resident weights for both kinds: one model {memory['one_model_mib']:.1f} MiB, "
        f"two models {memory['two_models_mib']:.1f} MiB",
        flush=True,
    )
    items = mix.items(args.requests, args.steps)
    for engine in ("request", "step"):  # warm-up: the img2img pipeline's first calls
        mix.run(
            engine,
            Traffic(items[: bench.cap], concurrency=bench.cap),
            "warm-up",
            bench.cap,
            None,
            args.window,
        )
    runs = [
        mix.run(e, Traffic(items, concurrency=top), "text+image", top, None, args.window)
        for e in ("request", "step")
    ]
    rate = 0.8 * runs[0].images_per_s
    poisson = mix.items(args.poisson_requests, args.steps)
    for engine in ("request", "step"):
        arrivals = poisson_arrivals(len(poisson), rate, args.arrival_seed)
        traffic = Traffic(poisson, arrivals=arrivals, warm_up_fraction=WARM_UP_FRACTION)
        runs.append(mix.run(engine, traffic, "text+image poisson80", None, rate, args.window))
    return runs, memory


def profile_step_engine(bench: Bench, steps: int, forwards: int) -> dict:
    """Full occupancy: ``cap`` jobs running all the time (a newcomer joins whenever one leaves). Splits
    each engine step into text encoding + noise (admission), the model forward, the row math around it
    (guidance, scheduler steps), VAE decode + postprocess, and the engine's own work."""
    engine = bench.step_engine(cohort=1)
    counter = 0
    for _ in range(3):  # warm-up
        engine.add(bench.job(counter, bench.request(counter, steps, 7.5), "step"))
        counter += 1
    while engine.active:
        engine.step()
    clock = StageClock(bench.device)
    with clock.timing(bench.adapter):
        for _ in range(forwards):
            while engine.active < bench.cap:
                engine.add(bench.job(counter, bench.request(counter, steps, 7.5), "step"))
                counter += 1
            sync(bench.device)
            started = time.perf_counter()
            engine.step()
            sync(bench.device)
            clock.end_step(time.perf_counter() - started, len(engine.scheduler.waiting))
    return {"forwards": forwards, "rows_per_forward": bench.cap, **clock.summary()}


def stage_costs(
    bench: Bench, steps: int, sizes: tuple[int, ...] = (1, 2, 4, 8)
) -> dict[str, dict[int, float]]:
    """Median seconds of text encoding + noise, one forward and one decode for k images (the engine's
    own adapter, CFG on): the costs ``engine_sim.py`` models the engines from."""
    costs: dict[str, dict[int, float]] = {"encode": {}, "forward": {}, "decode": {}}
    adapter = bench.adapter

    def fresh(k: int) -> list[Job]:
        jobs = [bench.job(i, bench.request(i, steps, 7.5), "step") for i in range(k)]
        for job, start in zip(jobs, adapter.prepare(jobs), strict=True):
            job.begin(start)
        return jobs

    for k in sizes:
        jobs = fresh(k)
        costs["encode"][k] = timed_median(lambda k=k: fresh(k), bench.device)
        costs["forward"][k] = timed_median(lambda jobs=jobs: adapter.step(jobs), bench.device)
        costs["decode"][k] = timed_median(lambda jobs=jobs: adapter.finish(jobs), bench.device)
    return costs


def timed_median(work, device: str, repeats: int = 7) -> float:
    work()
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        work()
        sync(device)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def sim_arguments(costs: dict[str, dict[int, float]]) -> str:
    return " ".join(
        f"--{stage} " + ",".join(f"{k}:{seconds:.5f}" for k, seconds in by_k.items())
        for stage, by_k in costs.items()
    )


def raw_ceiling(bench: Bench, steps: int, images: int) -> dict:
    out = {}
    for batch in (1, bench.cap):
        requests = [bench.request(i, steps, 7.5) for i in range(batch)]
        bench.raw_pipeline_call(requests)  # warm-up
        calls = max(1, images // batch)
        started = time.perf_counter()
        for _ in range(calls):
            bench.raw_pipeline_call(requests)
        out[f"batch{batch}_images_per_s"] = calls * batch / (time.perf_counter() - started)
        print(f"  raw batch {batch}: {out[f'batch{batch}_images_per_s']:.2f} images/s", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="tiny-sd")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=64, help="requests per closed-loop run")
    parser.add_argument(
        "--poisson-requests",
        type=int,
        default=500,
        help="requests per Poisson run (long enough for steady state; the first 10%% are left out)",
    )
    parser.add_argument("--arrival-seed", type=int, default=1, help="the Poisson arrival times' seed")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cap", type=int, default=8, help="rows per forward / per fused call")
    parser.add_argument(
        "--window", type=int, default=32, help="Triton's max_batch_size for the request engine"
    )
    parser.add_argument("--max-running", type=int, help="the step engine's running set (default: --cap)")
    parser.add_argument("--policy", default="oldest", help="the step engine's scheduling policy")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="homogeneous runs at the top concurrency, the engines alternated (this machine's speed drifts "
        "by 10%% and more between runs: the throughput ratio is taken round by round, and pooled)",
    )
    parser.add_argument("--no-mixed", action="store_true")
    parser.add_argument(
        "--no-image-mix",
        action="store_true",
        help="no text-only + img2img traffic (one model on the step engine vs two request-level models)",
    )
    parser.add_argument("--no-closed", action="store_true", help="no closed-loop runs (give --saturated)")
    parser.add_argument("--no-raw", action="store_true")
    parser.add_argument(
        "--timeline", action="store_true", help="on a GPU too: per-stage times of each step (synchronising)"
    )
    parser.add_argument(
        "--loads",
        default=",".join(str(load) for load in POISSON_LOADS),
        help="Poisson loads, fractions of the request-level engine's saturated throughput ('' for none)",
    )
    parser.add_argument(
        "--saturated", type=float, help="that throughput (images/s); default: the closed loop's best"
    )
    parser.add_argument(
        "--sim",
        type=Path,
        default=REPO_ROOT.parent / "shared" / "tools" / "engine_sim.py",
        help="engine_sim.py, to set its prediction beside the measurement (skipped if absent)",
    )
    parser.add_argument("--profile-forwards", type=int, default=40)
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="the model loaded with cuda_graphs (GPU: forwards replay captured graphs; ignored on a CPU)",
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results")
    parser.add_argument(
        "--step-cache",
        metavar="VARIANTS",
        help="instead: step caches per request, these step_cache values side by side (bench_caches.py; "
        "'default' for none,fbc:0.05,fbc:0.12,taylorseer:4:2), on --arch (default there: flux-bench)",
    )
    parser.add_argument(
        "--slo",
        action="store_true",
        help="instead: service tiers and deadlines under mixed interactive and background traffic "
        "(bench_slo.py; its own options follow --slo-args)",
    )
    parser.add_argument("--slo-args", default="", help="options for bench_slo.py, as one string")
    args, _ = parser.parse_known_args(argv)
    if args.step_cache:
        import bench_caches

        variants = [] if args.step_cache == "default" else ["--variants", args.step_cache]
        arch = [] if args.arch == "tiny-sd" else ["--arch", args.arch]
        bench_caches.main([*variants, *arch, "--out", str(args.out), "--dtype", args.dtype])
        return
    if args.slo:
        import bench_slo

        bench_slo.main([*args.slo_args.split(), "--out", str(args.out)])
        return
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        args.dtype, torch.bfloat16 if device == "cuda" else torch.float32
    )
    bench = Bench(args.arch, args.height, args.width, args.cap, device, dtype, args.cuda_graphs)
    bench.max_running, bench.policy = args.max_running or args.cap, args.policy
    bench.timeline = args.timeline
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.no_closed and args.loads and not args.saturated:
        parser.error(
            "--no-closed needs --saturated (the request-level engine's throughput) for Poisson loads"
        )
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    top = max(concurrencies)
    report: dict = {
        **bench.report_header(args.steps),
        "cuda_graphs": bench.adapter is not None and bench.adapter.captured is not None,
        "cap": args.cap,
        "window": args.window,
        "requests": args.requests,
        "poisson_requests": args.poisson_requests,
        "warm_up_fraction": WARM_UP_FRACTION,
        "arrival_seed": args.arrival_seed,
        "runs": [],
        "complete": False,  # until the last figure: a run cut short keeps what it measured
        "provenance": artefacts.provenance(),
    }
    path = args.out / "bench_engines.json"

    def save() -> None:
        """The report so far, rewritten after every measured run."""
        artefacts.write(path, {**report, "runs": [r.__dict__ for r in report["runs"]]})

    def measured(run: Outcome) -> None:
        report["runs"].append(run)
        save()

    homogeneous = [bench.request(i, args.steps, 7.5) for i in range(args.requests)]
    print("[warm-up]", flush=True)
    for engine in ("request", "step"):
        run_closed(bench, engine, homogeneous[: args.cap], args.cap, "warm-up", args.window)

    if not args.no_closed:
        print("[homogeneous closed loop]", flush=True)
        for concurrency in concurrencies:
            for round_ in range(args.rounds if concurrency == top else 1):
                # Each engine goes first in every other round: a machine slowing down (or warming up)
                # through the run does not always favour the same engine.
                for engine in ("request", "step") if round_ % 2 == 0 else ("step", "request"):
                    measured(run_closed(bench, engine, homogeneous, concurrency, "homogeneous", args.window))
    if not args.no_closed and not args.no_mixed:
        print("[mixed closed loop]", flush=True)
        rng = random.Random(5)
        mixed = [
            bench.request(i, rng.choice(MIXED_STEPS), rng.choice(MIXED_GUIDANCE))
            for i in range(args.requests)
        ]
        for engine in ("request", "step"):
            measured(run_closed(bench, engine, mixed, top, "mixed", args.window))
    img2img = "image" in getattr(bench.adapter, "starts", ())  # the family's step adapter starts from images
    if not args.no_closed and not args.no_image_mix and img2img:
        print("[text-only and img2img requests: one model (step) vs two models (request)]", flush=True)
        image_runs, report["image_mix_weights"] = run_image_mix(bench, args, top)
        report["runs"] += image_runs
        save()
    loads = [float(load) for load in args.loads.split(",")] if args.loads else []
    if loads:
        request_runs = [r for r in report["runs"] if r.engine == "request" and r.traffic == "homogeneous"]
        saturated = args.saturated or max(  # the best concurrency's, its rounds pooled
            pooled_throughput([r for r in request_runs if r.concurrency == c]) for c in concurrencies
        )
        report["request_saturated_images_per_s"] = saturated
        print(
            f"[poisson, {args.poisson_requests} requests per run, request-level saturation "
            f"{saturated:.2f} images/s]",
            flush=True,
        )
        poisson = [bench.request(i, args.steps, 7.5) for i in range(args.poisson_requests)]
        for load in loads:
            for engine in ("request", *STEP_COHORTS):
                measured(
                    run_poisson(
                        bench,
                        engine,
                        poisson,
                        load * saturated,
                        args.arrival_seed,
                        poisson_label(load),
                        args.window,
                        WARM_UP_FRACTION,
                    )
                )
        print("[stage costs, and what engine_sim.py predicts from them]", flush=True)
        costs = stage_costs(bench, steps=50)
        report["stage_costs"] = {stage: {str(k): v for k, v in by_k.items()} for stage, by_k in costs.items()}
        print("  engine_sim.py " + sim_arguments(costs) + f" --steps {args.steps} --cap {args.cap}")
        report["model"] = model_prediction(args.sim, costs, args, saturated, loads)
        save()
    if args.profile_forwards:
        print("[profile of the step engine at full occupancy]", flush=True)
        report["profile"] = profile_step_engine(bench, args.steps, args.profile_forwards)
        print("  " + timeline_line(report["profile"]), flush=True)
        save()
    if not args.no_raw:
        print("[raw pipeline]", flush=True)
        report["raw"] = raw_ceiling(bench, args.steps, max(args.requests // 2, args.cap * 2))
    report["ratios"] = ratios(report)
    report["runs"] = [r.__dict__ for r in report["runs"]]
    report["complete"] = True
    artefacts.write(path, report)
    (args.out / "bench_engines.md").write_text(markdown(report))
    print(markdown(report))


def model_prediction(sim: Path, costs: dict, args, saturated: float, loads: list[float]) -> dict | None:
    """engine_sim.py's prediction for the measured stage costs and the same arrivals: the request-level
    engine, the step engine with every stage on its thread (admitting every newcomer at once), and the
    bound with encoding and decoding free. None where the model is not there (a clean clone)."""
    if not sim.is_file():
        print(f"  ({sim} not found: no model prediction)")
        return None
    spec = importlib.util.spec_from_file_location("engine_sim", sim)
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    c = {
        stage: model.piecewise(",".join(f"{k}:{v}" for k, v in by_k.items())) for stage, by_k in costs.items()
    }
    c["row"] = 0.0  # the measured forward includes the row math
    out: dict = {}
    for load in loads:
        arrivals = poisson_arrivals(args.poisson_requests, load * saturated, args.arrival_seed)
        runs = {
            "request": model.run_request(arrivals, c, args.steps, args.cap, args.window),
            "step-eager": model.run_step(arrivals, c, args.steps, args.cap, "serial", 1.0),
            "step-free": model.run_step(arrivals, c, args.steps, args.cap, "free", 1.0),
        }
        out[poisson_label(load)] = runs
        for name, r in runs.items():
            print(
                f"  model {poisson_label(load)} {name:10s}: mean {r['mean']:.3f} s, p95 {r['p95']:.3f} s, "
                f"first step {r['ttfs']:.3f} s, mean / request {r['mean'] / runs['request']['mean']:.2f}"
            )
    return out


def ratios(report: dict) -> dict[str, tuple[float, str]]:
    runs = report["runs"]

    def pick(engine: str, traffic: str, concurrency: int | None = None) -> Outcome | None:
        found = [r for r in runs if r.engine == engine and r.traffic == traffic]
        if concurrency is not None:
            found = [r for r in found if r.concurrency == concurrency]
        return found[-1] if found else None

    out: dict[str, tuple[float, str]] = {}
    closed = [r.concurrency for r in runs if r.traffic == "homogeneous"]
    top = max(closed) if closed else None
    if top is not None:
        steps, requests = (
            [r for r in runs if r.engine == engine and r.traffic == "homogeneous" and r.concurrency == top]
            for engine in ("step", "request")
        )
        pooled, each = alternated_rounds(steps, requests)
        if len(each) == 1:
            out[f"homogeneous c={top}: step / request throughput"] = (pooled, TARGETS["throughput"])
        else:  # --rounds
            out[f"homogeneous c={top}: step / request throughput, {len(each)} alternated rounds pooled"] = (
                pooled,
                TARGETS["throughput"],
            )
            out[f"homogeneous c={top}: the same, median round (min {each[0]:.3f}, max {each[-1]:.3f})"] = (
                statistics.median(each),
                "-",
            )
        if "raw" in report:
            raw = report["raw"][f"batch{report['cap']}_images_per_s"]
            out[f"homogeneous c={top}: step / raw batch-{report['cap']} throughput"] = (
                pooled_throughput(steps) / raw,
                TARGETS["raw throughput"],
            )
    if pick("step", "mixed") and pick("request", "mixed"):
        out["mixed: step / request throughput"] = (
            pick("step", "mixed").images_per_s / pick("request", "mixed").images_per_s,
            TARGETS["mixed throughput"],
        )
    for traffic in ("text+image", "text+image poisson80"):
        step, request = pick("step", traffic), pick("request", traffic)
        if step and request:
            out[f"{traffic}: one model (step) / two models (request) throughput"] = (
                step.images_per_s / request.images_per_s,
                "-",
            )
            out[f"{traffic}: one model (step) / two models (request) p95 latency"] = (
                step.latency_p95_s / request.latency_p95_s,
                "-",
            )
    if "image_mix_weights" in report:
        weights = report["image_mix_weights"]
        out["text+image: resident weights, one model / two models"] = (
            weights["one_model_mib"] / weights["two_models_mib"],
            "-",
        )
    for load, (latency, first) in POISSON_TARGETS.items():
        label, percent = poisson_label(load), f"Poisson {round(load * 100)}%"
        request = pick("request", label)
        for engine in STEP_COHORTS:
            step = pick(engine, label)
            if not (step and request):
                continue
            served = engine == "step"
            out[f"{percent}: {engine} / request mean latency"] = (
                step.latency_mean_s / request.latency_mean_s,
                f"<= {latency}" if served else "-",
            )
            out[f"{percent}: {engine} / request p95 latency"] = (
                step.latency_p95_s / request.latency_p95_s,
                f"<= {latency}" if served else "-",
            )
            out[f"{percent}: {engine} / request mean time to first step"] = (
                step.first_step_mean_s / request.first_step_mean_s,
                f"<= {first}" if served else "-",
            )
            out[f"{percent}: {engine} delivered / offered"] = (
                step.images_per_s / step.offered_images_per_s,
                DELIVERED_TARGET if served and load == 0.95 else "-",
            )
    if "profile" in report:
        out["profile: engine's own work / step time"] = (
            report["profile"]["own_share_of_step"],
            TARGETS["own work"],
        )
    return out


def markdown(report: dict) -> str:
    lines = [
        f"{report['machine']}; {report['arch']} {report['dtype']}"
        f"{', captured forwards (cuda_graphs)' if report.get('cuda_graphs') else ''}, {report['size']}, "
        f"{report['steps']} steps "
        f"(mixed: 4/8/16 steps x guidance 1/5/7.5), {report['cap']} rows per forward or call, "
        f"request window {report['window']}, {report['requests']} requests per closed-loop run, "
        f"{report['poisson_requests']} per Poisson run (the same arrivals for both engines, the first "
        f"{100 * report['warm_up_fraction']:.0f}% left out). Latency runs from when a request was sent "
        "(its Poisson arrival, or its client's previous answer), not from when the engine took it.",
        "",
        "| engine | traffic | concurrency / rate | offered images/s | images/s | mean (s) | p95 (s) "
        "| first step mean (s) | first step p95 (s) | rows per forward / call | measured requests |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        rows = f"{r['rows_per_forward']:.2f}" if r["rows_per_forward"] else "-"
        lines.append(
            f"| {r['engine']} | {r['traffic']} | {load_cell(r['concurrency'], r['rate'])} "
            f"| {number_cell(r['offered_images_per_s'], 2)} | {r['images_per_s']:.2f} "
            f"| {r['latency_mean_s']:.3f} | {r['latency_p95_s']:.3f} | {r['first_step_mean_s']:.3f} "
            f"| {r['first_step_p95_s']:.3f} | {rows} | {r['measured_requests']} of {r['requests']} |"
        )
    if "image_mix_weights" in report:
        weights = report["image_mix_weights"]
        lines += [
            "",
            "text+image: half text-only, half img2img requests (strength "
            f"{IMAGE_STRENGTH}) of one size; request = a text_to_image and an image_to_image model on the "
            "request-level engine taking turns (two copies of the weights), step = one text_to_image model "
            "on the step engine running both kinds in the same forwards. Resident weights for serving both "
            f"kinds: {weights['one_model_mib']:.1f} MiB with one model, {weights['two_models_mib']:.1f} MiB "
            "with two.",
        ]
    if "raw" in report:
        raw = report["raw"]
        lines += ["", "Raw pipeline: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in raw.items())]
    timelines = [r for r in report["runs"] if "timeline" in r["extra"]]
    if timelines:
        lines += ["", "Where a step engine's time went under Poisson load (per engine step):", ""]
        lines += [
            f"- {r['engine']} {r['traffic']}: {timeline_line(r['extra']['timeline'])}" for r in timelines
        ]
    if report.get("model"):
        lines += [
            "",
            "engine_sim.py's prediction from the stage costs measured in this run (same arrivals):",
            "",
        ]
        lines += [
            "| load | engine | mean (s) | p95 (s) | first step (s) | mean / request |",
            "|---|---|---|---|---|---|",
        ]
        for label, by_engine in report["model"].items():
            base = by_engine["request"]["mean"]
            lines += [
                f"| {label} | {name} | {m['mean']:.3f} | {m['p95']:.3f} | {m['ttfs']:.3f} "
                f"| {m['mean'] / base:.2f} |"
                for name, m in by_engine.items()
            ]
    if "profile" in report:
        lines += [
            "",
            f"Step engine at full occupancy ({report['profile']['rows_per_forward']} rows): "
            + timeline_line(report["profile"])
            + ".",
        ]
    lines += [""]
    lines += ratio_table(report["ratios"])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

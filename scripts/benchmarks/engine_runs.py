"""How the in-process engines benchmark (``engines``) drives the two engines: one run of an engine under one
traffic (closed loop or Poisson) into an ``Outcome``, the ``StageClock`` that splits a step engine's step
into its stages, and the text-only + img2img mix (``ImageMix``: one model on the step engine against two
request-level models).

The loops go through the served code (the model's own field parsing, compatibility key, step adapter and
pipeline call) and the real engines. The clock lives in Traffic (arrivals.py); a loop only takes
``traffic.arrived()`` when it is free, sleeps with ``traffic.wait_for_arrival()`` when idle, reports
``traffic.first_step(i)`` and ``traffic.done(i)``, and stops at ``traffic.finished``. Each returns the
images of every call or forward.
"""

from __future__ import annotations

import gc
import io
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from benchmarks.arrivals import Traffic, poisson_arrivals
from benchmarks.common import WARM_UP_FRACTION, max_sequence_length, mean, percentile
from benchmarks.inprocess import Bench, Channel, Recorder, sync
from triton_diffusion.compatibility import compatibility_key
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.planner import RowCaps
from triton_diffusion.engine.request_engine import RequestEngine
from triton_diffusion.models.diffusion_model import RowInput
from triton_diffusion.models.image_to_image import ImageToImageModel
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.serving.server_process import WEIGHTS
from triton_diffusion.settings import ModelConfig, ModelSettings


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
    round: int = 0  # of the benchmark's alternated rounds (--rounds)
    arrival_seed: int | None = None  # Poisson: the seed of its arrival times


def run_request_level(
    bench: Bench, traffic: Traffic, window: int, recorder: Recorder | None = None
) -> list[int]:
    """The request-level engine over batches as Triton forms them for execute(): what arrived while the
    last batch ran, at most ``window`` requests. ``recorder``: one that keeps more of the reports (a
    ``Recorder`` subclass), else a plain one."""
    recorder = recorder or Recorder(traffic)
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
    bench: Bench,
    traffic: Traffic,
    cohort: int,
    clock: StageClock | None = None,
    recorder: Recorder | None = None,
) -> list[int]:
    recorder = recorder or Recorder(traffic)
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
    recorder.ended(engine)
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


def raw_loop_profile(bench: Bench, steps: int, calls: int) -> dict:
    """diffusers' own pipeline call at batch --cap (after one warm-up call), timed in place: its start (the
    inputs checked, the prompts encoded, the scheduler's timesteps and step arguments, the starting
    latents: what the step engine's start of a job does), the denoiser, the VAE decode and the
    postprocessing; the rest of the call, a denoising step, is its loop's own work (guidance, the
    scheduler's step, the latents' bookkeeping): what the step engine's row math and bookkeeping do
    around its forwards. Each timed method is wrapped where the call looks it up (an instance attribute
    over its class's method, or the pipeline module's ``retrieve_timesteps``) and given back after."""
    pipe = bench.pipe
    denoiser = pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer
    module = sys.modules[type(pipe).__module__]
    parts = {
        "start": [
            (pipe, "check_inputs"),
            (pipe, "encode_prompt"),
            (module, "retrieve_timesteps"),
            (pipe, "prepare_extra_step_kwargs"),
            (pipe, "prepare_latents"),
        ],
        "denoiser": [(denoiser, "forward")],
        "decode": [(pipe.vae, "decode"), (pipe.image_processor, "postprocess")],
    }
    totals = dict.fromkeys(parts, 0.0)

    def timed(part: str, original):
        def call(*args, **kwargs):
            sync(bench.device)
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                sync(bench.device)
                totals[part] += time.perf_counter() - started

        return call

    requests = [bench.request(i, steps, 7.5) for i in range(bench.cap)]
    bench.raw_pipeline_call(requests)  # warm-up
    wrapped = []  # (owner, name, what it had before, whether that was its own attribute)
    try:
        for part, owners in parts.items():
            for owner, name in owners:
                if hasattr(owner, name):  # a pipeline without one (no separate input check) skips it
                    original = getattr(owner, name)
                    wrapped.append((owner, name, original, name in vars(owner)))
                    setattr(owner, name, timed(part, original))
        sync(bench.device)
        started = time.perf_counter()
        for _ in range(calls):
            bench.raw_pipeline_call(requests)
        sync(bench.device)
        total = time.perf_counter() - started
    finally:
        for owner, name, original, own in reversed(wrapped):
            if own:  # a module's function: put back
                setattr(owner, name, original)
            else:  # an instance attribute over the class's method: removed
                delattr(owner, name)
    per_step = {part: 1000 * seconds / (calls * steps) for part, seconds in totals.items()}
    return {
        "images_per_call": bench.cap,
        "step_ms": 1000 * total / (calls * steps),
        "start_ms": per_step["start"],
        "denoiser_ms": per_step["denoiser"],
        "decode_ms": per_step["decode"],
        "loop_ms": 1000 * (total - sum(totals.values())) / (calls * steps),
        "timed": [name for _, name, _, _ in wrapped],  # what was found to time, in the parts' order
    }


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
    """``concurrency`` clients, each sending its next request when its last one is answered (the last
    run's garbage collected first, not during this one)."""
    gc.collect()
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
    """Poisson arrivals at ``rate``; the same ``seed`` gives both engines the same arrival times (the last
    run's garbage collected first)."""
    gc.collect()
    traffic = Traffic(
        requests, arrivals=poisson_arrivals(len(requests), rate, seed), warm_up_fraction=warm_up_fraction
    )
    # The timeline synchronises the device around every stage, which a GPU's step engine would not do
    # (it queues the next step while the last runs): on a GPU only with --timeline.
    timed = engine != "request" and (bench.device == "cpu" or bench.timeline)
    clock = StageClock(bench.device) if timed else None
    rows = drive(bench, engine, traffic, window, clock)
    result = outcome(engine, traffic_name, traffic, None, rate, rows)
    result.arrival_seed = seed
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

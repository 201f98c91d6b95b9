"""The served text-to-image model in one process, as the in-process benchmarks drive it: ``Bench`` loads it
as Triton's stub would (TextToImageModel.load) and makes its requests, jobs and step engines; ``Recorder``
renders the engines' reports into a ``Traffic``'s clock; ``Channel`` stands in for Triton's response
sender; ``sync`` and ``timed_median`` time work on a GPU as on a CPU; ``device_and_dtype`` picks what a GPU
run uses; ``full_size_flux1`` swaps FLUX.1's transformer at full size into tiny FLUX (random weights).
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch

from benchmarks.arrivals import Traffic
from benchmarks.common import PROMPTS, machine_description, max_sequence_length
from triton_diffusion.adapters.diffusers_pipeline import row_generator
from triton_diffusion.compatibility import compatibility_key
from triton_diffusion.engine.jobs import Job, StepReport
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.models.calibration import calibrate
from triton_diffusion.models.diffusion_model import RowInput
from triton_diffusion.models.text_to_image import TextToImageModel
from triton_diffusion.serving.engines import StepEngineKind
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.serving.server_process import WEIGHTS
from triton_diffusion.settings import ModelConfig, ModelSettings
from triton_diffusion.tiny_models import build_missing

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_and_dtype(device: str = "auto", dtype: str = "auto") -> tuple[str, torch.dtype]:
    """The device (``auto``: cuda where there is one) and dtype (``auto``: bfloat16 on cuda, float32 on a
    CPU) a benchmark runs in, as the GPU runs of the engines' and caches' benchmarks pick them."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = DTYPES.get(dtype, torch.bfloat16 if device.startswith("cuda") else torch.float32)
    return device, chosen


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

    def ended(self, engine: StepEngine) -> None:
        """The step engine once its run ended (a subclass keeps what it reports of it)."""


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
        device_profile: str | None = None,
    ) -> None:
        build_missing(WEIGHTS, only=[arch])
        config = ModelConfig(
            model=str(WEIGHTS / arch),
            dtype=str(dtype).removeprefix("torch."),
            max_sequence_length=max_sequence_length(arch),
            cuda_graphs=cuda_graphs,
            device_profile=device_profile,  # a GPU's forward and decode times (adapters/device_profiles.py)
        )
        kind = "GPU" if device.startswith("cuda") else "CPU"
        # The bench's size as the model's default: what cuda_graphs captures at load.
        sizes = {"default_height": str(height), "default_width": str(width)}
        self.settings = settings = ModelSettings(arch, WEIGHTS, config, sizes, cap, kind, 0)
        self.model = TextToImageModel()
        self.model.fields, self.adapter = self.model.load(settings)
        self.pipe = self.model.pipe
        self.height, self.width, self.cap, self.device = height, width, cap, device
        self.arch, self.dtype_name, self.device_profile = arch, config.dtype, device_profile
        self.max_running, self.policy = cap, "oldest"
        self.packing_gate = True  # config packing_gate: off, every forward of mixed sizes runs packed
        self.timeline = False  # on a GPU: time each step's stages under Poisson load (synchronising)
        self.cohort = max(1, cap // 2)  # the served default (EngineHost), for max_running >= cap
        # The packing gate's prices from load, as the served model has them (models/calibration.py).
        self.calibration = calibrate(self.adapter, self.model.calibration_requests(), lambda request: cap)

    def report_header(self, steps: int) -> dict:
        """What a report says of the machine and the model it measured."""
        return {
            "machine": machine_description(
                f"{torch.get_num_threads()} torch threads",
                torch.cuda.get_device_name() if self.device.startswith("cuda") else "CPU",
            ),
            "arch": self.arch,
            "device_profile": self.device_profile,
            "dtype": self.dtype_name,
            "size": f"{self.width}x{self.height}",
            "steps": steps,
        }

    def step_engine(self, cohort: int) -> StepEngine:
        """The served step engine, built by the server's own code (serving/engines.py StepEngineKind) from
        this model's settings, with the bench's running set, admission cohort, policy and packing gate."""
        config = dataclasses.replace(
            self.settings.config,
            max_running=self.max_running,
            admission_cohort=min(cohort, max(1, self.max_running // 2)),
            scheduling_policy=self.policy,
            packing_gate=self.packing_gate,
        )
        settings = dataclasses.replace(self.settings, config=config)
        kind = StepEngineKind(
            self.adapter,
            self.model.row_caps(settings),
            max_tokens_per_forward=config.max_tokens_per_forward,
            times=copy.deepcopy(self.calibration),  # each run's engine learns on from the load's prices
        )
        return kind.build(settings, on_progress=lambda report: None)

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
            params = self.model.step_request(values, 0)
            # Its shape and tokens, as the served model kind sets them (models/diffusion_model.py).
            return Job(
                tracked, params, record=index, shape=params.shape, tokens=self.adapter.tokens_of(params)
            )
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


def full_size_flux1(bench: Bench, device: str, dtype: torch.dtype) -> None:
    """Swap in FLUX.1-dev's transformer shape (random weights, made on the device: no 24 GB on disk), fed
    by the loaded pipeline's own text encoders (so only its input projections differ from FLUX.1's), and
    calibrate the packing gate again over it."""
    from diffusers import FluxTransformer2DModel

    from triton_diffusion.adapters.device_profiles import FLUX1_DEV
    from triton_diffusion.adapters.step_adapters import step_adapter_for

    pipe = bench.pipe
    tiny = pipe.transformer.config
    with torch.device(device):
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=tiny.in_channels,
            out_channels=tiny.out_channels,
            num_layers=FLUX1_DEV.double_layers,
            num_single_layers=FLUX1_DEV.single_layers,
            attention_head_dim=FLUX1_DEV.head_dim,
            num_attention_heads=FLUX1_DEV.heads,
            joint_attention_dim=tiny.joint_attention_dim,
            pooled_projection_dim=tiny.pooled_projection_dim,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        ).to(dtype)
    pipe.transformer = transformer
    model = bench.model
    bench.adapter = step_adapter_for(
        pipe, model.facts, model.schedulers, model.call_extras.get("max_sequence_length")
    )
    # The packing gate's prices again, from the transformer now served: the load's came from the tiny one.
    bench.calibration = calibrate(bench.adapter, model.calibration_requests(), lambda request: bench.cap)

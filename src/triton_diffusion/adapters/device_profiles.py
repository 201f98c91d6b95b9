"""Device profiles: the real engine, scheduler, host and server at a GPU's cost ratios, on a CPU.

A profile replaces a loaded pipeline's denoiser and its VAE decode with stand-ins that take the time a GPU
was measured to take for the same work, and compute nothing: the denoiser returns zeros of its output's
shape (so the scheduler's real update runs on real latents), the decode returns mid-grey pixels. Everything
around them (request parsing, admission, the scheduler's decisions, checkpoints, responses) runs for real.
What it answers is the cost of a feature where a forward is as long as it is on that GPU; what it serves
is not an image. What is not modelled: the measured forward is the engine's whole step (the UNet, the
guidance and the scheduler's update) and the measured decode includes its postprocessing, and both of
those also run here on the CPU, at its speed; everything else (text encoding, the engine's own work,
a checkpoint's copy, here a CPU copy of float32 latents rather than a device-to-host one of bfloat16)
runs at this CPU's speed too.

The times come from a committed GPU artefact, read at load (never copied into code):

- ``sd15-h100`` (a UNet): a forward's seconds against its model rows (images, doubled by classifier-free
  guidance) at the artefact's size, interpolated linearly in rows x latent positions (flat below the
  smallest measured forward: a GPU is latency-bound there; extended along the last segment above the
  largest), and a decode's seconds against its images.
- ``flux1-h100`` (FLUX.1-dev's transformer): one measured forward (two rows at 1024x1024, bfloat16;
  eager: the step caches' benchmark had neither CUDA graphs nor compile when it was taken) gives the
  rate at which that GPU ran its arithmetic; any other forward takes its own arithmetic at that rate
  (:class:`TransformerShape`: every row's image and text tokens through the linear layers, every token
  pair through attention; padding counts as the GPU computes it). An estimate, not a measurement, of
  every other forward: it assumes the GPU compute-bound at every size (no artefact of ours measures how a
  FLUX.1 forward's time grows with its size); where it is not (small forwards) it under-prices a
  forward, and a packed forward's key mask (which may take SDPA off its fastest kernel) is not priced
  either. The measured forward was timed by the host's clock (before engine/stopwatch.py), which can
  read a forward as its launch; its median over the run is used, and the run's closed-loop latency
  bears it out (its steps' forwards at that median are nearly all of it). A decode takes what SD 1.5's
  took on that GPU for as many pixels, from the ``sd15-h100`` artefact (the same AutoencoderKL decoder,
  its first layer aside; its mid-block attention grows faster than its pixels, so a large image's decode
  is under-priced a little; beyond the table's largest batch, extended along its last segment).

Text encoding and image encoding stay the tiny model's own (a few ms on a CPU).

Config ``device_profile`` turns one on (benchmarks only); ``scripts/bench.py checkpoint-cost
--device-profile NAME`` (and crash-soak, goodput, slo, mixed-sizes) measures with one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

log = logging.getLogger(__name__)

DOCS = Path(__file__).resolve().parents[3] / "docs"


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    pipeline: str  # the diffusers pipeline class it stands in for
    artefact: str  # under docs/: a bench_engines.json with ``stage_costs`` (scripts/benchmarks/engines.py)
    arch: str  # what the artefact must say it measured: its ``arch`` ...
    gpu: str  # ... and a word of its machine's GPU
    what: str
    # How its artefact gives its costs: "table" (a forward's and a decode's seconds by batch: load_table)
    # or "flops" (one measured forward's rate, and the decodes of ``decodes_from``: load_flux_costs).
    kind: Literal["table", "flops"] = "table"
    decodes_from: str = ""


PROFILES = {
    p.name: p
    for p in (
        DeviceProfile(
            "sd15-h100",
            "StableDiffusionPipeline",
            "gpu/checks/engines_eager/bench_engines.json",
            "sd15",
            "H100",
            "Stable Diffusion 1.5, 512x512, bfloat16, eager, on an NVIDIA H100 80GB (the step engine's "
            "own forward and decode, classifier-free guidance on)",
        ),
        DeviceProfile(
            "flux1-h100",
            "FluxPipeline",
            "gpu/checks_step_caches/step_caches/bench_caches.json",
            "FLUX.1 transformer at full size",
            "H100",
            "FLUX.1-dev's transformer, bfloat16, eager, on an NVIDIA H100 80GB: one measured forward (2 rows "
            "at 1024x1024, 64 text tokens) and every other forward estimated at the rate of its arithmetic; "
            "decodes "
            "as SD 1.5's decoder took for as many pixels",
            kind="flops",
            decodes_from="sd15-h100",
        ),
    )
}


def profiles_for(pipeline: str) -> list[str]:
    """The profiles that stand in for ``pipeline``'s denoiser (a benchmark's choices for its model)."""
    return sorted(name for name, p in PROFILES.items() if p.pipeline == pipeline)


# The text tokens of the forwards the flux1-h100 artefact measured: the benchmarks' FLUX prompt cap when it
# was taken (FLUX_MAX_SEQUENCE_LENGTH in scripts/bench_common.py at 7c26b7c; the artefact does not record
# it).
FLUX_MEASURED_TEXT_TOKENS = 64


@dataclass(frozen=True)
class TransformerShape:
    """A DiT's arithmetic: FLUX.1-dev's by default (the shape benchmarks.inprocess.full_size_flux1 builds).
    Its double-stream blocks (each stream its own weights) and its single-stream blocks both give a token
    12 d^2 multiply-adds (q, k, v and out projections, an MLP of ``mlp_ratio`` x d), and a token pair 2 d
    (scores and values) in attention; the per-row work (embeddings, modulation) and the in and out
    projections (under 1% at 1024x1024) are left out."""

    double_layers: int = 19
    single_layers: int = 38
    heads: int = 24
    head_dim: int = 128
    mlp_ratio: int = 4

    def flops(self, rows: int, tokens: int) -> float:
        """Floating-point operations (2 a multiply-add) of a forward of ``rows`` rows of ``tokens`` tokens
        each (image and text, padding included)."""
        d = self.heads * self.head_dim
        per_token = (4 + 2 * self.mlp_ratio) * d * d + 2 * tokens * d
        return 2.0 * rows * tokens * (self.double_layers + self.single_layers) * per_token


FLUX1_DEV = TransformerShape()


@dataclass(frozen=True)
class CostTable:
    """Seconds of a forward by rows x latent positions, and of a decode by images."""

    forward: tuple[tuple[float, float], ...]  # (model rows x latent positions, seconds), increasing
    decode: tuple[tuple[float, float], ...]  # (images, seconds), increasing
    size: tuple[int, int] = (0, 0)  # (height, width) the artefact measured at: where its times hold
    source: dict[str, Any] | None = None  # the artefact's path and provenance (for a benchmark's record)

    def forward_s(self, row_positions: float) -> float:
        return _interpolate(self.forward, row_positions)

    def decode_s(self, images: float, pixels: int | None = None) -> float:
        """Seconds to decode ``images`` of ``pixels`` each (the table's size where not given): as many
        images of the table's size as hold those pixels."""
        if pixels is not None:
            images = images * pixels / (self.size[0] * self.size[1])
        return _interpolate(self.decode, images)

    def record(self) -> dict[str, Any]:
        """What a benchmark's artefact keeps of the times its stand-ins waited."""
        return {"forward": self.forward, "decode": self.decode, "source": self.source}


@dataclass(frozen=True)
class FlopCosts:
    """Seconds of a transformer's forward at the rate its one measured forward ran its arithmetic; of a
    decode, by another profile's decodes per pixel."""

    per_flop_s: float
    decodes: CostTable  # the decodes of the profile named by ``decodes_from``, at its size
    size: tuple[int, int]  # (height, width) of the measured forward
    shape: TransformerShape = FLUX1_DEV
    source: dict[str, Any] | None = None

    def forward_s(self, rows: int, tokens: int) -> float:
        return self.per_flop_s * self.shape.flops(rows, tokens)

    def decode_s(self, images: float, pixels: int) -> float:
        return self.decodes.decode_s(images, pixels)

    def record(self) -> dict[str, Any]:
        return {
            "per_flop_s": self.per_flop_s,
            "measured_tflops_per_s": 1e-12 / self.per_flop_s,
            "shape": dataclasses.asdict(self.shape),
            "decodes": self.decodes.record(),
            "source": self.source,
        }


def _interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    if x <= points[0][0]:
        return points[0][1]
    i = min(max(bisect_left([p[0] for p in points], x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def load_table(profile: DeviceProfile, docs: Path = DOCS) -> CostTable:
    """The profile's costs from its artefact. Raises ValueError naming the file when it cannot."""
    path = docs / profile.artefact
    try:
        report = json.loads(path.read_text())
        costs = report["stage_costs"]
        width, height = (int(v) for v in report["size"].split("x"))
        forward = sorted((int(k), float(s)) for k, s in costs["forward"].items())
        decode = sorted((int(k), float(s)) for k, s in costs["decode"].items())
    except (OSError, KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"device profile {profile.name}: {path} has no stage costs ({exc})") from exc
    machine = json.dumps(report.get("provenance", {}).get("machine", report.get("machine", "")))
    if report.get("arch") != profile.arch or report.get("cuda_graphs") or profile.gpu not in machine:
        raise ValueError(
            f"device profile {profile.name}: {path} is not {profile.arch}, eager, on an {profile.gpu}"
        )
    positions = (height // 8) * (width // 8)  # SD's VAE: 8x down each side
    guided = 2  # the artefact's forwards ran with classifier-free guidance: two model rows an image
    forward = [(images * guided * positions, seconds) for images, seconds in forward]
    if len(forward) < 2 or len(decode) < 2:
        raise ValueError(f"device profile {profile.name}: {path} measures fewer than two batch sizes")
    source = {"artefact": f"docs/{profile.artefact}", "provenance": report.get("provenance")}
    return CostTable(tuple(forward), tuple(decode), (height, width), source)


def load_flux_costs(profile: DeviceProfile, docs: Path = DOCS) -> FlopCosts:
    """A transformer profile's costs: the rate of its artefact's uncached closed-loop forwards (a
    bench_caches.json, scripts/bench_caches.py), the median over them. Raises ValueError naming the file
    when it cannot."""
    path = docs / profile.artefact
    try:
        report = json.loads(path.read_text())
        config = report["config"]
        width, height = (int(v) for v in config["size"].split("x"))
        forwards = [
            (int(group["rows"]), float(group["median_ms"]) / 1000)
            for run in report["rounds"]
            for group in run["closed"]["none"]["forward_groups"]
            if group["reused"] == 0
        ]
    except (OSError, KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"device profile {profile.name}: {path} has no uncached forwards ({exc})") from exc
    machine = json.dumps(report.get("provenance", {}).get("machine", ""))
    if (
        profile.arch not in str(config.get("arch"))
        or config.get("dtype") != "bfloat16"
        or profile.gpu not in machine
    ):
        raise ValueError(
            f"device profile {profile.name}: {path} is not {profile.arch}, bfloat16, on an {profile.gpu}"
        )
    if not forwards:
        raise ValueError(f"device profile {profile.name}: {path} has no uncached forwards")
    tokens = (height // 16) * (width // 16) + FLUX_MEASURED_TEXT_TOKENS  # FLUX.1: 8x VAE, 2x2 patches
    rates = sorted(seconds / FLUX1_DEV.flops(rows, tokens) for rows, seconds in forwards)
    decodes = load_table(PROFILES[profile.decodes_from], docs)
    source = {
        "artefact": f"docs/{profile.artefact}",
        "provenance": report.get("provenance"),
        "forwards": forwards,
    }
    # The upper median (of two rounds, the slower): a forward read early by the host's clock is too short.
    return FlopCosts(rates[len(rates) // 2], decodes, (height, width), FLUX1_DEV, source)


def load_costs(profile: DeviceProfile, docs: Path = DOCS) -> CostTable | FlopCosts:
    """A profile's costs, as its kind reads them from its artefact."""
    return load_flux_costs(profile, docs) if profile.kind == "flops" else load_table(profile, docs)


def apply_profile(pipe: Any, name: str, docs: Path = DOCS) -> CostTable | FlopCosts:
    """Replace ``pipe``'s denoiser and VAE decode with stand-ins timed by profile ``name``. Raises
    ValueError naming what does not fit."""
    if name not in PROFILES:
        raise ValueError(f"device_profile: {name!r} is not one of {', '.join(sorted(PROFILES))}")
    profile = PROFILES[name]
    if type(pipe).__name__ != profile.pipeline:
        raise ValueError(f"device_profile {name}: times a {profile.pipeline}, not a {type(pipe).__name__}")
    costs = load_costs(profile, docs)
    if isinstance(costs, FlopCosts):
        config = pipe.transformer.config  # its output: each token's patch of latent channels
        pipe.transformer.forward = TimedTransformer(
            costs, config.patch_size**2 * pipe.transformer.out_channels
        )
    else:
        pipe.unet.forward = TimedUNet(costs, pipe.unet.config.out_channels)
    pipe.vae.decode = TimedDecode(costs.decode_s, pipe.vae_scale_factor, pipe.vae.config.out_channels)
    log.warning("device profile %s: the denoiser and decode compute nothing (%s)", name, profile.what)
    return costs


class TimedUNet:
    """``UNet2DConditionModel.forward``'s stand-in: waits the table's time for its rows and positions."""

    def __init__(self, table: CostTable, out_channels: int) -> None:
        self.table, self.out_channels = table, out_channels

    def __call__(self, sample: torch.Tensor, *args: Any, return_dict: bool = True, **kwargs: Any) -> Any:
        rows, _, height, width = sample.shape
        time.sleep(self.table.forward_s(rows * height * width))
        out = sample.new_zeros((rows, self.out_channels, height, width))
        if return_dict:
            from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

            return UNet2DConditionOutput(sample=out)
        return (out,)


class TimedTransformer:
    """``FluxTransformer2DModel.forward``'s stand-in: waits the time of its rows' arithmetic (image tokens,
    padding included, and text tokens)."""

    def __init__(self, costs: FlopCosts, out_channels: int) -> None:
        self.costs, self.out_channels = costs, out_channels

    def __call__(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        *args: Any,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> Any:
        rows, tokens, _ = hidden_states.shape
        text = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        time.sleep(self.costs.forward_s(rows, tokens + text))
        out = hidden_states.new_zeros((rows, tokens, self.out_channels))
        if return_dict:
            from diffusers.models.modeling_outputs import Transformer2DModelOutput

            return Transformer2DModelOutput(sample=out)
        return (out,)


class TimedDecode:
    """``AutoencoderKL.decode``'s stand-in: waits the profile's time for its images and their pixels;
    mid-grey pixels."""

    def __init__(self, seconds: Callable[[float, int], float], scale: int, channels: int) -> None:
        self.seconds, self.scale, self.channels = seconds, scale, channels

    def __call__(self, latents: torch.Tensor, *args: Any, return_dict: bool = True, **kwargs: Any) -> Any:
        images, _, height, width = latents.shape
        height, width = height * self.scale, width * self.scale
        time.sleep(self.seconds(images, height * width))
        pixels = latents.new_zeros((images, self.channels, height, width))
        if return_dict:
            from diffusers.models.autoencoders.vae import DecoderOutput

            return DecoderOutput(sample=pixels)
        return (pixels,)

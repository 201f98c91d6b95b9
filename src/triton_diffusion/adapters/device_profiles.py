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

The times come from a committed GPU artefact, read at load (never copied into code): a forward's seconds
against its model rows (images, doubled by classifier-free guidance) at the artefact's size, interpolated
linearly in rows x latent positions (flat below the smallest measured forward: a GPU is latency-bound
there; extended along the last segment above the largest), and a decode's seconds against its images.
Text encoding and image encoding stay the tiny model's own (a few ms on a CPU).

Config ``device_profile`` turns one on (benchmarks only); ``scripts/bench.py checkpoint-cost
--device-profile NAME`` measures with one.
"""

from __future__ import annotations

import json
import logging
import time
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    )
}


@dataclass(frozen=True)
class CostTable:
    """Seconds of a forward by rows x latent positions, and of a decode by images."""

    forward: tuple[tuple[float, float], ...]  # (model rows x latent positions, seconds), increasing
    decode: tuple[tuple[float, float], ...]  # (images, seconds), increasing
    size: tuple[int, int] = (0, 0)  # (height, width) the artefact measured at: where its times hold
    source: dict[str, Any] | None = None  # the artefact's path and provenance (for a benchmark's record)

    def forward_s(self, row_positions: float) -> float:
        return _interpolate(self.forward, row_positions)

    def decode_s(self, images: float) -> float:
        return _interpolate(self.decode, images)


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


def apply_profile(pipe: Any, name: str, docs: Path = DOCS) -> CostTable:
    """Replace ``pipe``'s denoiser and VAE decode with stand-ins timed by profile ``name``. Raises
    ValueError naming what does not fit."""
    if name not in PROFILES:
        raise ValueError(f"device_profile: {name!r} is not one of {', '.join(sorted(PROFILES))}")
    profile = PROFILES[name]
    if type(pipe).__name__ != profile.pipeline:
        raise ValueError(f"device_profile {name}: times a {profile.pipeline}, not a {type(pipe).__name__}")
    table = load_table(profile, docs)
    pipe.unet.forward = TimedUNet(table, pipe.unet.config.out_channels)
    pipe.vae.decode = TimedDecode(table, pipe.vae_scale_factor, pipe.vae.config.out_channels)
    log.warning("device profile %s: the denoiser and decode compute nothing (%s)", name, profile.what)
    return table


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


class TimedDecode:
    """``AutoencoderKL.decode``'s stand-in: waits the table's time for its images; mid-grey pixels."""

    def __init__(self, table: CostTable, scale: int, channels: int) -> None:
        self.table, self.scale, self.channels = table, scale, channels

    def __call__(self, latents: torch.Tensor, *args: Any, return_dict: bool = True, **kwargs: Any) -> Any:
        images, _, height, width = latents.shape
        time.sleep(self.table.decode_s(images))
        pixels = latents.new_zeros((images, self.channels, height * self.scale, width * self.scale))
        if return_dict:
            from diffusers.models.autoencoders.vae import DecoderOutput

            return DecoderOutput(sample=pixels)
        return (pixels,)

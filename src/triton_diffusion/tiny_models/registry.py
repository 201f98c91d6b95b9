"""Which tiny model each name builds, and building the missing ones into a weights folder
(``triton-diffusion-build-tiny``), rebuilding any that an older builder version made.
"""

from __future__ import annotations

import argparse
import fcntl
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from triton_diffusion.tiny_models.diffusion_lm import build_tiny_dllm
from triton_diffusion.tiny_models.flux import build_flux_bench, build_tiny_flux, build_tiny_flux_fill
from triton_diffusion.tiny_models.lora import build_tiny_lora
from triton_diffusion.tiny_models.pixart_sigma import build_tiny_pixart_alpha, build_tiny_pixart_sigma
from triton_diffusion.tiny_models.qwen_image import build_tiny_qwen_image
from triton_diffusion.tiny_models.sana import build_tiny_sana
from triton_diffusion.tiny_models.sd3 import build_tiny_sd3, build_tiny_sd3_inpaint
from triton_diffusion.tiny_models.sdxl import build_tiny_sdxl, build_tiny_sdxl_inpaint
from triton_diffusion.tiny_models.stable_diffusion import build_sd15, build_tiny_sd, build_tiny_sd_inpaint
from triton_diffusion.tiny_models.wan import build_tiny_wan
from triton_diffusion.tiny_models.z_image import build_tiny_z_image

# The repository's weights/ folder: this file is <repository>/src/triton_diffusion/tiny_models/registry.py.
DEFAULT_WEIGHTS_DIR = Path(__file__).resolve().parents[3] / "weights"


# name -> builder. The tiny ones are the defaults the model repository serves.
ARCHITECTURES: dict[str, Callable[[Path], None]] = {
    "tiny-sd": build_tiny_sd,
    "tiny-flux": build_tiny_flux,
    "flux-bench": build_flux_bench,  # more and wider blocks: step-cache benchmarks on a CPU
    "tiny-wan": build_tiny_wan,
    "tiny-dllm": build_tiny_dllm,
    "sd15": build_sd15,
    # More pipeline families, built on request (not served by default).
    "tiny-sdxl": build_tiny_sdxl,
    "tiny-sd-inpaint": build_tiny_sd_inpaint,  # a 9-channel inpainting UNet
    "tiny-sdxl-inpaint": build_tiny_sdxl_inpaint,  # the same for SDXL
    "tiny-flux-fill": build_tiny_flux_fill,  # a FLUX.1 Fill inpainting transformer
    "tiny-sd3-inpaint": build_tiny_sd3_inpaint,  # a 33-channel SD3 inpainting transformer
    "tiny-sd3": build_tiny_sd3,
    "tiny-qwen-image": build_tiny_qwen_image,
    "tiny-sana": build_tiny_sana,
    "tiny-pixart-sigma": build_tiny_pixart_sigma,
    "tiny-pixart-alpha": build_tiny_pixart_alpha,
    "tiny-z-image": build_tiny_z_image,
}
# Tiny LoRA adapters (tiny_models/lora.py), two per family that takes adapters: <family>-lora-<name>.
LORA_SEEDS = {"ink": 1, "neon": 2}


def _lora_builder(family: str, seed: int) -> Callable[[Path], None]:
    """Builds an adapter for the family's tiny pipeline, a sibling of the adapter's folder."""
    return lambda target: build_tiny_lora(target.parent / family, target, seed)


for _family in ("tiny-sd", "tiny-sdxl", "tiny-flux"):
    for _name, _seed in LORA_SEEDS.items():
        ARCHITECTURES[f"{_family}-lora-{_name}"] = _lora_builder(_family, _seed)
TINY_DEFAULTS = ["tiny-sd", "tiny-flux", "tiny-wan", "tiny-dllm"]
# The tiny families the family-matrix test serves (built on first use, then cached in weights/).
TINY_FAMILIES = [
    "tiny-sdxl",
    "tiny-sd3",
    "tiny-qwen-image",
    "tiny-sana",
    "tiny-pixart-sigma",
    "tiny-pixart-alpha",
    "tiny-z-image",
]
# Bump when a builder changes: folders built by an older version are rebuilt. One builder that changed
# alone gets its own version here, so only its folder is rebuilt.
BUILD_VERSION = "2"
# tiny-wan 3: a VAE without one-channel layers; tiny-qwen-image 3: a VAE with a per-channel mean and std.
BUILDER_VERSIONS = {"tiny-wan": "3", "tiny-qwen-image": "3"}
STAMP = ".triton-diffusion-build"


def build_missing(
    weights_dir: Path = DEFAULT_WEIGHTS_DIR, force: bool = False, only: list[str] | None = None
) -> list[Path]:
    """Build each of ``only`` (the tiny defaults unless given) that ``weights_dir`` lacks or holds from an
    older ``BUILD_VERSION`` (every one with ``force``); returns the folders built. One process builds at a
    time (a lock file in ``weights_dir``): two test workers asking for the same weights must not both
    build them, nor one read what the other is writing. A builder that builds what it derives from
    (build_missing within build_missing) holds the lock already: a second flock would wait on itself."""
    if getattr(_building, "held", False):
        return _build_missing(weights_dir, force, only)
    weights_dir.mkdir(parents=True, exist_ok=True)
    with open(weights_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        _building.held = True
        try:
            return _build_missing(weights_dir, force, only)
        finally:
            _building.held = False


_building = threading.local()  # this thread holds the build lock (build_missing is re-entered)


def _build_missing(weights_dir: Path, force: bool, only: list[str] | None) -> list[Path]:
    built = []
    for name in only or TINY_DEFAULTS:
        target = weights_dir / name
        stamp = target / STAMP
        version = BUILDER_VERSIONS.get(name, BUILD_VERSION)
        current = stamp.is_file() and stamp.read_text().strip() == version
        if force or not current:
            if target.exists():
                shutil.rmtree(target)
            ARCHITECTURES[name](target)
            stamp.write_text(version + "\n")
            built.append(target)
    return built


def main(argv: list[str] | None = None) -> None:
    """``triton-diffusion-build-tiny [NAMES] [--weights-dir DIR] [--force]``."""
    parser = argparse.ArgumentParser(
        description="Build random-weight pipelines (the tiny defaults unless named)."
    )
    parser.add_argument("names", nargs="*", help=f"any of {list(ARCHITECTURES)}; default: {TINY_DEFAULTS}")
    parser.add_argument("--weights-dir", type=Path, default=DEFAULT_WEIGHTS_DIR)
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    unknown = set(args.names) - set(ARCHITECTURES)
    if unknown:
        parser.error(f"unknown architectures {sorted(unknown)}; choose from {list(ARCHITECTURES)}")
    for path in build_missing(args.weights_dir, args.force, args.names or None):
        print(f"built {path}")

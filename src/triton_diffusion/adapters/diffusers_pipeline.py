"""Loading a diffusers pipeline from the model config, and the per-row pieces every family shares."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from triton_diffusion.settings import ModelSettings

SEED_MODULUS = 2**63  # SEED is an INT64 output


def load_pipeline(settings: ModelSettings, loader: str = "DiffusionPipeline") -> Any:
    """``<loader>.from_pretrained`` the configured folder or hub id: safetensors only, and
    ``trust_remote_code`` only when the model config opts in. The ``pipeline_class`` parameter names
    another diffusers class to load with (e.g. StableDiffusionInstructPix2PixPipeline)."""
    import diffusers

    name = settings.get("pipeline_class", loader)
    pipeline_class = getattr(diffusers, name, None)
    if pipeline_class is None or not hasattr(pipeline_class, "from_pretrained"):
        raise ValueError(f"model {settings.name}: pipeline_class {name!r} is not a diffusers pipeline class")
    device = settings.device()
    pipe = pipeline_class.from_pretrained(
        settings.model_source(),
        torch_dtype=settings.torch_dtype(device),
        use_safetensors=True,
        trust_remote_code=settings.flag("trust_remote_code"),
    )
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_parameters(pipe: Any) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(pipe.__call__).parameters


def signature_default(pipe: Any, name: str) -> Any:
    parameter = call_parameters(pipe).get(name)
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return None
    return parameter.default


def row_seed(seed: int, image_index: int) -> int:
    """Image i of a request uses seed + i, so each image can be reproduced alone."""
    return (seed + image_index) % SEED_MODULUS


def row_generator(seed: int, image_index: int) -> torch.Generator:
    # A CPU generator gives the same noise on every device; diffusers moves the noise to the device.
    return torch.Generator(device="cpu").manual_seed(row_seed(seed, image_index))


def default_size(pipe: Any) -> int:
    """The pipeline's own default resolution (what it renders when height/width are not given)."""
    if getattr(pipe, "default_sample_size", None):
        return int(pipe.default_sample_size * pipe.vae_scale_factor)
    unet = getattr(pipe, "unet", None)
    if unet is not None:
        return int(unet.config.sample_size * pipe.vae_scale_factor)
    return 1024


def size_multiple(pipe: Any) -> int:
    """Height and width must be multiples of this: the VAE factor, times the latent patch size for
    transformer pipelines (Flux packs 2x2 latent patches and would silently round other sizes)."""
    factor = int(getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", 8))
    transformer = getattr(pipe, "transformer", None)
    if transformer is not None:
        patch = getattr(transformer.config, "patch_size", 1) or 1
        patch = int(patch[-1] if isinstance(patch, (list, tuple)) else patch)  # video: (t, h, w)
        factor *= patch if patch > 1 else 2
    return factor


class SchedulerChoices:
    """Schedulers a request may pick by class name; ``scheduler_choices`` in config lists them."""

    def __init__(self, pipe: Any, choices: str | None) -> None:
        import diffusers

        self.default = type(pipe.scheduler).__name__
        names = [n.strip() for n in (choices or self.default).split(",") if n.strip()]
        compatible = {c.__name__ for c in getattr(pipe.scheduler, "compatibles", [])} | {self.default}
        self._schedulers: dict[str, Any] = {}
        for name in names:
            if name not in compatible:
                raise ValueError(f"scheduler {name} is not compatible with {type(pipe).__name__}")
            scheduler_class = getattr(diffusers, name)
            self._schedulers[name] = (
                pipe.scheduler if name == self.default else scheduler_class.from_config(pipe.scheduler.config)
            )
        if self.default not in self._schedulers:
            self.default = names[0]

    @property
    def names(self) -> list[str]:
        return list(self._schedulers)

    def __getitem__(self, name: str) -> Any:
        return self._schedulers[name]

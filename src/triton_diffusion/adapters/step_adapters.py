"""Which step adapter serves a loaded pipeline (named in families.py's traits), if any."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from triton_diffusion.adapters.dit import DiTAdapter
from triton_diffusion.adapters.flow_matching import FluxAdapter, StableDiffusion3Adapter
from triton_diffusion.adapters.latent_loop import LatentStepAdapter
from triton_diffusion.adapters.qwen_image import QwenImageAdapter
from triton_diffusion.adapters.stable_diffusion import StableDiffusionAdapter
from triton_diffusion.adapters.wan import WanAdapter
from triton_diffusion.adapters.z_image import ZImageAdapter
from triton_diffusion.families import PipelineFacts

if TYPE_CHECKING:
    from triton_diffusion.adapters.diffusion_lm_adapter import DiffusionLMAdapter
    from triton_diffusion.engine.step_engine import StepAdapter

    # Both are the step engine's StepAdapter: checked here, as the models hand adapters on untyped.
    _LATENT: type[StepAdapter] = LatentStepAdapter
    _LM: type[StepAdapter] = DiffusionLMAdapter

STEP_ADAPTERS: dict[str, type[LatentStepAdapter]] = {
    "stable_diffusion": StableDiffusionAdapter,
    "flux": FluxAdapter,
    "sd3": StableDiffusion3Adapter,
    "dit": DiTAdapter,
    "qwen_image": QwenImageAdapter,
    "z_image": ZImageAdapter,
    "wan": WanAdapter,
}


def step_adapter_for(
    pipe: Any, facts: PipelineFacts, schedulers: Any, max_sequence_length: int | None
) -> LatentStepAdapter | None:
    """The family's step adapter, or None where there is none (the request-level engine serves it)."""
    name = facts.traits.step_adapter
    if name is None:
        return None
    try:
        return STEP_ADAPTERS[name](pipe, facts, schedulers, max_sequence_length)
    except NotImplementedError:
        return None  # a variant of the family the adapter does not cover (an LCM UNet, ...)

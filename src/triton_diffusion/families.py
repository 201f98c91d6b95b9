"""What is special about each diffusers pipeline family, declared once.

One :class:`PipelineTraits` record per diffusers pipeline class says what cannot be read from the loaded
pipeline (how its code treats a missing negative prompt, whether its latents are packed, which guidance
argument it really uses, which step adapter serves it). A class without an entry gets the conservative
default: a negative prompt's presence splits batches, no row compaction, the request-level engine.
The family tests serve or step each step-engine class (tests/unit/test_*_steps.py in process, the family
matrix in tests/integration/test_families.py through the server).

Everything that *can* be read from the pipeline (its scheduler and the compatible ones, the VAE scale
factor, the transformer's patch size, the ``__call__`` signature and its defaults) is derived in
:class:`PipelineFacts`, never declared. Adding a family is one entry here and a row in the family test.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict


@dataclass(frozen=True)
class PipelineTraits:
    # encode_prompt turns a missing negative prompt into "" (read in its source): rows with and without one
    # may share a call. Elsewhere presence is a structural switch: Flux/Qwen-Image switch true CFG on for
    # the whole call, SDXL zeroes the negative embeddings only for None.
    negative_prompt_none_is_empty: bool = False
    # The loop works on 2x2-packed latents [B, h*w/4, C*4] (Flux, Qwen-Image): sizes are multiples of
    # twice the VAE factor, and previews unpack through the pipeline's own ``_unpack_latents``.
    packed_latents: bool = False
    # ``guidance_scale`` is an input of a guidance-distilled transformer, not CFG: it does something only
    # when the transformer config has ``guidance_embeds`` (FLUX.1-dev yes, schnell and Qwen-Image no).
    guidance_embedded: bool = False
    # Schedulers with which a cancelled row can be dropped between steps through callback_on_step_end:
    # the loop reads back latents and both CFG halves of prompt_embeds, and the scheduler keeps no per-row
    # history (multistep solvers do). Elsewhere a cancelled row keeps computing (its answer still goes
    # out at once).
    compaction_schedulers: frozenset[str] = frozenset()
    # With num_inference_steps == 1 the loop keeps the scheduler's predicted original sample, not the
    # stepped one (PixArt-Alpha), so one step needs a scheduler that returns it.
    one_step_keeps_original: bool = False
    # The step adapter serving this class in the step engine (adapters/), or None: request-level only.
    step_adapter: str | None = None
    # The family's diffusers classes for each way a step-engine job can start, built over the loaded
    # modules with ``from_pipe`` (nothing is loaded twice): from text (``text_pipeline``), from a source
    # image (``image_pipeline``, img2img) or from a source image and a mask (``inpaint_pipeline``). The
    # adapter follows each class's own code for its jobs; a start without a class is refused by name.
    text_pipeline: str | None = None
    image_pipeline: str | None = None
    inpaint_pipeline: str | None = None


DEFAULT_TRAITS = PipelineTraits()


class _StepTraits(TypedDict, total=False):
    """The step-engine fields of PipelineTraits a family's classes share."""

    step_adapter: str
    text_pipeline: str
    image_pipeline: str
    inpaint_pipeline: str


_NONE_IS_EMPTY = PipelineTraits(negative_prompt_none_is_empty=True)
# The step-engine families: a text-to-image class and its img2img class share one record of starts, so
# text_to_image and image_to_image (which loads the img2img class) serve the same jobs.
_SD_STEP: _StepTraits = {
    "step_adapter": "stable_diffusion",
    "text_pipeline": "StableDiffusionPipeline",
    "image_pipeline": "StableDiffusionImg2ImgPipeline",
    "inpaint_pipeline": "StableDiffusionInpaintPipeline",  # the 4-channel masked blend (an ordinary UNet)
}
_SDXL_STEP: _StepTraits = {
    "step_adapter": "stable_diffusion",
    "text_pipeline": "StableDiffusionXLPipeline",
    "image_pipeline": "StableDiffusionXLImg2ImgPipeline",
    "inpaint_pipeline": "StableDiffusionXLInpaintPipeline",  # the 4-channel masked blend, as SD's
}
_SD3_STEP: _StepTraits = {
    "step_adapter": "sd3",
    "text_pipeline": "StableDiffusion3Pipeline",
    "image_pipeline": "StableDiffusion3Img2ImgPipeline",
    "inpaint_pipeline": "StableDiffusion3InpaintPipeline",  # the masked blend of a 16-channel transformer
}
_FLUX_STEP: _StepTraits = {
    "step_adapter": "flux",
    "text_pipeline": "FluxPipeline",
    "image_pipeline": "FluxImg2ImgPipeline",
    "inpaint_pipeline": "FluxInpaintPipeline",  # the masked blend, in the packed layout
}
_QWEN_STEP: _StepTraits = {
    "step_adapter": "qwen_image",
    "text_pipeline": "QwenImagePipeline",
    "image_pipeline": "QwenImageImg2ImgPipeline",
}

# One entry per diffusers class.
TRAITS: Mapping[str, PipelineTraits] = {
    "StableDiffusionPipeline": PipelineTraits(
        negative_prompt_none_is_empty=True,
        compaction_schedulers=frozenset({"DDIMScheduler", "EulerDiscreteScheduler"}),
        **_SD_STEP,
    ),
    "StableDiffusionImg2ImgPipeline": PipelineTraits(negative_prompt_none_is_empty=True, **_SD_STEP),
    # An inpainting checkpoint (9-channel UNet) is saved as this class; an ordinary one may be loaded as it.
    "StableDiffusionInpaintPipeline": PipelineTraits(negative_prompt_none_is_empty=True, **_SD_STEP),
    "StableDiffusionXLPipeline": PipelineTraits(**_SDXL_STEP),
    "StableDiffusionXLImg2ImgPipeline": PipelineTraits(**_SDXL_STEP),
    # An SDXL inpainting checkpoint (9-channel UNet) is saved as this class.
    "StableDiffusionXLInpaintPipeline": PipelineTraits(**_SDXL_STEP),
    "StableDiffusion3Pipeline": PipelineTraits(negative_prompt_none_is_empty=True, **_SD3_STEP),
    "StableDiffusion3Img2ImgPipeline": PipelineTraits(negative_prompt_none_is_empty=True, **_SD3_STEP),
    "StableDiffusion3InpaintPipeline": PipelineTraits(negative_prompt_none_is_empty=True, **_SD3_STEP),
    "FluxPipeline": PipelineTraits(packed_latents=True, guidance_embedded=True, **_FLUX_STEP),
    "FluxImg2ImgPipeline": PipelineTraits(packed_latents=True, guidance_embedded=True, **_FLUX_STEP),
    "FluxInpaintPipeline": PipelineTraits(packed_latents=True, guidance_embedded=True, **_FLUX_STEP),
    # A FLUX.1 Fill checkpoint: inpainting only, as its own pipeline runs it (the mask is a model input).
    "FluxFillPipeline": PipelineTraits(
        packed_latents=True,
        guidance_embedded=True,
        step_adapter="flux",
        text_pipeline="FluxPipeline",
        inpaint_pipeline="FluxFillPipeline",
    ),
    "QwenImagePipeline": PipelineTraits(packed_latents=True, guidance_embedded=True, **_QWEN_STEP),
    "QwenImageImg2ImgPipeline": PipelineTraits(packed_latents=True, guidance_embedded=True, **_QWEN_STEP),
    "SanaPipeline": PipelineTraits(
        negative_prompt_none_is_empty=True, step_adapter="dit", text_pipeline="SanaPipeline"
    ),
    "PixArtSigmaPipeline": PipelineTraits(
        negative_prompt_none_is_empty=True, step_adapter="dit", text_pipeline="PixArtSigmaPipeline"
    ),
    "PixArtAlphaPipeline": PipelineTraits(
        negative_prompt_none_is_empty=True,
        one_step_keeps_original=True,
        step_adapter="dit",
        text_pipeline="PixArtAlphaPipeline",
    ),
    "AuraFlowPipeline": _NONE_IS_EMPTY,
    "Lumina2Pipeline": _NONE_IS_EMPTY,
    "ZImagePipeline": PipelineTraits(
        negative_prompt_none_is_empty=True, step_adapter="z_image", text_pipeline="ZImagePipeline"
    ),
    "WanPipeline": PipelineTraits(
        negative_prompt_none_is_empty=True, step_adapter="wan", text_pipeline="WanPipeline"
    ),
}


def traits_of(pipe: Any) -> PipelineTraits:
    return TRAITS.get(type(pipe).__name__, DEFAULT_TRAITS)


@dataclass(frozen=True)
class PipelineFacts:
    """What a loaded pipeline says about itself, read once at load time."""

    class_name: str
    traits: PipelineTraits
    call_parameters: Mapping[str, inspect.Parameter]
    scheduler: str  # the pipeline's own scheduler class
    compatible_schedulers: frozenset[str]
    size_multiple: int
    default_size: int
    uses_guidance_scale: bool
    min_steps: int  # 2 where one step gives NaN (a flow schedule with a terminal shift: Qwen-Image)

    @classmethod
    def of(cls, pipe: Any) -> PipelineFacts:
        traits = traits_of(pipe)
        parameters = inspect.signature(pipe.__call__).parameters
        scheduler = type(pipe.scheduler).__name__
        compatible = {c.__name__ for c in getattr(pipe.scheduler, "compatibles", [])} | {scheduler}
        transformer = getattr(pipe, "transformer", None)
        uses_guidance = "guidance_scale" in parameters
        if traits.guidance_embedded and transformer is not None:
            uses_guidance = uses_guidance and bool(getattr(transformer.config, "guidance_embeds", False))
        return cls(
            class_name=type(pipe).__name__,
            traits=traits,
            call_parameters=parameters,
            scheduler=scheduler,
            compatible_schedulers=frozenset(compatible),
            size_multiple=_size_multiple(pipe, traits),
            default_size=_default_size(pipe),
            uses_guidance_scale=uses_guidance,
            min_steps=2 if pipe.scheduler.config.get("shift_terminal") else 1,
        )

    def accepts(self, argument: str) -> bool:
        return argument in self.call_parameters

    def default(self, argument: str) -> Any:
        parameter = self.call_parameters.get(argument)
        if parameter is None or parameter.default is inspect.Parameter.empty:
            return None
        return parameter.default


def _vae_scale_factor(pipe: Any) -> int:
    return int(getattr(pipe, "vae_scale_factor", 0) or getattr(pipe, "vae_scale_factor_spatial", 8))


def _size_multiple(pipe: Any, traits: PipelineTraits) -> int:
    """Height and width must be multiples of this, or the pipeline raises or silently rounds: the VAE
    factor times the latent patch (2 for packed latents, else the transformer's patch size)."""
    factor = _vae_scale_factor(pipe)
    if traits.packed_latents:
        return factor * 2
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        return factor
    config = transformer.config
    # Z-Image lists its patch sizes as all_patch_size (its pipeline requires twice the VAE factor).
    patch = getattr(config, "patch_size", None) or (getattr(config, "all_patch_size", None) or [1])[0]
    patch = patch[-1] if isinstance(patch, (list, tuple)) else patch  # video: (t, h, w)
    return factor * int(patch)


def _default_size(pipe: Any) -> int:
    """The pipeline's own default resolution (what it renders when height/width are not given)."""
    if getattr(pipe, "default_sample_size", None):
        return int(pipe.default_sample_size * _vae_scale_factor(pipe))
    unet = getattr(pipe, "unet", None)
    if unet is not None:
        return int(unet.config.sample_size * _vae_scale_factor(pipe))
    transformer = getattr(pipe, "transformer", None)
    sample_size = getattr(getattr(transformer, "config", None), "sample_size", None)
    if isinstance(sample_size, int):
        return sample_size * _vae_scale_factor(pipe)
    return 1024

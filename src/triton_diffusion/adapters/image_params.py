"""What one image job is: the request's values the step adapters need (:class:`ImageParams`, a job's
``spec.params``), and its state between two steps (:class:`LatentJob`, a job's ``state``): its latents, its
own scheduler and timesteps, its text conditioning, its inpainting source, its step cache and its grid."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import torch

from triton_diffusion.adapters.lora import NO_LORA, LoraSet
from triton_diffusion.adapters.step_caches import CacheState
from triton_diffusion.recovery.checkpoint_format import JobCheckpoint
from triton_diffusion.step_cache_spec import NO_CACHE, StepCache

if TYPE_CHECKING:
    from triton_diffusion.engine.jobs import Job


@dataclass(frozen=True)
class ImageParams:
    """What one image (or video) job needs of its request (a job's ``spec.params`` on the step engine),
    read from the validated request: not a request (one request of several images makes one per image)."""

    prompt: str
    negative_prompt: str | None
    seed: int
    image_index: int
    height: int
    width: int
    steps: int
    guidance_scale: float | None
    true_cfg_scale: float | None
    scheduler: str
    # An image-conditioned start: the source (a PIL image of this size), how much of it is re-noised, and
    # for inpainting the mask (white: repaint, black: keep).
    image: Any = None
    strength: float | None = None
    mask_image: Any = None
    lora: LoraSet = NO_LORA  # the row's LoRA adapters and scales (adapters/lora.py)
    # A video job's frame count (text_to_video); None for an image.
    num_frames: int | None = None
    step_cache: StepCache = NO_CACHE  # the request's step cache (adapters/step_caches.py)
    # The step cache a deadline may turn on for its steps left (engine/degradation.py): NO_CACHE, never.
    degrade_cache: StepCache = NO_CACHE
    # A checkpoint of this very job (adapters/job_checkpoints.py' JobCheckpoint) found when its request was
    # resent: the job starts as usual, then takes the checkpoint's state (starts.py). Not part of what
    # the job is (equality, hashing, logs).
    resume: JobCheckpoint | None = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> tuple[int, int]:
        return self.height, self.width

    @property
    def shape(self) -> tuple[int, ...]:
        """The job's shape group: rows share a forward only with rows of one latent shape, so a video's
        frame count is part of it."""
        return self.size if self.num_frames is None else (*self.size, self.num_frames)

    @property
    def start(self) -> str:
        """How the job starts: ``text``, ``image`` (img2img) or ``mask`` (inpainting)."""
        if self.image is None:
            return "text"
        return "image" if self.mask_image is None else "mask"

    @property
    def summary(self) -> str:
        """For the admission log line."""
        size = f"{self.width}x{self.height}"
        if self.num_frames is not None:
            size += f", {self.num_frames} frames"
        start = "" if self.image is None else f", from an image ({self.start}, strength {self.strength})"
        return f"{size}, {self.steps} steps, {self.scheduler}, guidance {self.guidance_scale}{start}"


@dataclass(eq=False)
class InpaintSource:
    """An inpainting job's source: with an ordinary denoiser what it blends back after each step
    (StableDiffusionInpaintPipeline's loop with a 4-channel UNet); with an inpainting checkpoint the extra
    input channels of its every forward (the mask and the masked source's latents), and no blend."""

    image_latents: torch.Tensor | None  # [1, ...] the encoded source (to blend back)
    noise: torch.Tensor  # [1, ...] the job's initial noise, reused to noise the source to each timestep
    mask: torch.Tensor | None  # [1, 1, h, w] latent-size mask: 1 where the model paints, 0 where it keeps
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # an inpainting checkpoint's

    @property
    def blended(self) -> bool:
        return not self.model_inputs


@dataclass(eq=False)
class LatentJob:
    """A job's state between two steps (``job.state``)."""

    latents: torch.Tensor  # [1, ...]
    scheduler: Any
    timesteps: torch.Tensor
    conditional: dict[str, torch.Tensor]  # the model's conditioning inputs for this row, each [1, ...]
    unconditional: dict[str, torch.Tensor] | None  # with (true) classifier-free guidance
    guidance: float  # the (true) CFG scale applied when ``unconditional`` is set
    step_kwargs: dict[str, Any]  # extra arguments of scheduler.step (generator, eta)
    extra: dict[str, Any]  # per-row model inputs that are not text conditioning (Flux's guidance)
    inpaint: InpaintSource | None = None  # an inpainting job's source, blended back after each step
    cache: CacheState | None = None  # its step cache's state (each CFG branch its own where they differ)
    # Its denoiser rows and token grid (a video: None), what a packed forward pads it to: kept here so the
    # scheduler's count of a forward's tokens (row_sizes.RowSizes.computed) reads it, not works it out.
    grid: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Conditioning:
    """What the text encoders gave one job: its conditional inputs and, with guidance, unconditional."""

    conditional: dict[str, torch.Tensor]
    unconditional: dict[str, torch.Tensor] | None


def row_conditioning(
    count: int, conditional: dict[str, torch.Tensor], unconditional: dict[str, torch.Tensor] | None
) -> list[Conditioning]:
    """Each of ``count`` requests' conditioning from one text-encoder call's batched outputs: row i of
    every tensor (and of the unconditional ones, with guidance)."""

    def row(tensors: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        return {name: values[i : i + 1] for name, values in tensors.items()}

    return [
        Conditioning(row(conditional, i), None if unconditional is None else row(unconditional, i))
        for i in range(count)
    ]


# The engine holds a job's params, state and checkpoint as ``object`` (it reads no adapter's types); what
# the step adapters put there is read back as the type they made (a cast: no check at run time, as before).
def image_params(job: Job) -> ImageParams:
    """An image job's params (TextToImageModel.step_request's)."""
    return cast(ImageParams, job.spec.params)


def latent_state(state: object) -> LatentJob:
    """An image job's state (``Job.state``, ``JobStart.state``: what starts.py made)."""
    return cast(LatentJob, state)


def as_run(job: Job) -> ImageParams:
    """A job's request as it runs: from the checkpoint the host found for it (``JobSpec.resume``), or,
    where the scheduler cut its steps (engine/degradation.py), with those steps, from its start (a
    checkpoint of its full schedule does not fit the shorter one)."""
    params = image_params(job)
    if job.queue.cut is not None:
        return replace(params, steps=job.queue.cut.steps, resume=None)
    resume = cast("JobCheckpoint | None", job.spec.resume)  # the host's lookup (recovery/resumes.py)
    return params if resume is None else replace(params, resume=resume)

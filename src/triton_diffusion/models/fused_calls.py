"""The request-level engine's one place the diffusers pipeline is called: one fused call per compatible
group, one generator per image, with progress, previews, cancellation and row compaction through the
pipeline's step callback."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from triton_diffusion.adapters import diffusers_compat as compat
from triton_diffusion.adapters.call_caches import call_cache
from triton_diffusion.adapters.lora import lora_set
from triton_diffusion.compatibility import CompatibilityKey
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.request_engine import CallAbandoned, CallSteps
from triton_diffusion.models.diffusion_model import RowInput
from triton_diffusion.step_cache_spec import NO_CACHE, parse_step_cache

if TYPE_CHECKING:
    from triton_diffusion.adapters.diffusers_pipeline import SchedulerChoices
    from triton_diffusion.adapters.lora import LoraBank
    from triton_diffusion.families import PipelineFacts

# A model kind's keyword arguments of its pipeline for one call: (the key's values, the rows) -> kwargs.
CallArguments = Callable[[dict[str, Any], list[RowInput]], dict[str, Any]]


def row_input(job: Job) -> RowInput:
    """A request-level job's params (DiffusionModel.job_spec's): the engine holds them as ``object`` (a
    cast: no check at run time, as before)."""
    return cast(RowInput, job.spec.params)


@dataclass(frozen=True)
class FusedCalls:
    """The request-level engine's PipelineCall for a loaded pipeline (a collaborator of TextToImageModel,
    made at load): ``arguments`` is the model kind's own part (its pipeline's keyword arguments), the rest
    (callbacks, scheduler, LoRA adapters, step cache, the output) is the same for every kind."""

    pipe: Any
    facts: PipelineFacts
    schedulers: SchedulerChoices
    arguments: CallArguments
    output_attribute: str  # where the pipeline's output keeps one result per row
    loras: LoraBank | None = None
    step_callback: bool = False  # the pipeline takes callback_on_step_end
    legacy_callback: bool = False  # ... or the older callback(step, t, latents)
    compacting_schedulers: frozenset[str] = frozenset()
    callback_tensors: tuple[str, ...] = ("latents",)

    def __call__(self, key: CompatibilityKey, jobs: list[Job], steps: CallSteps) -> list[object]:
        shared = key.as_dict()
        kwargs = self.arguments(shared, [row_input(job) for job in jobs])
        if self.step_callback:
            kwargs["callback_on_step_end"] = self._step_callback(steps, shared)
            kwargs["callback_on_step_end_tensor_inputs"] = list(self.callback_tensors)
        elif self.legacy_callback:
            kwargs["callback"] = self._legacy_callback(steps, shared)
            kwargs["callback_steps"] = 1
        self.pipe.scheduler = self.schedulers[shared["scheduler"]]
        adapters = lora_set(shared.get("lora"))  # part of the key: one adapter set per fused call
        # A cached request's call is its own (its key says so): diffusers' cache decides per call.
        cache = parse_step_cache(shared["step_cache"]) if shared.get("step_cache") else NO_CACHE
        with (
            torch.inference_mode(),
            self.loras.uniform(adapters) if self.loras else contextlib.nullcontext(),
            call_cache(self.pipe, cache) if cache else contextlib.nullcontext(),
        ):
            images = list(getattr(self.pipe(**kwargs), self.output_attribute))
        return steps.scatter(images)

    def _step_callback(
        self, steps: CallSteps, shared: dict[str, Any]
    ) -> Callable[[Any, int, Any, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        compacts = shared["scheduler"] in self.compacting_schedulers

        def callback(pipe: Any, i: int, t: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            latents = tensors["latents"]
            total = compat.steps_planned(pipe) or shared["num_inference_steps"]
            ended = steps.on_step(i + 1, total, lambda position: self._snapshot(latents, position, shared))
            if not ended:
                return {}
            if steps.all_ended(ended):
                raise CallAbandoned  # no remaining steps and no decode: nobody is waiting for them
            if not compacts:
                return {}
            dropped = set(ended)
            keep = [p for p in range(latents.shape[0]) if p not in dropped]
            changed = {"latents": latents[keep]}
            embeds = tensors.get("prompt_embeds")
            if embeds is not None:
                rows = latents.shape[0]
                # With CFG the loop holds [negative; positive] embeddings: drop the row in both halves.
                changed["prompt_embeds"] = embeds[
                    keep + [rows + p for p in keep] if embeds.shape[0] == 2 * rows else keep
                ]
            steps.compact(ended, after_step=i + 1)
            return changed

        return callback

    def _legacy_callback(
        self, steps: CallSteps, shared: dict[str, Any]
    ) -> Callable[[int, Any, torch.Tensor], None]:
        """Pipelines with the older ``callback(step, t, latents)`` API (PixArt): progress, previews and
        cancellation, but no row compaction (the callback cannot hand tensors back)."""
        total = shared["num_inference_steps"]

        def callback(step_index: int, t: Any, latents: torch.Tensor) -> None:
            snapshot = lambda position: self._snapshot(latents, position, shared)  # noqa: E731
            ended = steps.on_step(step_index + 1, total, snapshot)
            if ended and steps.all_ended(ended):
                raise CallAbandoned

        return callback

    def _snapshot(self, latents: torch.Tensor, position: int, shared: dict[str, Any]) -> torch.Tensor:
        """[C, h, w] of one row's latents for a preview, copied: the PNG is made on the response thread
        while the pipeline goes on."""
        latent = latents[position : position + 1]
        if self.facts.traits.packed_latents:  # Flux, Qwen-Image: 2x2 latent patches packed into channels
            latent = compat.unpack_latents(self.pipe, latent, shared["height"], shared["width"])
        if latent.ndim == 5:  # video latents, and Qwen-Image's unpacked (B, C, 1, h, w)
            latent = latent[:, :, latent.shape[2] // 2]
        return latent[0].clone()

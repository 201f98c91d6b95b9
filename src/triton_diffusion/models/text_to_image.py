"""Text-to-image: the fields it accepts and the one place the diffusers pipeline is called.

Works with any diffusers text-to-image pipeline that takes a list of prompts and a list of generators
(Stable Diffusion 1.x/2.x/XL, SD3, FLUX.1, PixArt, Sana, ...): optional arguments are passed only when
the pipeline's ``__call__`` has them, and fields it lacks are refused per request.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from triton_diffusion.adapters.diffusers_pipeline import (
    SchedulerChoices,
    load_pipeline,
    row_generator,
)
from triton_diffusion.adapters.latent_steps import ImageRequest
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.codecs.image import IMAGE_FORMATS, OUTPUT_ENCODINGS, encode_image
from triton_diffusion.compatibility import CompatibilityKey
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.request_engine import CallAbandoned, CallSteps
from triton_diffusion.families import PipelineFacts
from triton_diffusion.faults import FaultInjection
from triton_diffusion.fields import REQUIRED, Field, FieldSet, Role, seed_field
from triton_diffusion.serving.triton_model import (
    PROGRESS_FIELDS,
    PROGRESS_OUTPUTS,
    DiffusionModel,
    ParsedRequest,
    RowInput,
)
from triton_diffusion.settings import ModelSettings

# Defaults and limits here are fallbacks: config.pbtxt parameters override them (default_<field>,
# min_<field>, max_<field>, ...), and size/step/guidance defaults are read from the pipeline itself.
TEXT_TO_IMAGE_FIELDS = FieldSet(
    [
        Field("prompt", str, REQUIRED, Role.ROW, allow_empty=False, max_length=2000, doc="what to draw"),
        Field(
            "negative_prompt",
            str,
            None,
            Role.ROW,
            max_length=2000,
            # Strict by default: families.py relaxes it where the pipeline treats None as "".
            key_on_presence=True,
            doc="what to steer away from",
        ),
        seed_field("random seed of the first image; image i uses seed + i; drawn and returned when absent"),
        Field(
            "num_images_per_prompt",
            int,
            1,
            Role.ROW,
            minimum=1,
            maximum=4,
            doc="images for this prompt; each is one row of the fused call",
        ),
        Field("height", int, None, minimum=64, maximum=2048, doc="image height in pixels"),
        Field("width", int, None, minimum=64, maximum=2048, doc="image width in pixels"),
        Field("num_inference_steps", int, None, minimum=1, maximum=150, doc="denoising steps"),
        Field("guidance_scale", float, None, minimum=0.0, maximum=30.0, doc="classifier-free guidance"),
        Field(
            "true_cfg_scale",
            float,
            None,
            minimum=0.0,
            maximum=30.0,
            doc="true CFG (Flux, Qwen-Image); on when > 1 and a negative prompt is given",
        ),
        Field("scheduler", str, None, doc="scheduler class name, from scheduler_choices"),
        Field("output_format", str, "png", Role.AFTER_SPLIT, choices=IMAGE_FORMATS, doc="image file format"),
        Field(
            "output_encoding",
            str,
            "binary",
            Role.AFTER_SPLIT,
            choices=OUTPUT_ENCODINGS,
            doc="base64 keeps the image intact in HTTP generate's JSON",
        ),
        *PROGRESS_FIELDS,
    ]
)


class TextToImageModel(DiffusionModel):
    FIELDS = TEXT_TO_IMAGE_FIELDS
    PIPELINE_LOADER = "DiffusionPipeline"  # overridden by the pipeline_class config parameter
    REQUIRED_CALL_ARGS = ("prompt", "generator", "height", "width", "num_inference_steps")
    # Fields passed only when the pipeline's __call__ has them; refused per request otherwise.
    OPTIONAL_CALL_FIELDS = ("negative_prompt", "guidance_scale", "true_cfg_scale")
    OUTPUT_ATTRIBUTE = "images"  # where the pipeline's output keeps one result per row
    OUTPUTS = [
        ("IMAGE", "TYPE_STRING", [-1]),  # one encoded image per generated image
        ("SEED", "TYPE_INT64", [-1]),  # the seed of each image
        ("BATCH", "TYPE_STRING", [1]),  # JSON: the key and the fused calls this request went through
        *PROGRESS_OUTPUTS,
    ]

    def load(self, settings: ModelSettings) -> tuple[FieldSet, Any]:
        config = settings.config
        self.pipe = load_pipeline(settings, self.PIPELINE_LOADER)
        self.facts = facts = PipelineFacts.of(self.pipe)
        self.faults = FaultInjection.from_config(config.fault_injection)
        self.schedulers = SchedulerChoices(self.pipe, facts, config.scheduler_choices, settings.name)
        missing = [p for p in self.REQUIRED_CALL_ARGS if not facts.accepts(p)]
        if missing:
            raise ValueError(f"{facts.class_name} does not fit {type(self).__name__}: no {missing} arguments")
        self.call_extras: dict[str, Any] = {}
        if facts.accepts("max_sequence_length") and config.max_sequence_length:
            self.call_extras["max_sequence_length"] = config.max_sequence_length

        fields = self.FIELDS
        if facts.traits.negative_prompt_none_is_empty:
            fields = FieldSet(
                replace(f, key_on_presence=False) if f.name == "negative_prompt" else f for f in fields
            )
        self.has_step_callback = facts.accepts("callback_on_step_end")
        self.has_legacy_callback = facts.accepts("callback") and facts.accepts("callback_steps")
        unsupported = [name for name in self.OPTIONAL_CALL_FIELDS if not self.uses(name)]
        if not (self.has_step_callback or self.has_legacy_callback):
            unsupported += [f.name for f in PROGRESS_FIELDS]
        self.compacting_schedulers = facts.traits.compaction_schedulers
        self.callback_tensors = ["latents"] + (["prompt_embeds"] if self.compacting_schedulers else [])
        # The scheduler list is what SchedulerChoices accepted: always the pipeline's own first.
        derived = {"scheduler_choices": ",".join(self.schedulers.names)}
        fields = fields.configured(
            {**self.derived_defaults(), **settings.field_params, **derived}, unsupported
        )
        return fields, self.choose_step_adapter(settings)

    def choose_step_adapter(self, settings: ModelSettings) -> Any:
        """``engine``: auto (the step engine where the family has a step adapter), step (required) or
        request (one fused diffusers call per compatible group)."""
        engine = settings.config.engine
        if engine == "request":
            return None
        max_sequence_length = self.call_extras.get("max_sequence_length")
        adapter = step_adapter_for(self.pipe, self.facts, self.schedulers, max_sequence_length)
        if adapter is None and engine == "step":
            raise ValueError(
                f"model {settings.name}: engine step, but {self.facts.class_name} has no step adapter "
                "(families.py); use engine auto or request"
            )
        return adapter

    def uses(self, argument: str) -> bool:
        """Whether the pipeline does something with this optional argument (not just accepts it)."""
        if argument == "guidance_scale":
            return self.facts.uses_guidance_scale
        return self.facts.accepts(argument)

    def derived_defaults(self) -> dict[str, str]:
        """Defaults and limits read from the pipeline itself; config.pbtxt parameters override them."""
        size, multiple = self.facts.default_size, self.facts.size_multiple
        derived = {
            "default_height": str(size),
            "default_width": str(size),
            "height_multiple_of": str(multiple),
            "width_multiple_of": str(multiple),
            "default_num_inference_steps": str(self.facts.default("num_inference_steps") or 30),
            "min_num_inference_steps": str(self.facts.min_steps),
            "default_scheduler": self.schedulers.default,
        }
        for name in self.OPTIONAL_CALL_FIELDS:
            if self.FIELDS[name].type is float:
                default = self.facts.default(name)
                derived[f"default_{name}"] = str(float(default if default is not None else 1.0))
        return derived

    def images_for(self, values: dict[str, Any]) -> int:
        return values["num_images_per_prompt"]

    def step_request(self, values: dict[str, Any], image_index: int) -> ImageRequest:
        return ImageRequest(
            prompt=values["prompt"],
            negative_prompt=values.get("negative_prompt"),
            seed=values["seed"],
            image_index=image_index,
            height=values["height"],
            width=values["width"],
            steps=values["num_inference_steps"],
            guidance_scale=values.get("guidance_scale"),
            true_cfg_scale=values.get("true_cfg_scale"),
            scheduler=values["scheduler"],
        )

    def call_arguments(self, shared: dict[str, Any], rows: list[RowInput]) -> dict[str, Any]:
        """The pipeline's keyword arguments for one fused call: the key's values, one entry per row."""
        kwargs: dict[str, Any] = {
            "prompt": [r.values["prompt"] for r in rows],
            "height": shared["height"],
            "width": shared["width"],
            "num_inference_steps": shared["num_inference_steps"],
            "generator": [row_generator(r.values["seed"], r.image_index) for r in rows],
            "output_type": "pil",
            **self.call_extras,
        }
        for name in self.OPTIONAL_CALL_FIELDS:
            if name != "negative_prompt" and self.fields[name].supported:
                kwargs[name] = shared[name]
        negatives = [r.values["negative_prompt"] for r in rows]
        if any(n is not None for n in negatives):
            # The key keeps rows with and without a negative prompt apart unless None means "" anyway.
            kwargs["negative_prompt"] = [n or "" for n in negatives]
        return kwargs

    def run_call(self, key: CompatibilityKey, jobs: list[Job], steps: CallSteps) -> list[Any]:
        shared = key.as_dict()
        kwargs = self.call_arguments(shared, [job.params for job in jobs])
        if self.faults:
            self.faults.before_call(kwargs["prompt"])
        if self.has_step_callback:
            kwargs["callback_on_step_end"] = self._step_callback(steps, shared)
            kwargs["callback_on_step_end_tensor_inputs"] = self.callback_tensors
        elif self.has_legacy_callback:
            kwargs["callback"] = self._legacy_callback(steps, shared)
            kwargs["callback_steps"] = 1
        self.pipe.scheduler = self.schedulers[shared["scheduler"]]
        with torch.inference_mode():
            images = list(getattr(self.pipe(**kwargs), self.OUTPUT_ATTRIBUTE))
        return steps.scatter(images)

    def _step_callback(self, steps: CallSteps, shared: dict[str, Any]):
        compacts = shared["scheduler"] in self.compacting_schedulers

        def callback(pipe: Any, i: int, t: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if self.faults:
                self.faults.after_step()
            latents = tensors["latents"]
            total = getattr(pipe, "_num_timesteps", None) or shared["num_inference_steps"]
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

    def _legacy_callback(self, steps: CallSteps, shared: dict[str, Any]):
        """Pipelines with the older ``callback(step, t, latents)`` API (PixArt): progress, previews and
        cancellation, but no row compaction (the callback cannot hand tensors back)."""
        total = shared["num_inference_steps"]

        def callback(step_index: int, t: Any, latents: torch.Tensor) -> None:
            if self.faults:
                self.faults.after_step()
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
            latent = self.pipe._unpack_latents(
                latent, shared["height"], shared["width"], self.pipe.vae_scale_factor
            )
        if latent.ndim == 5:  # video latents, and Qwen-Image's unpacked (B, C, 1, h, w)
            latent = latent[:, :, latent.shape[2] // 2]
        return latent[0].clone()

    def respond(self, request: ParsedRequest, outputs: list[Any]) -> dict[str, np.ndarray]:
        values = request.values
        images = [encode_image(img, values["output_format"], values["output_encoding"]) for img in outputs]
        return {"IMAGE": np.array([images], dtype=object)}

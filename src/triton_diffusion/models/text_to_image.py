"""Text-to-image: the fields it accepts and the one place the diffusers pipeline is called.

Works with any diffusers text-to-image pipeline that takes a list of prompts and a list of generators
(Stable Diffusion 1.x/2.x/XL, SD3, FLUX.1, PixArt, Sana, ...): optional arguments are passed only when
the pipeline's ``__call__`` has them, and fields it lacks are refused per request.

Where the family's step adapter can start a job from an image (families.py), a request may also send a
source ``image`` (img2img), its ``strength`` and a ``mask_image`` (inpainting): the same model, the same
weights, and the same forwards as text-only requests of its size. The source is decoded and resized with
Pillow while the request is parsed, so the resolved size is known before the engine sees it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from PIL import Image

from triton_diffusion.adapters.captured_forwards import CaptureError
from triton_diffusion.adapters.diffusers_pipeline import (
    SchedulerChoices,
    load_pipeline,
    row_generator,
)
from triton_diffusion.adapters.latent_steps import ImageRequest
from triton_diffusion.adapters.lora import (
    LoraLimits,
    load_loras,
    lora_set,
    lora_text,
    parse_lora,
    parse_lora_paths,
)
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.codecs.image import IMAGE_FORMATS, OUTPUT_ENCODINGS, decode_image, encode_image
from triton_diffusion.compatibility import CompatibilityKey
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.request_engine import CallAbandoned, CallSteps
from triton_diffusion.engine.requests import TrackedRequest
from triton_diffusion.errors import RequestError, invalid_field
from triton_diffusion.families import PipelineFacts
from triton_diffusion.faults import FaultInjection
from triton_diffusion.fields import REQUIRED, SOURCE_IMAGE_FIELDS, Field, FieldSet, Role, seed_field
from triton_diffusion.serving.triton_model import (
    PROGRESS_FIELDS,
    PROGRESS_OUTPUTS,
    DiffusionModel,
    ParsedRequest,
    RowInput,
)
from triton_diffusion.settings import IMAGE, IMAGE_SOURCE, ModelSettings

log = logging.getLogger("triton_diffusion")

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
        Field(
            "lora",
            str,
            None,
            max_length=512,
            doc="LoRA adapters from the model's loras: name or name:scale, comma-separated (ink:0.8,neon)",
        ),
        *PROGRESS_FIELDS,
        *SOURCE_IMAGE_FIELDS,  # served where the step adapter can start a job from an image
    ]
)


def parse_buckets(text: str | None) -> list[tuple[int, int]]:
    """``resize_buckets``: "WIDTHxHEIGHT,WIDTHxHEIGHT,..." -> [(width, height), ...]."""
    buckets = []
    for item in (text or "").split(","):
        if item.strip():
            width, _, height = item.strip().lower().partition("x")
            buckets.append((int(width), int(height)))
    return buckets


class TextToImageModel(DiffusionModel):
    FIELDS = TEXT_TO_IMAGE_FIELDS
    CONFIG_KINDS = (IMAGE, IMAGE_SOURCE)
    PIPELINE_LOADER = "DiffusionPipeline"  # overridden by the pipeline_class config parameter
    # How jobs start on the request-level engine, which calls the loaded pipeline as it is: text-to-image
    # pipelines from text only (image-conditioned requests need the step engine's adapter).
    REQUEST_LEVEL_STARTS: tuple[str, ...] = ("text",)
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
        paths = parse_lora_paths(config.loras, settings.name)
        self.loras = load_loras(self.pipe, settings.model_dir, paths, settings.name)
        self.lora_limits = LoraLimits(tuple(paths), config.max_lora_scale, config.max_loras_per_request)
        adapter = self.choose_step_adapter(settings)
        if adapter is not None:
            adapter.loras = self.loras

        fields = self.FIELDS
        if facts.traits.negative_prompt_none_is_empty:
            fields = FieldSet(
                replace(f, key_on_presence=False) if f.name == "negative_prompt" else f for f in fields
            )
        self.has_step_callback = facts.accepts("callback_on_step_end")
        self.has_legacy_callback = facts.accepts("callback") and facts.accepts("callback_steps")
        unsupported = [name for name in self.OPTIONAL_CALL_FIELDS if not self.uses(name)]
        unsupported += self.load_sources(config, adapter)
        if self.loras is None:
            unsupported.append("lora")
        if not (self.has_step_callback or self.has_legacy_callback):
            unsupported += [f.name for f in PROGRESS_FIELDS]
        self.compacting_schedulers = facts.traits.compaction_schedulers
        # PixArt-Alpha keeps step(...)[1] after one step: the schedulers that have one (both engines).
        self.one_step_schedulers = (
            self.schedulers.with_original_sample() if facts.traits.one_step_keeps_original else None
        )
        self.callback_tensors = ["latents"] + (["prompt_embeds"] if self.compacting_schedulers else [])
        # The scheduler list is what SchedulerChoices accepted: always the pipeline's own first.
        derived = {"scheduler_choices": ",".join(self.schedulers.names)}
        fields = fields.configured(
            {**self.derived_defaults(), **settings.field_params, **derived}, unsupported
        )
        for width, height in self.buckets:
            fields["width"].validate(width)  # a bucket outside the limits is a config error
            fields["height"].validate(height)
        if config.cuda_graphs and adapter is None:
            log.warning("model %s: cuda_graphs ignored: it is for the step engine", settings.name)
        elif config.cuda_graphs:
            self.capture_forwards(settings, adapter, fields)
        return fields, adapter

    def capture_forwards(self, settings: ModelSettings, adapter: Any, fields: FieldSet) -> None:
        """``cuda_graphs``: the step adapter's forwards through CUDA graphs, captured now (a warm-up at load,
        not on a request) for each of ``cuda_graph_sizes``. A capture that fails fails the load: it can
        leave CUDA in a capture state no serving process should carry."""
        if self.loras is not None:  # each forward sets its rows' adapter scales, which a graph would not see
            raise ValueError(f"model {settings.name}: cuda_graphs cannot be used with loras")
        if adapter.uncapturable is not None:
            raise ValueError(f"model {settings.name}: cuda_graphs: {adapter.uncapturable}")
        warm = self.warm_up_requests(settings, fields)
        device = str(adapter.device)
        if not device.startswith("cuda"):  # the checks above hold on a CPU too: one config serves both
            log.warning("model %s: cuda_graphs ignored: the model runs on %s", settings.name, device)
            return
        # A forward of a size holds at most its cap's jobs, two model rows each with (true) CFG.
        caps = self.row_caps(settings)
        rows = [2 * caps.cap_for_size(r.height, r.width, r.num_frames)[0] for r in warm]
        started = time.perf_counter()
        try:
            captured = adapter.capture_forwards(list(zip(warm, rows, strict=True)))
        except CaptureError as exc:
            raise ValueError(f"model {settings.name}: cuda_graphs: {exc}") from exc
        log.info(
            "model %s: cuda_graphs on, %d graphs captured at load for %s in %.1f s",
            settings.name,
            captured,
            ", ".join(f"{r.width}x{r.height}" for r in warm),
            time.perf_counter() - started,
        )

    def warm_up_requests(self, settings: ModelSettings, fields: FieldSet) -> list[ImageRequest]:
        """One request of each of ``cuda_graph_sizes`` (default: the default size), validated as a client's:
        what ``cuda_graphs`` captures the forwards of at load."""
        try:
            sizes = parse_buckets(settings.config.cuda_graph_sizes) or [None]
        except ValueError:
            raise ValueError(
                f"model {settings.name}: cuda_graph_sizes must be WIDTHxHEIGHT,..., got "
                f"{settings.config.cuda_graph_sizes!r}"
            ) from None
        requests = []
        for size in sizes:
            raw: dict[str, Any] = {"prompt": "warm-up", "seed": 0}
            if size is not None:
                raw.update(width=size[0], height=size[1])
            try:
                requests.append(self.step_request(fields.parse(raw), 0))
            except RequestError as exc:  # a size outside the limits, or a model whose requests need a source
                raise ValueError(
                    f"model {settings.name}: cuda_graphs: a warm-up request was refused: {exc}"
                ) from None
        return requests

    def load_sources(self, config: Any, adapter: Any) -> list[str]:
        """Which image-conditioned starts this model serves (``text``, ``image``: img2img, ``mask``:
        inpainting): the step adapter's, else the request-level engine's; returns the source fields it
        cannot serve (refused by name when sent)."""
        self.buckets: list[tuple[int, int]] = []
        if "image" not in self.FIELDS:
            return []  # a kind without source images (text_to_video)
        self.starts = adapter.starts if adapter is not None else self.REQUEST_LEVEL_STARTS
        # Where no strength is sent or configured, each start takes its diffusers pipeline's default.
        self.default_strengths = {
            start: adapter.default_strength(start) for start in self.starts if adapter and start != "text"
        }
        self.max_pixels = config.max_image_pixels
        self.image_formats = tuple(f.strip().upper() for f in config.image_formats.split(",") if f.strip())
        self.buckets = parse_buckets(config.resize_buckets)
        # Starts this model kind's fields can send: text and img2img, inpainting where it has a mask field.
        sendable = {"text", "image"} | ({"mask"} if "mask_image" in self.FIELDS else set())
        if not sendable & set(self.starts) or (adapter is None and self.facts.accepts("mask_image")):
            raise ValueError(
                f"{self.facts.class_name} serves only {'/'.join(self.starts) or 'no'} jobs here, which "
                f"{type(self).__name__} cannot serve: an inpainting checkpoint (mask and masked source as "
                "UNet inputs, or an inpaint pipeline class) is served by text_to_image on the step engine"
            )
        unsupported = []
        if "image" not in self.starts and "mask" not in self.starts:
            unsupported += ["image", "strength"]
        if "mask" not in self.starts and "mask_image" in self.FIELDS:
            unsupported.append("mask_image")
        return [name for name in unsupported if name not in self.OPTIONAL_CALL_FIELDS]

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

    # ---- image-conditioned requests -----------------------------------------------------------------
    def parse(self, index: int, raw: dict[str, Any], tracked: TrackedRequest) -> ParsedRequest:
        if getattr(self, "starts", None) == ("mask",):  # an inpainting checkpoint: nothing else to serve
            for name in ("image", "mask_image"):
                if raw.get(name) is None:
                    raise invalid_field(
                        name,
                        "is required: this model inpaints (its denoiser takes the mask and the masked "
                        "source as inputs: an SD/SDXL inpainting UNet, SD3's 33-channel transformer, "
                        "FLUX.1 Fill), so every request sends image and mask_image",
                    )
        optional = "image" in self.fields and self.fields["image"].default is not REQUIRED
        if optional and raw.get("image") is None:
            for name in ("strength", "mask_image"):
                if raw.get(name) is not None and name in self.fields and self.fields[name].supported:
                    raise invalid_field(name, "applies only to a request with a source image: send image too")
        return super().parse(index, raw, tracked)

    def resolve(self, values: dict[str, Any]) -> dict[str, Any]:
        """Decode the source image (and mask), fill in the strength of its start and check it, and fix
        the output size: both images are resized to it here, so the engine sees one size per job. The
        ``lora`` field becomes its canonical text (part of the compatibility key). A one-step request to a
        pipeline that keeps the predicted original sample (PixArt-Alpha) needs a scheduler that has one."""
        if values.get("lora") is not None:
            values = {**values, "lora": lora_text(parse_lora(values["lora"], self.lora_limits)) or None}
        one_step = getattr(self, "one_step_schedulers", None)
        if (
            one_step is not None
            and values["num_inference_steps"] == 1
            and values["scheduler"] not in one_step
        ):
            allowed = ", ".join(sorted(one_step)) or "none of this model's scheduler_choices"
            raise invalid_field(
                "scheduler",
                f"{values['scheduler']} returns no predicted original sample, which this pipeline keeps "
                f"after a single step: with num_inference_steps 1 send one of {allowed}, or 2 or more steps",
            )
        if values.get("image") is None:
            return values
        image = self.decode_source(values["image"], "image")
        mask = (
            None
            if values.get("mask_image") is None
            else self.decode_source(values["mask_image"], "mask_image")
        )
        values = dict(values)
        if values.get("strength") is None:
            values["strength"] = self.default_strengths.get("image" if mask is None else "mask")
        self.check_strength(values)
        width, height = self.output_size(image, values["width"], values["height"])
        values.update(
            image=image.resize((width, height), Image.Resampling.LANCZOS), width=width, height=height
        )
        if mask is not None:
            values["mask_image"] = mask.resize((width, height), Image.Resampling.LANCZOS)
        return values

    def decode_source(self, data: bytes, field: str) -> Image.Image:
        limit = self.fields[field].max_length or 0
        return decode_image(data, field, limit, self.max_pixels, self.image_formats)

    def check_strength(self, values: dict[str, Any]) -> None:
        """img2img runs int(num_inference_steps * strength) steps (SD, SDXL; flow-matching pipelines round
        more generously): zero steps would fail inside the pipeline, so refuse it here, naming both."""
        strength, steps = values.get("strength"), values["num_inference_steps"]
        if strength is None or not self.fields["strength"].supported:
            return
        if int(steps * strength) < 1:
            raise invalid_field(
                "strength",
                f"{strength} with num_inference_steps {steps} runs no denoising step "
                f"(allowed: {1 / steps:.4g}..1 for {steps} steps, i.e. strength x steps >= 1)",
            )

    def output_size(self, image: Image.Image, width: int | None, height: int | None) -> tuple[int, int]:
        """Requested size (text_to_image: its default size too), else the nearest bucket by aspect
        ratio, else the source size fitted into the limits and rounded down to the size multiple."""
        if width and height:
            return width, height
        source_w, source_h = image.size
        if width or height:  # one side given: keep the source's aspect ratio
            scale = (width / source_w) if width else (height / source_h)
            return self._fit(source_w * scale, source_h * scale)
        if self.buckets:
            aspect = math.log(source_w / source_h)
            return min(self.buckets, key=lambda b: abs(math.log(b[0] / b[1]) - aspect))
        return self._fit(source_w, source_h)

    def _fit(self, width: float, height: float) -> tuple[int, int]:
        w_field, h_field = self.fields["width"], self.fields["height"]
        scale = min(1.0, w_field.maximum / width, h_field.maximum / height)
        scale = max(scale, w_field.minimum / width, h_field.minimum / height)
        sizes = []
        for value, field in ((width * scale, w_field), (height * scale, h_field)):
            multiple = field.multiple_of or 1
            size = max(int(field.minimum), int(value) // multiple * multiple)
            if size > field.maximum:
                raise invalid_field("image", f"cannot be fitted into the allowed size ({field.allowed()})")
            sizes.append(size)
        return sizes[0], sizes[1]

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
            image=values.get("image"),
            strength=values.get("strength") if values.get("image") is not None else None,
            mask_image=values.get("mask_image"),
            lora=lora_set(values.get("lora")),
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
        adapters = lora_set(shared.get("lora"))  # part of the key: one adapter set per fused call
        with torch.inference_mode(), self.loras.uniform(adapters) if self.loras else contextlib.nullcontext():
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

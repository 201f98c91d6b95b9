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

import logging
import time
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np

from triton_diffusion.adapters.call_caches import call_methods
from triton_diffusion.adapters.captured_forwards import CaptureError
from triton_diffusion.adapters.device_profiles import apply_profile
from triton_diffusion.adapters.diffusers_pipeline import SchedulerChoices, load_pipeline, row_generator
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.latent_loop import LatentStepAdapter
from triton_diffusion.adapters.lora import NO_LORA, LoraLimits, load_loras, lora_set, lora_text, parse_lora
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.codecs.image import encode_image
from triton_diffusion.compatibility import CompatibilityKey
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.request_engine import CallSteps
from triton_diffusion.errors import RequestError, invalid_field
from triton_diffusion.families import PipelineFacts
from triton_diffusion.fields import FieldSet
from triton_diffusion.models.diffusion_model import DiffusionModel, ParsedRequest, RowInput
from triton_diffusion.models.fused_calls import FusedCalls
from triton_diffusion.models.image_fields import TEXT_TO_IMAGE_FIELDS
from triton_diffusion.models.interfaces import TEXT_TO_IMAGE_OUTPUTS
from triton_diffusion.models.source_images import SourceImages
from triton_diffusion.serving.progress import PROGRESS_FIELDS
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.settings import IMAGE, IMAGE_SOURCE, ModelSettings
from triton_diffusion.step_cache_spec import NO_CACHE, StepCache, parse_step_cache

log = logging.getLogger("triton_diffusion")


class TextToImageModel(DiffusionModel):
    KIND = "text_to_image"
    FIELDS = TEXT_TO_IMAGE_FIELDS
    CONFIG_KINDS: ClassVar[tuple[str, ...]] = (IMAGE, IMAGE_SOURCE)
    PIPELINE_LOADER = "DiffusionPipeline"  # overridden by the pipeline_class config parameter
    # How jobs start on the request-level engine, which calls the loaded pipeline as it is: text-to-image
    # pipelines from text only (image-conditioned requests need the step engine's adapter).
    REQUEST_LEVEL_STARTS: tuple[str, ...] = ("text",)
    REQUIRED_CALL_ARGS: tuple[str, ...] = ("prompt", "generator", "height", "width", "num_inference_steps")
    # Fields passed only when the pipeline's __call__ has them; refused per request otherwise.
    OPTIONAL_CALL_FIELDS: tuple[str, ...] = ("negative_prompt", "guidance_scale", "true_cfg_scale")
    OUTPUT_ATTRIBUTE = "images"  # where the pipeline's output keeps one result per row
    # Set at load (here: what a model serves before it is loaded).
    step_cache_default = NO_CACHE  # config step_cache: for requests that send none
    one_step_schedulers: frozenset[str] | None = None  # PixArt-Alpha: schedulers that keep x0 at one step
    sources = SourceImages()  # what it does with a source image and mask (set at load)
    OUTPUTS = TEXT_TO_IMAGE_OUTPUTS

    def load(self, settings: ModelSettings) -> tuple[FieldSet, LatentStepAdapter | None]:
        config = settings.config
        self.pipe = load_pipeline(settings, self.PIPELINE_LOADER)
        if config.device_profile:  # before anything times a forward (the calibration, the adapter's)
            apply_profile(self.pipe, config.device_profile)
        self.facts = facts = PipelineFacts.of(self.pipe)
        self.schedulers = SchedulerChoices(self.pipe, facts, config.scheduler_choices, settings.name)
        missing = [p for p in self.REQUIRED_CALL_ARGS if not facts.accepts(p)]
        if missing:
            raise ValueError(f"{facts.class_name} does not fit {type(self).__name__}: no {missing} arguments")
        self.call_extras: dict[str, Any] = {}
        if facts.accepts("max_sequence_length") and config.max_sequence_length:
            self.call_extras["max_sequence_length"] = config.max_sequence_length
        paths = config.loras or {}
        self.loras = load_loras(self.pipe, settings.model_dir, paths, settings.name)
        self.lora_limits = LoraLimits(tuple(paths), config.max_lora_scale, config.max_loras_per_request)
        adapter = self.choose_step_adapter(settings)
        if adapter is not None:
            adapter.loras = self.loras
            if not config.pack_sizes:
                adapter.sizes.stop_packing("config pack_sizes is false")
        # Step caches (adapters/step_caches.py): the methods this model's denoiser serves per request.
        self.step_cache_methods = self.cache_methods(adapter)
        self.step_cache_default = config.step_cache or NO_CACHE
        served = ", ".join(self.step_cache_methods) or "none"
        for tier, text in (config.degrade_step_cache or {}).items():
            if parse_step_cache(text).method not in self.step_cache_methods:
                raise ValueError(
                    f"model {settings.name}: config parameter 'degrade_step_cache': tier {tier}: {text} is "
                    f"not served by {facts.class_name} (served: {served})"
                )
        if self.step_cache_default and self.step_cache_default.method not in self.step_cache_methods:
            raise ValueError(
                f"model {settings.name}: config parameter 'step_cache': {self.step_cache_default.method} is "
                f"not served by {facts.class_name} (served: {', '.join(self.step_cache_methods) or 'none'})"
            )

        fields = self.FIELDS
        if facts.traits.negative_prompt_none_is_empty:
            fields = FieldSet(
                replace(f, key_on_presence=False) if f.name == "negative_prompt" else f for f in fields
            )
        step_callback = facts.accepts("callback_on_step_end")
        legacy_callback = facts.accepts("callback") and facts.accepts("callback_steps")
        unsupported = [name for name in self.OPTIONAL_CALL_FIELDS if not self.uses(name)]
        self.sources = SourceImages.at_load(
            type(self).__name__,
            self.FIELDS,
            config,
            adapter.starter if adapter is not None else None,
            facts,
            self.REQUEST_LEVEL_STARTS,
            self.OPTIONAL_CALL_FIELDS,
        )
        unsupported += self.sources.unsupported
        if self.loras is None:
            unsupported.append("lora")
        if not (step_callback or legacy_callback):
            unsupported += [f.name for f in PROGRESS_FIELDS]
        # PixArt-Alpha keeps step(...)[1] after one step: the schedulers that have one (both engines).
        self.one_step_schedulers = (
            self.schedulers.with_original_sample() if facts.traits.one_step_keeps_original else None
        )
        compacting = facts.traits.compaction_schedulers
        self.calls = FusedCalls(
            self.pipe,
            facts,
            self.schedulers,
            self.call_arguments,
            self.OUTPUT_ATTRIBUTE,
            self.loras,
            step_callback,
            legacy_callback,
            compacting,
            ("latents", "prompt_embeds") if compacting else ("latents",),
        )
        # The scheduler list is what SchedulerChoices accepted: always the pipeline's own first.
        derived = {"scheduler_choices": ",".join(self.schedulers.names)}
        fields = fields.configured(
            {**self.derived_defaults(), **settings.field_params, **derived}, unsupported
        )
        for width, height in self.sources.buckets:
            fields["width"].validate(width)  # a bucket outside the limits is a config error
            fields["height"].validate(height)
        if config.cuda_graphs and adapter is None:
            log.warning("model %s: cuda_graphs ignored: it is for the step engine", settings.name)
        elif config.cuda_graphs and adapter is not None:
            self.capture_forwards(settings, adapter, fields)
        return fields, adapter

    def capture_forwards(self, settings: ModelSettings, adapter: LatentStepAdapter, fields: FieldSet) -> None:
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

    def warm_up_requests(self, settings: ModelSettings, fields: FieldSet) -> list[ImageParams]:
        """One request of each of ``cuda_graph_sizes`` (default: the default size), validated as a client's:
        what ``cuda_graphs`` captures the forwards of at load."""
        sizes = settings.config.cuda_graph_sizes or (None,)
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

    def choose_step_adapter(self, settings: ModelSettings) -> LatentStepAdapter | None:
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

    def cache_methods(self, adapter: LatentStepAdapter | None) -> tuple[str, ...]:
        """The step caches requests may ask for: the step adapter's per-row ones, else diffusers' own on a
        request-level call (step_caches.py)."""
        if adapter is not None:
            return adapter.cache_methods
        return call_methods(self.pipe.transformer) if "transformer" in self.pipe.components else ()

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

    # ---- requests -----------------------------------------------------------------------------------
    def parse(self, index: int, raw: dict[str, Any], tracked: TrackedRequest) -> ParsedRequest:
        self.sources.check_fields(raw, self.fields)
        return super().parse(index, raw, tracked)

    def resolve(self, values: dict[str, Any]) -> dict[str, Any]:
        """What a request needs before planning (its values here are part of the compatibility key): the
        ``lora`` and ``step_cache`` fields in their canonical text, a one-step scheduler that keeps the
        predicted original sample where the pipeline needs one (PixArt-Alpha), and the source image."""
        values = dict(values)
        if values.get("lora") is not None:
            values["lora"] = lora_text(parse_lora(values["lora"], self.lora_limits)) or None
        cache, sent = self.step_cache_default, values.get("step_cache") is not None  # else the default
        if values.get("step_cache") is not None:
            cache = parse_step_cache(values["step_cache"])
        if cache and cache.method not in self.step_cache_methods:
            allowed = ", ".join(self.step_cache_methods) or "none (this family has no step cache here)"
            raise invalid_field(
                "step_cache", f"{cache.method} is not served by this model (allowed: {allowed})"
            )
        values["step_cache"] = cache.text if cache else None
        if values.get("degrade_step_cache") is not None:
            values["degrade_step_cache"] = self.degrade_cache_text(values["degrade_step_cache"], cache, sent)
        one_step = self.one_step_schedulers
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
        return self.sources.resolve(values, self.fields)

    def degrade_cache_text(self, text: str, cache: StepCache, sent: bool = True) -> str:
        """A request's ``degrade_step_cache`` in its canonical text (``none``: never, whatever its tier
        allows). Raises INVALID_ARG naming the field where the model's denoiser does not serve it, or where
        the request runs a step cache already (a job runs one; ``sent``: its own, else the model's
        default)."""
        spec = parse_step_cache(text, field="degrade_step_cache")
        if not spec:
            return "none"
        if spec.method not in self.step_cache_methods:
            allowed = ", ".join(self.step_cache_methods) or "none (this family has no step cache here)"
            raise invalid_field(
                "degrade_step_cache", f"{spec.method} is not served by this model (allowed: {allowed})"
            )
        if cache and sent:
            raise invalid_field(
                "degrade_step_cache",
                f"the request runs step_cache {cache.text} already (a job runs one step cache): send one of "
                "the two",
            )
        if cache:
            raise invalid_field(
                "degrade_step_cache",
                f"this model runs step_cache {cache.text} by default (config step_cache; a job runs one step "
                "cache): send step_cache none with it",
            )
        return spec.text

    def degrade_cache(self, values: dict[str, Any], deadline: float | None, tier: int) -> str | None:
        """The step cache a request's images may be given for their steps left where their deadline needs
        it (engine/degradation.py): its ``degrade_step_cache``, else its tier's in config. None where nothing
        would give it (the request-level engine, no deadline, ``deadline_policy: best_effort``: so such a
        job keeps packing with other sizes), on a model without the field (video), for a request with a
        step cache of its own, or one that sent ``none``."""
        config = self.settings.config
        if self.adapter is None or deadline is None or config.deadline_policy != "refuse":
            return None
        if "degrade_step_cache" not in self.fields or values.get("step_cache"):
            return None
        sent = values.get("degrade_step_cache")
        if sent is None:
            sent = (config.degrade_step_cache or {}).get(config.service_tiers[tier])
        return sent if sent and sent != "none" else None

    def takes_steps(self, values: dict[str, Any], steps: int) -> bool:
        """What resolve (one step) and the source image's check (img2img runs int(steps x strength) steps)
        would accept for ``steps``."""
        one_step = self.one_step_schedulers
        if steps == 1 and one_step is not None and values["scheduler"] not in one_step:
            return False
        strength = values.get("strength")
        return values.get("image") is None or strength is None or int(steps * strength) >= 1

    def step_request(self, values: dict[str, Any], image_index: int) -> ImageParams:
        return ImageParams(
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
            lora=lora_set(values["lora"]) if values.get("lora") else NO_LORA,
            step_cache=parse_step_cache(values["step_cache"]) if values.get("step_cache") else NO_CACHE,
            # Set by job_spec to what the request and its tier allow (degrade_cache): absent, never.
            degrade_cache=parse_step_cache(values["degrade_cache"])
            if values.get("degrade_cache")
            else NO_CACHE,
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
        return self.calls(key, jobs, steps)

    def respond(self, request: ParsedRequest, outputs: list[Any]) -> dict[str, np.ndarray]:
        values = request.values
        images = [encode_image(img, values["output_format"], values["output_encoding"]) for img in outputs]
        return {"IMAGE": np.array([images], dtype=object)}

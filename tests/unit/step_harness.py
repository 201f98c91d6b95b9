"""What the step adapters' exactness tests share: a tiny pipeline loaded for a family, requests run
through a step engine with their arrival steps (and a neighbour cancelled half-way), and the diffusers
pipeline's own image for a request to compare with."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting, DiffusionPipeline

from tests.unit.recording import RecordingChannel, deliver_errors, step_as_worker
from triton_diffusion.adapters.diffusers_pipeline import SchedulerChoices, row_generator
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.config_values import parse_names
from triton_diffusion.engine.jobs import Job, StepReport
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.families import PipelineFacts
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.serving.server_process import WEIGHTS
from triton_diffusion.tiny_models import build_missing


def load_family(
    name: str, scheduler_choices: str | None = None, scheduler: Callable[[], Any] | None = None
) -> tuple[Any, PipelineFacts, SchedulerChoices]:
    """The tiny model's pipeline (built if missing), its facts and its scheduler choices; ``scheduler``
    makes the pipeline's own scheduler in place of the one it was built with."""
    build_missing(WEIGHTS, only=[name])
    pipe = DiffusionPipeline.from_pretrained(WEIGHTS / name, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    if scheduler is not None:
        pipe.scheduler = scheduler()
    facts = PipelineFacts.of(pipe)
    return pipe, facts, SchedulerChoices(pipe, facts, parse_names(scheduler_choices or ""), name)


class Host:
    """Renders the engine's reports as the engine host does, minimally: each finished job's output under
    ``output`` (``image``, or a video's ``frames``), and what each forward and preview was."""

    def __init__(self, output: str = "image") -> None:
        self.output = output
        self.forwards: list[int] = []  # the jobs (images or videos) of each forward
        self.model_rows: list[int] = []  # the model rows of each forward (two for a guided job)
        self.previews: list[Any] = []

    def render(self, report: StepReport) -> None:
        for finished in report.finished:
            finished.job.request.finish({self.output: finished.output})
        deliver_errors(report)
        self.forwards.extend(forward.images for forward in report.forwards)
        self.model_rows.extend(forward.rows for forward in report.forwards)
        self.previews.extend(s.snapshot for s in report.stepped if s.snapshot is not None)


def run_engine(
    adapter: Any,
    arrivals: list[tuple[int, ImageParams]],
    host: Host | None = None,
    victim: ImageParams | None = None,
    first_preview_every: int = 0,
) -> list[Job]:
    """The requests through one step engine, each added at its engine step; their jobs, in order.

    With a ``victim``: one more request, added at step 0 after the others of step 0, is cancelled after
    its second step (checked here), so the others run on around a cancellation. ``first_preview_every``:
    the first request's preview interval (0: none)."""
    engine, host = StepEngine(adapter, EngineLimits(8, 8)), host or Host()
    jobs = [job_of(adapter, str(i), RecordingChannel(), request) for i, (_, request) in enumerate(arrivals)]
    jobs[0].spec = replace(jobs[0].spec, preview_every=first_preview_every)
    pending = list(zip([at for at, _ in arrivals], jobs, strict=True))
    cancel = {"now": False}
    if victim is not None:
        channel = RecordingChannel(cancelled=lambda: cancel["now"])
        pending.append((0, job_of(adapter, "victim", channel, victim)))
    cancelled = pending[-1][1] if victim is not None else None
    pending.sort(key=lambda pair: pair[0])
    step = 0
    while pending or engine.active:
        while pending and pending[0][0] <= step:
            engine.add(pending.pop(0)[1])
        host.render(step_as_worker(engine))
        step += 1
        if cancelled is not None:
            cancel["now"] = cancelled.run.steps_done >= 2
    if cancelled is not None:
        assert cancelled.request.channel.finals[0].code.value == "CANCELLED" and cancelled.run.steps_done == 2
    return jobs


def job_of(adapter: Any, request_id: str, channel: RecordingChannel, request: ImageParams) -> Job:
    """A job as the model kind makes it (models/diffusion_model.py job_spec): its shape and its tokens."""
    job = Job(TrackedRequest(request_id, channel), request, shape=request.shape)
    job.spec = replace(job.spec, tokens=adapter.tokens_of(request))
    return job


def served(job: Job) -> np.ndarray:
    """The job's image as ints."""
    (final,) = job.request.channel.finals
    return np.asarray(final["image"], dtype=int)


# Keyed by the pipeline itself, weakly: a key of id(pipe) outlives a collected pipeline, and a later pipeline
# given the same id got the old one's counterpart (other weights), an order-dependent failure.
_COUNTERPARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pipeline_for(pipe: Any, request: ImageParams) -> Any:
    """The diffusers pipeline that serves this request alone: text-to-image, or its img2img / inpaint
    counterpart over the same modules (``from_pipe``)."""
    if request.image is None:
        return pipe
    if request.mask_image is not None and "mask_image" in inspect.signature(pipe.__call__).parameters:
        return pipe  # an inpainting checkpoint's own class (FluxFillPipeline has no AutoPipeline entry)
    auto = AutoPipelineForInpainting if request.mask_image is not None else AutoPipelineForImage2Image
    counterparts = _COUNTERPARTS.setdefault(pipe, {})
    if auto not in counterparts:
        counterparts[auto] = auto.from_pipe(pipe)  # float32 here: from_pipe's cast changes nothing
        counterparts[auto].set_progress_bar_config(disable=True)
    return counterparts[auto]


def call_arguments(request: ImageParams) -> dict[str, Any]:
    """The arguments of ``pipeline(...)`` every request has: prompt, size, steps and the row's generator."""
    return {
        "prompt": [request.prompt],
        "height": request.height,
        "width": request.width,
        "num_inference_steps": request.steps,
        "generator": [row_generator(request.seed, request.image_index)],
    }


def reference(
    pipe: Any, facts: PipelineFacts, schedulers: SchedulerChoices, request: ImageParams, **more: Any
) -> Any:
    """The image the request's own diffusers pipeline makes for it alone, with its scheduler (``more``:
    further arguments of the call, such as ``callback_on_step_end``)."""
    pipe = pipeline_for(pipe, request)
    pipe.scheduler = schedulers[request.scheduler]
    kwargs = {**call_arguments(request), **more}
    if request.image is not None:
        kwargs.update(image=request.image, strength=request.strength)
        if request.mask_image is not None:
            kwargs["mask_image"] = request.mask_image
        for name in ("height", "width"):  # SD/SDXL img2img take the size from the image
            if name not in inspect.signature(pipe.__call__).parameters:
                del kwargs[name]
    if request.negative_prompt is not None:
        kwargs["negative_prompt"] = [request.negative_prompt]
    if facts.uses_guidance_scale:
        kwargs["guidance_scale"] = request.guidance_scale
    if facts.accepts("true_cfg_scale"):
        kwargs["true_cfg_scale"] = request.true_cfg_scale
    if type(pipe).__name__ == "StableDiffusion3InpaintPipeline":
        return sd3_inpaint_with_shift(pipe, kwargs)
    return pipe(**kwargs).images[0]


def sd3_inpaint_with_shift(pipe: Any, kwargs: dict[str, Any]) -> Any:
    """StableDiffusion3InpaintPipeline's image with its decode fixed: it divides by the VAE's scaling
    factor but forgets to add its shift factor (diffusers issue #13611, PR #14671), unlike every other SD3
    pipeline and its own encode. The step engine decodes as the others do; everything else is the
    pipeline's own."""
    latents = pipe(**kwargs, output_type="latent").images
    vae = pipe.vae
    image = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
    return pipe.image_processor.postprocess(image.detach(), output_type="pil")[0]


def assert_each_image_equals_the_pipelines_own(
    family: tuple[Any, PipelineFacts, SchedulerChoices], requests: list[ImageParams], jobs: list[Job]
) -> None:
    """Each job's image has its request's size and equals ``pipeline(...)`` alone to one uint8 level."""
    pipe, facts, schedulers = family
    for request, job in zip(requests, jobs, strict=True):
        image = served(job)
        expected = np.asarray(reference(pipe, facts, schedulers, request), dtype=int)
        assert image.shape == (request.height, request.width, 3)
        assert np.abs(image - expected).max() <= 1, (facts.class_name, request)

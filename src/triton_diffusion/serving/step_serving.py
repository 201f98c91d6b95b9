"""Image models on the step engine: each image of a request is one job; the engine's thread denoises,
this module answers.

``execute()`` validates a request (as for the request-level engine) and hands its jobs to the engine's
worker; ``submit`` blocks while the running set and the waiting room are full, at most
``max_admission_wait_s``, then answers UNAVAILABLE (Triton 2.51's own queue policy stalls these models,
so the bound is kept here). On the engine's thread this listener records what happens and hands the
slow parts (PNG encoding of previews and images, sending) to a response worker, in order, so the next
denoising step is not delayed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from triton_diffusion.adapters.latent_steps import ImageRequest
from triton_diffusion.codecs.preview import preview_png
from triton_diffusion.engine.planner import RowCaps
from triton_diffusion.engine.policies import make_policy
from triton_diffusion.engine.requests import TrackedRequest
from triton_diffusion.engine.step_engine import EngineLimits, EngineWorker, Job, StepEngine
from triton_diffusion.errors import RequestError
from triton_diffusion.faults import FaultInjection, FaultyStepAdapter
from triton_diffusion.serving.responses import ResponseWorker
from triton_diffusion.settings import ModelSettings

log = logging.getLogger("triton_diffusion")


@dataclass(eq=False)
class RequestJobs:
    """What the jobs of one request share (each job's ``context``)."""

    parsed: Any  # the ParsedRequest
    outputs: list[Any]
    remaining: int
    forwards: int = 0
    most_shared: int = 0
    first_step_seen: bool = False
    progress: bool = False
    preview_every: int = 0  # 0: no previews


def image_request(values: dict[str, Any], image_index: int) -> ImageRequest:
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


class ImageStepServing:
    def __init__(self, model: Any, adapter: Any, settings: ModelSettings, caps: RowCaps) -> None:
        self.model = model
        self.metrics = model.metrics
        self.adapter = adapter
        faults = FaultInjection.from_config(settings.get("fault_injection"))
        stepped = adapter
        if faults is not None:
            stepped = FaultyStepAdapter(adapter, faults, lambda job: job.params.prompt)
        limits = EngineLimits(
            max_running=int(settings.get("max_running_rows", str(caps.max_rows))),
            max_per_forward=caps.max_rows,
            cap_for=lambda size: caps.cap_for_size(*size)[0],
            cancel_poll_s=float(settings.get("cancel_poll_ms", "50")) / 1000,
        )
        policy = make_policy(
            settings.get("scheduling_policy", "oldest"), int(settings.get("starvation_steps", "16"))
        )
        self.engine = StepEngine(stepped, self, limits, policy)
        self.worker = EngineWorker(
            self.engine,
            int(settings.get("waiting_room", str(caps.max_rows))),
            on_device_lost=model.exit_for_restart,
        )
        self.max_wait_s = float(settings.get("max_admission_wait_s", "120"))
        self.responses = ResponseWorker()
        log.info(
            "%s: step engine (%s), running rows %d, %d per forward, policy %s",
            settings.name,
            type(adapter).__name__,
            limits.max_running,
            limits.max_per_forward,
            policy.name,
        )

    def submit(self, tracked: TrackedRequest, parsed: Any) -> None:
        values = parsed.values
        context = RequestJobs(
            parsed,
            [None] * parsed.rows,
            parsed.rows,
            progress=bool(values.get("progress")),
            preview_every=values.get("preview_every", 0),
        )
        jobs = [Job(tracked, image_request(values, i), context, index=i) for i in range(parsed.rows)]
        # One bound from execute() entry: the last request of a big batch waits no longer than the first.
        left = self.max_wait_s - (time.perf_counter() - tracked.entered)
        try:
            waited = self.worker.submit(jobs, timeout_s=max(left, 0.0))
        except RequestError as error:
            tracked.fail(error)
            return
        self.metrics.observe("triton_diffusion_admission_wait_seconds", waited)

    def close(self) -> None:
        self.worker.close()  # what it held is answered UNAVAILABLE
        self.responses.close()

    # ---- engine listener (on the engine's thread) --------------------------------------------------
    def on_admitted(self, job: Job) -> None:
        request: ImageRequest = job.params
        log.info(
            "request %s image %d admitted: %dx%d, %d steps, %s, guidance %s (%d running)",
            job.request.request_id,
            job.index,
            request.width,
            request.height,
            job.total_steps,
            request.scheduler,
            request.guidance_scale,
            len(self.engine.running) + 1,
        )

    def on_stepped(self, job: Job) -> None:
        context: RequestJobs = job.context
        if job.index != 0:
            return  # the first image speaks for its request
        if not context.first_step_seen:
            context.first_step_seen = True
            waited = time.perf_counter() - job.request.entered
            self.responses.submit(
                None, lambda: self.metrics.observe("triton_diffusion_first_step_seconds", waited)
            )
        if not context.progress:
            return
        from triton_diffusion.serving.triton_io import progress_outputs

        step, total = job.steps_done, job.total_steps
        latent = None
        if context.preview_every and step % context.preview_every == 0:
            # Taken now: the job's latents move on with the next step.
            latent = self.adapter.preview_latent(job.state.latents, job.params.size)

        def send() -> None:
            preview = preview_png(latent) if latent is not None else None
            job.request.progress(progress_outputs(step, total, preview))

        self.responses.submit(job.request, send)

    def on_finished(self, job: Job, output: Any) -> None:
        context: RequestJobs = job.context
        context.outputs[job.index] = output
        context.remaining -= 1
        context.forwards = max(context.forwards, job.forwards)
        context.most_shared = max(context.most_shared, job.most_shared)
        if context.remaining:
            return
        parsed = context.parsed
        report = {
            "key": {"height": parsed.values["height"], "width": parsed.values["width"]},
            "engine": "step",
            "forwards": context.forwards,
            "most_rows_shared": context.most_shared,
        }
        outputs = list(context.outputs)

        def answer() -> None:
            job.request.finish(self.model.response(parsed, outputs, report))

        self.responses.submit(job.request, answer)

    def on_left(self, job: Job, reason: str) -> None:
        if reason == "cancelled":
            self.metrics.increment("triton_diffusion_rows_cancelled_total")
        log.info(
            "request %s image %d left (%s) after %d/%d steps, %d forwards, shared with up to %d",
            job.request.request_id,
            job.index,
            reason,
            job.steps_done,
            job.total_steps,
            job.forwards,
            job.most_shared,
        )

    def on_forward(self, jobs: list[Job], rows: int, seconds: float) -> None:
        images, running = len(jobs), len(self.engine.running)

        def record() -> None:  # custom metrics are round trips to the server: off the engine thread
            self.metrics.observe("triton_diffusion_forward_rows", images)
            self.metrics.observe("triton_diffusion_step_seconds", seconds)
            self.metrics.set("triton_diffusion_rows_in_flight", running)

        self.responses.submit(None, record)

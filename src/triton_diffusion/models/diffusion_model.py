"""Image and video models (text-to-image, image-to-image, text-to-video): what a request is in images.

A request is parsed once, into a :class:`ParsedRequest` that already holds its jobs (one
:class:`JobSpec` per image or video: its params, tier, deadline, planned steps, expected shape, step
cache), so the serving host hands them to the engine without asking back. Sizes, strength, frames, seeds
and BATCH are known here and nowhere in serving/. Parsing reads nothing the model kept: the host looks a
request up in the result cache and its checkpoints after (serving/intake.py).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np

from triton_diffusion.adapters.device_profiles import PROFILES
from triton_diffusion.adapters.diffusers_pipeline import row_seed
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.compatibility import CompatibilityKey, compatibility_key
from triton_diffusion.engine.degradation import StepsAllowed, degraded_report, steps_allowed
from triton_diffusion.engine.jobs import Job, JobSpec, Stepped
from triton_diffusion.engine.planner import RowCaps
from triton_diffusion.engine.request_engine import CallSteps
from triton_diffusion.errors import RequestError, invalid_field
from triton_diffusion.families import PipelineFacts
from triton_diffusion.fields import FieldSet
from triton_diffusion.models.calibration import calibrate
from triton_diffusion.recovery.resumes import Resumes, seed_from_key
from triton_diffusion.serving.engine_host import RequestRecord
from triton_diffusion.serving.engines import EngineKind, RequestEngineKind, StepEngineKind
from triton_diffusion.serving.metrics import FAMILIES, IMAGE_METRICS, BatchingMetrics
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.serving.result_cache import result_key
from triton_diffusion.serving.triton_model import Hosting, Urgency, json_output, urgency_of
from triton_diffusion.settings import IMAGE, ModelSettings

if TYPE_CHECKING:
    import torch

    from triton_diffusion.adapters.latent_loop import LatentStepAdapter

log = logging.getLogger("triton_diffusion")


@dataclass(frozen=True)
class ParsedRequest:
    """A validated image or video request, with its jobs decided (one per image or video)."""

    index: int
    values: dict[str, Any]
    key: CompatibilityKey | None  # the request-level engine's (None on the step engine: groups are shapes)
    jobs: tuple[JobSpec, ...] = ()
    service: Urgency = Urgency()
    result_key: str | None = None  # its answer's key in the result cache (None: not cached, no seed given)
    progress: bool = False  # progress responses were asked for
    summary: str = ""  # what it asks for, for the admission log line

    @property
    def resume_key(self) -> str | None:
        """The resume_key it gave: the host looks its checkpoints up under it (serving/intake.py)."""
        return self.values.get("resume_key") or None


@dataclass(frozen=True)
class RowInput:
    """What the request-level engine's pipeline call needs of one image: its request's validated values
    and which of its images this is (a job's ``params``)."""

    values: dict[str, Any]
    image_index: int


def batch_output(report: dict[str, Any]) -> np.ndarray:
    """The BATCH output: JSON of how the request was batched (its key and its fused calls, or for the
    step engine its shape group, the forwards it took part in and the most rows it shared one with)."""
    return json_output(report)


def seed_output(seed: int, count: int) -> np.ndarray:
    return np.array([[row_seed(seed, i) for i in range(count)]], dtype=np.int64)


class DiffusionModel:
    """Image and video models, a model kind (serving/triton_model.py ``ModelKind``): one job per image (or
    video). With a step adapter for the loaded pipeline (and ``engine`` auto or step) the host runs the
    step engine; otherwise the request-level engine, one fused diffusers call (:meth:`run_call`) per
    compatible group."""

    KIND: ClassVar[str]
    FIELDS: ClassVar[FieldSet]
    OUTPUTS: ClassVar[list[tuple[str, str, list[int]]]]
    METRIC_FAMILIES: ClassVar[dict[str, tuple[str, str]]] = FAMILIES
    CONFIG_KINDS: ClassVar[tuple[str, ...]] = (IMAGE,)

    fields: FieldSet
    settings: ModelSettings
    metrics: BatchingMetrics
    engine_kind: EngineKind

    facts: PipelineFacts  # what the loaded pipeline is (set by load)
    step_cache_methods: tuple[str, ...] = ()  # the step caches its denoiser serves per request (at load)
    adapter: LatentStepAdapter | None = None  # the step adapter (None: the request-level engine)

    def __init__(self) -> None:
        self._own_calls = itertools.count()  # cached requests' own compatibility keys

    # ---- what a model kind provides -------------------------------------------------------------
    def load(self, settings: ModelSettings) -> tuple[FieldSet, LatentStepAdapter | None]:
        """Load the pipeline; return FIELDS configured with this model's defaults and limits, and the
        step adapter for it (None: the request-level engine)."""
        raise NotImplementedError

    def images_for(self, values: dict[str, Any]) -> int:
        return 1

    def resolve(self, values: dict[str, Any]) -> dict[str, Any]:
        """Work a request needs before planning (decode an image, resolve its size): whatever this
        sets can be part of the compatibility key. Raises RequestError for this request only."""
        return values

    def step_request(self, values: dict[str, Any], image_index: int) -> ImageParams:
        """What the step adapter needs of one image (a job's ``params`` on the step engine)."""
        raise NotImplementedError

    def run_call(self, key: CompatibilityKey, jobs: list[Job], steps: CallSteps) -> list[object]:
        """One fused pipeline call; one output per job, in order (``steps.scatter`` helps)."""
        raise NotImplementedError

    def respond(self, request: ParsedRequest, outputs: list[object]) -> dict[str, np.ndarray]:
        """The outputs of a request whose images are all done (SEED and BATCH are added here)."""
        raise NotImplementedError

    def preview_png(self, snapshot: torch.Tensor) -> bytes:
        from triton_diffusion.codecs.preview import preview_png

        return preview_png(snapshot)

    # ---- setup and parsing --------------------------------------------------------------------------
    @staticmethod
    def row_caps(settings: ModelSettings) -> RowCaps:
        """Jobs per forward or fused call: ``max_rows_per_call``, lower for the sizes of
        ``max_rows_by_resolution``."""
        return RowCaps.from_config(settings.max_rows_per_call(), settings.config.max_rows_by_resolution)

    def calibration_requests(self) -> list[ImageParams]:
        """Step requests at the default size and at another (half of it, else twice it, where the limits
        allow one): what a calibration at load runs (models/calibration.py); none for a model whose
        requests need more than a prompt (a source image)."""
        raw = {"prompt": "calibration", "seed": 0}
        try:
            default = self.fields.parse(raw)
        except RequestError:
            return []
        for scale in (0.5, 2.0):
            sizes = {name: int(default[name] * scale) // 16 * 16 for name in ("width", "height")}
            try:
                return [
                    self.step_request(default, 0),
                    self.step_request(self.fields.parse({**raw, **sizes}), 0),
                ]
            except RequestError:
                continue
        return [self.step_request(default, 0)]

    def setup(self, settings: ModelSettings, metrics: BatchingMetrics) -> Hosting:
        self.settings, self.metrics = settings, metrics
        self.fields, adapter = self.load(settings)
        self.adapter = adapter
        if settings.config.checkpoint_every_steps and adapter is None:
            raise ValueError(
                f"model {settings.name}: config parameter 'checkpoint_every_steps' needs the step engine "
                "(this model runs the request-level engine: see 'engine')"
            )
        resumes = Resumes.from_settings(settings)  # the host's (serving/intake.py)
        caps = self.row_caps(settings)
        engine_kind: EngineKind
        if adapter is not None:
            engine_kind = StepEngineKind(
                adapter,
                caps,
                max_tokens_per_forward=settings.config.max_tokens_per_forward,
                # The packing gate's prices from load (not needed where it is off).
                times=calibrate(adapter, self.calibration_requests(), lambda r: caps.cap_for_shape(r.shape))
                if settings.config.packing_gate
                else None,
            )
        else:
            engine_kind = RequestEngineKind(self.run_call, caps)
        self.engine_kind = engine_kind
        log.info(
            "%s ready: engine=%s max_rows_per_call=%d caps_by_resolution=%s",
            settings.name,
            engine_kind.name,
            caps.max_rows,
            dict(caps.by_resolution),
        )
        return Hosting(engine_kind, IMAGE_METRICS, resumes)

    def parse(self, index: int, raw: dict[str, Any], tracked: TrackedRequest) -> ParsedRequest:
        """Validate a request and decide its jobs: one per image (or video), each with its params, tier,
        deadline, planned steps, expected shape, step cache and checkpoint key. Reads and changes nothing
        else (the host looks up what the model kept: serving/intake.py)."""
        parsed = self.fields.parse(raw)
        # The cheap checks before resolve decodes a source image: a bad tier or timeout is refused first.
        service = urgency_of(parsed, tracked, self.settings.config, self.fields)
        values = self.resolve(parsed)
        seed_given = values.get("seed") is not None
        if not seed_given:  # drawn here so the response can return it; a resend with its key draws the same
            resume_key = values.get("resume_key")
            values["seed"] = seed_from_key(resume_key) if resume_key else random.randrange(2**32)
        key = self.key_for(values)
        answer_key = result_key(values, seed_given) if self.settings.config.result_cache_mb > 0 else None
        jobs = tuple(self.job_spec(values, i, key, service) for i in range(self.images_for(values)))
        progress = bool(values.get("progress"))
        summary = self.summary(values)
        return ParsedRequest(index, values, key, jobs, service, answer_key, progress, summary)

    def key_for(self, values: dict[str, Any]) -> CompatibilityKey | None:
        """The request-level engine's compatibility key (None on the step engine: rows of any fields
        share forwards there, grouped by latent shape). With a step cache, a key of its own: diffusers'
        cache decides once per call over all its rows, so a cached request shares a call with nobody."""
        if self.adapter is not None:
            return None
        key = compatibility_key(self.fields, values)
        if not values.get("step_cache"):
            return key
        return CompatibilityKey((*key.items, ("own_call", next(self._own_calls))))

    def job_spec(
        self,
        values: dict[str, Any],
        index: int,
        key: CompatibilityKey | None,
        service: Urgency,
    ) -> JobSpec:
        """Image ``index`` of a request: what its engine needs (the step adapter's params, or the values
        and image index for a fused call) and what the scheduler orders and estimates it by; where the
        model takes checkpoints and the request gives a resume_key, the key its checkpoints go under (the
        host finds the one it starts from: serving/intake.py)."""
        previews = bool(values.get("progress")) and index == 0  # the first image speaks for its request
        degrade_cache = self.degrade_cache(values, service.deadline, service.tier)
        params: ImageParams | RowInput
        if self.adapter is not None:
            step = self.step_request({**values, "degrade_cache": degrade_cache}, index)
            params, tokens = step, self.adapter.tokens_of(step)
        else:
            params, tokens = RowInput(values, index), 1
        resume_key = values.get("resume_key") if self.settings.config.checkpoint_every_steps else None
        return JobSpec(
            params=params,
            tokens=tokens,
            index=index,
            group=key,
            tier=service.tier,
            deadline=service.deadline,
            planned_steps=self.planned_steps(values),
            # The latent shape group the adapter will give it (ImageParams.shape), for estimates before.
            shape=(values.get("height"), values.get("width"), *filter(None, [values.get("num_frames")])),
            cache_method=(values.get("step_cache") or "none").partition(":")[0],
            preview_every=values.get("preview_every", 0) if previews else 0,
            previews=values.get("previews", 0) if previews else 0,
            checkpoint_key=f"{resume_key}.{index}" if resume_key else None,
            steps_allowed=self.steps_allowed(values, service.tier),
            degrade_cache=degrade_cache,
        )

    def degrade_cache(self, values: dict[str, Any], deadline: float | None, tier: int) -> str | None:
        """The step cache a request's images may be given where their deadline needs it (a family with
        step caches: text_to_image.py); None: never."""
        return None

    def steps_allowed(self, values: dict[str, Any], tier: int) -> StepsAllowed:
        """The steps a request's images may be run with under overload (engine/degradation.py): from what it
        asked down to its ``min_inference_steps``, else its tier's ``degrade_tiers`` share of them; none on
        the request-level engine (it runs what it asked). Raises INVALID_ARG naming min_inference_steps
        where it is above num_inference_steps."""
        asked, least = values.get("num_inference_steps") or 1, values.get("min_inference_steps")
        floor = int(self.fields["num_inference_steps"].minimum or 1)  # the model's (Qwen-Image: 2)
        if least is not None and not floor <= least <= asked:
            allowed = f"{floor} to num_inference_steps, {asked}"
            raise invalid_field("min_inference_steps", f"got {least} (allowed: {allowed})")
        if self.adapter is None:
            return ()
        if least is None:
            share = (self.settings.config.degrade_tiers or {}).get(self.settings.config.service_tiers[tier])
            if share is None:
                return ()
            least = max(floor, math.ceil(round(asked * share, 9)))  # 50 x 0.14 is 7, not 8
        return steps_allowed(
            asked,
            least,
            lambda steps: self.planned_steps({**values, "num_inference_steps": steps}),
            lambda steps: self.takes_steps(values, steps),
        )

    def takes_steps(self, values: dict[str, Any], steps: int) -> bool:
        """Whether the request could be run with ``steps`` num_inference_steps (a family's rules)."""
        return True

    def planned_steps(self, values: dict[str, Any]) -> int:
        """The denoising steps a request's image will run: an image start runs the steps after its first
        one, by the step adapter's own rule (each family's ``get_timesteps``: SD rounds ``steps x strength``
        down, FLUX.1 and SD3 subtract it unrounded)."""
        steps = values.get("num_inference_steps") or 1
        strength = values.get("strength")
        if values.get("image") is not None and strength is not None:
            if self.adapter is not None:
                steps -= self.adapter.starter.first_step(steps, strength)
            else:  # only estimates read this, and the request-level engine makes none
                steps = min(int(steps * strength), steps)
        return max(steps, 1)

    # ---- the host's model kind --------------------------------------------------------------------
    def summary(self, values: dict[str, Any]) -> str:
        """What a request asks for, for the admission log line."""
        size = f"{values.get('width')}x{values.get('height')}"
        if values.get("num_frames"):
            size += f", {values['num_frames']} frames"
        source = (
            f", from an image (strength {values.get('strength')})" if values.get("image") is not None else ""
        )
        return f"{size}, {values.get('num_inference_steps')} steps, {values.get('scheduler')}{source}"

    def progress_outputs(self, record: RequestRecord, stepped: Stepped) -> Mapping[str, Any]:
        from triton_diffusion.serving.triton_io import progress_outputs

        # A preview latent (LatentStepAdapter.snapshot's, FusedCalls' callback's), held as ``object``.
        snapshot = cast("torch.Tensor | None", stepped.snapshot)
        preview = self.preview_png(snapshot) if snapshot is not None else None
        return progress_outputs(stepped.step, stepped.total, preview)

    def final_outputs(
        self, record: RequestRecord, outputs: list[object], reported: dict[str, Any]
    ) -> dict[str, Any]:
        parsed = cast(ParsedRequest, record.parsed)  # this kind's parse made it
        batch = {**self.batch_report(parsed.values, record.jobs), **reported}
        if any(job.degraded for job in record.jobs):  # where its deadline needed it (engine/degradation.py)
            batch["degraded"] = degraded_report(record.jobs)
        answer = {
            **self.respond(parsed, outputs),
            "SEED": seed_output(parsed.values["seed"], len(outputs)),
            "BATCH": batch_output(batch),
            # The size it was rendered at (an image's size may come from its source): told, not scraped.
            "WIDTH": np.array([[parsed.values["width"]]], dtype=np.int32),
            "HEIGHT": np.array([[parsed.values["height"]]], dtype=np.int32),
        }
        return answer

    def batch_report(self, values: dict[str, Any], jobs: list[Job]) -> dict[str, Any]:
        """BATCH: how the request was batched. On the step engine its shape group (what its rows shared
        forwards by), the forwards its images took part in and the most images they shared one with; on
        the request-level engine its compatibility key and the fused calls it went through."""
        report: dict[str, Any]
        if self.engine_kind.name == "request":
            group = cast(CompatibilityKey, jobs[0].run.group)  # the request-level engine's groups are keys
            key = {name: value for name, value in group.as_dict().items() if name != "own_call"}
            report = {"key": key, "fused_calls": jobs[0].stats.calls}
            if values.get("step_cache"):  # diffusers' own cache, on calls of its own
                report["step_cache"] = {"cache": values["step_cache"], "own_calls": True}
            return report
        shape: dict[str, Any] = {
            name: values[name] for name in ("height", "width", "num_frames") if name in values
        }
        if values.get("lora"):  # the adapters and scales this request's rows had
            shape["lora"] = values["lora"]
        report = {
            "key": shape,
            "engine": "step",
            "forwards": max(job.stats.forwards for job in jobs),
            "most_rows_shared": max(job.stats.most_shared for job in jobs),
        }
        if any(job.run.also_joins is not None for job in jobs):  # it may share forwards with other sizes
            report["packed_forwards"] = max(job.stats.packed_forwards for job in jobs)
        if values.get("step_cache"):  # its denoiser rows: run in full, or from its cache
            report["step_cache"] = {
                "cache": values["step_cache"],
                "rows_computed": sum(job.stats.rows_computed for job in jobs),
                "rows_reused": sum(job.stats.rows_reused for job in jobs),
            }
        return report

    def describe_more(self) -> dict[str, Any]:
        more: dict[str, Any] = {"step_caches": ["none", *self.step_cache_methods]}
        profile = self.settings.config.device_profile
        if profile:  # benchmarks only: what it answers is the cost of a GPU's forwards, not an image
            more["device_profile"] = {"name": profile, "what": PROFILES[profile].what, "serves_images": False}
        if self.adapter is not None:  # per tier, the least share of its steps a request may be run with
            more["degrade_tiers"] = dict(self.settings.config.degrade_tiers or {})
            more["degrade_step_cache"] = dict(self.settings.config.degrade_step_cache or {})
        if self.adapter is not None:  # whether images of different sizes share forwards, and why not
            packing = self.adapter.sizes.packing
            more["packed_sizes"] = (
                {"served": True} if packing.on else {"served": False, "why_not": packing.why_not}
            )
        return more

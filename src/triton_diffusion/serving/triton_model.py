"""The shared Triton Python model: read + validate each request, hand the valid ones to the engine host.

A model kind (text-to-image, ..., the diffusion LM) subclasses :class:`TritonModel` and says which fields
it accepts, how to load its model and what its engine host runs (engine_host.py); image and video kinds
share :class:`DiffusionModel`, which turns a request into one job per image and outputs into tensors.
Whatever raises while a request is read answers that request alone.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from triton_diffusion.adapters.diffusers_pipeline import row_seed
from triton_diffusion.compatibility import CompatibilityKey
from triton_diffusion.engine.failures import exit_for_restart
from triton_diffusion.engine.jobs import Job, Stepped
from triton_diffusion.engine.planner import RowCaps
from triton_diffusion.errors import ErrorCode, RequestError, invalid_field
from triton_diffusion.fields import FieldSet
from triton_diffusion.serving.engine_host import EngineHost, RequestRecord
from triton_diffusion.serving.engines import EngineKind, RequestEngineKind, StepEngineKind
from triton_diffusion.serving.metrics import FAMILIES, IMAGE_METRICS
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.serving.result_cache import ResultCache, result_key
from triton_diffusion.settings import IMAGE, ModelSettings

log = logging.getLogger("triton_diffusion")


@dataclass(frozen=True)
class Service:
    """How urgent a request is (the scheduler's order, engine/ordering.py): its tier's rank (0: the
    highest) and the perf_counter time by which it must be done (None: no deadline)."""

    tier: int = 0
    deadline: float | None = None


@dataclass(frozen=True)
class ParsedRequest:
    index: int
    values: dict[str, Any]
    key: CompatibilityKey | None  # the request-level engine's (None on the step engine: groups are shapes)
    images: int  # jobs: images (or videos) this request asks for
    service: Service = Service()
    result_key: str | None = None  # its answer's key in the result cache (None: not cached, no seed given)


@dataclass(frozen=True)
class RowInput:
    """What the request-level engine's pipeline call needs of one image: its request's validated values
    and which of its images this is (a job's ``params``)."""

    values: dict[str, Any]
    image_index: int


# Outputs every image and video model has beside its images: the size it rendered at, and MODEL_INFO.
RENDER_OUTPUTS = [
    ("WIDTH", "TYPE_INT32", [1]),
    ("HEIGHT", "TYPE_INT32", [1]),
    ("MODEL_INFO", "TYPE_STRING", [1]),  # the answer to a describe request (JSON)
]


def json_output(value: dict[str, Any]) -> np.ndarray:
    """A [1, 1] TYPE_STRING output holding JSON (BATCH, MODEL_INFO)."""
    return np.array([[json.dumps(value).encode()]], dtype=object)


def batch_output(report: dict[str, Any]) -> np.ndarray:
    """The BATCH output: JSON of how the request was batched (its key and its fused calls, or for the
    step engine its shape group, the forwards it took part in and the most rows it shared one with)."""
    return json_output(report)


def seed_output(seed: int, count: int) -> np.ndarray:
    return np.array([[row_seed(seed, i) for i in range(count)]], dtype=np.int64)


class TritonModel:
    """What every model kind shares: Triton's entry points, reading and validating each request on its
    own (whatever raises answers that request alone), and the answered-exactly-once tracking. A kind's
    ``setup`` sets ``self.fields`` and ``self.host``."""

    KIND: ClassVar[str]  # what it serves, as MODEL_INFO tells clients: text_to_image, text_generation, ...
    FIELDS: ClassVar[FieldSet]
    OUTPUTS: ClassVar[list[tuple[str, str, list[int]]]]
    METRIC_FAMILIES: ClassVar[dict[str, tuple[str, str]]] = FAMILIES
    CONFIG_KINDS: ClassVar[tuple[str, ...]] = (IMAGE,)  # which config parameters it reads (settings.py)

    fields: FieldSet
    host: EngineHost

    # ---- what a model kind provides -------------------------------------------------------------
    def setup(self, settings: ModelSettings) -> None:
        """Load the model; set ``self.fields`` (FIELDS configured with this model's defaults and limits)
        and ``self.host``."""
        raise NotImplementedError

    def parse(self, index: int, raw: dict[str, Any], tracked: TrackedRequest) -> Any:
        """Validate one request's raw fields. Raises RequestError for this request only."""
        raise NotImplementedError

    # ---- Triton entry points ----------------------------------------------------------------------
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config: Any) -> Any:
        from triton_diffusion.serving.triton_io import add_io_to_config

        return add_io_to_config(auto_complete_model_config, cls.FIELDS, cls.OUTPUTS)

    def initialize(self, args: dict[str, str]) -> None:
        from triton_diffusion.serving.triton_io import batching_metrics, install_log_handler

        install_log_handler()
        self.settings = ModelSettings.from_triton_args(args, self.CONFIG_KINDS, [f.name for f in self.FIELDS])
        self.metrics = batching_metrics(self.settings.name, self.METRIC_FAMILIES)
        self.setup(self.settings)

    def execute(self, requests: Sequence[Any]) -> None:
        entered = time.perf_counter()
        self.metrics.observe("triton_diffusion_execute_requests", len(requests))
        tracked: list[TrackedRequest] = []
        try:
            admitted = []
            for index, request in enumerate(requests):
                target, parsed = self._read(index, request, entered)
                tracked.append(target)
                if parsed is not None:
                    admitted.append((target, parsed))
            log.info("execute: %d requests ids=%s", len(requests), [t.request_id for t in tracked])
            self.host.submit(admitted)
        except Exception as exc:  # noqa: BLE001  (every request must still get its FINAL response)
            log.exception("execute failed")
            error = RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            for index, request in enumerate(requests):
                try:
                    target = tracked[index] if index < len(tracked) else self._track(request, entered)
                    target.fail(error)  # a no-op for requests answered already
                except Exception:  # noqa: BLE001
                    log.exception("could not answer request %d of the batch", index)
        return None

    def cached_answer(self, parsed: Any) -> dict[str, Any] | None:
        """The answer of an earlier identical request (serving/result_cache.py), or None."""
        return None

    def describe(self) -> dict[str, Any]:
        """MODEL_INFO: what a client needs to know to call this model (so it never infers it)."""
        config = self.settings.config
        return {
            "kind": self.KIND,
            "engine": self.host.engine_kind.name,
            "fields": {f.name: f.describe() for f in self.fields},
            "outputs": [name for name, _, _ in self.OUTPUTS],
            "service_tiers": list(config.service_tiers),
            "default_service_tier": config.default_service_tier,
            "error_codes": [code.value for code in ErrorCode],
            **self.describe_more(),
        }

    def describe_more(self) -> dict[str, Any]:
        """What a model kind adds to MODEL_INFO."""
        return {}

    def service_of(self, values: dict[str, Any], tracked: TrackedRequest) -> Service:
        """The request's tier (``service_tier``, or the model's default) and deadline (Triton's request
        timeout, or over HTTP the ``timeout`` parameter, in microseconds from its arrival). Raises
        INVALID_ARG naming the field and what is allowed."""
        config = self.settings.config
        tier = values.get("service_tier")
        if tier is None:  # absent: the model's default; sent, it must be a tier ("" and " " are not)
            tier = config.default_service_tier
        if tier not in config.service_tiers:
            allowed = ", ".join(config.service_tiers)
            raise invalid_field("service_tier", f"got {tier[:64]!r} (allowed: one of {allowed})")
        timeout_us = values.get("timeout") or tracked.timeout_us
        if timeout_us and not 0 < timeout_us <= self.fields["timeout"].maximum:
            raise invalid_field(
                "timeout", f"got {timeout_us} us (allowed: {self.fields['timeout'].allowed()})"
            )
        deadline = tracked.entered + timeout_us / 1e6 if timeout_us else None
        return Service(config.service_tiers.index(tier), deadline)

    def finalize(self) -> None:
        self.host.close()
        log.info("%s unloaded", self.settings.name)

    def exit_for_restart(self, reason: str) -> None:
        """The accelerator failed or the engine is stuck: every request held was answered (or is queued
        for sending); send what 10 s allow, then leave so the supervisor restarts the server."""
        try:
            self.host.before_exit(reason)
        finally:
            exit_for_restart(reason)

    # ---- reading requests -------------------------------------------------------------------------
    def _track(self, request: Any, entered: float) -> TrackedRequest:
        from triton_diffusion.serving.triton_io import TritonChannel, request_id, request_timeout_us

        channel = TritonChannel(request)
        return TrackedRequest(
            request_id(request), channel, self._on_answered, entered, request_timeout_us(request)
        )

    def _read(self, index: int, request: Any, entered: float) -> tuple[TrackedRequest, Any]:
        """Track the request, read and validate it. Whatever raises answers this request alone."""
        from triton_diffusion.serving.triton_io import read_raw_fields

        tracked = self._track(request, entered)
        try:
            raw = read_raw_fields(request, self.fields)
            if raw.get("describe") is True:  # what the model serves, at once: no generation
                tracked.finish({"MODEL_INFO": json_output(self.describe())})
                return tracked, None
            parsed = self.parse(index, raw, tracked)
            answer = self.cached_answer(parsed)
            if answer is not None:  # the same request was answered before: its bytes again, at once
                tracked.finish(answer)
                return tracked, None
            return tracked, parsed
        except RequestError as error:
            tracked.fail(error)
        except Exception as exc:  # noqa: BLE001  (a bug while reading one request fails it alone)
            log.exception("request %s: could not be read", tracked.request_id)
            error = RequestError(ErrorCode.INTERNAL, f"reading the request failed: {type(exc).__name__}")
            tracked.fail(error)
        return tracked, None

    def _on_answered(self, tracked: TrackedRequest, code: ErrorCode | None) -> None:
        if code is not None:
            self.metrics.increment("triton_diffusion_requests_failed_total", code=code.value)


class DiffusionModel(TritonModel):
    step_cache_methods: tuple[str, ...] = ()  # the step caches its denoiser serves per request (at load)
    results = ResultCache(0)  # answers to repeated requests (result_cache_mb; set at load; 0: off)

    """Image and video models: one job per image (or video). With a step adapter for the loaded pipeline
    (and ``engine`` auto or step) the host runs the step engine; otherwise the request-level engine, one
    fused diffusers call (:meth:`run_call`) per compatible group."""

    # ---- what a model kind provides -------------------------------------------------------------
    def load(self, settings: ModelSettings) -> tuple[FieldSet, Any]:
        """Load the pipeline; return FIELDS configured with this model's defaults and limits, and the
        step adapter for it (None: the request-level engine)."""
        raise NotImplementedError

    def images_for(self, values: dict[str, Any]) -> int:
        return 1

    def resolve(self, values: dict[str, Any]) -> dict[str, Any]:
        """Work a request needs before planning (decode an image, resolve its size): whatever this
        sets can be part of the compatibility key. Raises RequestError for this request only."""
        return values

    def step_request(self, values: dict[str, Any], image_index: int) -> Any:
        """What the step adapter needs of one image (a job's ``params`` on the step engine)."""
        raise NotImplementedError

    def run_call(self, key: CompatibilityKey, jobs: list[Job], steps: Any) -> list[Any]:
        """One fused pipeline call; one output per job, in order (``steps.scatter`` helps)."""
        raise NotImplementedError

    def respond(self, request: ParsedRequest, outputs: list[Any]) -> dict[str, np.ndarray]:
        """The outputs of a request whose images are all done (SEED and BATCH are added here)."""
        raise NotImplementedError

    def preview_png(self, snapshot: Any) -> bytes:
        from triton_diffusion.codecs.preview import preview_png

        return preview_png(snapshot)

    # ---- setup and parsing --------------------------------------------------------------------------
    @staticmethod
    def row_caps(settings: ModelSettings) -> RowCaps:
        """Jobs per forward or fused call: ``max_rows_per_call``, lower for the sizes of
        ``max_rows_by_resolution``."""
        return RowCaps.from_config(settings.max_rows_per_call(), settings.config.max_rows_by_resolution)

    def setup(self, settings: ModelSettings) -> None:
        self.fields, adapter = self.load(settings)
        self.results = ResultCache(int(settings.config.result_cache_mb * 2**20))
        caps = self.row_caps(settings)
        engine_kind: EngineKind
        if adapter is not None:
            engine_kind = StepEngineKind(
                adapter, self.step_request, caps, prompt_of=lambda job: job.params.prompt
            )
        else:
            engine_kind = RequestEngineKind(self.run_call, RowInput, caps)
        self.engine_kind = engine_kind
        self.host = EngineHost(
            self, engine_kind, settings, self.metrics, IMAGE_METRICS, self.exit_for_restart
        )
        log.info(
            "%s ready: engine=%s max_rows_per_call=%d caps_by_resolution=%s",
            settings.name,
            engine_kind.name,
            caps.max_rows,
            dict(caps.by_resolution),
        )

    def parse(self, index: int, raw: dict[str, Any], tracked: TrackedRequest) -> ParsedRequest:
        values = self.resolve(self.fields.parse(raw))
        seed_given = values.get("seed") is not None
        if not seed_given:
            values["seed"] = random.randrange(2**32)  # drawn here so the response can return it
        key = self.engine_kind.key_for(self.fields, values)
        service = self.service_of(values, tracked)
        answer_key = result_key(values, seed_given) if self.results else None
        return ParsedRequest(index, values, key, self.images_for(values), service, answer_key)

    def cached_answer(self, parsed: ParsedRequest) -> dict[str, Any] | None:
        if parsed.result_key is None:
            return None
        answer = self.results.get(parsed.result_key)
        if answer is None:
            return None
        self.metrics.increment("triton_diffusion_result_cache_hits_total")
        batch = json.loads(answer["BATCH"].reshape(-1)[0])
        # Its own service, not the first request's: nothing waited or was paused for this one.
        service = {"tier": self.settings.config.service_tiers[parsed.service.tier], "paused_times": 0}
        batch.update(result_cache="hit", service={**service, "paused_s": 0.0})
        return {**answer, "BATCH": batch_output(batch)}

    # ---- the host's model kind --------------------------------------------------------------------
    def jobs_for(self, record: RequestRecord) -> list[Job]:
        parsed: ParsedRequest = record.parsed
        values = parsed.values
        record.values = values
        record.progress = bool(values.get("progress"))
        jobs = []
        for i in range(parsed.images):
            params, group = self.engine_kind.job_params(values, i, parsed.key)
            job = Job(record.tracked, params, record, index=i, group=group)
            if record.progress and i == 0:  # the first image speaks for its request
                job.preview_every, job.previews = values.get("preview_every", 0), values.get("previews", 0)
            job.tier, job.deadline = parsed.service.tier, parsed.service.deadline
            job.planned_steps = planned_steps(values)
            # the latent shape group the adapter will give it (ImageRequest.shape), for estimates before
            job.shape = (values.get("height"), values.get("width"), *filter(None, [values.get("num_frames")]))
            job.cache_method = (values.get("step_cache") or "none").partition(":")[0]
            jobs.append(job)
        record.summary = self.summary(values)
        return jobs

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

        preview = self.preview_png(stepped.snapshot) if stepped.snapshot is not None else None
        return progress_outputs(stepped.step, stepped.total, preview)

    def final_outputs(
        self, record: RequestRecord, outputs: list[Any], batch: dict[str, Any]
    ) -> dict[str, Any]:
        parsed: ParsedRequest = record.parsed
        answer = {
            **self.respond(parsed, outputs),
            "SEED": seed_output(parsed.values["seed"], len(outputs)),
            "BATCH": batch_output(batch),
            # The size it was rendered at (an image's size may come from its source): told, not scraped.
            "WIDTH": np.array([[parsed.values["width"]]], dtype=np.int32),
            "HEIGHT": np.array([[parsed.values["height"]]], dtype=np.int32),
        }
        if parsed.result_key is not None:
            self.results.put(parsed.result_key, answer)
        return answer

    def describe_more(self) -> dict[str, Any]:
        return {"step_caches": ["none", *self.step_cache_methods]}


def planned_steps(values: dict[str, Any]) -> int:
    """The denoising steps a request's image will run: an image start runs the last ``strength`` of its
    schedule (diffusers' ``get_timesteps``)."""
    steps = values.get("num_inference_steps") or 1
    strength = values.get("strength")
    if values.get("image") is not None and strength is not None:
        steps = min(int(steps * strength), steps)
    return max(steps, 1)

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
from triton_diffusion.compatibility import CompatibilityKey, compatibility_key
from triton_diffusion.engine.failures import exit_for_restart
from triton_diffusion.engine.jobs import Job, Stepped
from triton_diffusion.engine.planner import RowCaps
from triton_diffusion.engine.request_engine import CallSteps
from triton_diffusion.engine.requests import TrackedRequest
from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.fields import Field, FieldSet, Role
from triton_diffusion.serving.engine_host import EngineHost, RequestRecord
from triton_diffusion.serving.metrics import FAMILIES, IMAGE_METRICS
from triton_diffusion.settings import IMAGE, ModelSettings

log = logging.getLogger("triton_diffusion")

# Fields and outputs every denoising model has: per-step progress responses before the FINAL one.
PROGRESS_FIELDS = [
    Field("progress", bool, False, Role.AFTER_SPLIT, doc="send STEP/TOTAL_STEPS after every denoising step"),
    Field(
        "preview_every",
        int,
        0,
        Role.AFTER_SPLIT,
        minimum=0,
        maximum=1000,
        doc="with progress: a low-resolution PREVIEW image every N steps (0 = never)",
    ),
]
PROGRESS_OUTPUTS = [
    ("STEP", "TYPE_INT32", [1]),
    ("TOTAL_STEPS", "TYPE_INT32", [1]),
    ("PREVIEW", "TYPE_STRING", [1]),
]


@dataclass(frozen=True)
class ParsedRequest:
    index: int
    values: dict[str, Any]
    key: CompatibilityKey
    images: int  # jobs: images (or videos) this request asks for


@dataclass(frozen=True)
class RowInput:
    """What the request-level engine's pipeline call needs of one image: its request's validated values
    and which of its images this is (a job's ``params``)."""

    values: dict[str, Any]
    image_index: int


def batch_output(report: dict[str, Any]) -> np.ndarray:
    """The BATCH output: JSON of how the request was batched (its key and its fused calls, or for the
    step engine its shape group, the forwards it took part in and the most rows it shared one with)."""
    return np.array([[json.dumps(report).encode()]], dtype=object)


def seed_output(seed: int, count: int) -> np.ndarray:
    return np.array([[row_seed(seed, i) for i in range(count)]], dtype=np.int64)


class TritonModel:
    """What every model kind shares: Triton's entry points, reading and validating each request on its
    own (whatever raises answers that request alone), and the answered-exactly-once tracking. A kind's
    ``setup`` sets ``self.fields`` and ``self.host``."""

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
        from triton_diffusion.serving.triton_io import TritonChannel, request_id

        return TrackedRequest(request_id(request), TritonChannel(request), self._on_answered, entered)

    def _read(self, index: int, request: Any, entered: float) -> tuple[TrackedRequest, Any]:
        """Track the request, read and validate it. Whatever raises answers this request alone."""
        from triton_diffusion.serving.triton_io import read_raw_fields

        tracked = self._track(request, entered)
        try:
            return tracked, self.parse(index, read_raw_fields(request, self.fields), tracked)
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

    def run_call(self, key: CompatibilityKey, jobs: list[Job], steps: CallSteps) -> list[Any]:
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
        caps = self.row_caps(settings)
        if adapter is not None:
            waiting = caps.max_rows
            extra = {"adapter": adapter, "prompt_of": lambda job: job.params.prompt}
        else:
            waiting = max(settings.max_batch_size, caps.max_rows)
            extra = {"pipeline_call": self.run_call}
        self.host = EngineHost(
            self,
            settings,
            self.metrics,
            IMAGE_METRICS,
            self.exit_for_restart,
            caps=caps,
            default_running=caps.max_rows,
            default_waiting=waiting,
            **extra,
        )
        log.info(
            "%s ready: engine=%s max_rows_per_call=%d caps_by_resolution=%s",
            settings.name,
            self.host.engine.name,
            caps.max_rows,
            dict(caps.by_resolution),
        )

    def parse(self, index: int, raw: dict[str, Any], tracked: TrackedRequest) -> ParsedRequest:
        values = self.resolve(self.fields.parse(raw))
        if "seed" in values and values["seed"] is None:
            values["seed"] = random.randrange(2**32)  # drawn here so the response can return it
        return ParsedRequest(index, values, compatibility_key(self.fields, values), self.images_for(values))

    # ---- the host's model kind --------------------------------------------------------------------
    def jobs_for(self, record: RequestRecord, engine: str) -> list[Job]:
        parsed: ParsedRequest = record.parsed
        values = parsed.values
        record.progress = bool(values.get("progress"))
        preview_every = values.get("preview_every", 0) if record.progress else 0
        if engine == "step":
            return [
                Job(
                    record.tracked, self.step_request(values, i), record, index=i, preview_every=preview_every
                )
                for i in range(parsed.images)
            ]
        return [
            Job(
                record.tracked,
                RowInput(values, i),
                record,
                index=i,
                preview_every=preview_every if i == 0 else 0,
                group=parsed.key,
            )
            for i in range(parsed.images)
        ]

    def progress_outputs(self, record: RequestRecord, stepped: Stepped) -> Mapping[str, Any]:
        from triton_diffusion.serving.triton_io import progress_outputs

        preview = self.preview_png(stepped.snapshot) if stepped.snapshot is not None else None
        return progress_outputs(stepped.step, stepped.total, preview)

    def final_outputs(
        self, record: RequestRecord, outputs: list[Any], batch: dict[str, Any]
    ) -> dict[str, Any]:
        parsed: ParsedRequest = record.parsed
        if batch.get("engine") == "step":  # one shape group per forward: the shape is its key
            shape = ("height", "width", "num_frames")
            key = {name: parsed.values[name] for name in shape if name in parsed.values}
            if parsed.values.get("lora"):  # the adapters and scales this request's rows had
                key["lora"] = parsed.values["lora"]
        else:
            key = parsed.key.as_dict()
        return {
            **self.respond(parsed, outputs),
            "SEED": seed_output(parsed.values["seed"], len(outputs)),
            "BATCH": batch_output({"key": key, **batch}),
        }

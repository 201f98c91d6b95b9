"""The one Triton Python model: read + validate each request, hand the valid ones to the engine host.

A model file is ``TritonPythonModel = serve("text_to_image")`` (models/model_file.py), which composes
a model kind (:class:`ModelKind`: text-to-image, ..., the diffusion LM) into :class:`TritonModel`, which
is final and is not subclassed. The kind says which fields it accepts, loads its model and says what its
engine host runs (:class:`Hosting`), turns a raw request into a parsed request holding its job specs, and
renders progress and outputs (engine_host.py ``HostedKind``); image and video kinds share
models/diffusion_model.py. This class builds the engine host and owns Triton's entry points: whatever
raises while a request is read answers that request alone. A request is parsed by its kind, then read by
the host (what the model kept: the result cache, its checkpoints; serving/intake.py). Nothing here knows
an image field.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, final

import numpy as np

from triton_diffusion.engine.failures import exit_for_restart
from triton_diffusion.engine.jobs import Stepped
from triton_diffusion.errors import ErrorCode, RequestError, invalid_field
from triton_diffusion.fields import FieldSet
from triton_diffusion.recovery.resumes import Resumes
from triton_diffusion.serving.engine_host import Admitted, EngineHost, Parsed, RequestRecord
from triton_diffusion.serving.engines import EngineKind
from triton_diffusion.serving.metrics import BatchingMetrics, MetricNames
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.settings import ModelConfig, ModelSettings

log = logging.getLogger("triton_diffusion")


@dataclass(frozen=True)
class Urgency:
    """How urgent a request is (the scheduler's order, engine/ordering.py): its tier's rank (0: the
    highest) and the perf_counter time by which it must be done (None: no deadline)."""

    tier: int = 0
    deadline: float | None = None


def urgency_of(
    values: dict[str, Any], tracked: TrackedRequest, config: ModelConfig, fields: FieldSet
) -> Urgency:
    """A request's tier (``service_tier``, or the model's default) as its rank, and its deadline (Triton's
    request timeout, or over HTTP the ``timeout`` parameter, in microseconds from its arrival): the one
    place a tier's name becomes a rank. Raises INVALID_ARG naming the field and what is allowed."""
    tier = values.get("service_tier")
    if tier is None:  # absent: the model's default; sent, it must be a tier ("" and " " are not)
        tier = config.default_service_tier
    if tier not in config.service_tiers:
        allowed = ", ".join(config.service_tiers)
        raise invalid_field("service_tier", f"got {tier[:64]!r} (allowed: one of {allowed})")
    timeout_us = values.get("timeout") or tracked.timeout_us
    most = fields["timeout"].maximum
    if timeout_us and not (0 < timeout_us and (most is None or timeout_us <= most)):
        raise invalid_field("timeout", f"got {timeout_us} us (allowed: {fields['timeout'].allowed()})")
    deadline = tracked.entered + timeout_us / 1e6 if timeout_us else None
    return Urgency(config.service_tiers.index(tier), deadline)


def json_output(value: dict[str, Any]) -> np.ndarray:
    """A [1, 1] TYPE_STRING output holding JSON (BATCH, MODEL_INFO)."""
    return np.array([[json.dumps(value).encode()]], dtype=object)


@dataclass(frozen=True)
class Hosting:
    """What a loaded model kind runs: its engine, the metric names its host reports under, and where its
    jobs' checkpoints go (None: none are taken)."""

    engine_kind: EngineKind
    names: MetricNames
    resumes: Resumes | None = None


class ModelKind(Protocol):
    """What a model kind supplies to :class:`TritonModel` (and, as engine_host.py's ``HostedKind``, to its
    engine host). Made with no arguments; ``setup`` loads it."""

    KIND: ClassVar[str]  # what it serves, as MODEL_INFO tells clients: text_to_image, text_generation, ...
    FIELDS: ClassVar[FieldSet]
    OUTPUTS: ClassVar[list[tuple[str, str, list[int]]]]
    METRIC_FAMILIES: ClassVar[dict[str, tuple[str, str]]]
    CONFIG_KINDS: ClassVar[tuple[str, ...]]  # which config parameters it reads (settings.py)

    fields: FieldSet  # FIELDS configured with this model's defaults and limits (set by setup)

    def setup(self, settings: ModelSettings, metrics: BatchingMetrics) -> Hosting:
        """Load the model (set ``fields``); say what its engine host runs."""

    def parse(self, index: int, raw: dict[str, Any], tracked: TrackedRequest) -> Parsed:
        """Validate one request's raw fields and decide its jobs, reading and changing nothing else.
        Raises RequestError for this request only."""

    def describe_more(self) -> dict[str, Any]:
        """What the kind adds to MODEL_INFO."""

    def progress_outputs(self, record: RequestRecord, stepped: Stepped) -> Mapping[str, Any] | None:
        """A progress response for this step, or None (the response thread)."""

    def final_outputs(
        self, record: RequestRecord, outputs: list[object], reported: dict[str, Any]
    ) -> Mapping[str, Any]:
        """The FINAL response's tensors (the response thread); ``reported``: the host's part of BATCH."""


@final
class TritonModel:
    """Triton's entry points over a model kind: reading and validating each request on its own (whatever
    raises answers that request alone), the answered-exactly-once tracking, MODEL_INFO, and the engine host
    built from what the kind's ``setup`` returned."""

    host: EngineHost

    def __init__(self, kind: ModelKind) -> None:
        self.kind = kind

    # ---- Triton entry points ----------------------------------------------------------------------
    def initialize(self, args: dict[str, str]) -> None:
        from triton_diffusion.serving.triton_io import batching_metrics, install_log_handler

        install_log_handler()
        kind = self.kind
        names = [f.name for f in kind.FIELDS]
        self.settings = ModelSettings.from_triton_args(args, kind.CONFIG_KINDS, names)
        self.metrics = batching_metrics(self.settings.name, kind.METRIC_FAMILIES)
        hosting = kind.setup(self.settings, self.metrics)
        self.host = EngineHost(
            kind,
            hosting.engine_kind,
            self.settings,
            self.metrics,
            hosting.names,
            self.exit_for_restart,
            hosting.resumes,
        )

    def execute(self, requests: Sequence[Any]) -> None:
        entered = time.perf_counter()
        self.metrics.observe("triton_diffusion_execute_requests", len(requests))
        tracked: list[TrackedRequest] = []
        try:
            admitted = []
            for index, request in enumerate(requests):
                target, read = self._read(index, request, entered)
                tracked.append(target)
                if read is not None:
                    admitted.append(read)
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

    def describe(self) -> dict[str, Any]:
        """MODEL_INFO: what a client needs to know to call this model (so it never infers it)."""
        config, kind = self.settings.config, self.kind
        return {
            "kind": kind.KIND,
            "engine": self.host.engine_kind.name,
            "fields": {f.name: f.describe() for f in kind.fields},
            "outputs": [name for name, _, _ in kind.OUTPUTS],
            "service_tiers": list(config.service_tiers),
            "default_service_tier": config.default_service_tier,
            "error_codes": [code.value for code in ErrorCode],
            **({"cost_model": cost} if (cost := self.host.cost_model()) is not None else {}),
            **kind.describe_more(),
        }

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

    def _read(self, index: int, request: Any, entered: float) -> tuple[TrackedRequest, Admitted | None]:
        """Track the request; its kind parses it, the host reads it (None: answered already). Whatever
        raises answers this request alone."""
        from triton_diffusion.serving.triton_io import read_raw_fields

        tracked = self._track(request, entered)
        try:
            raw = read_raw_fields(request, self.kind.fields)
            if raw.get("describe") is True:  # what the model serves, at once: no generation
                tracked.finish({"MODEL_INFO": json_output(self.describe())})
                return tracked, None
            return tracked, self.host.read(tracked, self.kind.parse(index, raw, tracked))
        except RequestError as refused:
            tracked.fail(refused)
        except Exception as exc:  # noqa: BLE001  (a bug while reading one request fails it alone)
            log.exception("request %s: could not be read", tracked.request_id)
            tracked.fail(
                RequestError(ErrorCode.INTERNAL, f"reading the request failed: {type(exc).__name__}")
            )
        return tracked, None

    def _on_answered(self, tracked: TrackedRequest, code: ErrorCode | None) -> None:
        if code is not None:
            self.metrics.increment("triton_diffusion_requests_failed_total", code=code.value)
        self.host.answered(tracked, code)

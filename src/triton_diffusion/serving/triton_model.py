"""The shared Triton Python model: read + validate each request, hand the valid ones to the engine host.

A model kind (text-to-image, ..., the diffusion LM) subclasses :class:`TritonModel` and says which fields
it accepts, how to load its model, how a raw request becomes a parsed request holding its job specs, and
what its engine host runs (engine_host.py); image and video kinds share models/diffusion_model.py.
Whatever raises while a request is read answers that request alone. Nothing here knows an image field.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from triton_diffusion.engine.failures import exit_for_restart
from triton_diffusion.errors import ErrorCode, RequestError, invalid_field
from triton_diffusion.fields import FieldSet
from triton_diffusion.serving.engine_host import EngineHost
from triton_diffusion.serving.metrics import FAMILIES
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.settings import IMAGE, ModelSettings

log = logging.getLogger("triton_diffusion")


@dataclass(frozen=True)
class Urgency:
    """How urgent a request is (the scheduler's order, engine/ordering.py): its tier's rank (0: the
    highest) and the perf_counter time by which it must be done (None: no deadline)."""

    tier: int = 0
    deadline: float | None = None


def json_output(value: dict[str, Any]) -> np.ndarray:
    """A [1, 1] TYPE_STRING output holding JSON (BATCH, MODEL_INFO)."""
    return np.array([[json.dumps(value).encode()]], dtype=object)


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

    def service_of(self, values: dict[str, Any], tracked: TrackedRequest) -> Urgency:
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
        most = self.fields["timeout"].maximum
        if timeout_us and not (0 < timeout_us and (most is None or timeout_us <= most)):
            raise invalid_field(
                "timeout", f"got {timeout_us} us (allowed: {self.fields['timeout'].allowed()})"
            )
        deadline = tracked.entered + timeout_us / 1e6 if timeout_us else None
        return Urgency(config.service_tiers.index(tier), deadline)

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
        self.answered(tracked, code)

    def answered(self, tracked: TrackedRequest, code: ErrorCode | None) -> None:
        """A request's FINAL response went out (``code``: its error's, None for a result), once per request,
        whichever path answered it: what a model kind keeps for a request until then is let go here."""

"""The front's only connection to Triton: gRPC streaming (``tritonclient.grpc.aio``), the model catalog
and readiness.

The requests go through the client's stream code (``triton_diffusion_client.streams``, the one the
project's gRPC client uses): prompts and images as input tensors, every other field as a request
parameter; progress responses, then one FINAL response. Streams are pooled and carry one request at a
time: opening a gRPC stream per request cost a large part of the front's CPU, and Triton 2.51 cancels a
whole stream, not one request on it, so one
stream shared by requests in flight could not cancel just one. Leaving a request early (the HTTP client
went away, a video job was deleted, the timeout passed) cancels its stream, which cancels the Triton
request (its rows leave at the next step). Here the client's errors become the front's: ApiError with
the OpenAI status.

A request Triton lost (it restarted after a model process died, it drained, the stream broke) is resent
as the project's client resends it (``triton_diffusion_client.retry``): with the resume key the front gave
it, once Triton and the model are ready again, within ``retries`` and the request's timeout, so the HTTP
client sees one answer. The key is always the front's own, and sent only to a model that declares the
field: an OpenAI client cannot send one (translation.py refuses it).

The catalog is what the models say they serve: each ready model that declares a MODEL_INFO output is
sent one describe request (its kind, its fields with their real defaults and limits), asked again only
once it has left READY or Triton restarted. A model that does not describe itself is not served.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import grpc
import tritonclient.grpc.aio as grpcclient_aio
from triton_diffusion_client.retry import (
    DEFAULT_RETRIES,
    RESUME_KEY_FIELD,
    RetryBudget,
    new_resume_key,
    wait_ready_async,
)
from triton_diffusion_client.streams import (
    RequestStream,
    ResponseError,
    StreamPool,
    pooled_responses,
    request_message,
)
from triton_diffusion_client.streams import StreamResponse as TritonResponse
from tritonclient.utils import InferenceServerException

from triton_diffusion.openai_front.errors import ApiError, from_triton_message, model_not_found, unavailable

log = logging.getLogger("triton_diffusion.openai_front")

# What a model serves: the ``kind`` of its MODEL_INFO.
TEXT_TO_IMAGE = "text_to_image"
IMAGE_TO_IMAGE = "image_to_image"
TEXT_TO_VIDEO = "text_to_video"
TEXT_GENERATION = "text_generation"
KINDS = (TEXT_TO_IMAGE, IMAGE_TO_IMAGE, TEXT_TO_VIDEO, TEXT_GENERATION)


@dataclass(frozen=True)
class ModelInfo:
    """What a model told the front it serves: its answer to a describe request (MODEL_INFO)."""

    name: str
    kind: str
    # Field name -> its description: "type" (string, byte string, integer, number, boolean), "default"
    # (the model's own, configured or from its pipeline), "allowed", "supported", ...
    fields: Mapping[str, Mapping[str, Any]]
    default_service_tier: str | None = None

    def serves(self, name: str) -> bool:
        """The model declares the field and its loaded pipeline honours it."""
        description = self.fields.get(name)
        return description is not None and description.get("supported") is not False

    def default(self, name: str) -> Any:
        """The field's default (None: absent, or none)."""
        return (self.fields.get(name) or {}).get("default")

    def field_type(self, name: str) -> str:
        return str((self.fields.get(name) or {}).get("type", "string"))


def model_info(name: str, text: str | bytes) -> ModelInfo | None:
    """A model's MODEL_INFO (JSON) as a :class:`ModelInfo`; None when it is not one the front can serve."""
    try:
        described = json.loads(text)
    except ValueError:
        return None
    if not isinstance(described, dict) or described.get("kind") not in KINDS:
        return None
    fields = described.get("fields")
    if not isinstance(fields, dict) or not all(isinstance(f, dict) for f in fields.values()):
        return None
    tier = described.get("default_service_tier")
    return ModelInfo(name, described["kind"], fields, tier if isinstance(tier, str) else None)


@dataclass
class TritonRequest:
    """One Triton request: its tensors (PROMPT, IMAGE, MASK as bytes) and its parameters."""

    model: str
    tensors: dict[str, bytes]
    parameters: dict[str, Any] = field(default_factory=dict)
    openai_names: dict[str, str] = field(default_factory=dict)  # model field -> OpenAI parameter, for 400s


class TritonBridge:
    """A gRPC connection to Triton shared by every request of the front (one event loop)."""

    def __init__(
        self,
        url: str,
        catalog_ttl_s: float = 5.0,
        ready_ttl_s: float = 1.0,
        max_idle_streams: int = 64,
        describe_timeout_s: float = 10.0,
        retries: int = DEFAULT_RETRIES,
    ) -> None:
        self.url = url
        self.retries = retries
        self.catalog_ttl_s = catalog_ttl_s
        self.ready_ttl_s = ready_ttl_s
        self.describe_timeout_s = describe_timeout_s
        self._client: grpcclient_aio.InferenceServerClient | None = None
        self._streams = StreamPool(self._open_stream, max_idle_streams)
        self._catalog: dict[str, ModelInfo] = {}
        self._described: dict[str, ModelInfo | None] = {}  # each ready model's answer (None: not ours)
        self._catalog_at = -1e9
        self._catalog_lock: asyncio.Lock | None = None
        self._ready = False
        self._ready_at = -1e9

    @property
    def client(self) -> grpcclient_aio.InferenceServerClient:
        if self._client is None:  # made on the running event loop
            self._client = grpcclient_aio.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        self._streams.clear()
        if self._client is not None:
            await self._client.close()
            self._client = None

    # ---- readiness and the model catalog -------------------------------------------------------------
    async def ready(self) -> bool:
        """Triton answers and reports ready (all its models loaded); asked at most once per ready_ttl_s."""
        now = time.monotonic()
        if now - self._ready_at >= self.ready_ttl_s:
            try:
                self._ready = bool(await self.client.is_server_ready(client_timeout=2.0))
            except (InferenceServerException, grpc.RpcError, OSError):
                self._ready = False
            self._ready_at = time.monotonic()
            if not self._ready:
                self._catalog_at = -1e9  # after a restart the repository may differ
                self._described = {}  # and so may the models' fields
                self._streams.clear()  # and idle streams are of the old server
        return self._ready

    async def models(self) -> dict[str, ModelInfo]:
        """Ready models of the repository that the front can serve, by name. 503 while Triton is down."""
        if self._catalog_lock is None:
            self._catalog_lock = asyncio.Lock()
        async with self._catalog_lock:
            if time.monotonic() - self._catalog_at < self.catalog_ttl_s:
                return self._catalog
            try:
                index = await self.client.get_model_repository_index(as_json=True, client_timeout=5.0)
            except (InferenceServerException, grpc.RpcError, OSError) as exc:
                self._ready_at = -1e9
                raise unavailable(
                    f"Triton cannot be reached now ({_short(exc)}); try again shortly"
                ) from None
            ready = [entry["name"] for entry in index.get("models", []) if entry.get("state") == "READY"]
            # A model that left READY (unloaded, reloading) is asked again when it is back: its new
            # config may serve other fields and defaults.
            self._described = {name: info for name, info in self._described.items() if name in ready}
            new = [name for name in ready if name not in self._described]
            answers = await asyncio.gather(*(self._describe(name) for name in new))
            for name, (settled, info) in zip(new, answers, strict=True):
                if settled:
                    self._described[name] = info
            catalog = {name: info for name in ready if (info := self._described.get(name)) is not None}
            self._catalog, self._catalog_at = catalog, time.monotonic()
            return catalog

    async def _describe(self, name: str) -> tuple[bool, ModelInfo | None]:
        """What the model serves, asked once while it stays ready: (True, its MODEL_INFO), (True, None)
        when it is not one of ours, (False, None) when it could not be asked now (asked next time)."""
        try:
            meta = await self.client.get_model_metadata(name, as_json=True, client_timeout=5.0)
        except (InferenceServerException, grpc.RpcError, OSError) as exc:
            log.warning("model %s: its metadata cannot be read now (%s)", name, _short(exc))
            return False, None
        # Only a model that declares MODEL_INFO is sent a describe request: another model would take
        # it for a request to run.
        if "MODEL_INFO" not in {output.get("name") for output in meta.get("outputs", [])}:
            return True, None
        message = request_message(
            name, {"PROMPT": b""}, {"describe": True}, "oai-describe-" + uuid.uuid4().hex[:8]
        )
        text = None
        try:
            async with aclosing(pooled_responses(self._streams, message, self.describe_timeout_s)) as answers:
                async for response in answers:
                    text = response.scalar("MODEL_INFO") if response.final else text
        except (ResponseError, TimeoutError, InferenceServerException, grpc.RpcError) as exc:
            log.warning("model %s: no answer to describe now (%s)", name, _short(exc))
            return False, None
        info = model_info(name, text) if text is not None else None
        if info is None:
            log.warning("model %s declares MODEL_INFO but did not describe itself: not served here", name)
        return True, info

    async def model(self, name: str, kinds: tuple[str, ...], endpoint: str) -> ModelInfo:
        """The named model, which must be ready and of one of ``kinds``: 404 unknown, 400 wrong kind."""
        if not await self.ready():
            raise unavailable("Triton is not ready (starting or restarting); try again shortly")
        info = (await self.models()).get(name)
        if info is None:
            raise model_not_found(name)
        if info.kind not in kinds:
            raise ApiError(
                400,
                f"model {name!r} is a {info.kind} model; {endpoint} serves {' or '.join(kinds)} models",
                param="model",
                code="model_not_supported",
            )
        return info

    # ---- requests ----------------------------------------------------------------------------------
    async def stream(
        self, request: TritonRequest, info: ModelInfo, timeout_s: float
    ) -> AsyncGenerator[TritonResponse, None]:
        """Send one request and yield its responses up to the FINAL one, resent after a failure the
        client's retry module deems retryable (its responses go on from where it resumed). A per-request
        error raises an ApiError (400 naming the field, 503, 500; 504 past ``timeout_s``, which bounds
        every attempt together); closing the iterator early cancels the request."""
        parameters = dict(request.parameters)
        parameters.pop(RESUME_KEY_FIELD, None)  # only ever the front's own (translation.py refuses one)
        key = None
        if self.retries > 0 and info.serves(RESUME_KEY_FIELD):
            key = parameters[RESUME_KEY_FIELD] = new_resume_key()
        budget = RetryBudget(self.retries, timeout_s, key)
        try:
            # A parameter Triton would not carry intact (a NUL, a lone surrogate) is refused here as the
            # model would refuse it: a ResponseError naming the field, a 400.
            message = request_message(
                request.model, request.tensors, parameters, "oai-" + uuid.uuid4().hex[:16]
            )
        except ResponseError as exc:
            raise from_triton_message(exc.message, info.fields, request.openai_names) from None
        while True:
            budget.attempts += 1
            try:
                async with aclosing(pooled_responses(self._streams, message, budget.left_s())) as responses:
                    async for response in responses:
                        yield response
                return
            except InferenceServerException as exc:  # no stream could be opened
                if not budget.may_resend(exc.status() or "StatusCode.UNAVAILABLE", exc.message()):
                    raise unavailable(f"Triton cannot be reached now ({_short(exc)})") from None
            except ResponseError as exc:
                if not budget.may_resend(exc.status, exc.message):
                    raise from_triton_message(exc.message, info.fields, request.openai_names) from None
            except TimeoutError:
                raise ApiError(
                    504, f"no FINAL response within {timeout_s} s", "server_error", None, "timeout"
                ) from None
            except grpc.RpcError as exc:
                self._ready_at = -1e9  # ask again: the server may be going down
                self._streams.clear()  # the others may have gone with it
                code = exc.code() if hasattr(exc, "code") else None
                if not budget.may_resend(str(code), _short(exc)):
                    raise _stream_failed(exc, code) from None
            self._streams.clear()  # streams of a server that failed this request: not for its resend
            if not await wait_ready_async(lambda: self._model_ready(request.model), budget.deadline):
                raise ApiError(
                    504,
                    f"no FINAL response within {timeout_s} s: Triton was not ready again in time to resend "
                    f"the request ({budget.failures[-1][:200]})",
                    "server_error",
                    None,
                    "timeout",
                )

    async def _model_ready(self, model: str) -> bool:
        try:
            return bool(
                await self.client.is_server_ready(client_timeout=2.0)
                and await self.client.is_model_ready(model, client_timeout=2.0)
            )
        except (InferenceServerException, grpc.RpcError, OSError):
            return False

    def _open_stream(self) -> RequestStream:
        return RequestStream(self.client)


def _stream_failed(exc: grpc.RpcError, code: Any) -> ApiError:
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return unavailable(f"Triton went away during the request ({_short(exc)})")
    return ApiError(502, f"Triton stream failed: {_short(exc)}", "server_error", None, "bad_gateway")


def _short(exc: BaseException) -> str:
    details = exc.details() if isinstance(exc, grpc.RpcError) and hasattr(exc, "details") else str(exc)
    return (details or type(exc).__name__)[:200]

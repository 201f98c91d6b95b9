"""The front's only connection to Triton: gRPC streaming (``tritonclient.grpc.aio``), the model catalog
and readiness.

Our models are decoupled: a request gets progress responses (STEP, TOTAL_STEPS, PREVIEW; TEXT blocks for
the diffusion LM) and then one FINAL response. Prompts and images travel as input tensors, every other
field as a request parameter (so every request carries the same inputs and Triton may batch them), the
way the project's own client sends them.

Streams are pooled and carry one request at a time, as the project's own ``StreamSession`` does: opening a
gRPC stream per request was about a third of the front's CPU (2.5-2.7 ms a request before pooling, 1.4-1.8
after, README), and Triton 2.51 cancels a whole stream, not one request on it, so one stream shared by
requests in flight could not cancel just one. Leaving a request early (the HTTP client went away, a video
job was deleted, the timeout passed) cancels its stream, which cancels the Triton request (its rows leave at
the next step); that stream is dropped, as is one that ended or answered with an error, and only a stream
whose request reached its FINAL response goes back to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.utils import InferenceServerException

from triton_diffusion.openai_front.errors import ApiError, from_triton_message, model_not_found, unavailable

log = logging.getLogger("triton_diffusion.openai_front")

# What a model serves, told from its outputs and inputs (never from its name).
TEXT_TO_IMAGE = "text_to_image"
IMAGE_TO_IMAGE = "image_to_image"
TEXT_TO_VIDEO = "text_to_video"
TEXT_GENERATION = "text_generation"


def model_kind(inputs: Mapping[str, str], outputs: Mapping[str, str]) -> str | None:
    """The kind of a model from its metadata (input/output name -> datatype); None: not one of ours.
    ``text_to_image`` takes an optional source image and mask (img2img and inpainting share its forwards
    with text-only requests): it serves generations and edits. A model that takes a source image but no
    mask is ``image_to_image`` (both declare IMAGE optional, as the image may also come as a parameter)."""
    if "TEXT" in outputs:
        return TEXT_GENERATION
    if "VIDEO" in outputs:
        return TEXT_TO_VIDEO
    if "IMAGE" in outputs:
        if "IMAGE" not in inputs or "MASK_IMAGE" in inputs:
            return TEXT_TO_IMAGE
        return IMAGE_TO_IMAGE
    return None


@dataclass(frozen=True)
class ModelInfo:
    name: str
    kind: str
    inputs: dict[str, str]  # field name (lower case) -> Triton datatype (INT32, FP32, BYTES, ...)
    # Defaults the model's config.pbtxt sets (None: not set there, the model derives its own): the
    # denoising steps of image models, the generated tokens of the diffusion LM.
    default_steps: int | None = None
    default_gen_length: int | None = None

    @property
    def fields(self) -> set[str]:
        return set(self.inputs)


def config_defaults(parameters: Mapping[str, Any]) -> dict[str, int]:
    """``default_<field>`` entries of a model config's parameters that hold an integer, by field name."""
    defaults = {}
    for key, value in parameters.items():
        text = value.get("string_value", "") if isinstance(value, Mapping) else ""
        if key.startswith("default_") and re.fullmatch(r"[0-9]{1,9}", text.strip()):
            defaults[key.removeprefix("default_")] = int(text)
    return defaults


@dataclass
class TritonRequest:
    """One Triton request: its tensors (PROMPT, IMAGE, MASK as bytes) and its parameters."""

    model: str
    tensors: dict[str, bytes]
    parameters: dict[str, Any] = field(default_factory=dict)
    openai_names: dict[str, str] = field(default_factory=dict)  # model field -> OpenAI parameter, for 400s


@dataclass(frozen=True)
class TritonResponse:
    outputs: dict[str, np.ndarray]
    final: bool

    def scalar(self, name: str) -> Any:
        array = self.outputs.get(name)
        return None if array is None else array.reshape(-1)[0]


class TritonBridge:
    """A gRPC connection to Triton shared by every request of the front (one event loop)."""

    def __init__(
        self, url: str, catalog_ttl_s: float = 5.0, ready_ttl_s: float = 1.0, max_idle_streams: int = 64
    ) -> None:
        self.url = url
        self.catalog_ttl_s = catalog_ttl_s
        self.ready_ttl_s = ready_ttl_s
        self._client: grpcclient_aio.InferenceServerClient | None = None
        self._streams = StreamPool(self._open_stream, max_idle_streams)
        self._catalog: dict[str, ModelInfo] = {}
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
                catalog = {}
                for entry in index.get("models", []):
                    if entry.get("state") != "READY":
                        continue
                    meta = await self.client.get_model_metadata(
                        entry["name"], as_json=True, client_timeout=5.0
                    )
                    inputs = {i["name"].lower(): i["datatype"] for i in meta.get("inputs", [])}
                    outputs = {o["name"]: o["datatype"] for o in meta.get("outputs", [])}
                    kind = model_kind({n.upper(): t for n, t in inputs.items()}, outputs)
                    if kind is not None:
                        defaults = await self._config_defaults(entry["name"])
                        catalog[entry["name"]] = ModelInfo(
                            entry["name"],
                            kind,
                            inputs,
                            defaults.get("num_inference_steps"),
                            defaults.get("gen_length"),
                        )
            except (InferenceServerException, grpc.RpcError, OSError) as exc:
                self._ready_at = -1e9
                raise unavailable(
                    f"Triton cannot be reached now ({_short(exc)}); try again shortly"
                ) from None
            self._catalog, self._catalog_at = catalog, time.monotonic()
            return catalog

    async def _config_defaults(self, name: str) -> dict[str, int]:
        """The integer ``default_<field>`` parameters of a model's config ({} when it cannot be read: they
        only tune the front's requests)."""
        try:
            config = await self.client.get_model_config(name, as_json=True, client_timeout=5.0)
        except (InferenceServerException, grpc.RpcError, OSError) as exc:
            log.warning("the config of model %s cannot be read (%s); its defaults are unknown", name, exc)
            return {}
        return config_defaults(config.get("config", {}).get("parameters", {}))

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
    ) -> AsyncIterator[TritonResponse]:
        """Send one request and yield its responses up to the FINAL one. A per-request error raises an
        ApiError (400 naming the field, 503, 500; 504 past ``timeout_s``); closing the iterator early
        cancels the request."""
        inputs = []
        for name, value in request.tensors.items():
            tensor = grpcclient.InferInput(name, [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[value]], dtype=object))
            inputs.append(tensor)
        message = {
            "model_name": request.model,
            "inputs": inputs,
            "request_id": "oai-" + uuid.uuid4().hex[:16],
            # A model that ends a request with a bare FINAL flag (no response) still ends it on the
            # stream: the pooled stream is never half-closed, so nothing else would tell its end.
            "parameters": {**request.parameters, "triton_enable_empty_final_response": True},
        }
        try:
            stream = self._streams.take()
        except InferenceServerException as exc:
            raise unavailable(f"Triton cannot be reached now ({_short(exc)})") from None
        answered = False  # the FINAL response came: the stream is free for the next request
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            stream.send(message)
            while not answered:
                # The deadline around each read only (never around a yield: the caller may go on
                # reading from another task).
                async with asyncio.timeout_at(deadline):
                    result, error = await anext(stream.responses, (None, None))
                if result is None and error is None:
                    return  # the stream ended (the callers tell a missing FINAL response)
                if error is not None:
                    raise from_triton_message(error.message(), info.fields, request.openai_names)
                response = result.get_response()
                outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
                final_flag = response.parameters.get("triton_final_response")
                answered = bool(final_flag.bool_param) if final_flag is not None else False
                if answered and not outputs:
                    return  # an empty FINAL after the last data response: the callers tell it is missing
                yield TritonResponse(outputs, answered)
        except TimeoutError:
            raise ApiError(
                504, f"no FINAL response within {timeout_s} s", "server_error", None, "timeout"
            ) from None
        except grpc.RpcError as exc:
            self._ready_at = -1e9  # ask again: the server may be going down
            self._streams.clear()  # the others may have gone with it
            code = exc.code() if hasattr(exc, "code") else None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise unavailable(f"Triton went away during the request ({_short(exc)})") from None
            raise ApiError(
                502, f"Triton stream failed: {_short(exc)}", "server_error", None, "bad_gateway"
            ) from None
        finally:
            # Back to the pool after its FINAL response; else (left early, an error response, a failed
            # stream) cancelled, which cancels the Triton request, and dropped.
            self._streams.give_back(stream, reusable=answered)

    def _open_stream(self) -> RequestStream:
        return RequestStream(self.client)


class RequestStream:
    """One gRPC stream to Triton that carries one request at a time (see the module's docstring)."""

    def __init__(self, client: grpcclient_aio.InferenceServerClient) -> None:
        self._requests: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.responses = client.stream_infer(self._feed())

    async def _feed(self) -> AsyncIterator[dict[str, Any]]:
        while (message := await self._requests.get()) is not None:
            yield message

    def send(self, message: dict[str, Any]) -> None:
        self._requests.put_nowait(message)

    def ended(self) -> bool:
        """The gRPC call is over (cancelled, or the connection closed under it: a restarted server).
        tritonclient's iterator keeps its gRPC call as ``_grpc_call`` and offers no public way to ask."""
        return self.responses._grpc_call.done()

    def cancel(self) -> None:
        # The end of the requests first: gRPC stops reading them only when it cancels a live call, so on
        # a call the server already ended the task reading them would wait for ever.
        self._requests.put_nowait(None)
        self.responses.cancel()  # cancels the Triton request on it, if one is running


class StreamPool:
    """Idle streams, the most recently used first (its connection is the likeliest to be alive); at most
    ``max_idle`` kept, the rest closed."""

    def __init__(self, open_stream: Callable[[], Any], max_idle: int) -> None:
        self._open = open_stream
        self._max_idle = max_idle
        self._idle: list[Any] = []

    def take(self) -> Any:
        while self._idle:
            stream = self._idle.pop()
            if not stream.ended():
                return stream
            stream.cancel()  # ended by the server: its request reader still waits
        return self._open()

    def give_back(self, stream: Any, reusable: bool) -> None:
        if reusable and not stream.ended() and len(self._idle) < self._max_idle:
            self._idle.append(stream)
        else:
            stream.cancel()

    def clear(self) -> None:
        idle, self._idle = self._idle, []
        for stream in idle:
            stream.cancel()

    def __len__(self) -> int:
        return len(self._idle)


def _short(exc: BaseException) -> str:
    details = exc.details() if isinstance(exc, grpc.RpcError) and hasattr(exc, "details") else str(exc)
    return (details or type(exc).__name__)[:200]

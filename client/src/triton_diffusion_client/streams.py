"""The one gRPC stream client of triton-diffusion: the image and text clients (threads) and the OpenAI
front (asyncio) all send their requests and read their responses here.

Our models are decoupled: a request gets progress responses (STEP, TOTAL_STEPS, PREVIEW; TEXT blocks for
the diffusion LM) and then one FINAL response. Prompts and images travel as BYTES input tensors, every
other field as a request parameter, so every request of a model carries the same inputs and Triton may
batch them together.

A stream carries one request at a time: tritonclient reports an error response without its request id
(so an error belongs to the request in flight), and Triton 2.51 cancels a whole stream, not one request
on it. A stream whose request reached its FINAL response is kept for the next request (opening a stream
costs about a millisecond of CPU per request); one left early (cancelled, timed out) or that answered with
an error is cancelled, which cancels its Triton request, and dropped.

- :class:`StreamSession`: one connection and stream, for requests sent one after another from a thread.
- :class:`RequestStream`, :class:`StreamPool`, :func:`pooled_responses`: pooled streams on one
  ``tritonclient.grpc.aio`` connection, for many requests at once on an event loop.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from triton_diffusion_client.retry import RESUME_KEY_FIELD, RetryBudget, unknown_resume_key, wait_ready


class ResponseError(Exception):
    """The request failed: the model's own message (``field: ...``), or the stream's (``[StatusCode.X]
    ...`` when the connection failed). ``message`` is the text alone, ``str()`` adds the gRPC status;
    ``status`` is that status (``StatusCode.UNAVAILABLE``), None for the model's own answer."""

    def __init__(self, error: InferenceServerException | str, status: str | None = None) -> None:
        super().__init__(str(error))
        self.message = error if isinstance(error, str) else error.message()
        self.status = status if isinstance(error, str) else error.status()


class UnsendableRequest(ResponseError):
    """A request refused here, before it is sent, as the model would refuse it (``field: ...
    [INVALID_ARG]``): a request id or string parameter that cannot reach the model as it is."""


def check_sendable(request_id: str, parameters: Mapping[str, Any]) -> None:
    """Refuse, naming it, a request id or string parameter (name or value) that Triton cannot carry to
    the model intact. Text that is not valid UTF-8 (a ``str`` holding a lone surrogate, as
    ``errors="surrogateescape"`` makes): in a gRPC request it makes Triton end the whole stream, with no
    response for that request or the ones after it on the stream. A NUL character: Triton cuts the text
    there (its C API takes NUL-terminated strings), so the model would get a shorter value, unaware."""
    texts = [("request_id", request_id)]
    for name, value in parameters.items():
        texts.append((f"parameter name {name[:64]!r}", name))
        texts.append((name if name.isprintable() and len(name) <= 64 else repr(name[:64]), value))
    for field, text in texts:
        if isinstance(text, str) and (why := _unsendable(text)) is not None:
            raise UnsendableRequest(f"{field}: {why} [INVALID_ARG]")


def _unsendable(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"is not valid UTF-8 (character {exc.start} is a lone surrogate); Triton would end the stream "
            "without an answer"
        )
    nul = text.find("\0")
    if nul >= 0:
        return f"contains a NUL character at position {nul}; Triton would cut the text there"
    return None


@dataclass(frozen=True)
class StreamResponse:
    """One response: its outputs by name (every output the model sent) and whether it is the FINAL one."""

    outputs: dict[str, np.ndarray]
    final: bool

    def scalar(self, name: str) -> Any:
        """The first element of an output, None when the response has no such output."""
        array = self.outputs.get(name)
        return None if array is None else array.reshape(-1)[0]


def request_message(
    model: str, tensors: Mapping[str, bytes], parameters: Mapping[str, Any], request_id: str
) -> dict[str, Any]:
    """One request as both tritonclient APIs take it (``async_stream_infer(**message)``, and the items of
    ``stream_infer``'s request iterator). No requested outputs: the model sends what it has (IMAGE or
    VIDEO or TEXT, ...). Raises :class:`UnsendableRequest` for an id or parameter Triton would not carry
    to the model intact (:func:`check_sendable`)."""
    check_sendable(request_id, parameters)
    inputs = []
    for name, value in tensors.items():
        tensor = grpcclient.InferInput(name, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[value]], dtype=object))
        inputs.append(tensor)
    return {
        "model_name": model,
        "inputs": inputs,
        "request_id": request_id,
        # A model that ends a request with a bare FINAL flag (no data) still ends it on the stream: a kept
        # stream is never half-closed, so nothing else would tell the request's end.
        "parameters": {
            **{k: v for k, v in parameters.items() if v is not None},
            "triton_enable_empty_final_response": True,
        },
    }


def read_result(result: Any) -> StreamResponse:
    """A tritonclient InferResult (either API) as a :class:`StreamResponse`."""
    response = result.get_response()
    outputs = {output.name: result.as_numpy(output.name) for output in response.outputs}
    final_flag = response.parameters.get("triton_final_response")
    return StreamResponse(outputs, bool(final_flag.bool_param) if final_flag is not None else False)


# ---- threads -------------------------------------------------------------------------------------------
def stop_cancelling(client: grpcclient.InferenceServerClient) -> None:
    """Stop ``client``'s stream with ``cancel_requests=True``, then end its requests side (after the
    cancel, so that the server sees the cancel alone, as it did before; :func:`end_request_iterator`)."""
    stream = getattr(client, "_stream", None)
    client.stop_stream(cancel_requests=True)
    end_request_iterator(stream)


def end_request_iterator(stream: object) -> None:
    """End the requests side of a tritonclient stream (``client._stream``) stopped with
    ``cancel_requests=True``.

    tritonclient (2.50) ends a stream's request iterator only on a graceful stop: a cancelling one leaves
    gRPC's thread that reads it blocked for good, one thread (and its call) per cancelled stream, which
    slowed a long benchmark's client to a crawl. The one private piece of tritonclient used here (the
    client's ``_stream`` and its ``_request_queue``, where ``None`` ends the iterator);
    tests/unit/test_stream_threads.py fails if it moves."""
    requests = getattr(stream, "_request_queue", None)
    if requests is not None:
        requests.put(None)


_Session = TypeVar("_Session", bound="StreamSession")


class StreamSession:
    """One gRPC connection and stream to a model, reused for requests sent one after another.
    Concurrency comes from several sessions (each on its own thread)."""

    def __init__(self, url: str = "localhost:8001", model: str = "text_to_image") -> None:
        self.url = url
        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self._responses: queue.Queue = queue.Queue()
        self._streaming = False

    def __enter__(self: _Session) -> _Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._streaming:
            self._stop_stream(cancel=True)  # never waits on a server that may be gone
        self.client.close()

    def _stop_stream(self, cancel: bool) -> None:
        if cancel:
            stop_cancelling(self.client)
        else:
            self.client.stop_stream(cancel_requests=False)
        self._streaming = False
        self._responses = queue.Queue()  # whatever the old stream still reports goes nowhere

    def _send(self, message: dict[str, Any]) -> None:
        if not self._streaming:
            responses = self._responses
            self.client.start_stream(callback=lambda result, error: responses.put((result, error)))
            self._streaming = True
        self.client.async_stream_infer(**message)

    def responses(
        self,
        tensors: Mapping[str, bytes],
        parameters: Mapping[str, Any],
        request_id: str,
        timeout_s: float = 300.0,
    ) -> Generator[StreamResponse, None, None]:
        """Send one request and yield its responses up to the FINAL one (an empty FINAL is not
        yielded). Raises :class:`ResponseError` for an error response or an unreachable server,
        ``TimeoutError`` past ``timeout_s``. Closing the iterator early (``contextlib.closing``) cancels
        the request: the stream closes with cancel_requests=True, which Triton passes on to the model."""
        message = request_message(self.model, tensors, parameters, request_id)
        try:
            self._send(message)
        except InferenceServerException:
            # The stream broke with its connection (the server restarted): a new one, once.
            self._stop_stream(cancel=False)
            try:
                self._send(message)
            except InferenceServerException as exc:
                self._stop_stream(cancel=False)
                raise ResponseError(
                    f"UNAVAILABLE: the server cannot be reached now ({exc.message()})",
                    "StatusCode.UNAVAILABLE",
                ) from None
        deadline = time.monotonic() + timeout_s
        answered = False
        try:
            while True:
                try:
                    result, error = self._responses.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(f"no final response within {timeout_s} s") from None
                if error is not None:
                    raise ResponseError(error)
                response = read_result(result)
                answered = response.final
                if response.outputs:
                    yield response
                if answered:
                    return
        finally:
            if not answered:  # left early, timed out or failed: cancel the request, drop the stream
                self._stop_stream(cancel=True)

    def resilient_responses(
        self,
        tensors: Mapping[str, bytes],
        parameters: Mapping[str, Any],
        request_id: str,
        budget: RetryBudget,
    ) -> Generator[StreamResponse, None, None]:
        """:meth:`responses`, resent (same fields, same resume key) after a failure :mod:`.retry` deems
        retryable, once the server and the model are ready again, within ``budget``. A resumed request
        goes on from its checkpoint: its progress responses start from that step. Raises as
        :meth:`responses` does for the last attempt, ``TimeoutError`` past the budget's deadline."""
        parameters = dict(parameters)
        while True:
            budget.attempts += 1
            try:
                yield from self.responses(tensors, parameters, request_id, budget.left_s())
                return
            except TimeoutError:
                raise budget.timed_out() from None
            except ResponseError as error:
                if budget.resume_key is not None and unknown_resume_key(error.message):
                    # A server from before resume keys: the same request without one, at once.
                    parameters.pop(RESUME_KEY_FIELD, None)
                    budget.resume_key = None
                    continue
                if not budget.may_resend(error.status, error.message):
                    raise
            # A new connection: behind a load balancer it may reach another replica than the draining one.
            self._reconnect()
            if not wait_ready(self.server_ready, budget.deadline, budget.clock):
                raise budget.timed_out()

    def server_ready(self) -> bool:
        """The server and this session's model answer ready (a restarted server loads its models)."""
        try:
            return bool(
                self.client.is_server_ready(client_timeout=2.0)
                and self.client.is_model_ready(self.model, client_timeout=2.0)
            )
        except InferenceServerException:
            return False

    def _reconnect(self) -> None:
        if self._streaming:
            self._stop_stream(cancel=True)
        self.client.close()
        self.client = grpcclient.InferenceServerClient(self.url)


# ---- asyncio (the OpenAI front) ------------------------------------------------------------------------
class RequestStream:
    """One gRPC stream on a ``tritonclient.grpc.aio`` client that carries one request at a time."""

    def __init__(self, client: Any) -> None:
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


async def pooled_responses(
    pool: StreamPool, message: dict[str, Any], timeout_s: float
) -> AsyncGenerator[StreamResponse, None]:
    """Send one request (:func:`request_message`) on a pooled stream and yield its responses up to the
    FINAL one (an empty FINAL is not yielded; a stream that ends without one just stops). Raises
    :class:`ResponseError` for an error response, ``TimeoutError`` past ``timeout_s``; a broken stream's
    ``grpc.RpcError`` and a failed open's ``InferenceServerException`` pass through. Closing the iterator
    early (``contextlib.aclosing``) cancels the request."""
    stream = pool.take()
    answered = False  # the FINAL response came: the stream is free for the next request
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        stream.send(message)
        while not answered:
            # The deadline around each read only (never around a yield: the caller may go on reading
            # from another task). wait_for, not asyncio.timeout_at: that is Python 3.11+.
            left = deadline - loop.time()
            result, error = await asyncio.wait_for(anext(stream.responses, (None, None)), max(left, 0))
            if result is None and error is None:
                return  # the stream ended
            if error is not None:
                raise ResponseError(error)
            response = read_result(result)
            answered = response.final
            if response.outputs:
                yield response
    except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11, two before
        raise TimeoutError(f"no FINAL response within {timeout_s} s") from None
    finally:
        # Back to the pool after its FINAL response; else (left early, an error response, a failed
        # stream) cancelled, which cancels the Triton request, and dropped.
        pool.give_back(stream, reusable=answered)

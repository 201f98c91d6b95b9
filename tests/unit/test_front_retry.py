"""The OpenAI front resends a request Triton lost as the project's client does (triton_bridge.py,
``triton_diffusion_client.retry``): with a resume key of its own, once Triton and the model are ready
again, within its retries and the request's timeout, so the HTTP client sees one answer; and it never
forwards a resume key an OpenAI client sent."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest
from triton_diffusion_client import retry
from tritonclient.utils import InferenceServerException

from triton_diffusion.errors import RESEND, ErrorCode, RequestError, tagged_message
from triton_diffusion.openai_front.chat import text_chunks
from triton_diffusion.openai_front.errors import ApiError
from triton_diffusion.openai_front.image_translation import image_call
from triton_diffusion.openai_front.images import image_events
from triton_diffusion.openai_front.limits import Limits
from triton_diffusion.openai_front.text_translation import TextCall
from triton_diffusion.openai_front.triton_bridge import ModelInfo, TritonBridge, TritonRequest
from triton_diffusion.recovery.drain import DRAINING_MESSAGE


class Gone(grpc.RpcError):
    """The stream's call failed under the request: Triton went away."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "Socket closed"


class Result:
    """A tritonclient InferResult as streams.read_result reads it: one IMAGE, FINAL or not."""

    def __init__(self, final: bool) -> None:
        self.final = final

    def get_response(self):
        final = self.final

        class Flag:
            bool_param = final

        class Output:
            name = "IMAGE"

        class Response:
            outputs = [Output()]
            parameters = {"triton_final_response": Flag()}

        return Response()

    def as_numpy(self, name: str) -> np.ndarray:
        return np.array([b"png"], dtype=object)


class Call:
    """tritonclient.grpc.aio's stream iterator: answers its one request with a script ("progress",
    "final", "gone" (the stream fails), "draining", "invalid")."""

    def __init__(self, requests, script: list[str], sent: list) -> None:
        self.requests, self.script, self.sent = requests.__aiter__(), list(script), sent
        self.cancelled = False
        self._grpc_call = self

    def done(self) -> bool:
        return self.cancelled

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def __aiter__(self):
        return self

    async def __anext__(self):
        if len(self.sent) == 0 or self.sent[-1][1] is not self:
            self.sent.append((await self.requests.__anext__(), self))
        kind = self.script.pop(0)
        if kind == "gone":
            raise Gone()
        if kind == "draining":
            draining = RequestError(ErrorCode.UNAVAILABLE, DRAINING_MESSAGE, RESEND)
            return None, InferenceServerException(tagged_message(draining))
        if kind == "invalid":
            invalid = RequestError(ErrorCode.INVALID_ARG, "seed: must be an integer")
            return None, InferenceServerException(tagged_message(invalid))
        return Result(final=kind == "final"), None


class FakeTriton:
    """The aio client: each stream answers with the next script; readiness polls answer ``ready`` in
    order (True once used up)."""

    def __init__(self, scripts: list[list[str]], ready: list[bool] = ()) -> None:
        self.scripts, self.ready = list(scripts), list(ready)
        self.sent: list = []
        self.polls = 0

    def stream_infer(self, requests, stream_timeout=None):
        return Call(requests, self.scripts.pop(0), self.sent)

    async def is_server_ready(self, client_timeout=None) -> bool:
        self.polls += 1
        return self.ready.pop(0) if self.ready else True

    async def is_model_ready(self, model, client_timeout=None) -> bool:
        return True

    async def close(self) -> None:
        pass


def model(resume_keys: bool = True) -> ModelInfo:
    names = ["prompt", "seed", "num_images_per_prompt", "output_format", "output_encoding", "progress"]
    names += ["resume_key"] if resume_keys else []
    fields = {n: {"type": "integer" if n == "seed" else "string", "supported": True} for n in names}
    return ModelInfo("m", "text_to_image", fields, "default")


def run(triton: FakeTriton, info: ModelInfo, parameters=None, timeout_s: float = 5.0, retries: int = 3):
    bridge = TritonBridge("127.0.0.1:1", retries=retries)
    bridge._client = triton
    request = TritonRequest("m", {"PROMPT": b"a cat"}, dict(parameters or {}))

    async def read() -> list[bool]:
        return [response.final async for response in bridge.stream(request, info, timeout_s)]

    return asyncio.run(asyncio.wait_for(read(), 30))


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setattr(retry, "FIRST_WAIT_S", 0.01)


def keys(triton: FakeTriton) -> list:
    return [message["parameters"].get("resume_key") for message, _ in triton.sent]


def test_a_request_triton_lost_is_resent_with_the_fronts_key_and_answered_once():
    triton = FakeTriton([["progress", "gone"], ["draining"], ["progress", "final"]], ready=[False, True])
    assert run(triton, model()) == [False, False, True]  # one answer: its progress, then its image
    (key,) = set(keys(triton))
    assert len(triton.sent) == 3 and retry.RESUME_KEY.fullmatch(key) and triton.polls == 3
    assert all(call.cancelled for _, call in triton.sent[:2])  # the failed streams were dropped


def test_a_model_without_resume_keys_gets_none_and_is_still_resent():
    triton = FakeTriton([["gone"], ["final"]])
    assert run(triton, model(resume_keys=False)) == [True] and keys(triton) == [None, None]


def test_an_openai_clients_resume_key_is_refused_and_never_forwarded():
    with pytest.raises(ApiError) as refused:
        image_call({"prompt": "a cat", "resume_key": "someone-elses-key-0123"}, {}, model(), Limits())
    assert refused.value.status == 400 and refused.value.param == "resume_key"
    assert "the front gives every request its own" in refused.value.message
    # Even one that reached the bridge some other way is replaced by the front's own, or dropped.
    triton = FakeTriton([["final"], ["final"]])
    run(triton, model(), {"resume_key": "someone-elses-key-0123"})
    run(triton, model(), {"resume_key": "someone-elses-key-0123"}, retries=0)
    assert "someone-elses-key-0123" not in keys(triton) and keys(triton)[1] is None


@pytest.mark.parametrize(
    ("scripts", "retries", "status", "sent"),
    [
        ([["invalid"], ["final"]], 3, 400, 1),  # refused for what it is: never resent
        ([["gone"], ["final"]], 0, 503, 1),  # retry off
        ([["gone"]] * 3, 2, 503, 3),  # the budget spent: the last failure's answer
    ],
)
def test_what_is_not_resent(scripts, retries, status, sent):
    triton = FakeTriton(scripts)
    with pytest.raises(ApiError) as failed:
        run(triton, model(), retries=retries)
    assert failed.value.status == status and len(triton.sent) == sent


def test_the_requests_timeout_bounds_its_resends():
    triton = FakeTriton([["gone"], ["final"]], ready=[False] * 1000)  # Triton never comes back
    with pytest.raises(ApiError) as late:
        run(triton, model(), timeout_s=0.3)
    assert late.value.status == 504 and "not ready again in time" in late.value.message


class TextResponse:
    """A diffusion-LM response as the front reads it: a committed block (its index) or the FINAL text."""

    def __init__(self, text: str, block: int | None = None) -> None:
        self.final = block is None
        self.values = {"TEXT": text.encode(), "BLOCK": block, "TOKENS": 3}

    def scalar(self, name: str):
        return self.values.get(name)


def streamed_chat(*responses: TextResponse) -> tuple[str, list[dict]]:
    """The chat chunks' text and the error events, as the openai client would read the stream."""
    call = TextCall(TritonRequest("m", {}, {}), True, False, "m", None)

    async def rest():
        for response in responses[1:]:
            yield response

    async def read() -> list[bytes]:
        return [chunk async for chunk in text_chunks(call, True, None, responses[0], rest())]

    lines = b"".join(asyncio.run(read())).decode().splitlines()
    events = [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in events if c.get("choices"))
    return text, [e for e in events if "error" in e]


def test_a_resent_chat_stream_never_repeats_or_changes_what_was_sent():
    """The bridge resends a request Triton lost; the diffusion LM runs it again from its first block, with
    the seed the front's key gives: the blocks already sent come again and are dropped."""
    hello, world, bye = TextResponse("Hello", 0), TextResponse(" world.", 1), TextResponse(" Bye.", 2)
    text, errors = streamed_chat(hello, world, hello, world, bye, TextResponse("Hello world. Bye."))
    assert text == "Hello world. Bye." and not errors
    # A block that came back different cannot be taken back: the stream ends with an error saying why.
    text, errors = streamed_chat(hello, TextResponse("Goodbye", 0), world, TextResponse("Goodbye world."))
    assert text == "Hello" and "block 0 came back different" in errors[0]["error"]["message"]


def test_a_stream_triton_ends_without_a_final_response_ends_with_an_error_event():
    """Not a silent end (HTTP 200, no [DONE], no completed event): the client is told the answer is cut."""
    text, errors = streamed_chat(TextResponse("Hello", 0), TextResponse(" world.", 1))
    assert text == "Hello world." and len(errors) == 1, errors
    assert "without a FINAL response" in errors[0]["error"]["message"]

    class Preview:
        final = False

        def scalar(self, name: str):
            return np.array([b"png"], dtype=object) if name == "PREVIEW" else None

    async def nothing_more():
        for response in ():
            yield response

    call = image_call({"prompt": "x", "stream": True, "partial_images": 1}, {}, model(), Limits())

    async def read() -> list[bytes]:
        return [chunk async for chunk in image_events(call, "image_generation", Preview(), nothing_more())]

    events = b"".join(asyncio.run(read())).decode()
    assert "image_generation.partial_image" in events and "completed" not in events
    assert "event: error" in events and "without a FINAL response" in events, events

"""The project's client refuses, before sending, what Triton cannot carry to the model intact
(client/src/triton_diffusion_client/streams.py ``check_sendable``): text that is not valid UTF-8 in a
request id or a parameter (a gRPC request holding one makes Triton end the whole stream, answering
nothing on it), and a NUL in one (Triton cuts the text there: the model would get a shorter value)."""

from __future__ import annotations

import asyncio
import io

import pytest
from triton_diffusion_client import ImageSession
from triton_diffusion_client.streams import UnsendableRequest, pooled_responses, request_message

from triton_diffusion.errors import ErrorCode, code_of


@pytest.mark.parametrize(
    ("request_id", "parameters", "says"),
    [
        (
            "r",
            {"negative_prompt": "a\0" + "x" * 5000},
            "negative_prompt: contains a NUL character at position 1",
        ),
        ("r", {"service_tier": "flex\0"}, "service_tier: contains a NUL character at position 4"),
        ("r", {"neg\0x": "v"}, "parameter name 'neg\\x00x': contains a NUL character at position 3"),
        ("a\0b", {}, "request_id: contains a NUL character at position 1"),
        ("r", {"negative_prompt": "ab\udcff"}, "negative_prompt: is not valid UTF-8 (character 2"),
        ("id\udcff", {}, "request_id: is not valid UTF-8 (character 2"),
        ("r", {"x\udcff": 1}, "parameter name 'x\\udcff': is not valid UTF-8 (character 1"),
    ],
)
def test_what_triton_would_cut_or_choke_on_is_refused_before_sending_naming_it(request_id, parameters, says):
    with pytest.raises(UnsendableRequest) as refused:
        request_message("text_to_image", {"PROMPT": b"x"}, parameters, request_id)
    assert refused.value.message.startswith(says), refused.value.message
    assert code_of(refused.value.message) is ErrorCode.INVALID_ARG  # tagged as the model tags its own


def test_what_travels_intact_is_sent_as_it_is():
    # A NUL in a tensor travels intact (the model refuses it by name); numbers and booleans are no text.
    message = request_message(
        "text_to_image",
        {"PROMPT": b"a\0b"},
        {"negative_prompt": "blurry, caf\u00e9 \u2615", "seed": 0, "progress": True},
        "r-1",
    )
    assert message["request_id"] == "r-1" and message["parameters"]["seed"] == 0
    assert message["parameters"]["negative_prompt"] == "blurry, caf\u00e9 \u2615"


def test_the_image_client_answers_an_unsendable_request_with_its_error_and_sends_nothing():
    with ImageSession("127.0.0.1:1", "text_to_image") as session:  # nothing listens there
        result = session.generate({"prompt": "a cat", "negative_prompt": "a\0b"}, "r")
    assert not result.ok and result.error.startswith("negative_prompt: contains a NUL"), result.error
    assert not session._streaming  # no stream was opened


class SilentStream:
    """A pooled stream that takes a request and never answers."""

    def __init__(self) -> None:
        self.sent: list = []

        async def never():
            await asyncio.sleep(3600)
            yield None

        self.responses = never()

    def send(self, message) -> None:
        self.sent.append(message)


class OnePool:
    def __init__(self) -> None:
        self.stream, self.returned = SilentStream(), []

    def take(self):
        return self.stream

    def give_back(self, stream, reusable: bool) -> None:
        self.returned.append(reusable)


def test_a_pooled_request_without_an_answer_times_out_and_its_stream_is_dropped(monkeypatch):
    # The deadline is read with asyncio.wait_for, which Python 3.10 has: asyncio.timeout_at (3.11+) is
    # taken away here, as on 3.10, so code that used it fails this test on any Python.
    monkeypatch.delattr(asyncio, "timeout_at", raising=False)
    pool = OnePool()

    async def read() -> list:
        return [response async for response in pooled_responses(pool, {"id": "t"}, 0.05)]

    with pytest.raises(TimeoutError, match="no FINAL response within 0.05 s"):
        asyncio.run(read())
    assert pool.stream.sent == [{"id": "t"}] and pool.returned == [False]  # not reusable: cancelled


class _Stream(io.StringIO):
    def __init__(self, terminal: bool) -> None:
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def test_progress_is_a_line_each_in_a_log_and_one_redrawn_line_on_a_terminal():
    from triton_diffusion_client.images import Progress, ProgressLine

    log = _Stream(terminal=False)
    line = ProgressLine(2, log)
    line.update(0, Progress(1, 4, None))
    line.update(1, Progress(2, 8, None))
    line.close()
    assert log.getvalue() == "[0] step 1/4\n[1] step 2/8\n"  # never run together
    screen = _Stream(terminal=True)
    line = ProgressLine(2, screen)
    line.update(0, Progress(2, 4, None))
    line.close()
    text = screen.getvalue()
    assert text.startswith("\r\x1b[K[#####     ]  2/4") and text.endswith("\n") and text.count("\n") == 1

"""The client resends a request the server lost (client/src/triton_diffusion_client/retry.py): against a
fake Triton at tritonclient's level (the real StreamSession code runs), a request whose stream broke, that
found the server down or draining, is resent with the same resume key once the server is ready again,
within its retry budget and its total deadline; a request refused for what it is never is."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from triton_diffusion_client import ImageSession, TextSession, images, retry, streams, text
from tritonclient.utils import InferenceServerException

from triton_diffusion.errors import RESEND, ErrorCode, RequestError, Retry, RetryHint, tagged_message
from triton_diffusion.recovery.drain import DRAINING_MESSAGE

KEY = "caller-chosen-key_0123"


class FakeResult:
    """A tritonclient InferResult as streams.read_result reads it."""

    def __init__(self, outputs: dict[str, np.ndarray], final: bool) -> None:
        self.outputs, self.final = outputs, final

    def get_response(self):
        final, names = self.final, list(self.outputs)

        class Flag:
            bool_param = final

        class Output:
            def __init__(self, name: str) -> None:
                self.name = name

        class Response:
            outputs = [Output(name) for name in names]
            parameters = {"triton_final_response": Flag()}

        return Response()

    def as_numpy(self, name: str) -> np.ndarray:
        return self.outputs[name]


def step(n: int, total: int = 4) -> tuple:
    return FakeResult({"STEP": np.array([n]), "TOTAL_STEPS": np.array([total])}, final=False), None


def final(resumed_from_step: int | None = None) -> tuple:
    batch = (
        {"calls": 1} if resumed_from_step is None else {"calls": 1, "resumed_from_step": resumed_from_step}
    )
    outputs = {
        "IMAGE": np.array([b"png"], dtype=object),
        "SEED": np.array([7]),
        "BATCH": np.array([json.dumps(batch).encode()], dtype=object),
    }
    return FakeResult(outputs, final=True), None


def failure(message: str, status: str | None = None) -> tuple:
    return None, InferenceServerException(message, status=status)


BROKEN = failure("Socket closed", "StatusCode.UNAVAILABLE")


class FakeTriton:
    """One server behind every connection the client opens: answers each request with the next script,
    refuses connections while ``down`` (until a readiness poll finds it back: ``ready`` is what the polls
    answer, in order; True once they are used up)."""

    def __init__(self, scripts: list[list[tuple]], ready: list[bool] = (), down: bool = False) -> None:
        self.scripts, self.ready, self.down = list(scripts), list(ready), down
        self.sent: list[dict] = []
        self.connections = 0
        self.polls = 0

    def client(self, url: str) -> FakeClient:
        self.connections += 1
        return FakeClient(self)


class FakeClient:
    def __init__(self, server: FakeTriton) -> None:
        self.server, self.callback = server, None

    def start_stream(self, callback) -> None:
        self.callback = callback

    def async_stream_infer(self, **message) -> None:
        if self.server.down:
            raise InferenceServerException(
                "failed to connect to all addresses", status="StatusCode.UNAVAILABLE"
            )
        self.server.sent.append(message)
        for result, error in self.server.scripts.pop(0):
            if result == "sleep":  # the server takes this long before its next answer
                time.sleep(error)
                continue
            self.callback(result, error)

    def stop_stream(self, cancel_requests: bool = False) -> None:
        self.callback = None

    def is_server_ready(self, client_timeout=None) -> bool:
        self.server.polls += 1
        ready = self.server.ready.pop(0) if self.server.ready else True
        self.server.down = self.server.down and not ready
        return ready

    def is_model_ready(self, model, client_timeout=None) -> bool:
        return True

    def close(self) -> None:
        pass


@pytest.fixture
def triton(monkeypatch):
    """Install a FakeTriton (set its scripts, readiness and state on the returned holder)."""
    monkeypatch.setattr(retry, "FIRST_WAIT_S", 0.01)
    holder: dict = {}

    def install(*args, **kwargs) -> FakeTriton:
        holder["server"] = FakeTriton(*args, **kwargs)
        monkeypatch.setattr(streams.grpcclient, "InferenceServerClient", holder["server"].client)
        return holder["server"]

    return install


def generate(request: dict | None = None, **kwargs):
    seen: list[int] = []
    with ImageSession("fake:8001", "text_to_image") as session:
        result = session.generate(
            request or {"prompt": "a cat"}, "r", on_progress=lambda p: seen.append(p.step), **kwargs
        )
    return result, seen


def keys(server: FakeTriton) -> list:
    return [message["parameters"].get("resume_key") for message in server.sent]


def test_a_request_whose_stream_broke_is_resent_with_its_key_and_resumes(triton):
    server = triton(
        [[step(1), step(2), BROKEN], [step(3), step(4), final(resumed_from_step=2)]], [False, True]
    )
    result, seen = generate()
    assert result.ok and result.attempts == 2, result.error
    (key,) = set(keys(server))  # the same key both times, one the server accepts
    assert retry.RESUME_KEY.fullmatch(key) and result.resume_key == key
    assert [m["request_id"] for m in server.sent] == ["r", "r"]
    assert seen == result.steps == [1, 2, 3, 4]  # progress goes on from where the request resumed
    assert result.batch["resumed_from_step"] == 2 and result.images == [b"png"]
    assert server.polls == 2 and server.connections == 2  # waited for ready, on a new connection


def served(message: str, hint: RetryHint | None = None) -> str:
    """An UNAVAILABLE answer as the server words it on the wire (errors.py tagged_message)."""
    return tagged_message(RequestError(ErrorCode.UNAVAILABLE, message, hint))


@pytest.mark.parametrize("reworded", [False, True])
def test_a_server_down_draining_shutting_down_or_that_checkpointed_it_gets_it_again(triton, reworded):
    # The server's own messages, and the same hints under words that say nothing: the client acts on the
    # hint alone, so rewording a message changes nothing.
    answers = [
        (DRAINING_MESSAGE, RESEND),
        (f"draining: checkpointed at step 2; resend with resume_key {KEY}", RetryHint(Retry.RESUME, KEY, 2)),
        ("the model is shutting down", RESEND),
    ]
    server = triton(
        [[failure(served("zzz" if reworded else words, hint))] for words, hint in answers] + [[final()]],
        down=True,  # connections refused while it restarts
    )
    result, _ = generate({"prompt": "a cat", "resume_key": KEY}, retries=4)
    # 3 answers, a connection refused while it restarts, then the result: 5 attempts, 4 of them sent
    assert result.ok and result.attempts == 5 and keys(server) == [KEY] * 4, result.error


def test_an_answer_without_a_hint_is_not_resent_whatever_its_words(triton):
    # Last round's contract was words: "draining", or the request's own key, in an UNAVAILABLE answer.
    server = triton([[failure(served(f"draining: checkpointed; resend with resume_key {KEY}"))], [final()]])
    result, _ = generate({"prompt": "a cat", "resume_key": KEY})
    assert not result.ok and result.attempts == 1 and len(server.sent) == 1


def test_a_hint_on_an_answer_other_than_unavailable_is_not_acted_on(triton):
    # e.g. a prompt that ends with the hint's text, echoed in a field error
    words = tagged_message(RequestError(ErrorCode.INVALID_ARG, "prompt: got 'x'", RESEND))
    server = triton([[failure(words)], [final()]])
    result, _ = generate()
    assert not result.ok and result.attempts == 1 and len(server.sent) == 1


@pytest.mark.parametrize(
    "words",
    [
        # the server up, the model not yet
        "Request for unknown model: 'text_to_image' has no available versions",
        "[request id: 7] Server is stopping, scheduler for model has stopped accepting new inference"
        " requests",
    ],
)
def test_a_request_sent_while_the_server_restarts_is_sent_again(triton, words):
    # Triton's words while the supervisor restarts the server, seen by the crash soak (bench.py crash-soak).
    server = triton([[failure(words, "StatusCode.INVALID_ARGUMENT")], [final()]])
    result, _ = generate()
    assert result.ok and result.attempts == 2 and server.polls >= 1, result.error


def test_it_gives_up_after_its_retries(triton):
    server = triton([[BROKEN]] * 5)
    result, _ = generate(retries=2)
    assert not result.ok and result.attempts == 3 and len(server.sent) == 3
    assert "Socket closed" in result.error


@pytest.mark.parametrize(
    "answer",
    [
        failure("seed: must be an integer, got 'x' [INVALID_ARG]"),
        failure("at capacity: no room within max_admission_wait_s [UNAVAILABLE]"),  # no retry hint
        failure("pipeline failed [INTERNAL]"),
        failure("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED"),
        failure("Request for unknown model: 'text_to_imag' is not found", "StatusCode.NOT_FOUND"),
    ],
)
def test_what_would_fail_again_is_never_resent(triton, answer):
    server = triton([[answer], [final()]])
    result, _ = generate()
    assert not result.ok and result.attempts == 1 and len(server.sent) == 1 and server.polls == 0


def test_the_deadline_bounds_every_attempt_and_wait_together(triton):
    triton([[BROKEN], [final()]], ready=[False] * 1000)  # never back
    started = time.monotonic()
    result, _ = generate(timeout_s=0.5)
    # Without the deadline it would poll a server never back a thousand times: seconds are margin enough.
    assert time.monotonic() - started < 5.0
    assert not result.ok and result.error.startswith("no final response within 0.5 s (1 attempts"), (
        result.error
    )


def test_a_resend_gets_what_is_left_of_the_deadline_not_a_new_one(triton):
    triton([[("sleep", 1.2), BROKEN], []])  # the resend is never answered
    started = time.monotonic()
    result, _ = generate(timeout_s=2.0)
    # About 2.0 s, not 1.2 + 2.0: 0.9 s of margin for a loaded machine either way.
    assert time.monotonic() - started < 2.9
    assert result.error.startswith("no final response within 2.0 s (2 attempts"), result.error


def test_off_with_no_retries_and_then_no_key_is_sent(triton):
    server = triton([[BROKEN], [final()]])
    result, _ = generate(retries=0)
    assert not result.ok and result.attempts == 1 and keys(server) == [None] and result.resume_key is None


def test_a_server_from_before_resume_keys_gets_the_request_without_one(triton):
    unknown = failure("resume_key: unknown field (known: prompt, seed) [INVALID_ARG]")
    server = triton([[unknown], [BROKEN], [final()]])
    result, _ = generate()
    assert result.ok and result.attempts == 3 and result.resume_key is None
    assert keys(server)[0] is not None and keys(server)[1:] == [None, None]  # still resent after a failure


def test_the_text_client_retries_too(triton):
    text_final = FakeResult(
        {"TEXT": np.array([b"hi"], dtype=object), **{n: np.array([1]) for n in ("TOKENS", "STEPS", "SEED")}},
        final=True,
    )
    server = triton([[BROKEN], [(text_final, None)]])
    with TextSession("fake:8001") as session:
        result = session.generate({"prompt": "hello"})
    assert result.ok and result.text == "hi" and result.attempts == 2 and len(set(keys(server))) == 1


def text_block(index: int, text: str) -> tuple:
    outputs = {"TEXT": np.array([text.encode()], dtype=object), "BLOCK": np.array([index])}
    return FakeResult({**outputs, "TOKENS": np.array([4 * (index + 1)])}, final=False), None


def text_final(text: str) -> tuple:
    counts = {n: np.array([1]) for n in ("TOKENS", "STEPS", "SEED")}
    return FakeResult({"TEXT": np.array([text.encode()], dtype=object), **counts}, final=True), None


def test_a_resent_text_request_never_repeats_text(triton):
    """The diffusion LM runs a resend from its first block (with the seed its key gives): the blocks the
    client had come again and are neither kept twice nor handed to on_block twice."""
    first = [text_block(0, "Hello"), text_block(1, " world."), BROKEN]
    again = [text_block(0, "Hello"), text_block(1, " world."), text_block(2, " Bye.")]
    second = [*again, text_final("Hello world. Bye.")]
    server = triton([first, second])
    seen: list[str] = []
    with TextSession("fake:8001") as session:
        result = session.generate({"prompt": "hello"}, on_block=lambda b: seen.append(b.text))
    assert result.ok and result.attempts == 2 and len(set(keys(server))) == 1
    assert seen == [b.text for b in result.blocks] == ["Hello", " world.", " Bye."]
    assert "".join(seen) == result.text


def test_a_resent_text_request_whose_block_came_back_different_fails_saying_why(triton):
    first = [text_block(0, "Hello"), BROKEN]
    second = [text_block(0, "Goodbye"), text_block(1, " world."), text_final("Goodbye world.")]
    triton([first, second])
    seen: list[str] = []
    with TextSession("fake:8001") as session:
        result = session.generate({"prompt": "hello"}, on_block=lambda b: seen.append(b.text))
    assert not result.ok and "block 0 came back different" in result.error, result.error
    assert seen == ["Hello"]


@pytest.mark.parametrize("resumed", [2, None])
def test_progress_steps_a_resend_runs_again_replace_the_earlier_ones(triton, resumed):
    """Resumed from step 2 (its steps 3 and 4 run) or started over (1 to 4): each step once, in order."""
    again = [step(3), step(4)] if resumed else [step(n) for n in (1, 2, 3, 4)]
    triton([[step(1), step(2), step(3), BROKEN], [*again, final(resumed)]])
    result, seen = generate()
    assert result.ok and result.attempts == 2 and result.steps == [1, 2, 3, 4]


def test_the_clis_turn_retry_off_and_one_key_is_never_shared(monkeypatch):
    with pytest.raises(ValueError, match="each request needs its own"):
        images.generate(["a", "b"], resume_key=KEY)  # before anything is sent
    taken: list = []
    monkeypatch.setattr(images, "generate", lambda *args, **fields: taken.append(args) or [])
    monkeypatch.setattr(text, "generate_text_many", lambda *args: taken.append(args) or [])
    images.main(["a cat", "--no-retry"])
    images.main(["a cat", "--retries", "5"])
    images.main(["a cat"])
    text.main(["hello", "--no-retry"])
    assert [args[-1] for args in taken] == [0, 5, retry.DEFAULT_RETRIES, 0]

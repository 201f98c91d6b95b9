"""The OpenAI front's pure logic: limits applied before parsing, request translation, error shaping, keys,
partial-image choice, video job bounds; and the app's answers that need no Triton (401, 413, 404, 503)."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import logging
import multiprocessing
import os
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from triton_diffusion.errors import RequestError
from triton_diffusion.fields import Field, FieldSet
from triton_diffusion.openai_front.app import create_app, require_key
from triton_diffusion.openai_front.errors import ApiError, from_triton_message
from triton_diffusion.openai_front.front_state import FrontState
from triton_diffusion.openai_front.keys import check_bearer, key_owner, load_keys
from triton_diffusion.openai_front.limits import Limits, json_depth, parse_form, parse_json_object
from triton_diffusion.openai_front.translation import (
    IMAGE_OPENAI_NAMES,
    PartialImagePicker,
    chat_prompt,
    completion_response,
    decode_schedule,
    form_value,
    frames_for_seconds,
    image_call,
    parse_size,
    preview_every,
    text_call,
    video_call,
)
from triton_diffusion.openai_front.triton_bridge import (
    ModelInfo,
    StreamPool,
    TritonBridge,
    TritonRequest,
    TritonResponse,
    config_defaults,
    model_kind,
)
from triton_diffusion.openai_front.video_jobs import COMPLETED, FAILED, VideoJob, VideoJobs, VideoLimits
from triton_diffusion.serving import launcher

LIMITS = Limits()
IMAGE_FIELDS = [
    "prompt",
    "negative_prompt",
    "seed",
    "num_images_per_prompt",
    "height",
    "width",
    "num_inference_steps",
    "guidance_scale",
    "scheduler",
    "output_format",
    "output_encoding",
    "progress",
    "preview_every",
]
TYPES = {
    "seed": "INT64",
    "num_images_per_prompt": "INT32",
    "height": "INT32",
    "width": "INT32",
    "num_inference_steps": "INT32",
    "guidance_scale": "FP32",
    "progress": "BOOL",
    "preview_every": "INT32",
}
IMAGE_MODEL = ModelInfo("text_to_image", "text_to_image", {n: TYPES.get(n, "BYTES") for n in IMAGE_FIELDS})
EDIT_MODEL = ModelInfo(
    "image_to_image", "image_to_image", {**IMAGE_MODEL.inputs, "image": "BYTES", "strength": "FP32"}
)
LM_FIELDS = [
    "prompt",
    "apply_chat_template",
    "gen_length",
    "block_length",
    "steps",
    "temperature",
    "cfg_scale",
    "seed",
    "stream",
]
LM_MODEL = ModelInfo("diffusion_lm", "text_generation", {n: "BYTES" for n in LM_FIELDS})
VIDEO_MODEL = ModelInfo(
    "text_to_video",
    "text_to_video",
    {
        **{n: IMAGE_MODEL.inputs[n] for n in ("prompt", "seed", "height", "width", "num_inference_steps")},
        "num_videos_per_prompt": "INT32",
        "num_frames": "INT32",
        "fps": "INT32",
        "output_format": "BYTES",
        "output_encoding": "BYTES",
        "progress": "BOOL",
        "preview_every": "INT32",
    },
)


def raises_api_error(status: int, param: str | None, *args, call) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args)
    assert caught.value.status == status, caught.value.message
    assert caught.value.param == param, caught.value.message
    return caught.value


# ---- limits ------------------------------------------------------------------------------------------
def test_json_depth_counts_brackets_outside_strings_only():
    assert json_depth(b'{"a": [1, {"b": 2}]}') == 3
    assert json_depth(b'{"a": "[[[[[[[[", "b": "\\"[[[["}') == 1  # brackets and escaped quotes in strings
    assert json_depth(b"[" * 100_000 + b"]" * 100_000) == 100_000
    assert json_depth(b"") == 0


def test_deep_or_malformed_json_is_refused_before_parsing():
    deep = b'{"prompt": "x", "seed": ' + b"[" * 150_000 + b"]" * 150_000 + b"}"
    error = raises_api_error(400, None, deep, LIMITS, call=parse_json_object)
    assert "nests 150001 levels deep (allowed: at most 32)" in error.message
    raises_api_error(400, None, b"[1, 2]", LIMITS, call=parse_json_object)
    raises_api_error(400, None, b"{'single': 1}", LIMITS, call=parse_json_object)
    raises_api_error(400, None, b'{"seed": ' + b"9" * 5000 + b"}", LIMITS, call=parse_json_object)
    assert parse_json_object(b'{"prompt": "[ok]"}', LIMITS) == {"prompt": "[ok]"}


def form_body(parts: list[tuple[str, str | None, bytes]]) -> tuple[bytes, str]:
    boundary = "testboundary"
    chunks = []
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        chunks.append(f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n")
    return b"".join(chunks) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def test_multipart_limits_on_files_fields_and_part_size():
    body, content_type = form_body([("image", "a.png", b"png"), ("prompt", None, b"a cat")])
    form = asyncio.run(parse_form(body, content_type, LIMITS))
    assert form["prompt"] == "a cat"
    too_many_files = form_body([(f"f{i}", f"{i}.png", b"x") for i in range(3)])
    raises_api_error(400, None, *too_many_files, LIMITS, call=lambda *a: asyncio.run(parse_form(*a)))
    long_field = form_body([("prompt", None, b"a" * (LIMITS.max_form_field_bytes + 1))])
    raises_api_error(400, None, *long_field, LIMITS, call=lambda *a: asyncio.run(parse_form(*a)))


# ---- errors ------------------------------------------------------------------------------------------
def test_triton_messages_become_openai_errors():
    fields = set(IMAGE_FIELDS)
    error = from_triton_message(
        "height: got 100 (allowed: 64..512, multiple of 8)", fields, IMAGE_OPENAI_NAMES
    )
    assert (error.status, error.param) == (400, "size")
    assert error.body()["error"] == {
        "message": "height: got 100 (allowed: 64..512, multiple of 8)",  # the model's own words
        "type": "invalid_request_error",
        "param": "size",
        "code": "invalid_value",
    }
    assert from_triton_message("seed: must be an integer, got str 'x'", fields).param == "seed"
    unknown = from_triton_message("heigth: unknown field; did you mean 'height'? (known: ...)", fields)
    assert (unknown.status, unknown.param) == (400, "heigth")
    assert from_triton_message("RuntimeError: boom", fields).status == 500  # not a field of the model
    assert from_triton_message("denoising step failed: injected failure", fields).status == 500
    stub = "Failed to process the request(s) for model 'm', message: Stub process 'm_0_0' is not healthy."
    assert from_triton_message(stub, fields).status == 503
    assert from_triton_message("out of memory; the model is restarting", fields).status == 503
    assert from_triton_message("cancelled after step 3", fields).status == 499


# ---- translation -----------------------------------------------------------------------------------------
def test_sizes():
    assert parse_size("512x768") == (512, 768)
    assert parse_size("auto") is None and parse_size(None) is None
    for bad in ("512", "0x64", "64x", "64X64", "99999999x64", 64, "-64x64"):
        raises_api_error(400, "size", bad, call=parse_size)


def test_image_generation_translation():
    call = image_call(
        {
            "prompt": "a cat",
            "n": 2,
            "size": "96x64",
            "output_format": "jpeg",
            "seed": 7,
            "quality": "high",
            "negative_prompt": "blurry",
        },
        {},
        IMAGE_MODEL,
        LIMITS,
    )
    request = call.request
    assert request.tensors == {"PROMPT": b"a cat"}
    assert request.parameters == {
        "seed": 7,
        "negative_prompt": "blurry",
        "num_images_per_prompt": 2,
        "output_format": "jpeg",
        "output_encoding": "binary",
        "width": 96,
        "height": 64,
    }  # quality ignored
    assert not call.stream and call.size == "96x64"
    streamed = image_call({"prompt": "x", "stream": True, "partial_images": 2}, {}, IMAGE_MODEL, LIMITS)
    assert (
        streamed.request.parameters["progress"] is True and streamed.request.parameters["preview_every"] == 1
    )
    plain_stream = image_call({"prompt": "x", "stream": True}, {}, IMAGE_MODEL, LIMITS)
    assert "progress" not in plain_stream.request.parameters


@pytest.mark.parametrize(
    ("params", "param", "words"),
    [
        ({}, "prompt", "prompt: is required"),
        ({"prompt": 3}, "prompt", "prompt: must be a string"),
        ({"prompt": "x", "n": 0}, "n", "n: got 0 (allowed: 1..10)"),
        ({"prompt": "x", "n": True}, "n", "n: must be an integer"),
        ({"prompt": "x", "response_format": "url"}, "response_format", "images are not stored"),
        ({"prompt": "x", "partial_images": 4}, "partial_images", "allowed: 0..3"),
        ({"prompt": "x", "num_images_per_prompt": 2}, "num_images_per_prompt", "send n instead"),
        ({"prompt": "x", "output_encoding": "base64"}, "output_encoding", "send response_format instead"),
        ({"prompt": "x", "seed": [1]}, "seed", "seed: must be a single value, got list"),
        ({"prompt": "x", "seed": 2**64}, "seed", "allowed: a 64-bit integer at most"),
        ({"prompt": "x", "priority": 1}, "priority", "priority: unknown field"),
    ],
)
def test_image_requests_refused_by_the_front_name_the_parameter(params, param, words):
    error = raises_api_error(400, param, params, {}, IMAGE_MODEL, LIMITS, call=image_call)
    assert words in error.message


def test_unknown_fields_get_the_models_own_message():
    error = raises_api_error(
        400, "heigth", {"prompt": "x", "heigth": 64}, {}, IMAGE_MODEL, LIMITS, call=image_call
    )
    declared = FieldSet(Field(name, str) for name in IMAGE_FIELDS)  # what the model itself answers
    with pytest.raises(RequestError) as model_error:
        declared.parse({"heigth": 64})
    assert error.message == model_error.value.message and "did you mean 'height'?" in error.message


def test_form_fields_take_the_models_input_types():
    call = image_call(
        {
            "prompt": "x",
            "n": "2",
            "stream": "true",
            "partial_images": "1",
            "seed": "7",
            "strength": "0.5",
            "negative_prompt": "y",
        },
        {"IMAGE": b"png"},
        EDIT_MODEL,
        LIMITS,
        from_form=True,
    )
    assert call.request.parameters["seed"] == 7 and call.request.parameters["strength"] == 0.5
    assert call.request.parameters["num_images_per_prompt"] == 2 and call.stream
    assert call.request.tensors == {"PROMPT": b"x", "IMAGE": b"png"}
    assert form_value("progress", "off", "BOOL") is False
    raises_api_error(400, "seed", "seed", "7x", "INT64", call=form_value)
    raises_api_error(400, "seed", "seed", "1" * 30, "INT64", call=form_value)
    raises_api_error(400, "strength", "strength", "half", "FP32", call=form_value)
    raises_api_error(400, "progress", "progress", "maybe", "BOOL", call=form_value)


def test_partial_images_are_spread_over_the_steps():
    def picked(count, total):
        picker = PartialImagePicker(count)
        return [step for step in range(1, total + 1) if picker.take(step, total) is not None]

    assert picked(2, 4) == [2, 3]
    assert picked(3, 4) == [1, 2, 3]
    assert picked(1, 10) == [5]
    assert picked(2, 30) == [10, 20]
    assert picked(3, 2) == [1]  # never more than the steps before the last
    assert picked(0, 10) == []


def test_max_tokens_gives_a_schedule_the_model_accepts():
    from triton_diffusion.adapters.masked_diffusion import DecodeParams

    for max_tokens in (1, 7, 10, 16, 32, 37, 40, 64, 100, 256):
        schedule = decode_schedule(max_tokens, None, None)
        DecodeParams(schedule["gen_length"], schedule["block_length"], schedule["steps"]).check()
        assert schedule["gen_length"] == max_tokens and schedule["block_length"] <= 16
    assert decode_schedule(64, 32, None) == {"gen_length": 64, "steps": 32}
    assert decode_schedule(64, 16, 8) == {"gen_length": 64}  # the client's values are the model's to check


def test_chat_messages_become_one_prompt():
    assert chat_prompt([{"role": "user", "content": "hi"}], LIMITS) == "hi"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "x?"}]},
        {"role": "assistant", "content": "A letter."},
        {"role": "user", "content": "And y?"},
    ]
    assert (
        chat_prompt(messages, LIMITS) == "System: Be brief.\nUser: What is x?\nAssistant: A letter.\n\nAnd y?"
    )
    raises_api_error(400, "messages", [], LIMITS, call=chat_prompt)
    raises_api_error(400, "messages", [{"role": "assistant", "content": "x"}], LIMITS, call=chat_prompt)
    raises_api_error(400, "messages", [{"role": "robot", "content": "x"}], LIMITS, call=chat_prompt)
    image_part = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    raises_api_error(400, "messages", image_part, LIMITS, call=chat_prompt)
    raises_api_error(400, "messages", [{"role": "user", "content": "x"}] * 257, LIMITS, call=chat_prompt)


def test_chat_and_completion_translation():
    chat = text_call(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 32,
            "temperature": 0.5,
            "seed": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "top_p": 1,
            "cfg_scale": 1.0,
        },
        LM_MODEL,
        LIMITS,
        chat=True,
    )
    assert chat.request.parameters == {
        "cfg_scale": 1.0,
        "temperature": 0.5,
        "seed": 3,
        "gen_length": 32,
        "block_length": 16,
        "steps": 16,
        "apply_chat_template": True,
        "stream": True,
    }
    assert chat.stream and chat.include_usage and chat.gen_length == 32
    completion = text_call({"prompt": ["The sea"]}, LM_MODEL, LIMITS, chat=False)
    assert completion.request.tensors == {"PROMPT": b"The sea"}
    assert completion.request.parameters == {"apply_chat_template": False, "stream": False}
    for body, param in (
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "stop": ["\n"]}, "stop"),
        ({"prompt": "x", "gen_length": 8}, "gen_length"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ):
        raises_api_error(400, param, body, LM_MODEL, LIMITS, False, call=text_call)


def test_video_translation():
    call = video_call({"prompt": "a boat", "seconds": "1", "size": "64x64", "fps": "8"}, VIDEO_MODEL, True)
    assert call.request.parameters == {
        "fps": 8,
        "width": 64,
        "height": 64,
        "num_frames": 9,
        "output_format": "mp4",
        "output_encoding": "binary",
        "progress": True,
    }
    assert frames_for_seconds(4, 16) == 65 and frames_for_seconds(0.1, 16) == 5
    assert (
        video_call({"prompt": "x", "num_frames": 5}, VIDEO_MODEL, False).request.parameters["num_frames"] == 5
    )
    raises_api_error(
        400, "seconds", {"prompt": "x", "seconds": "forever"}, VIDEO_MODEL, True, call=video_call
    )
    raises_api_error(
        400, "input_reference", {"prompt": "x", "input_reference": "x"}, VIDEO_MODEL, True, call=video_call
    )
    raises_api_error(
        400, "output_format", {"prompt": "x", "output_format": "frames"}, VIDEO_MODEL, False, call=video_call
    )


def test_model_kinds_come_from_inputs_and_outputs():
    assert model_kind({"PROMPT": "BYTES"}, {"IMAGE": "BYTES"}) == "text_to_image"
    assert model_kind({"PROMPT": "BYTES", "IMAGE": "BYTES"}, {"IMAGE": "BYTES"}) == "image_to_image"
    # text_to_image takes an optional source image and mask: a text-to-image model that also serves edits.
    both = {"PROMPT": "BYTES", "IMAGE": "BYTES", "MASK_IMAGE": "BYTES"}
    assert model_kind(both, {"IMAGE": "BYTES"}) == "text_to_image"
    assert model_kind({"PROMPT": "BYTES"}, {"VIDEO": "BYTES", "FRAMES": "UINT8"}) == "text_to_video"
    assert model_kind({"PROMPT": "BYTES"}, {"TEXT": "BYTES"}) == "text_generation"
    assert model_kind({"X": "FP32"}, {"Y": "FP32"}) is None


# ---- keys --------------------------------------------------------------------------------------------
def test_api_keys(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\nsk-one\n\n  sk-two  \n")
    keys = load_keys(path)
    assert keys == {"sk-one", "sk-two"} and load_keys(None) == frozenset()
    check_bearer("Bearer sk-two", keys)
    check_bearer(None, frozenset())  # no keys: open
    for header in (None, "", "Bearer", "Bearer sk-three", "Basic sk-one", "sk-one"):
        raises_api_error(401, None, header, keys, call=check_bearer)
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_keys(tmp_path / "empty")


# ---- video jobs ----------------------------------------------------------------------------------------
def test_video_jobs_are_bounded_in_time_and_size():
    now = [1000.0]
    jobs = VideoJobs(TritonBridge("127.0.0.1:1"), VideoLimits(max_bytes=100, ttl_s=60), clock=lambda: now[0])

    def finished(video_id: str, size: int, expires: int) -> None:
        job = VideoJob(
            video_id,
            "m",
            "p",
            None,
            None,
            int(now[0]),
            COMPLETED,
            100,
            int(now[0]),
            expires,
            None,
            b"x" * size,
        )
        jobs.jobs[video_id] = job

    finished("a", 40, 1030)
    finished("b", 40, 1100)
    assert [j.id for j in jobs.listing("")] == ["a", "b"]
    finished("c", 40, 1100)  # 120 bytes held: the oldest goes
    assert [j.id for j in jobs.listing("")] == ["b", "c"]
    now[0] = 1100
    assert jobs.listing("") == []  # expired
    with pytest.raises(ApiError) as missing:
        jobs.get("b", "")
    assert missing.value.status == 404


# ---- the app, without a reachable Triton -------------------------------------------------------------------
@pytest.fixture
def app_client():
    front = FrontState(TritonBridge("127.0.0.1:1"), limits=Limits(max_json_bytes=1000), keys=frozenset({"k"}))
    with TestClient(create_app(front)) as client:
        yield client


def test_the_app_checks_keys_and_limits_before_triton(app_client):
    url = "/v1/images/generations"
    assert app_client.post(url, json={"prompt": "x"}).status_code == 401
    auth = {"Authorization": "Bearer k"}
    big = app_client.post(url, content=b'{"prompt":"' + b"a" * 2000 + b'"}', headers=auth)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    deep = app_client.post(url, content=b"[" * 500 + b"]" * 500, headers=auth)
    assert deep.status_code == 400 and "nests 500 levels deep" in deep.json()["error"]["message"]
    down = app_client.post(url, json={"prompt": "x"}, headers=auth)  # nothing listens on port 1
    assert down.status_code == 503 and down.json()["error"]["code"] == "service_unavailable"
    assert app_client.get("/health").status_code == 503
    missing = app_client.get("/v1/no/such/route", headers=auth)
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert app_client.get("/v1/videos/../../etc/passwd", headers=auth).status_code == 404
    assert app_client.get("/v1/videos/video_" + "0" * 32, headers=auth).status_code == 404
    assert "<html" in app_client.get("/").text.lower()


def test_an_open_front_warns_at_startup(caplog):
    with caplog.at_level(logging.WARNING, logger="triton_diffusion.openai_front"):
        with TestClient(create_app(FrontState(TritonBridge("127.0.0.1:1")))):
            pass
    assert "no API key file" in caplog.text


# ---- launcher -------------------------------------------------------------------------------------------
def test_the_launcher_starts_the_front_against_tritons_grpc_port(tmp_path):
    argv = launcher.openai_front_command(["--grpc-port=9101", "--log-verbose=1"], 9000, "0.0.0.0", None)
    assert argv[1:3] == ["-m", "triton_diffusion.openai_front"]
    assert argv[argv.index("--triton-grpc") + 1] == "127.0.0.1:9101"
    assert argv[argv.index("--port") + 1] == "9000" and "--api-key-file" not in argv
    keyed = launcher.openai_front_command([], 9000, "127.0.0.1", tmp_path / "keys")
    assert keyed[keyed.index("--api-key-file") + 1] == str(tmp_path / "keys")
    assert keyed[keyed.index("--triton-grpc") + 1] == "127.0.0.1:8001"
    assert json.dumps(argv)  # plain strings only


# ---- review fixes --------------------------------------------------------------------------------------
class FakeBridge(TritonBridge):
    """A Triton that is ready, serves ``models`` and answers every request with ``responses`` (or never,
    with ``block``)."""

    def __init__(self, models: list[ModelInfo], responses: list[TritonResponse] = (), block: bool = False):
        super().__init__("127.0.0.1:1")
        self.catalog = {info.name: info for info in models}
        self.responses = list(responses)
        self.block = block
        self.requests: list = []

    async def ready(self) -> bool:
        return True

    async def models(self) -> dict[str, ModelInfo]:
        return self.catalog

    async def stream(self, request, info, timeout_s):
        self.requests.append(request)
        if self.block:
            await asyncio.Event().wait()
        for response in self.responses:
            yield response

    async def close(self) -> None:
        pass


def _refuse_in_child(body: bytes) -> None:
    started = time.perf_counter()
    try:
        parse_json_object(body, LIMITS)
    except ApiError as error:
        refused = error.status == 400 and error.code == "invalid_json"
        os._exit(0 if refused and time.perf_counter() - started < 2.0 else 2)
    os._exit(3)


@pytest.mark.parametrize(
    "body",
    [
        b'"' + b'\\"' * ((1 << 20) // 2 - 1),  # one unterminated string of escaped quotes: 1 MiB
        b'{"prompt": "' + b'\\"' * ((1 << 20) // 2 - 16),
        b'"\\' * ((1 << 20) // 2),
    ],
)
def test_a_hostile_json_body_is_refused_in_linear_time(body):
    """The depth check's string pattern once backtracked quadratically (40 KB of escaped quotes: 10 s on
    the event loop; 1 MiB: hours). Run in a child process, so that a regression fails instead of hanging."""
    assert len(body) <= LIMITS.max_json_bytes
    child = multiprocessing.get_context("fork").Process(target=_refuse_in_child, args=(body,))
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the JSON depth check did not finish within 30 s")
    assert child.exitcode == 0, "refused with 400 within 2 s" if child.exitcode else ""


def test_json_depth_handles_escapes_and_unterminated_strings():
    assert json_depth(b'["a\\\\", [["\\"]"]]]') == 3  # an escaped backslash closes the string
    assert json_depth(b'[["unterminated [[[[') == 2  # the rest is one string; json.loads refuses it
    assert json_depth(b'"\\') == 0


def test_capacity_and_memory_errors_are_503_with_the_models_own_words():
    from triton_diffusion.engine.failures import Failure, FailureKind, device_lost_error

    fields = set(IMAGE_FIELDS)
    oom = FailureKind.OUT_OF_MEMORY
    unavailable = [
        "the model is at capacity: no room for this request within 120 s",  # serving/engine_host.py
        "the model is shutting down",
        "the engine reported nothing for 130 s (bound 120 s); the model is restarting",
        "process exit; the model is restarting, retry shortly",
        device_lost_error("RuntimeError: CUDA error: an illegal memory access was encountered").message,
        Failure(oom, "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        .request_error("denoising step")
        .message,
        Failure(oom, "MemoryError: ").request_error("pipeline call").message,
        Failure(oom, "RuntimeError: CUDA error: out of memory").request_error("decoding").message,
    ]
    for message in unavailable:
        for sent in (message, f"[request id: oai-1] {message}"):
            error = from_triton_message(sent, fields)
            assert (error.status, error.code) == (503, "service_unavailable"), sent
            assert error.message == sent
    ordinary = Failure(FailureKind.ORDINARY, "RuntimeError: boom").request_error("denoising step")
    assert from_triton_message(ordinary.message, fields).status == 500


def test_video_jobs_drop_finished_ones_for_new_ones_and_refuse_only_for_active_ones():
    call = video_call({"prompt": "x"}, VIDEO_MODEL, False)

    def finished(video_id: str, status: str, completed_at: int) -> VideoJob:
        content = b"mp4" if status == COMPLETED else None
        return VideoJob(video_id, "m", "p", None, None, 0, status, 100, completed_at, 10**9, None, content)

    async def scenario() -> None:
        limits = VideoLimits(max_jobs=3, max_running=2)
        jobs = VideoJobs(FakeBridge([VIDEO_MODEL], block=True), limits, clock=lambda: 1000.0)
        jobs.jobs["done"] = finished("done", COMPLETED, 20)
        jobs.jobs["failed"] = finished("failed", FAILED, 10)
        one = jobs.create(call, VIDEO_MODEL, "")  # three held
        two = jobs.create(call, VIDEO_MODEL, "")  # the longest-finished (the failed one) makes room
        assert list(jobs.jobs) == ["done", one.id, two.id]
        with pytest.raises(ApiError) as busy:
            jobs.create(call, VIDEO_MODEL, "")  # two generating: the limit
        assert (busy.value.status, busy.value.code) == (429, "too_many_jobs")
        await jobs.delete(one.id, "")
        three = jobs.create(call, VIDEO_MODEL, "")  # room again, not refused for the finished one
        assert list(jobs.jobs) == ["done", two.id, three.id]
        jobs._completed(three, b"mp4")  # finished after "done": "done" goes first
        four = jobs.create(call, VIDEO_MODEL, "")
        assert list(jobs.jobs) == [two.id, three.id, four.id]
        await jobs.close()

        full = VideoJobs(FakeBridge([VIDEO_MODEL], block=True), VideoLimits(max_jobs=1, max_running=4))
        full.create(call, VIDEO_MODEL, "")
        with pytest.raises(ApiError) as held:
            full.create(call, VIDEO_MODEL, "")  # nothing finished to drop
        assert held.value.status == 429
        await full.close()

    asyncio.run(scenario())


def video_front(keys: frozenset[str]) -> TestClient:
    video = TritonResponse({"VIDEO": np.array([b"mp4 bytes"], dtype=object)}, True)
    return TestClient(create_app(FrontState(FakeBridge([VIDEO_MODEL], [video]), keys=keys)))


def wait_completed(client: TestClient, video_id: str, headers: dict[str, str]) -> None:
    for _ in range(200):
        if client.get(f"/v1/videos/{video_id}", headers=headers).json()["status"] == COMPLETED:
            return
        time.sleep(0.01)
    pytest.fail("the video job did not complete")


def test_video_jobs_are_visible_to_their_creating_key_only():
    alice, bob = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-bob"}
    with video_front(frozenset({"sk-alice", "sk-bob"})) as client:
        created = client.post("/v1/videos", json={"prompt": "a boat"}, headers=alice)
        assert created.status_code == 200, created.text
        video_id = created.json()["id"]
        wait_completed(client, video_id, alice)
        assert [v["id"] for v in client.get("/v1/videos", headers=alice).json()["data"]] == [video_id]
        assert client.get("/v1/videos", headers=bob).json()["data"] == []
        for method, path in (
            ("GET", f"/v1/videos/{video_id}"),
            ("GET", f"/v1/videos/{video_id}/content"),
            ("DELETE", f"/v1/videos/{video_id}"),
        ):
            other = client.request(method, path, headers=bob)
            assert other.status_code == 404 and other.json()["error"]["code"] == "video_not_found"
        assert client.get(f"/v1/videos/{video_id}/content", headers=alice).content == b"mp4 bytes"
        owner = client.app.state.front.videos.jobs[video_id].owner
        assert owner == hashlib.sha256(b"sk-alice").hexdigest() and "sk-alice" not in repr(owner)
        assert client.delete(f"/v1/videos/{video_id}", headers=alice).json()["deleted"] is True
    assert key_owner("Bearer sk-bob", frozenset({"sk-bob"})) == hashlib.sha256(b"sk-bob").hexdigest()
    with video_front(frozenset()) as open_client:  # no keys: one tenant
        video_id = open_client.post("/v1/videos", json={"prompt": "a boat"}).json()["id"]
        wait_completed(open_client, video_id, {})
        assert open_client.get(f"/v1/videos/{video_id}", headers=bob).status_code == 200


def test_an_open_front_listens_on_loopback_unless_told_otherwise(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("sk-one\n")
    assert launcher.openai_front_address(None, None) == "127.0.0.1"
    assert launcher.openai_front_address(None, keys) == "0.0.0.0"
    assert launcher.openai_front_address("0.0.0.0", None) == "0.0.0.0"
    assert launcher.open_front_warning("0.0.0.0", None) and not launcher.open_front_warning("0.0.0.0", keys)
    assert launcher.open_front_warning("127.0.0.1", None) is None

    started = []
    command = launcher.ServerCommand(["tritonserver"], {})
    monkeypatch.setattr(launcher, "server_command", lambda *args: command)
    monkeypatch.setattr(launcher, "supervise", lambda command, extra, port, front: started.append(front) or 0)
    for argv, address in (
        (["--openai-port=9000"], "127.0.0.1"),
        (["--openai-port=9000", f"--openai-api-key-file={keys}"], "0.0.0.0"),
        (["--openai-port=9000", "--openai-address=0.0.0.0"], "0.0.0.0"),
    ):
        with pytest.raises(SystemExit):
            launcher.main(argv)
        assert started[-1][started[-1].index("--host") + 1] == address, argv
    from triton_diffusion.openai_front.__main__ import parser as front_parser

    assert front_parser().parse_args([]).host is None  # chosen from the keys at startup
    # The container passes a key file or says outright that the front listens on every interface.
    dockerfile = (launcher.REPO_ROOT / "docker" / "Dockerfile").read_text()
    cmd = dockerfile[dockerfile.index('CMD ["triton-diffusion-serve"') :]
    assert "--openai-api-key-file" in cmd or '"--openai-address=0.0.0.0"' in cmd
    assert "OPEN" in dockerfile


def test_comment_lines_are_never_keys_even_when_indented(tmp_path):
    path = tmp_path / "keys"
    path.write_text("  # note\n\t# another\nsk-one\n")
    assert load_keys(path) == {"sk-one"}
    (tmp_path / "only_comments").write_text("   # nothing here\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_keys(tmp_path / "only_comments")


def test_images_come_back_binary_whatever_the_models_default_encoding():
    call = image_call({"prompt": "x"}, {}, IMAGE_MODEL, LIMITS)
    assert call.request.parameters["output_encoding"] == "binary"
    edit = image_call({"prompt": "x"}, {"IMAGE": b"png"}, EDIT_MODEL, LIMITS, from_form=True)
    assert edit.request.parameters["output_encoding"] == "binary"


def test_previews_are_asked_for_about_as_often_as_partial_images_are_sent():
    def every(params, info=IMAGE_MODEL, tensors=None):
        body = {"prompt": "x", "stream": True, **params}
        return image_call(body, tensors or {}, info, LIMITS).request.parameters["preview_every"]

    assert every({"partial_images": 2, "num_inference_steps": 30}) == 10
    assert every({"partial_images": 3, "num_inference_steps": 50}) == 12
    assert every({"partial_images": 1, "num_inference_steps": 3}) == 1
    configured = ModelInfo(IMAGE_MODEL.name, IMAGE_MODEL.kind, IMAGE_MODEL.inputs, default_steps=40)
    assert every({"partial_images": 1}, configured) == 20  # the model's configured default
    assert every({"partial_images": 1}) == 1  # steps unknown: every step, the picker still sends one
    edit = ModelInfo(EDIT_MODEL.name, EDIT_MODEL.kind, EDIT_MODEL.inputs, default_steps=40)
    assert every({"partial_images": 1, "strength": 0.5}, edit, {"IMAGE": b"png"}) == 10  # 20 steps run
    assert every({"partial_images": 1}, edit, {"IMAGE": b"png"}) == 1  # the default strength is unknown
    # However many steps, the previews asked for still give the picker every partial image it sends.
    for steps in range(1, 80):
        for count in (1, 2, 3):
            period = preview_every(count, steps)
            picker, sparse = PartialImagePicker(count), PartialImagePicker(count)
            dense = [s for s in range(1, steps + 1) if picker.take(s, steps) is not None]
            sent = [s for s in range(period, steps + 1, period) if sparse.take(s, steps) is not None]
            assert len(sent) == len(dense) == min(count, steps - 1), (steps, count, period)
            assert steps < count + 1 or len(range(period, steps, period)) <= 2 * count + 1


def test_the_model_config_defaults_reach_the_catalog():
    assert config_defaults(
        {
            "default_num_inference_steps": {"string_value": "4"},
            "default_gen_length": {"string_value": " 64 "},
            "default_scheduler": {"string_value": "EulerDiscreteScheduler"},
            "max_num_inference_steps": {"string_value": "50"},
            "default_strength": {"string_value": "0.8"},
        }
    ) == {"num_inference_steps": 4, "gen_length": 64}

    class FakeClient:
        async def get_model_repository_index(self, **_):
            return {"models": [{"name": "text_to_image", "state": "READY"}]}

        async def get_model_metadata(self, name, **_):
            tensor = {"name": "PROMPT", "datatype": "BYTES"}
            return {"inputs": [tensor], "outputs": [{**tensor, "name": "IMAGE"}]}

        async def get_model_config(self, name, **_):
            return {"config": {"parameters": {"default_num_inference_steps": {"string_value": "4"}}}}

    bridge = TritonBridge("127.0.0.1:1")
    bridge._client = FakeClient()
    info = asyncio.run(bridge.models())["text_to_image"]
    assert (info.kind, info.default_steps, info.default_gen_length) == ("text_to_image", 4, None)


@pytest.mark.parametrize(
    ("url", "body"),
    [
        ("/v1/images/generations", {"prompt": "x", "stream": True, "partial_images": 1}),
        ("/v1/images/generations", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
        ("/v1/completions", {"prompt": "hi"}),
    ],
)
def test_a_stream_that_ends_without_a_response_is_a_502(url, body):
    front = FrontState(FakeBridge([IMAGE_MODEL, LM_MODEL]))
    with TestClient(create_app(front), raise_server_exceptions=False) as client:
        answer = client.post(url, json=body)
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["code"] == "bad_gateway"
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}


def test_finish_reason_is_length_when_every_token_asked_for_was_generated():
    def final(tokens: int) -> TritonResponse:
        outputs = {"TEXT": np.array([b"text"], dtype=object), "TOKENS": np.array([tokens], dtype=np.int32)}
        return TritonResponse(outputs, True)

    configured = ModelInfo(LM_MODEL.name, LM_MODEL.kind, LM_MODEL.inputs, default_gen_length=64)
    plain = text_call({"prompt": "The sea"}, configured, LIMITS, chat=False)  # no max_tokens
    assert plain.gen_length == 64
    assert completion_response(plain, final(64), False)["choices"][0]["finish_reason"] == "length"
    assert completion_response(plain, final(12), False)["choices"][0]["finish_reason"] == "stop"  # an EOS
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    asked = text_call(chat, configured, LIMITS, chat=True)
    assert completion_response(asked, final(16), True)["choices"][0]["finish_reason"] == "length"
    unknown = text_call({"prompt": "The sea"}, LM_MODEL, LIMITS, chat=False)  # no default in its config
    assert completion_response(unknown, final(64), False)["choices"][0]["finish_reason"] == "stop"


def test_the_key_check_runs_on_the_event_loop():
    assert inspect.iscoroutinefunction(require_key)  # a sync dependency is a threadpool hop per request
    front = FrontState(FakeBridge([IMAGE_MODEL]), keys=frozenset({"k"}))
    with TestClient(create_app(front)) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200


# ---- pooled streams ----------------------------------------------------------------------------------------
class FakeStreamCall:
    """tritonclient.grpc.aio's stream iterator as the bridge uses it: requests from an async iterator, one
    scripted answer per request (responses "progress", "final", "bare final" (no outputs), "error",
    "hang"), ``cancel``."""

    def __init__(self, requests, script):
        self.requests, self.script = requests.__aiter__(), script
        self.pending: list = []
        self.cancelled = False
        self._grpc_call = self  # what RequestStream.ended asks

    def done(self) -> bool:
        return self.cancelled

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def __aiter__(self):
        return self

    async def __anext__(self):
        from tritonclient.utils import InferenceServerException

        if not self.pending:
            message = await self.requests.__anext__()
            self.pending = list(self.script[message["parameters"]["answer"]])
        kind = self.pending.pop(0)
        if kind == "hang":
            await asyncio.sleep(3600)
        if kind == "error":
            return None, InferenceServerException("seed: must be an integer")
        return FakeResult(final=kind != "progress", empty=kind == "bare final"), None


class FakeResult:
    def __init__(self, final: bool, empty: bool) -> None:
        self.final, self.empty = final, empty

    def get_response(self):
        class Flag:
            bool_param = self.final

        class Output:
            name = "IMAGE"

        class Response:
            outputs = [] if self.empty else [Output()]
            parameters = {"triton_final_response": Flag()}

        return Response()

    def as_numpy(self, name: str) -> np.ndarray:
        return np.array([b"png"], dtype=object)


def test_streams_are_reused_after_a_final_response_and_dropped_otherwise():
    script = {
        "final": ["final"],
        "progress": ["progress", "final"],
        "bare": ["progress", "bare final"],
        "error": ["error"],
        "hang": ["progress", "hang"],
    }
    calls: list[FakeStreamCall] = []

    class FakeClient:
        def stream_infer(self, requests, stream_timeout=None):
            assert stream_timeout is None  # a pooled stream outlives any one request's deadline
            requests = LoggedRequests(requests)
            calls.append(FakeStreamCall(requests, script))
            return calls[-1]

        async def close(self) -> None:
            pass

    info = ModelInfo("m", "text_to_image", {"prompt": "BYTES", "seed": "INT64"})
    bridge = TritonBridge("127.0.0.1:1")
    bridge._client = FakeClient()

    def request(answer: str) -> TritonRequest:
        return TritonRequest("m", {"PROMPT": b"x"}, {"answer": answer})

    async def drain(answer: str, timeout_s: float = 5.0) -> list[bool]:
        return [r.final async for r in bridge.stream(request(answer), info, timeout_s)]

    async def scenario() -> None:
        assert await drain("final") == [True]
        assert await drain("progress") == [False, True]
        # A model that ends with a bare FINAL flag: the request ends there (its callers see no FINAL
        # response and answer 502), and its stream is free.
        assert await drain("bare") == [False]
        assert len(calls) == 1 and not calls[0].cancelled  # one stream carried all three, one at a time
        assert all(p["triton_enable_empty_final_response"] is True for p in calls[0].requests.sent)
        with pytest.raises(ApiError) as refused:
            await drain("error")
        assert (refused.value.status, refused.value.param) == (400, "seed")
        assert calls[0].cancelled and len(bridge._streams) == 0  # an error response: that stream dropped
        # Left after its first response: the stream is cancelled (so is its Triton request), not pooled.
        responses = bridge.stream(request("progress"), info, 5.0)
        assert (await anext(responses)).final is False
        await responses.aclose()
        assert len(calls) == 2 and calls[1].cancelled and len(bridge._streams) == 0
        with pytest.raises(ApiError) as late:
            await drain("hang", timeout_s=0.2)
        assert late.value.status == 504 and calls[2].cancelled
        assert await drain("final") == [True]
        assert len(calls) == 4 and len(bridge._streams) == 1
        await bridge.close()
        assert calls[3].cancelled and len(bridge._streams) == 0

    asyncio.run(asyncio.wait_for(scenario(), 30))


class LoggedRequests:
    """The request iterator a stream was given, keeping each request's parameters."""

    def __init__(self, requests) -> None:
        self.requests, self.sent = requests, []

    def __aiter__(self):
        return self

    async def __anext__(self):
        message = await self.requests.__anext__()
        self.sent.append(message["parameters"])
        return message


def test_the_stream_pool_skips_ended_streams_and_keeps_at_most_its_bound():
    class Stream:
        def __init__(self) -> None:
            self.over = False

        def ended(self) -> bool:
            return self.over

        def cancel(self) -> None:
            self.over = True

    opened: list[Stream] = []

    def open_stream() -> Stream:
        opened.append(Stream())
        return opened[-1]

    pool = StreamPool(open_stream, max_idle=2)
    a, b, c = pool.take(), pool.take(), pool.take()
    for stream in (a, b, c):
        pool.give_back(stream, reusable=True)
    assert len(pool) == 2 and c.over and not a.over  # beyond the bound: closed
    b.over = True  # its connection went away while idle (a restarted server)
    assert pool.take() is a and len(pool) == 0  # b skipped
    pool.give_back(a, reusable=False)
    assert a.over and len(pool) == 0
    assert pool.take() is opened[-1] and len(opened) == 4

"""The OpenAI front's pure logic: limits applied before parsing, request translation, error shaping by the
models' error tags, keys, video job bounds, the model catalog built from MODEL_INFO; and the app's answers
against fakes of Triton (401, 413, 404, 503, partial images, finish reasons)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import json
import logging
import multiprocessing
import os
import time
from dataclasses import replace

import numpy as np
import pytest
from fastapi.testclient import TestClient
from triton_diffusion_client.streams import StreamPool

from triton_diffusion.errors import ErrorCode, RequestError, Retry, RetryHint, tagged_message
from triton_diffusion.fields import Field, FieldSet
from triton_diffusion.openai_front.app import create_app, require_key
from triton_diffusion.openai_front.errors import ApiError, from_triton_message
from triton_diffusion.openai_front.front_state import FrontState
from triton_diffusion.openai_front.image_translation import IMAGE_OPENAI_NAMES, image_call, result_size
from triton_diffusion.openai_front.keys import check_bearer, key_owner, load_keys
from triton_diffusion.openai_front.limits import Limits, json_depth, parse_form, parse_json_object
from triton_diffusion.openai_front.text_translation import (
    chat_prompt,
    completion_response,
    decode_schedule,
    schedule_defaults,
    text_call,
)
from triton_diffusion.openai_front.translation import form_value, parse_size
from triton_diffusion.openai_front.triton_bridge import (
    ModelInfo,
    TritonBridge,
    TritonRequest,
    TritonResponse,
    model_info,
)
from triton_diffusion.openai_front.video_jobs import COMPLETED, FAILED, VideoJob, VideoJobs, VideoLimits
from triton_diffusion.openai_front.video_translation import frames_for_seconds, video_call
from triton_diffusion.serving import launcher

LIMITS = Limits()
# Field types as MODEL_INFO names them (the rest are strings).
TYPES = {
    "seed": "integer",
    "num_images_per_prompt": "integer",
    "height": "integer",
    "width": "integer",
    "num_inference_steps": "integer",
    "guidance_scale": "number",
    "strength": "number",
    "progress": "boolean",
    "preview_every": "integer",
    "previews": "integer",
    "describe": "boolean",
    "num_videos_per_prompt": "integer",
    "num_frames": "integer",
    "fps": "integer",
    "gen_length": "integer",
    "block_length": "integer",
    "steps": "integer",
    "temperature": "number",
    "cfg_scale": "number",
    "apply_chat_template": "boolean",
    "stream": "boolean",
}


def described(name: str, kind: str, names: list[str], **defaults) -> ModelInfo:
    """A model as its MODEL_INFO describes it: ``names`` its fields, ``defaults`` their defaults."""
    fields = {
        n: {"type": TYPES.get(n, "string"), "default": defaults.get(n), "supported": True} for n in names
    }
    return ModelInfo(name, kind, fields, "default")


COMMON_FIELDS = ["service_tier", "timeout", "describe"]
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
    "step_cache",
    "progress",
    "preview_every",
    "previews",
    *COMMON_FIELDS,
]
IMAGE_MODEL = described("text_to_image", "text_to_image", IMAGE_FIELDS)
EDIT_MODEL = described("image_to_image", "image_to_image", [*IMAGE_FIELDS, "image", "strength"])
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
    *COMMON_FIELDS,
]
LM_MODEL = described("diffusion_lm", "text_generation", LM_FIELDS, gen_length=64, block_length=16, steps=32)
VIDEO_FIELDS = ["prompt", "seed", "height", "width", "num_inference_steps", "num_videos_per_prompt"]
VIDEO_MODEL = described(
    "text_to_video",
    "text_to_video",
    [*VIDEO_FIELDS, "num_frames", "fps", "output_format", "output_encoding", "progress", "preview_every"],
    fps=16,
)


def tagged(message: str, code: ErrorCode) -> str:
    """A model's error as it reaches the front: its code as the tag at the end (serving/triton_io.py)."""
    return f"{message} [{code.value}]"


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
        tagged("height: got 100 (allowed: 64..512, multiple of 8)", ErrorCode.INVALID_ARG),
        fields,
        IMAGE_OPENAI_NAMES,
    )
    assert (error.status, error.param) == (400, "size")
    assert error.body()["error"] == {
        "message": "height: got 100 (allowed: 64..512, multiple of 8)",  # the model's own words, no tag
        "type": "invalid_request_error",
        "param": "size",
        "code": "invalid_value",
    }
    seed = from_triton_message(tagged("seed: must be an integer, got str 'x'", ErrorCode.INVALID_ARG), fields)
    assert (seed.status, seed.param) == (400, "seed")
    unknown = from_triton_message(
        tagged("heigth: unknown field; did you mean 'height'? (known: ...)", ErrorCode.INVALID_ARG), fields
    )
    assert (unknown.status, unknown.param) == (400, "heigth")
    internal = from_triton_message(tagged("denoising step failed: boom", ErrorCode.INTERNAL), fields)
    assert (internal.status, internal.message) == (500, "denoising step failed: boom")
    unavailable = from_triton_message(tagged("out of memory; retry", ErrorCode.UNAVAILABLE), fields)
    assert (unavailable.status, unavailable.code) == (503, "service_unavailable")
    assert from_triton_message(tagged("cancelled after step 3", ErrorCode.CANCELLED), fields).status == 499
    # Untagged: Triton's own words, the only messages still classified by what they say.
    stub = "Failed to process the request(s) for model 'm', message: Stub process 'm_0_0' is not healthy."
    assert from_triton_message(stub, fields).status == 503
    assert from_triton_message("RuntimeError: boom", fields).status == 500
    assert from_triton_message("seed: must be an integer", fields).status == 500  # no tag: not a model's


def test_a_retry_hint_goes_into_the_body_and_out_of_the_message():
    hint = RetryHint(Retry.RESUME, "k" * 16, 7)
    wire = tagged_message(RequestError(ErrorCode.UNAVAILABLE, "draining: checkpointed at step 7", hint))
    assert wire.endswith(' retry={"retry":"resume","resume_key":"kkkkkkkkkkkkkkkk","step":7} [UNAVAILABLE]')
    error = from_triton_message(wire, set(IMAGE_FIELDS))
    assert error.status == 503 and error.message == "draining: checkpointed at step 7"
    assert error.body()["error"]["retry"] == {"retry": "resend"}  # the key is the front's own, not theirs
    plain = from_triton_message(tagged("out of memory", ErrorCode.UNAVAILABLE), set(IMAGE_FIELDS))
    assert "retry" not in plain.body()["error"]


def test_the_tag_decides_the_status_not_the_words():
    fields = set(IMAGE_FIELDS)
    words = "scheduler: 'Unavailable' is unavailable here; the model is restarting, out of memory"
    refused = from_triton_message(tagged(words, ErrorCode.INVALID_ARG), fields)
    assert (refused.status, refused.param, refused.message) == (400, "scheduler", words)
    failed = from_triton_message(tagged("seed: cancelled", ErrorCode.INTERNAL), fields)
    assert (failed.status, failed.param) == (500, None)  # a field's name first does not make it a 400
    busy = from_triton_message(tagged("width: the model is busy", ErrorCode.UNAVAILABLE), fields)
    assert (busy.status, busy.message) == (503, "width: the model is busy")
    # A tag names its code exactly; brackets elsewhere in the message are the model's words.
    odd = from_triton_message("prompt: got '[INVALID_ARG]x' [INTERNAL]", fields)
    assert (odd.status, odd.message) == (500, "prompt: got '[INVALID_ARG]x'")
    with_id = from_triton_message(tagged("[request id: oai-1] seed: got 'x'", ErrorCode.INVALID_ARG), fields)
    assert (with_id.status, with_id.param) == (400, "seed")


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
    # The model spreads the previews over the steps it runs: the front asks for as many as partial images.
    streamed = image_call({"prompt": "x", "stream": True, "partial_images": 2}, {}, IMAGE_MODEL, LIMITS)
    assert {k: streamed.request.parameters.get(k) for k in ("progress", "previews", "preview_every")} == {
        "progress": True,
        "previews": 2,
        "preview_every": None,
    }
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
        ({"prompt": "x", "previews": 2}, "previews", "send partial_images instead"),
        ({"prompt": "x", "describe": True}, "describe", "describe: is not sent through the OpenAI front"),
        ({"prompt": "x", "seed": [1]}, "seed", "seed: must be a single value, got list"),
        ({"prompt": "x", "seed": 2**64}, "seed", "allowed: a 64-bit integer at most"),
        ({"prompt": "x", "priority": 1}, "priority", "priority: unknown field"),
        # Triton's gRPC front reads timeout itself and would refuse these in its own words (a 500):
        ({"prompt": "x", "timeout": "5000"}, "timeout", "must be an integer, got str"),
        ({"prompt": "x", "timeout": 5000.0}, "timeout", "must be an integer, got float"),
        ({"prompt": "x", "timeout": True}, "timeout", "must be an integer, got bool"),
        ({"prompt": "x", "timeout": -1}, "timeout", "got -1 (allowed: 0.."),
    ],
)
def test_image_requests_refused_by_the_front_name_the_parameter(params, param, words):
    error = raises_api_error(400, param, params, {}, IMAGE_MODEL, LIMITS, call=image_call)
    assert words in error.message


def test_a_timeout_goes_to_triton_as_an_integer_within_the_models_range():
    fields = {**IMAGE_MODEL.fields, "timeout": {"type": "integer", "minimum": 1, "maximum": 10**6}}
    model = ModelInfo(IMAGE_MODEL.name, IMAGE_MODEL.kind, fields, "default")
    assert (
        image_call({"prompt": "x", "timeout": 5000}, {}, model, LIMITS).request.parameters["timeout"] == 5000
    )
    error = raises_api_error(
        400, "timeout", {"prompt": "x", "timeout": 10**7}, {}, model, LIMITS, call=image_call
    )
    assert "allowed: 1..1000000" in error.message


def test_height_width_and_num_frames_are_our_fields_where_size_and_seconds_are_absent():
    # The `openai` package's size literals need not list a model's sizes: height and width as extras.
    call = image_call({"prompt": "x", "height": 64, "width": 96}, {}, IMAGE_MODEL, LIMITS)
    assert call.request.parameters["width"] == 96 and call.request.parameters["height"] == 64
    assert call.size == "96x64"
    model_error = from_triton_message(
        tagged("height: got 100 (allowed: ...)", ErrorCode.INVALID_ARG),
        set(IMAGE_FIELDS),
        call.request.openai_names,
    )
    assert model_error.param == "height"  # the model's error names the field the client sent
    edit = image_call({"prompt": "x", "height": "64"}, {"IMAGE": b"png"}, EDIT_MODEL, LIMITS, from_form=True)
    assert edit.request.parameters["height"] == 64 and edit.size is None
    # Sent with size too: they must agree, and the model's errors then name size.
    same = image_call({"prompt": "x", "size": "96x64", "height": 64}, {}, IMAGE_MODEL, LIMITS)
    assert same.request.parameters["height"] == 64 and same.request.openai_names["height"] == "size"
    error = raises_api_error(
        400, "width", {"prompt": "x", "size": "96x64", "width": 64}, {}, IMAGE_MODEL, LIMITS, call=image_call
    )
    assert error.message == "width: got 64, but size 96x64 gives 96 (send one of them)"
    video = video_call({"prompt": "x", "height": 64, "width": 96, "num_frames": 13}, VIDEO_MODEL, False)
    assert {k: video.request.parameters[k] for k in ("width", "height", "num_frames")} == {
        "width": 96,
        "height": 64,
        "num_frames": 13,
    }
    assert video.size == "96x64" and video.request.openai_names == {}
    agreed = video_call({"prompt": "x", "seconds": "1", "fps": 8, "num_frames": 9}, VIDEO_MODEL, False)
    assert (
        agreed.request.parameters["num_frames"] == 9
        and agreed.request.openai_names["num_frames"] == "seconds"
    )
    error = raises_api_error(
        400,
        "num_frames",
        {"prompt": "x", "seconds": "1", "fps": 8, "num_frames": 13},
        VIDEO_MODEL,
        False,
        call=video_call,
    )
    assert "but seconds 1 at 8 fps gives 9" in error.message
    raises_api_error(
        400, "height", {"prompt": "x", "size": "64x64", "height": 96}, VIDEO_MODEL, False, call=video_call
    )


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
    assert form_value("progress", "off", "boolean") is False
    assert form_value("scheduler", "7", "string") == "7"
    raises_api_error(400, "seed", "seed", "7x", "integer", call=form_value)
    raises_api_error(400, "seed", "seed", "1" * 30, "integer", call=form_value)
    raises_api_error(400, "strength", "strength", "half", "number", call=form_value)
    raises_api_error(400, "progress", "progress", "maybe", "boolean", call=form_value)


def test_max_tokens_gives_a_schedule_the_model_accepts():
    from triton_diffusion.adapters.masked_diffusion import DecodeParams

    for max_tokens in (1, 7, 10, 16, 32, 37, 40, 64, 100, 256):
        schedule = decode_schedule(max_tokens, None, None)
        DecodeParams(schedule["gen_length"], schedule["block_length"], schedule["steps"]).check()
        assert schedule["gen_length"] == max_tokens and schedule["block_length"] <= 16
    assert decode_schedule(64, 32, None) == {"gen_length": 64, "steps": 32}
    assert decode_schedule(64, 16, 8) == {"gen_length": 64}  # the client's values are the model's to check
    # Block size and tokens per step follow the model's own default schedule (its MODEL_INFO).
    assert schedule_defaults(LM_MODEL) == (16, 2.0)
    assert schedule_defaults(described("lm", "text_generation", LM_FIELDS)) == (16, 2.0)  # none given
    wide = described("lm", "text_generation", LM_FIELDS, gen_length=128, block_length=32, steps=128)
    assert decode_schedule(64, None, None, *schedule_defaults(wide)) == {
        "gen_length": 64,
        "block_length": 32,
        "steps": 64,
    }


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
    assert chat.stream and chat.include_usage and chat.service_tier == "default"  # the model's default
    completion = text_call({"prompt": ["The sea"]}, LM_MODEL, LIMITS, chat=False)
    assert completion.request.tensors == {"PROMPT": b"The sea"}
    assert completion.request.parameters == {"apply_chat_template": False, "stream": False}
    # OpenAI's service_tier is the model's field of that name; "auto" is the model's default: not sent.
    flex = text_call({"prompt": "x", "service_tier": "flex"}, LM_MODEL, LIMITS, chat=False)
    assert flex.request.parameters["service_tier"] == "flex" and flex.service_tier == "flex"
    auto = text_call({"prompt": "x", "service_tier": "auto"}, LM_MODEL, LIMITS, chat=False)
    assert "service_tier" not in auto.request.parameters and auto.service_tier == "default"
    for body, param in (
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "stop": ["\n"]}, "stop"),
        ({"prompt": "x", "gen_length": 8}, "gen_length"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_completion_tokens": 0}, "max_completion_tokens"),
    ):
        raises_api_error(400, param, body, LM_MODEL, LIMITS, False, call=text_call)


def test_a_text_models_error_names_the_openai_parameter_the_client_sent():
    too_long = tagged("prompt: is 9000 characters long (allowed: at most 8192)", ErrorCode.INVALID_ARG)
    too_many = tagged("gen_length: got 9000 (allowed: 1..4096)", ErrorCode.INVALID_ARG)
    for body, chat, prompt_param, tokens_param in (
        ({"prompt": "x", "max_tokens": 9000}, False, "prompt", "max_tokens"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9000},
            True,
            "messages",
            "max_tokens",
        ),
        ({"prompt": "x", "max_completion_tokens": 9000}, False, "prompt", "max_completion_tokens"),
    ):
        names = text_call(body, LM_MODEL, LIMITS, chat=chat).request.openai_names
        assert from_triton_message(too_long, LM_FIELDS, names).param == prompt_param
        assert from_triton_message(too_many, LM_FIELDS, names).param == tokens_param


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
    assert video_call({"prompt": "x", "seconds": "1", "fps": "8", "num_frames": "9"}, VIDEO_MODEL, True)
    # Without fps, seconds count at the model's default fps (its MODEL_INFO): 16 here.
    assert (
        video_call({"prompt": "x", "seconds": "1"}, VIDEO_MODEL, False).request.parameters["num_frames"] == 17
    )
    raises_api_error(400, "previews", {"prompt": "x", "previews": 2}, VIDEO_MODEL, False, call=video_call)
    # A rate past the model's range (MODEL_INFO's maximum) is refused here, not once the job was queued.
    fields = {**VIDEO_MODEL.fields, "fps": {**VIDEO_MODEL.fields["fps"], "maximum": 60}}
    capped = ModelInfo(VIDEO_MODEL.name, VIDEO_MODEL.kind, fields, "default")
    huge = {"prompt": "x", "seconds": "60", "fps": 2**63 - 1}
    assert "allowed: 1..60" in raises_api_error(400, "fps", huge, capped, False, call=video_call).message
    assert (
        video_call({"prompt": "x", "seconds": "1", "fps": 60}, capped, False).request.parameters["fps"] == 60
    )
    raises_api_error(
        400, "fps", {"prompt": "x", "fps": 2**63 - 1}, capped, False, call=video_call
    )  # no seconds
    raises_api_error(
        400, "seconds", {"prompt": "x", "seconds": "forever"}, VIDEO_MODEL, True, call=video_call
    )
    raises_api_error(
        400, "input_reference", {"prompt": "x", "input_reference": "x"}, VIDEO_MODEL, True, call=video_call
    )
    raises_api_error(
        400, "output_format", {"prompt": "x", "output_format": "frames"}, VIDEO_MODEL, False, call=video_call
    )


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


def test_a_key_is_compared_by_digests_of_one_length(monkeypatch):
    # hmac.compare_digest returns at once on inputs of different lengths: comparing the keys themselves
    # told a key's length by the answer's timing.
    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append((len(a), len(b))) or real(a, b))
    check_bearer("Bearer sk-one", frozenset({"sk-one", "a-much-longer-key-than-that"}))
    raises_api_error(401, None, "Bearer x", frozenset({"sk-one"}), call=check_bearer)
    assert compared and set(compared) == {(32, 32)}


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
    errors = [
        device_lost_error("RuntimeError: CUDA error: an illegal memory access was encountered"),
        Failure(oom, "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB").request_error(
            "step"
        ),
        Failure(oom, "MemoryError: ").request_error("pipeline call"),
        Failure(oom, "RuntimeError: CUDA error: out of memory").request_error("decoding"),
    ]
    for error in errors:
        assert error.code is ErrorCode.UNAVAILABLE, error.message  # the server says so: the front reads it
        for sent in (error.message, f"[request id: oai-1] {error.message}"):
            answer = from_triton_message(tagged(sent, error.code), fields)
            assert (answer.status, answer.code, answer.message) == (503, "service_unavailable", sent.rstrip())
    ordinary = Failure(FailureKind.ORDINARY, "RuntimeError: boom").request_error("denoising step")
    assert from_triton_message(tagged(ordinary.message, ordinary.code), fields).status == 500


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

        # A key making room drops its own finished jobs first, another's only where it holds none.
        shared = VideoJobs(FakeBridge([VIDEO_MODEL], block=True), limits, clock=lambda: 1000.0)
        shared.jobs["alices"] = replace(finished("alices", COMPLETED, 10), owner="alice")
        shared.jobs["bobs"] = replace(finished("bobs", COMPLETED, 20), owner="bob")
        shared.jobs["bobs-later"] = replace(finished("bobs-later", COMPLETED, 30), owner="bob")
        shared.create(call, VIDEO_MODEL, "bob")
        assert list(shared.jobs)[:2] == ["alices", "bobs-later"]  # bob's oldest went, not alice's older one
        shared.create(call, VIDEO_MODEL, "carol")  # carol holds none finished: the longest-finished goes
        assert list(shared.jobs)[0] == "bobs-later" and "alices" not in shared.jobs
        await shared.close()

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
    monkeypatch.setattr(
        launcher, "supervise", lambda command, extra, port, front, *drain_s: started.append(front) or 0
    )
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


def model_info_json(kind: str, **fields: dict) -> str:
    """A MODEL_INFO as a model answers it (serving/triton_model.py ``describe``)."""
    return json.dumps(
        {
            "kind": kind,
            "engine": "step",
            "fields": fields,
            "outputs": ["IMAGE", "MODEL_INFO"],
            "service_tiers": ["priority", "default", "flex"],
            "default_service_tier": "default",
            "error_codes": [code.value for code in ErrorCode],
        }
    )


class DescribingClient:
    """Triton's gRPC client as the catalog uses it: the repository index, each model's metadata, and
    streams whose describe requests each model answers with ``answers[name]`` (a MODEL_INFO text, or an
    error for None); ``plain`` models declare no MODEL_INFO output."""

    def __init__(self, answers: dict[str, str | None], plain: tuple[str, ...] = ()) -> None:
        self.answers, self.plain = answers, plain
        self.states = {name: "READY" for name in [*answers, *plain]}
        self.asked: list[tuple[str, dict, dict]] = []  # (model, tensors, parameters) of each request

    async def get_model_repository_index(self, **_):
        return {"models": [{"name": name, "state": state} for name, state in self.states.items()]}

    async def get_model_metadata(self, name, **_):
        outputs = [{"name": "IMAGE", "datatype": "BYTES"}]
        if name not in self.plain:
            outputs.append({"name": "MODEL_INFO", "datatype": "BYTES"})
        return {"inputs": [{"name": "PROMPT", "datatype": "BYTES"}], "outputs": outputs}

    def stream_infer(self, requests, stream_timeout=None):
        return DescribeCall(requests, self)

    async def close(self) -> None:
        pass


class DescribeCall:
    def __init__(self, requests, client: DescribingClient) -> None:
        self.requests, self.client, self.cancelled = requests.__aiter__(), client, False
        self._grpc_call = self

    def done(self) -> bool:
        return self.cancelled

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def __aiter__(self):
        return self

    async def __anext__(self):
        from tritonclient.utils import InferenceServerException

        message = await self.requests.__anext__()
        name = message["model_name"]
        tensors = {tensor.name(): tensor.datatype() for tensor in message["inputs"]}
        self.client.asked.append((name, tensors, message["parameters"]))
        answer = self.client.answers[name]
        if answer is None:
            return None, InferenceServerException("Stub process 'x' is not healthy.")
        return FakeResult({"MODEL_INFO": np.array([[answer.encode()]], dtype=object)}, final=True), None


def test_the_catalog_is_built_from_model_info():
    steps = {"type": "integer", "default": 4, "minimum": 1, "maximum": 50, "supported": True}
    image = {"type": "byte string", "default": None, "supported": False}
    fps = {"type": "integer", "default": 24, "supported": True}
    client = DescribingClient(
        {
            "text_to_image": model_info_json("text_to_image", num_inference_steps=steps, image=image),
            "text_to_video": model_info_json("text_to_video", fps=fps),
            "garbled": "{not json",
            "other_kind": model_info_json("speech_to_text"),
        },
        plain=("someone_elses",),
    )
    bridge = TritonBridge("127.0.0.1:1")
    bridge._client = client

    async def catalog() -> dict[str, ModelInfo]:
        bridge._catalog_at = -1e9  # past its TTL
        return await bridge.models()

    async def scenario() -> None:
        models = await catalog()
        assert sorted(models) == ["text_to_image", "text_to_video"]  # the rest did not describe themselves
        assert models["text_to_image"].kind == "text_to_image"
        assert models["text_to_image"].default("num_inference_steps") == 4  # the model's real default
        assert not models["text_to_image"].serves("image")  # declared; its pipeline cannot start from one
        assert models["text_to_image"].default_service_tier == "default"
        assert models["text_to_video"].default("fps") == 24
        # One describe request each (the prompt input Triton requires, describe=true); none to a model
        # that declares no MODEL_INFO.
        assert sorted(name for name, _, _ in client.asked) == [
            "garbled",
            "other_kind",
            "text_to_image",
            "text_to_video",
        ]
        for _, tensors, sent in client.asked:
            assert tensors == {"PROMPT": "BYTES"} and sent["describe"] is True
        # Kept while the model stays ready: the next catalog asks nobody.
        asked = len(client.asked)
        assert sorted(await catalog()) == ["text_to_image", "text_to_video"] and len(client.asked) == asked
        # A model that left READY is asked again when it is back (its config may have changed).
        client.states["text_to_video"] = "UNAVAILABLE"
        assert sorted(await catalog()) == ["text_to_image"]
        client.states["text_to_video"] = "READY"
        client.answers["text_to_video"] = model_info_json("text_to_video", fps={**fps, "default": 8})
        assert (await catalog())["text_to_video"].default("fps") == 8 and len(client.asked) == asked + 1
        # A model that cannot answer now is left out and asked again next time.
        client.states["late"], client.answers["late"] = "READY", None
        assert "late" not in await catalog()
        client.answers["late"] = model_info_json("text_generation")
        assert (await catalog())["late"].kind == "text_generation"
        assert [name for name, _, _ in client.asked].count("late") == 2
        await bridge.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert model_info("m", json.dumps({"kind": "text_to_image", "fields": []})) is None


def test_partial_images_are_the_models_previews_numbered_from_zero():
    def progress(step: int, preview: bool) -> TritonResponse:
        outputs = {
            "STEP": np.array([[step]], dtype=np.int32),
            "TOTAL_STEPS": np.array([[10]], dtype=np.int32),
        }
        if preview:
            outputs["PREVIEW"] = np.array([[b"preview%d" % step]], dtype=object)
        return TritonResponse(outputs, False)

    final = TritonResponse(
        {
            "IMAGE": np.array([[b"png"]], dtype=object),
            "SEED": np.array([[7]], dtype=np.int64),
            "WIDTH": np.array([[96]], dtype=np.int32),
            "HEIGHT": np.array([[64]], dtype=np.int32),
        },
        True,
    )
    # Progress after every step, a preview where the model chose (it spreads them over the steps it runs).
    responses = [progress(step, step in (4, 7)) for step in range(1, 10)] + [final]
    bridge = FakeBridge([IMAGE_MODEL], responses)
    with TestClient(create_app(FrontState(bridge))) as client:
        body = {"prompt": "x", "stream": True, "partial_images": 2}
        answer = client.post("/v1/images/generations", json=body)
    assert bridge.requests[0].parameters["previews"] == 2
    events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ")]
    assert [(e["type"], e.get("partial_image_index")) for e in events] == [
        ("image_generation.partial_image", 0),
        ("image_generation.partial_image", 1),
        ("image_generation.completed", None),
    ]
    assert [e["size"] for e in events] == ["auto", "auto", "96x64"]  # the size the model rendered at
    assert result_size(final, None) == "96x64" and result_size(responses[0], "64x64") == "64x64"


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


def test_finish_reason_is_the_models_own():
    def final(reason: bytes) -> TritonResponse:
        outputs = {
            "TEXT": np.array([[b"text"]], dtype=object),
            "TOKENS": np.array([[64]], dtype=np.int32),
            "FINISH_REASON": np.array([[reason]], dtype=object),
        }
        return TritonResponse(outputs, True)

    plain = text_call({"prompt": "The sea"}, LM_MODEL, LIMITS, chat=False)  # no max_tokens
    assert completion_response(plain, final(b"length"), False)["choices"][0]["finish_reason"] == "length"
    assert completion_response(plain, final(b"stop"), False)["choices"][0]["finish_reason"] == "stop"
    asked = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    body = completion_response(text_call(asked, LM_MODEL, LIMITS, chat=True), final(b"length"), True)
    assert body["choices"][0]["finish_reason"] == "length" and body["service_tier"] == "default"
    streamed = FakeBridge([LM_MODEL], [final(b"stop")])
    with TestClient(create_app(FrontState(streamed))) as client:
        answer = client.post("/v1/completions", json={"prompt": "hi", "stream": True, "max_tokens": 64})
    chunks = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]


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
            return None, InferenceServerException("seed: must be an integer [INVALID_ARG]")
        outputs = {} if kind == "bare final" else {"IMAGE": np.array([b"png"], dtype=object)}
        return FakeResult(outputs, final=kind != "progress"), None


class FakeResult:
    """A tritonclient InferResult as streams.read_result reads it."""

    def __init__(self, outputs: dict[str, np.ndarray], final: bool) -> None:
        self.outputs, self.final = outputs, final

    def get_response(self):
        final = self.final

        class Flag:
            bool_param = final

        class Output:
            def __init__(self, name: str) -> None:
                self.name = name

        class Response:
            outputs = [Output(name) for name in self.outputs]
            parameters = {"triton_final_response": Flag()}

        return Response()

    def as_numpy(self, name: str) -> np.ndarray:
        return self.outputs[name]


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

    info = described("m", "text_to_image", ["prompt", "seed"])
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


def test_a_parameter_triton_would_cut_is_a_400_naming_it_and_nothing_is_sent():
    class NoStreams:
        def stream_infer(self, requests, stream_timeout=None):
            raise AssertionError("a stream was opened for a request that cannot be sent")

        async def close(self) -> None:
            pass

    info = described("m", "text_to_image", ["prompt", "negative_prompt"])
    bridge = TritonBridge("127.0.0.1:1")
    bridge._client = NoStreams()
    # A NUL: Triton would cut the parameter there; a lone surrogate (JSON's "\udcff"): not UTF-8.
    for text in ("a\0" + "x" * 5000, "ab\udcff"):
        request = TritonRequest("m", {"PROMPT": b"x"}, {"negative_prompt": text})

        async def drain(request=request) -> list:
            return [r async for r in bridge.stream(request, info, 5.0)]

        with pytest.raises(ApiError) as refused:
            asyncio.run(drain())
        assert (refused.value.status, refused.value.param) == (400, "negative_prompt")
        assert refused.value.message.startswith("negative_prompt: "), refused.value.message


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

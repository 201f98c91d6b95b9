"""OpenAI request shapes to our model fields, and our models' outputs back to OpenAI shapes. Pure: no I/O.

Our own fields travel through the client's ``extra_body`` as top-level keys and go to the model as they
are; the model validates them (the field declarations in ``triton_diffusion.fields``) and its error
names the field. The front checks only what it must before Triton sees a request: the OpenAI parameters
it translates itself, values that cannot be a Triton parameter (lists, objects, integers past 64 bits),
field names the model does not have, and form fields (multipart sends text) converted to the model's
input types.
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from triton_diffusion.errors import RequestError, short_text
from triton_diffusion.fields import Field, FieldSet
from triton_diffusion.openai_front.errors import ApiError, bad_request, field_error
from triton_diffusion.openai_front.limits import Limits
from triton_diffusion.openai_front.triton_bridge import ModelInfo, TritonRequest, TritonResponse

INT64_RANGE = (-(2**63), 2**63 - 1)
_SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")
_INTEGER = re.compile(r"^[+-]?[0-9]{1,20}$")
_BOOLEANS = {
    "true": True,
    "1": True,
    "yes": True,
    "on": True,
    "false": False,
    "0": False,
    "no": False,
    "off": False,
}

# OpenAI parameters that mean nothing for these models: accepted and ignored, as OpenAI-compatible
# servers do, so application code written for OpenAI runs unchanged.
IGNORED_IMAGE_PARAMS = frozenset(
    {
        "quality",
        "background",
        "moderation",
        "style",
        "user",
        "output_compression",
        "input_fidelity",
        "safety_identifier",
    }
)
IGNORED_TEXT_PARAMS = frozenset(
    {
        "user",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "store",
        "metadata",
        "service_tier",
        "parallel_tool_calls",
        "logprobs",
        "safety_identifier",
        "prompt_cache_key",
    }
)
# Model fields the front sets from OpenAI parameters: a client sends the OpenAI parameter instead.
IMAGE_FIELDS_SET_BY_FRONT = {
    "num_images_per_prompt": "n",
    "height": "size",
    "width": "size",
    "output_encoding": "response_format",
    "progress": "stream",
    "preview_every": "partial_images",
}
VIDEO_FIELDS_SET_BY_FRONT = {
    "num_videos_per_prompt": "the one video of a job",
    "height": "size",
    "width": "size",
    "output_format": "the MP4 of GET /v1/videos/{id}/content",
    "output_encoding": "the MP4 of GET /v1/videos/{id}/content",
    "progress": "the job's progress",
    "preview_every": "the job's progress",
}
TEXT_FIELDS_SET_BY_FRONT = {"prompt": "messages / prompt", "stream": "stream", "gen_length": "max_tokens"}
# Which model field each OpenAI parameter becomes, so a model's error about the field names the parameter
# the client sent (param) while its message stays the model's own.
IMAGE_OPENAI_NAMES = {
    "num_images_per_prompt": "n",
    "height": "size",
    "width": "size",
    "image": "image",
    "mask": "mask",
    "mask_image": "mask",
}
TEXT_OPENAI_NAMES = {"gen_length": "max_tokens", "prompt": "messages"}
VIDEO_OPENAI_NAMES = {"height": "size", "width": "size", "num_frames": "seconds"}


# ---- values -------------------------------------------------------------------------------------------
def scalar_value(name: str, value: Any) -> Any:
    """A JSON value that can be a Triton request parameter (string, integer, number, boolean); the model
    checks its type and range. None means absent."""
    if value is None or isinstance(value, (str, bool, float)):
        return value
    if isinstance(value, int):
        if not INT64_RANGE[0] <= value <= INT64_RANGE[1]:
            raise field_error(name, f"got {short_text(value)} (allowed: a 64-bit integer at most)")
        return value
    raise field_error(name, f"must be a single value, got {type(value).__name__} {short_text(value)}")


def form_value(name: str, text: str, datatype: str) -> Any:
    """A multipart form field (always text) as the model input's type."""
    if datatype.startswith(("INT", "UINT")):
        if not _INTEGER.match(text.strip()):
            raise field_error(name, f"must be an integer, got {short_text(text)}")
        return scalar_value(name, int(text))
    if datatype.startswith("FP"):
        try:
            return float(text)
        except ValueError:
            raise field_error(name, f"must be a number, got {short_text(text)}") from None
    if datatype == "BOOL":
        if text.strip().lower() not in _BOOLEANS:
            raise field_error(name, f"must be a boolean (true or false), got {short_text(text)}")
        return _BOOLEANS[text.strip().lower()]
    return text


def check_field_names(names: list[str], info: ModelInfo) -> None:
    """Refuse a field the model does not declare with the model's own message (did-you-mean included),
    before the request leaves; the model would say the same."""
    unknown = [name for name in names if name not in info.inputs]
    if not unknown:
        return
    declared = FieldSet(Field(name, str) for name in info.inputs)
    try:
        declared.parse({unknown[0]: None})
    except RequestError as error:
        raise bad_request(error.message, unknown[0] if len(unknown[0]) <= 64 else None) from None


def model_fields(
    extras: Mapping[str, Any], info: ModelInfo, set_by_front: Mapping[str, str], from_form: bool
) -> dict[str, Any]:
    """Our own fields sent beside the OpenAI parameters (the client's ``extra_body``), as Triton request
    parameters of the right type."""
    fields: dict[str, Any] = {}
    for name in extras:
        if name in set_by_front:
            raise field_error(name, f"is set by the OpenAI front (send {set_by_front[name]} instead)")
    check_field_names(list(extras), info)
    for name, value in extras.items():
        converted = form_value(name, value, info.inputs[name]) if from_form else scalar_value(name, value)
        if converted is not None:
            fields[name] = converted
    return fields


def _integer(name: str, value: Any, low: int, high: int, from_form: bool) -> int:
    if from_form and isinstance(value, str):
        value = form_value(name, value, "INT64")
    if not isinstance(value, int) or isinstance(value, bool):
        raise field_error(name, f"must be an integer, got {type(value).__name__} {short_text(value)}")
    if not low <= value <= high:
        raise field_error(name, f"got {short_text(value)} (allowed: {low}..{high})")
    return value


def _boolean(name: str, value: Any, from_form: bool) -> bool:
    if from_form and isinstance(value, str):
        value = form_value(name, value, "BOOL")
    if not isinstance(value, bool):
        raise field_error(name, f"must be a boolean, got {type(value).__name__} {short_text(value)}")
    return value


def _text(name: str, value: Any) -> str:
    if value is None:
        raise field_error(name, "is required")
    if not isinstance(value, str):
        raise field_error(name, f"must be a string, got {type(value).__name__} {short_text(value)}")
    return value


def parse_size(value: Any) -> tuple[int, int] | None:
    """OpenAI's ``size``: "WIDTHxHEIGHT" -> (width, height); "auto" or absent -> None (the model's
    default, or for edits the source image's size). The model checks the limits."""
    if value is None or value == "auto":
        return None
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise field_error(
            "size", f"must be 'WIDTHxHEIGHT' (e.g. '512x512') or 'auto', got {short_text(value)}"
        )
    return int(match.group(1)), int(match.group(2))


def model_name(value: Any, default: str) -> str:
    if value is None:
        return default
    if not isinstance(value, str) or not value or len(value) > 128:
        raise field_error("model", f"must be a model name, got {short_text(value)}")
    return value


# ---- images -------------------------------------------------------------------------------------------
@dataclass
class ImageCall:
    request: TritonRequest
    stream: bool
    partial_images: int
    output_format: str
    size: str | None  # as asked ("WxH"); None: the model's default or the source's size


def image_call(
    params: Mapping[str, Any],
    tensors: dict[str, bytes],
    info: ModelInfo,
    limits: Limits,
    from_form: bool = False,
) -> ImageCall:
    """/v1/images/generations (JSON) and /v1/images/edits (multipart: ``from_form``) to one Triton request
    whose ``num_images_per_prompt`` rows are the ``n`` images (seeds seed + i)."""
    known = {
        "prompt",
        "model",
        "n",
        "size",
        "response_format",
        "output_format",
        "stream",
        "partial_images",
        "image",
        "mask",
    }
    extras = {k: v for k, v in params.items() if k not in known and k not in IGNORED_IMAGE_PARAMS}
    prompt = _text("prompt", params.get("prompt"))
    n = _integer("n", params["n"], 1, limits.max_n, from_form) if params.get("n") is not None else 1
    size = parse_size(params.get("size"))
    response_format = params.get("response_format") or "b64_json"
    if response_format != "b64_json":
        raise field_error(
            "response_format",
            f"got {short_text(response_format)} (allowed: 'b64_json'; images are not stored)",
        )
    output_format = params.get("output_format") or "png"
    stream = _boolean("stream", params["stream"], from_form) if params.get("stream") is not None else False
    partial = params.get("partial_images")
    partial_images = (
        _integer("partial_images", partial, 0, limits.max_partial_images, from_form)
        if partial is not None
        else 0
    )

    parameters = model_fields(extras, info, IMAGE_FIELDS_SET_BY_FRONT, from_form)
    parameters["num_images_per_prompt"] = n
    parameters["output_format"] = scalar_value("output_format", output_format)
    if "output_encoding" in info.inputs:
        # Raw image bytes, which the front base64-encodes once: a model configured with a base64 default
        # (for Triton's HTTP JSON) would otherwise be encoded twice.
        parameters["output_encoding"] = "binary"
    if size is not None:
        parameters["width"], parameters["height"] = size
    if stream and partial_images:
        # The front forwards ``partial_images`` previews, evenly spread: ask for about that many (each
        # preview is a PNG the server encodes), not one per step.
        parameters["progress"] = True
        parameters["preview_every"] = preview_every(
            partial_images, denoising_steps(parameters, info, "IMAGE" in tensors)
        )
    request = TritonRequest(
        info.name, {"PROMPT": prompt.encode("utf-8"), **tensors}, parameters, IMAGE_OPENAI_NAMES
    )
    return ImageCall(
        request, stream, partial_images, str(output_format), None if size is None else f"{size[0]}x{size[1]}"
    )


def denoising_steps(parameters: Mapping[str, Any], info: ModelInfo, from_image: bool) -> int | None:
    """The denoising steps a request will run, or None when the front cannot tell: the request's
    ``num_inference_steps``, else the model's configured default. An edit runs ``int(steps * strength)``
    of them, known only when the request gives ``strength`` (the default depends on the pipeline)."""
    steps = parameters.get("num_inference_steps", info.default_steps)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        return None
    if not from_image:
        return steps
    strength = parameters.get("strength")
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0 < strength <= 1:
        return None
    return max(1, int(steps * strength))


def preview_every(partial_images: int, steps: int | None) -> int:
    """Previews every N steps so that about ``partial_images`` arrive before the last step: N =
    steps // (partial_images + 1) gives at least ``partial_images`` previews before the last step, one
    past each point where :class:`PartialImagePicker` takes one. Unknown steps: every step (the picker
    still forwards only ``partial_images``)."""
    if steps is None:
        return 1
    return min(1000, max(1, steps // (partial_images + 1)))


class PartialImagePicker:
    """Chooses which previews become OpenAI partial images: ``count`` of them, spread evenly over the
    denoising steps (the k-th at the first preview past (k + 1) / (count + 1) of the steps)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.sent = 0

    def take(self, step: int, total: int) -> int | None:
        """The partial image index for a preview at ``step`` of ``total``, or None to skip it."""
        if self.sent >= self.count or step >= total:
            return None  # the last step's image arrives as the completed one
        if step * (self.count + 1) >= (self.sent + 1) * total or total - step <= self.count - self.sent:
            self.sent += 1
            return self.sent - 1
        return None


def result_size(response: TritonResponse, asked: str | None) -> str | None:
    """The size of the images: the BATCH report's key when the model reports one, else as asked."""
    batch = response.scalar("BATCH")
    if batch is not None:
        try:
            key = json.loads(batch).get("key", {})
            if "width" in key and "height" in key:
                return f"{key['width']}x{key['height']}"
        except (ValueError, AttributeError):
            pass
    return asked


def b64(data: bytes) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def images_response(call: ImageCall, response: TritonResponse, created: int | None = None) -> dict[str, Any]:
    images = response.outputs["IMAGE"].reshape(-1)
    seeds = response.outputs["SEED"].reshape(-1) if "SEED" in response.outputs else [None] * len(images)
    return {
        "created": created or int(time.time()),
        "data": [
            {"b64_json": b64(image), "seed": None if seed is None else int(seed)}
            for image, seed in zip(images, seeds, strict=True)
        ],
        "output_format": call.output_format,
        "size": result_size(response, call.size),
    }


def partial_image_event(prefix: str, index: int, preview: bytes, size: str | None) -> dict[str, Any]:
    """``image_generation.partial_image`` (``image_edit.`` for edits); previews are low-resolution PNGs."""
    return {
        "type": f"{prefix}.partial_image",
        "b64_json": b64(preview),
        "created_at": int(time.time()),
        "size": size or "auto",
        "quality": "auto",
        "background": "auto",
        "output_format": "png",
        "partial_image_index": index,
    }


def completed_events(prefix: str, call: ImageCall, response: TritonResponse) -> list[dict[str, Any]]:
    """One ``image_generation.completed`` event per image (``image_index`` and ``seed`` added)."""
    body = images_response(call, response)
    zero_usage = {
        "input_tokens": 0,
        "output_tokens": 0,
        "total_tokens": 0,
        "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
    }
    return [
        {
            "type": f"{prefix}.completed",
            "b64_json": item["b64_json"],
            "created_at": body["created"],
            "size": body["size"] or "auto",
            "quality": "auto",
            "background": "auto",
            "output_format": call.output_format,
            "usage": zero_usage,
            "image_index": index,
            "seed": item["seed"],
        }
        for index, item in enumerate(body["data"])
    ]


def sse(data: Mapping[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


def error_event(error: ApiError) -> bytes:
    """An error after the stream began (the status line is sent): the openai client raises it."""
    return sse(error.body(), "error")


# ---- text (the diffusion LM) -----------------------------------------------------------------------
@dataclass
class TextCall:
    request: TritonRequest
    stream: bool
    include_usage: bool
    gen_length: int | None  # tokens asked for: max_tokens, else the model's configured default (or None)
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def decode_schedule(gen_length: int, block_length: Any, steps: Any) -> dict[str, int]:
    """The diffusion LM decodes ``gen_length`` tokens in blocks of ``block_length`` with ``steps`` steps
    in all (a multiple of the block count, at most gen_length). ``max_tokens`` alone must give a valid
    schedule: blocks of up to 16 tokens that divide it, and about two tokens per step (the model's own
    default ratio, 64 tokens in 32 steps). Given values are kept; the model checks them."""
    schedule = {"gen_length": gen_length}
    if block_length is None:
        block_length = max(d for d in range(1, min(16, gen_length) + 1) if gen_length % d == 0)
        schedule["block_length"] = block_length
    valid_block = isinstance(block_length, int) and not isinstance(block_length, bool) and block_length > 0
    if steps is None and valid_block and gen_length % block_length == 0:
        blocks = gen_length // block_length
        schedule["steps"] = max(blocks, (gen_length // 2) // blocks * blocks)
    return schedule


def chat_prompt(messages: Any, limits: Limits) -> str:
    """OpenAI chat messages as one prompt. The model wraps the prompt as one user turn of its chat
    template; earlier turns (and a system message) go before the last user message as plain text."""
    if not isinstance(messages, list) or not messages:
        raise field_error("messages", "must be a non-empty list of messages")
    if len(messages) > limits.max_chat_messages:
        raise field_error(
            "messages", f"has {len(messages)} messages (allowed: at most {limits.max_chat_messages})"
        )
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise field_error(f"messages[{i}]", "must be an object with role and content", "messages")
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise field_error(
                f"messages[{i}].role",
                f"got {short_text(role)} (allowed: system, developer, user, assistant)",
                "messages",
            )
        turns.append((role, message_text(message.get("content"), i)))
    if turns[-1][0] != "user":
        raise field_error("messages", "the last message must be from the user")
    *earlier, (_, last) = turns
    if not earlier:
        return last
    context = "\n".join(f"{role.capitalize()}: {text}" for role, text in earlier)
    return f"{context}\n\n{last}"


def message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise field_error(f"messages[{index}].content", "only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise field_error(f"messages[{index}].content", "must be a string or a list of text parts", "messages")


def text_call(body: Mapping[str, Any], info: ModelInfo, limits: Limits, chat: bool) -> TextCall:
    """/v1/chat/completions (``chat``) and /v1/completions to one request of the diffusion LM."""
    known = {
        "messages" if chat else "prompt",
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "seed",
        "stream",
        "stream_options",
        "n",
        "stop",
    }
    if chat:
        prompt = chat_prompt(body.get("messages"), limits)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        prompt = _text("prompt", prompt)
    if body.get("n") not in (None, 1):
        raise field_error("n", f"got {short_text(body.get('n'))} (allowed: 1)")
    if body.get("stop") is not None:
        raise field_error("stop", "is not supported by the diffusion LM (it stops at its end-of-text token)")
    stream = _boolean("stream", body["stream"], False) if body.get("stream") is not None else False
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise field_error("stream_options", "must be an object")
    extras = {k: v for k, v in body.items() if k not in known and k not in IGNORED_TEXT_PARAMS}
    parameters = model_fields(extras, info, TEXT_FIELDS_SET_BY_FRONT, False)
    for name in ("temperature", "seed"):
        if body.get(name) is not None:
            parameters[name] = scalar_value(name, body[name])
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    gen_length = info.default_gen_length
    if max_tokens is not None:
        gen_length = _integer("max_tokens", max_tokens, 1, 1 << 20, False)
        parameters.update(
            decode_schedule(gen_length, parameters.get("block_length"), parameters.get("steps"))
        )
    # Chat wraps the prompt in the model's chat template; a completion continues the text as it is.
    parameters.setdefault("apply_chat_template", chat)
    parameters["stream"] = stream  # blocks as partial responses only when the client streams
    request = TritonRequest(info.name, {"PROMPT": prompt.encode("utf-8")}, parameters, TEXT_OPENAI_NAMES)
    include_usage = bool(options.get("include_usage"))
    return TextCall(request, stream, include_usage, gen_length, info.name)


def finish_reason(tokens: int, gen_length: int | None) -> str:
    """ "length" when every requested token was generated, "stop" when the model ended earlier. The
    model's TOKENS counts the generated tokens up to the first EOS, so fewer than ``gen_length`` means an
    EOS ended the text. With ``gen_length`` unknown (no max_tokens, and no default_gen_length in the
    model's config) it cannot be told: "stop"."""
    return "length" if gen_length is not None and tokens >= gen_length else "stop"


def usage(response: TritonResponse) -> dict[str, int]:
    completion = int(response.scalar("TOKENS") or 0)
    prompt = int(response.scalar("PROMPT_TOKENS") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def block_text(response: TritonResponse) -> str:
    """The TEXT output: a committed block's new text (partial responses) or the whole text (FINAL)."""
    text = response.scalar("TEXT")
    return bytes(text).decode("utf-8", errors="replace") if text is not None else ""


def completion_response(call: TextCall, response: TritonResponse, chat: bool) -> dict[str, Any]:
    text = block_text(response)
    counts = usage(response)
    reason = finish_reason(counts["completion_tokens"], call.gen_length)
    seed = response.scalar("SEED")
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": reason,
            "logprobs": None,
        }
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + call.id,
        "object": "chat.completion" if chat else "text_completion",
        "created": call.created,
        "model": call.model,
        "choices": [choice],
        "usage": counts,
        "seed": None if seed is None else int(seed),
    }


def completion_chunk(
    call: TextCall, chat: bool, text: str | None, reason: str | None, first: bool
) -> dict[str, Any]:
    """One streamed chunk: a committed block's text, or (``reason`` set) the closing chunk."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + call.id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": call.created,
        "model": call.model,
        "choices": [choice],
    }


def usage_chunk(call: TextCall, chat: bool, response: TritonResponse) -> dict[str, Any]:
    chunk = completion_chunk(call, chat, None, None, False)
    chunk["choices"] = []
    chunk["usage"] = usage(response)
    return chunk


# ---- videos ---------------------------------------------------------------------------------------------
@dataclass
class VideoCall:
    request: TritonRequest
    prompt: str
    size: str | None
    seconds: str | None


def frames_for_seconds(seconds: float, fps: int) -> int:
    """Wan-style models take 4k+1 frames: the nearest such count to seconds x fps."""
    return 4 * max(1, round(seconds * fps / 4)) + 1


def video_call(params: Mapping[str, Any], info: ModelInfo, from_form: bool) -> VideoCall:
    """POST /v1/videos (JSON or multipart) to one Triton request for one MP4."""
    known = {"prompt", "model", "seconds", "size", "input_reference"}
    if params.get("input_reference") is not None:
        raise field_error("input_reference", "is not supported: text_to_video models take a prompt only")
    prompt = _text("prompt", params.get("prompt"))
    extras = {k: v for k, v in params.items() if k not in known and k not in IGNORED_IMAGE_PARAMS}
    parameters = model_fields(extras, info, VIDEO_FIELDS_SET_BY_FRONT, from_form)
    size = parse_size(params.get("size"))
    if size is not None:
        parameters["width"], parameters["height"] = size
    seconds_text = params.get("seconds")
    if seconds_text is not None:
        try:
            seconds = float(seconds_text)
        except (TypeError, ValueError):
            seconds = math.nan
        if not (math.isfinite(seconds) and 0 < seconds <= 60):
            raise field_error(
                "seconds", f"must be a number of seconds in 0..60, got {short_text(seconds_text)}"
            )
        if "num_frames" not in parameters:
            fps = parameters.get("fps", 16)
            parameters["num_frames"] = frames_for_seconds(seconds, fps if isinstance(fps, int) else 16)
    parameters.update(output_format="mp4", output_encoding="binary", progress=True)
    request = TritonRequest(info.name, {"PROMPT": prompt.encode("utf-8")}, parameters, VIDEO_OPENAI_NAMES)
    return VideoCall(
        request,
        prompt,
        None if size is None else f"{size[0]}x{size[1]}",
        None if seconds_text is None else str(seconds_text),
    )

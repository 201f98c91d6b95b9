"""OpenAI's image requests (generations, edits) to one request of an image model, and its outputs back
to OpenAI's shapes: the images, the streamed partial images and completed events (translation.py has
the checks every endpoint shares). Pure: no I/O."""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from triton_diffusion.errors import short_text
from triton_diffusion.openai_front.errors import field_error
from triton_diffusion.openai_front.limits import Limits
from triton_diffusion.openai_front.translation import (
    agreed_size,
    boolean_param,
    integer_param,
    model_fields,
    openai_names,
    parse_size,
    scalar_value,
    text_param,
)
from triton_diffusion.openai_front.triton_bridge import ModelInfo, TritonRequest, TritonResponse

# OpenAI parameters that mean nothing for image and video models: accepted and ignored, as
# OpenAI-compatible servers do, so application code written for OpenAI runs unchanged.
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
# Model fields the front sets from OpenAI parameters: a client sends the OpenAI parameter instead.
# (height, width and num_frames are not here: they may come as our own fields where size and seconds are
# absent, as the `openai` package's size literals need not list a model's sizes; see agreed_size.)
IMAGE_FIELDS_SET_BY_FRONT = {
    "num_images_per_prompt": "n",
    "output_encoding": "response_format",
    "progress": "stream",
    "preview_every": "partial_images",
    "previews": "partial_images",
}
# Which model field each OpenAI parameter becomes, so a model's error about the field names the parameter
# the client sent (param) while its message stays the model's own (height and width only when size was
# sent: see openai_names).
IMAGE_OPENAI_NAMES = {
    "num_images_per_prompt": "n",
    "height": "size",
    "width": "size",
    "image": "image",
    "mask": "mask",
    "mask_image": "mask",
}


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
    prompt = text_param("prompt", params.get("prompt"))
    n = integer_param("n", params["n"], 1, limits.max_n, from_form) if params.get("n") is not None else 1
    size = parse_size(params.get("size"))
    response_format = params.get("response_format") or "b64_json"
    if response_format != "b64_json":
        raise field_error(
            "response_format",
            f"got {short_text(response_format)} (allowed: 'b64_json'; images are not stored)",
        )
    output_format = params.get("output_format") or "png"
    stream = params.get("stream") is not None and boolean_param("stream", params["stream"], from_form)
    partial = params.get("partial_images")
    partial_images = (
        integer_param("partial_images", partial, 0, limits.max_partial_images, from_form)
        if partial is not None
        else 0
    )

    parameters = model_fields(extras, info, IMAGE_FIELDS_SET_BY_FRONT, from_form)
    parameters["num_images_per_prompt"] = n
    parameters["output_format"] = scalar_value("output_format", output_format)
    if "output_encoding" in info.fields:
        # Raw image bytes, which the front base64-encodes once: a model configured with a base64 default
        # (for Triton's HTTP JSON) would otherwise be encoded twice.
        parameters["output_encoding"] = "binary"
    asked_size = agreed_size(parameters, size)
    if stream and partial_images:
        # The model spreads that many previews over the steps the request runs (which only it knows: an
        # edit runs a share of them set by its strength); each is one partial image.
        parameters["progress"] = True
        parameters["previews"] = partial_images
    sent = {"n", "image", "mask"} | ({"size"} if size is not None else set())
    request = TritonRequest(
        info.name,
        {"PROMPT": prompt.encode("utf-8"), **tensors},
        parameters,
        openai_names(IMAGE_OPENAI_NAMES, sent),
    )
    return ImageCall(request, stream, partial_images, str(output_format), asked_size)


def result_size(response: TritonResponse, asked: str | None) -> str | None:
    """The size the images were rendered at, as the model tells it (WIDTH, HEIGHT: an edit's may come
    from its source image); as asked when a response lacks them."""
    width, height = response.scalar("WIDTH"), response.scalar("HEIGHT")
    if width is None or height is None:
        return asked
    return f"{int(width)}x{int(height)}"


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

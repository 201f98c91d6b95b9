"""OpenAI's ``POST /v1/videos`` to one request of a text-to-video model (translation.py has the checks
every endpoint shares; video_jobs.py runs it). Pure: no I/O."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from triton_diffusion.errors import short_text
from triton_diffusion.openai_front.errors import field_error
from triton_diffusion.openai_front.image_translation import IGNORED_IMAGE_PARAMS
from triton_diffusion.openai_front.translation import (
    agree,
    agreed_size,
    model_fields,
    openai_names,
    parse_size,
    text_param,
)
from triton_diffusion.openai_front.triton_bridge import ModelInfo, TritonRequest

# Model fields the front sets itself: a job is one MP4 with its progress.
VIDEO_FIELDS_SET_BY_FRONT = {
    "num_videos_per_prompt": "the one video of a job",
    "output_format": "the MP4 of GET /v1/videos/{id}/content",
    "output_encoding": "the MP4 of GET /v1/videos/{id}/content",
    "progress": "the job's progress",
    "preview_every": "the job's progress",
    "previews": "the job's progress",
}
# Which model field each OpenAI parameter becomes, so a model's error about the field names the parameter
# the client sent (only when size and seconds were sent: see openai_names).
VIDEO_OPENAI_NAMES = {"height": "size", "width": "size", "num_frames": "seconds"}


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
    prompt = text_param("prompt", params.get("prompt"))
    extras = {k: v for k, v in params.items() if k not in known and k not in IGNORED_IMAGE_PARAMS}
    parameters = model_fields(extras, info, VIDEO_FIELDS_SET_BY_FRONT, from_form)
    size = parse_size(params.get("size"))
    asked_size = agreed_size(parameters, size)
    seconds_text = params.get("seconds")
    if "fps" in parameters:  # its range checked here, seconds or not: not once the job was queued
        frame_rate(parameters, info)
    if seconds_text is not None:
        try:
            seconds = float(seconds_text)
        except (TypeError, ValueError):
            seconds = math.nan
        if not (math.isfinite(seconds) and 0 < seconds <= 60):
            raise field_error(
                "seconds", f"must be a number of seconds in 0..60, got {short_text(seconds_text)}"
            )
        fps = frame_rate(parameters, info)
        frames = frames_for_seconds(seconds, fps)
        agree(parameters, "num_frames", frames, f"seconds {seconds:g} at {fps} fps")
        parameters["num_frames"] = frames
    parameters.update(output_format="mp4", output_encoding="binary", progress=True)
    sent = {"size"} if size is not None else set()
    if seconds_text is not None:
        sent.add("seconds")
    request = TritonRequest(
        info.name, {"PROMPT": prompt.encode("utf-8")}, parameters, openai_names(VIDEO_OPENAI_NAMES, sent)
    )
    return VideoCall(request, prompt, asked_size, None if seconds_text is None else str(seconds_text))


def frame_rate(parameters: Mapping[str, Any], info: ModelInfo) -> int:
    """The frames per second that ``seconds`` is counted in: the request's ``fps``, else the model's
    default (from its MODEL_INFO), within the model's range (a rate past it would count more frames than
    a request can carry: the model would refuse the fps, but only after the job was queued)."""
    fps = parameters.get("fps", info.default("fps"))
    if isinstance(fps, bool) or not isinstance(fps, int) or fps < 1:
        raise field_error("fps", f"must be a positive integer to count seconds in, got {short_text(fps)}")
    described = info.fields.get("fps") or {}
    low = 1 if described.get("minimum") is None else described["minimum"]
    high = described.get("maximum")
    if fps < low or (high is not None and fps > high):
        raise field_error("fps", f"got {short_text(fps)} (allowed: {low}..{'' if high is None else high})")
    return fps

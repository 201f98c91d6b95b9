"""Text-to-video through the same batching core: Wan-style pipelines that return ``.frames``.

With a step adapter for the pipeline (Wan 2.1: adapters/wan.py) each video is one job of the step engine,
joining running videos of its size and frame count at the next step; otherwise one fused pipeline call per
compatible group. ``num_frames`` is part of the key (the shape group); ``fps`` only sets the MP4's frame
rate, after the split. Each video is one row with its own generator; the response carries an MP4 (PyAV)
per video, or raw uint8 frames on request.
"""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.codecs.video import available_codec, encode_mp4, to_uint8
from triton_diffusion.compatibility import CompatibilityKey
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.request_engine import CallSteps
from triton_diffusion.fields import FieldSet
from triton_diffusion.models.diffusion_model import ParsedRequest, RowInput
from triton_diffusion.models.interfaces import TEXT_TO_VIDEO_FIELDS, TEXT_TO_VIDEO_OUTPUTS
from triton_diffusion.models.text_to_image import TextToImageModel
from triton_diffusion.settings import IMAGE, ModelSettings

if TYPE_CHECKING:
    from triton_diffusion.adapters.latent_loop import LatentStepAdapter


class TextToVideoModel(TextToImageModel):
    KIND = "text_to_video"
    FIELDS = TEXT_TO_VIDEO_FIELDS
    CONFIG_KINDS: ClassVar[tuple[str, ...]] = (IMAGE,)  # no source images
    REQUIRED_CALL_ARGS = ("prompt", "generator", "height", "width", "num_frames", "num_inference_steps")
    OPTIONAL_CALL_FIELDS = ("negative_prompt", "guidance_scale")
    OUTPUT_ATTRIBUTE = "frames"
    OUTPUTS = TEXT_TO_VIDEO_OUTPUTS

    def load(self, settings: ModelSettings) -> tuple[FieldSet, LatentStepAdapter | None]:
        loaded = super().load(settings)
        self.codec = available_codec()
        return loaded

    def derived_defaults(self) -> dict[str, str]:
        derived = super().derived_defaults()
        frames = self.facts.default("num_frames")
        derived["num_frames_multiple_of"] = str(self.pipe.vae_scale_factor_temporal)
        if isinstance(frames, int):
            derived["default_num_frames"] = str(frames)
        return derived

    def images_for(self, values: dict[str, Any]) -> int:
        return values["num_videos_per_prompt"]

    def step_request(self, values: dict[str, Any], image_index: int) -> ImageParams:
        # The frame count is part of the job's shape group; the adapter answers uint8 frames, as run_call.
        return replace(super().step_request(values, image_index), num_frames=values["num_frames"])

    def call_arguments(self, shared: dict[str, Any], rows: list[RowInput]) -> dict[str, Any]:
        kwargs = super().call_arguments(shared, rows)
        kwargs.update(num_frames=shared["num_frames"], output_type="np")
        return kwargs

    def run_call(self, key: CompatibilityKey, jobs: list[Job], steps: CallSteps) -> list[Any]:
        return [None if video is None else to_uint8(video) for video in super().run_call(key, jobs, steps)]

    def respond(self, request: ParsedRequest, outputs: list[Any]) -> dict[str, np.ndarray]:
        values = request.values
        if values["output_format"] == "frames":
            return {"FRAMES": np.stack(outputs)[None]}
        videos = [encode_mp4(frames, values["fps"], self.codec) for frames in outputs]
        if values["output_encoding"] == "base64":
            videos = [base64.b64encode(video) for video in videos]
        return {"VIDEO": np.array([videos], dtype=object)}

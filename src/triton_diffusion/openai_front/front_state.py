"""What every endpoint of the front shares: the Triton bridge, the limits, the default models, the keys
and the video jobs (``app.state.front``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from triton_diffusion.openai_front.limits import Limits
from triton_diffusion.openai_front.triton_bridge import TritonBridge
from triton_diffusion.openai_front.video_jobs import VideoJobs


@dataclass(frozen=True)
class DefaultModels:
    """The model an endpoint uses when a request names none (repository names)."""

    image: str = "text_to_image"
    edit: str = "image_to_image"
    video: str = "text_to_video"
    text: str = "diffusion_lm"


@dataclass
class FrontState:
    bridge: TritonBridge
    limits: Limits = field(default_factory=Limits)
    models: DefaultModels = field(default_factory=DefaultModels)
    keys: frozenset[str] = frozenset()
    videos: VideoJobs | None = None

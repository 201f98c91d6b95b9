"""Encoding generated videos for the response: MP4 through PyAV (applied per request, after the call)."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np

# H.264 when the FFmpeg inside PyAV has an encoder for it, else MPEG-4 Part 2: both play in MP4.
CODECS = ("libx264", "h264", "mpeg4")


def available_codec() -> str:
    import av

    for name in CODECS:
        try:
            av.codec.Codec(name, "w")
            return name
        except Exception:  # noqa: BLE001,S112  (not built into this FFmpeg: try the next)
            continue
    raise RuntimeError(f"PyAV has none of the video encoders {CODECS}")


def encode_mp4(frames: np.ndarray, fps: int, codec: str) -> bytes:
    """(F, H, W, 3) uint8 frames -> MP4 bytes."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=Fraction(fps))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        if codec in ("libx264", "h264"):
            stream.options = {"crf": "18", "preset": "veryfast"}
        else:
            stream.bit_rate = 4_000_000
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """diffusers' float frames in [0, 1] -> uint8."""
    return (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)

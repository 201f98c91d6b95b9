"""The client for triton-diffusion's image and video models over gRPC streaming.

Python:
    from triton_diffusion_client import generate
    results = generate(["a red cat", "a blue dog"], seed=7, height=64, width=64)
    results[0].save("out")

CLI:
    triton-diffusion-generate "a red cat" "a blue dog" --seed 7 --out out/
    triton-diffusion-generate "a boat" --model text_to_video --param num_frames=9 --out out/  # MP4 files

Every prompt is its own Triton request (own seed, own error), sent concurrently so the server's batcher
can fuse them. A request the server lost (it restarted, drained or the connection broke) is resent with
its resume key once the server is ready again, up to ``retries`` times within ``timeout_s`` (retry.py;
``retries=0`` or ``--no-retry``: never).

The prompt, a source image and a mask travel as input tensors; every other field is a request parameter
(streams.py).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from PIL import Image

from triton_diffusion_client.concurrency import send_concurrently
from triton_diffusion_client.retry import DEFAULT_RETRIES, RESUME_KEY_FIELD, RetryBudget, new_resume_key
from triton_diffusion_client.streams import ResponseError, StreamResponse, StreamSession

# Request fields sent as input tensors (encoded image files), by the tensor's name.
IMAGE_TENSORS = {"image": "IMAGE", "mask_image": "MASK_IMAGE"}


@dataclass(frozen=True)
class Progress:
    step: int
    total: int
    preview: bytes | None  # a low-resolution PNG when the request set preview_every


# Called for every progress response; return True to cancel the request.
OnProgress = Callable[[Progress], "bool | None"]


@dataclass
class GenerateResult:
    request_id: str
    prompt: str
    images: list[bytes] = field(default_factory=list)  # encoded image files (PNG by default)
    videos: list[bytes] = field(default_factory=list)  # MP4 files, from video models
    frames: np.ndarray | None = None  # video models with output_format "frames": uint8 [videos, F, H, W, 3]
    seeds: list[int] = field(default_factory=list)  # seed of each image or video
    batch: dict[str, Any] | None = None  # the compatibility key and fused calls, as the server reports
    error: str | None = None
    latency_s: float = 0.0
    # STEP of each progress response, in order (a resend's replace the steps it runs again)
    steps: list[int] = field(default_factory=list)
    first_progress_s: float | None = None  # time to the first progress response
    cancelled: bool = False  # cancelled by this client
    attempts: int = 0  # requests sent: 1, or more when it was resent after a failure (retry.py)
    resume_key: str | None = None  # sent with the request (None: retry was off, or the server too old)

    @property
    def ok(self) -> bool:
        return self.error is None

    def save(self, directory: str | Path, extension: str = "png") -> list[Path]:
        """Write every image (``<request_id>_<seed>.<extension>``), video (``.mp4``) or video's frames
        (``<request_id>_<seed>_<frame>.png``) into ``directory``; returns the paths."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = []
        if self.frames is not None:
            for video, seed in zip(self.frames, self.seeds, strict=True):
                for index, frame in enumerate(video):
                    paths.append(directory / f"{self.request_id}_{seed}_{index:03d}.png")
                    Image.fromarray(frame).save(paths[-1])
            return paths
        files, suffix = (self.videos, "mp4") if self.videos else (self.images, extension)
        for data, seed in zip(files, self.seeds, strict=True):
            paths.append(directory / f"{self.request_id}_{seed}.{suffix}")
            paths[-1].write_bytes(data)
        return paths


def encoded_image(value: bytes | str | Path | Image.Image) -> bytes:
    """A source image or mask as the bytes of an image file: the bytes themselves, a file's, or a PIL
    image encoded as PNG (the server decodes any format it reads)."""
    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return buffer.getvalue()
    if isinstance(value, (str, Path)):
        return Path(value).read_bytes()
    return bytes(value)


class ImageSession(StreamSession):
    """One gRPC connection and stream to an image or video model, reused for requests sent one after
    another (a new stream opens by itself when the server restarted)."""

    def generate(
        self,
        request: dict[str, Any],
        request_id: str,
        timeout_s: float = 300.0,
        on_progress: OnProgress | None = None,
        retries: int = DEFAULT_RETRIES,
    ) -> GenerateResult:
        """Send one request (``prompt`` and any other fields; ``image`` and ``mask_image`` as bytes, a
        path or a PIL image) and wait for its FINAL response. With ``on_progress`` the request asks for
        per-step progress; the callback may return True to cancel the request. With ``retries`` (the
        default) it carries a resume key (its own ``resume_key``, else a new one) and is resent after a
        lost connection, a restart or a drain: ``timeout_s`` bounds all its attempts together."""
        fields = dict(request)
        if on_progress is not None:
            fields.setdefault("progress", True)
        if retries > 0 and fields.get(RESUME_KEY_FIELD) is None:
            fields[RESUME_KEY_FIELD] = new_resume_key()
        budget = RetryBudget(retries, timeout_s, fields.get(RESUME_KEY_FIELD))
        prompt = fields.pop("prompt")
        out = GenerateResult(request_id=request_id, prompt=prompt)
        tensors = {"PROMPT": prompt.encode("utf-8")}
        for name, tensor in IMAGE_TENSORS.items():
            value = fields.pop(name, None)
            if value is not None:
                tensors[tensor] = encoded_image(value)
        started = time.perf_counter()
        try:
            attempts = self.resilient_responses(tensors, fields, request_id, budget)
            with closing(attempts) as responses:
                for response in responses:
                    if response.scalar("STEP") is not None:
                        progress = _progress(response)
                        # A resend resumes from a checkpoint or starts over: its steps replace those after.
                        out.steps = [s for s in out.steps if s < progress.step] + [progress.step]
                        if out.first_progress_s is None:
                            out.first_progress_s = time.perf_counter() - started
                        if on_progress is not None and on_progress(progress):
                            out.cancelled, out.error = True, "cancelled by the client"
                            break  # closing the responses cancels the request
                    _read_outputs(response, fields.get("output_encoding"), out)
        except (ResponseError, TimeoutError) as exc:
            out.error = str(exc)
        out.latency_s = time.perf_counter() - started
        out.attempts, out.resume_key = budget.attempts, budget.resume_key
        return out


def generate_one(
    request: dict[str, Any],
    request_id: str,
    url: str = "localhost:8001",
    model: str = "text_to_image",
    timeout_s: float = 300.0,
    on_progress: OnProgress | None = None,
    retries: int = DEFAULT_RETRIES,
) -> GenerateResult:
    """Send one request on a stream of its own and wait for its FINAL response."""
    with ImageSession(url, model) as session:
        return session.generate(request, request_id, timeout_s, on_progress, retries)


def _progress(response: StreamResponse) -> Progress:
    preview = response.scalar("PREVIEW")
    return Progress(
        step=int(response.scalar("STEP")),
        total=int(response.scalar("TOTAL_STEPS")),
        preview=bytes(preview) if preview is not None else None,
    )


def _read_outputs(response: StreamResponse, encoding: str | None, result: GenerateResult) -> None:
    def files(name: str) -> list[bytes]:
        items = response.outputs[name].reshape(-1)
        return [base64.b64decode(x) if encoding == "base64" else bytes(x) for x in items]

    if "IMAGE" in response.outputs:
        result.images = files("IMAGE")
    if "VIDEO" in response.outputs:
        result.videos = files("VIDEO")  # MP4 files, encoded by the server
    if "FRAMES" in response.outputs:
        frames = response.outputs["FRAMES"]
        result.frames = frames.reshape(-1, *frames.shape[-4:])
    if "SEED" in response.outputs:
        result.seeds = [int(s) for s in response.outputs["SEED"].reshape(-1)]
    batch = response.scalar("BATCH")
    if batch is not None:
        result.batch = json.loads(batch)


def generate_many(
    requests: Sequence[dict[str, Any]],
    url: str = "localhost:8001",
    model: str = "text_to_image",
    timeout_s: float = 300.0,
    on_progress: Callable[[int, Progress], bool | None] | None = None,
    retries: int = DEFAULT_RETRIES,
) -> list[GenerateResult]:
    """Send each request (a dict with ``prompt`` and any other fields) concurrently; results in order.
    ``on_progress(index, progress)`` is called per progress response; return True to cancel that request.
    Each is resent up to ``retries`` times after a lost connection, a restart or a drain (0: never)."""
    send_one = partial(generate_one, retries=retries)
    return send_concurrently(send_one, requests, url, model, timeout_s, on_progress)


def generate(
    prompts: str | Sequence[str],
    url: str = "localhost:8001",
    model: str = "text_to_image",
    timeout_s: float = 300.0,
    on_progress: Callable[[int, Progress], bool | None] | None = None,
    retries: int = DEFAULT_RETRIES,
    **fields: Any,
) -> list[GenerateResult]:
    """One request per prompt, all with the same fields (seed, height, width, num_inference_steps, ...);
    each gets its own resume key (a ``resume_key`` among the fields would be shared: pass it per request
    with :func:`generate_many`)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if fields.get(RESUME_KEY_FIELD) is not None and len(prompts) > 1:
        raise ValueError("one resume_key for several prompts: each request needs its own (generate_many)")
    requests = [{"prompt": p, **fields} for p in prompts]
    return generate_many(requests, url, model, timeout_s, on_progress, retries)


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class ProgressLine:
    """Every request's step on stderr (no progress-bar package needed): on a terminal one status line,
    redrawn in place, with a bar per request; otherwise (a pipe, a log file) one line per progress response,
    so the lines never run together."""

    WIDTH = 10  # characters of each request's bar

    def __init__(self, count: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.steps: list[tuple[int, int] | None] = [None] * count
        self.terminal = self.stream.isatty()

    def update(self, index: int, progress: Progress) -> None:
        self.steps[index] = (progress.step, progress.total)
        if not self.terminal:
            print(f"[{index}] step {progress.step}/{progress.total}", file=self.stream, flush=True)
            return
        cells = []
        for done in self.steps:
            if done is None:
                cells.append("[" + " " * self.WIDTH + "]    -")
                continue
            filled = self.WIDTH * done[0] // max(done[1], 1)
            cells.append(f"[{'#' * filled}{' ' * (self.WIDTH - filled)}] {done[0]:>2}/{done[1]}")
        print("\r\x1b[K" + "  ".join(cells), end="", file=self.stream, flush=True)

    def close(self) -> None:
        if self.terminal and any(step is not None for step in self.steps):
            print(file=self.stream)


def add_retry_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--retries",
        type=int,
        default=DEFAULT_RETRIES,
        help="resend a request the server lost (it restarted, drained, the connection broke) with its "
        "resume key, at most this many times",
    )
    parser.add_argument(
        "--no-retry", action="store_true", help="never resend (no resume key): the same as --retries 0"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate images or videos with a triton-diffusion model.")
    parser.add_argument("prompts", nargs="+", help="one request per prompt, sent concurrently")
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    parser.add_argument("--model", default="text_to_image")
    parser.add_argument("--out", default="out", help="folder for the images and videos")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--height", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--steps", type=int, dest="num_inference_steps")
    parser.add_argument("--guidance", type=float, dest="guidance_scale")
    parser.add_argument("--negative", dest="negative_prompt")
    parser.add_argument("-n", "--images", type=int, dest="num_images_per_prompt")
    parser.add_argument(
        "--format", dest="output_format", help="png, jpeg, webp (images); mp4, frames (videos)"
    )
    parser.add_argument("--lora", help="LoRA adapters of the model's loras: name or name:scale,...")
    parser.add_argument("--image", type=Path, help="a source image file (img2img; every prompt)")
    parser.add_argument("--mask", type=Path, help="with --image: a mask file (inpainting: white repainted)")
    parser.add_argument("--strength", type=float, help="with --image: how much of the schedule runs")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any other field, e.g. --param scheduler=EulerDiscreteScheduler or --param num_frames=9",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds for each request, its resends included"
    )
    add_retry_options(parser)
    parser.add_argument("--no-progress", action="store_true", help="no per-request progress")
    parser.add_argument(
        "--preview-every",
        type=int,
        default=0,
        help="save a low-resolution preview every N steps (needs progress)",
    )
    args = parser.parse_args(argv)

    named = (
        "seed",
        "height",
        "width",
        "num_inference_steps",
        "guidance_scale",
        "negative_prompt",
        "num_images_per_prompt",
        "output_format",
        "lora",
        "strength",
    )
    fields = {name: getattr(args, name) for name in named if getattr(args, name) is not None}
    if (args.mask is not None or args.strength is not None) and args.image is None:
        parser.error("--mask and --strength need --image")
    for name, path in (("image", args.image), ("mask_image", args.mask)):
        if path is not None:
            fields[name] = path.read_bytes()
    for item in args.param:
        name, _, value = item.partition("=")
        fields[name] = _parse_value(value)
    extension = {"jpeg": "jpg"}.get(fields.get("output_format", "png"), fields.get("output_format", "png"))

    on_progress = None
    line = ProgressLine(len(args.prompts))
    if not args.no_progress:
        if args.preview_every:
            fields["preview_every"] = args.preview_every

        def on_progress(index: int, progress: Progress) -> None:
            line.update(index, progress)
            if progress.preview is not None:
                folder = Path(args.out) / "previews"
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"{index}_step{progress.step}.png").write_bytes(progress.preview)

    retries = 0 if args.no_retry else args.retries
    results = generate(args.prompts, args.url, args.model, args.timeout, on_progress, retries, **fields)
    line.close()
    failed = 0
    for result in results:
        if result.ok:
            for path in result.save(args.out, extension):
                print(f"{path}  ({result.latency_s:.2f} s, prompt {result.prompt!r})")
        else:
            failed += 1
            print(f"error for prompt {result.prompt!r}: {result.error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

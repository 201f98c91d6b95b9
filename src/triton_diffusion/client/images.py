"""A small client for triton-diffusion's image and video models over gRPC streaming (the models are
decoupled).

Python:
    from triton_diffusion.client import generate
    results = generate(["a red cat", "a blue dog"], seed=7, height=64, width=64)
    results[0].save("out")

CLI:
    triton-diffusion-generate "a red cat" "a blue dog" --seed 7 --out out/

Every prompt is its own Triton request (own seed, own error), sent concurrently so the server's dynamic
batcher can fuse them. Only PROMPT travels as an input tensor; every other field is sent as a request
parameter, so all requests carry the same set of inputs and Triton may batch them together.
"""

from __future__ import annotations

import argparse
import base64
import json
import queue
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from triton_diffusion.client.concurrency import send_concurrently

OUTPUTS = ("IMAGE", "SEED", "BATCH", "STEP", "TOTAL_STEPS", "PREVIEW")


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
    seeds: list[int] = field(default_factory=list)  # seed of each image
    batch: dict[str, Any] | None = None  # the compatibility key and fused calls, as the server reports
    error: str | None = None
    latency_s: float = 0.0
    steps: list[int] = field(default_factory=list)  # STEP of each progress response, in arrival order
    first_progress_s: float | None = None  # time to the first progress response
    cancelled: bool = False  # cancelled by this client

    @property
    def ok(self) -> bool:
        return self.error is None

    def save(self, directory: str | Path, extension: str = "png") -> list[Path]:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = []
        for image, seed in zip(self.images, self.seeds, strict=True):
            path = directory / f"{self.request_id}_{seed}.{extension}"
            path.write_bytes(image)
            paths.append(path)
        return paths


class StreamSession:
    """One gRPC connection and stream, reused for requests sent one after another.

    One request at a time per stream: tritonclient reports an error response without its request id,
    so the error then belongs to the request in flight. Concurrency comes from several sessions.
    """

    def __init__(self, url: str = "localhost:8001", model: str = "text_to_image") -> None:
        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self._responses: queue.Queue = queue.Queue()
        self._streaming = False

    def __enter__(self) -> StreamSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._streaming:
            self.client.stop_stream()
        self.client.close()

    def _stop_stream(self, cancel: bool) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self._streaming = False
        self._responses = queue.Queue()

    def _send(self, inputs: list, request_id: str, fields: dict[str, Any]) -> None:
        if not self._streaming:
            responses = self._responses
            self.client.start_stream(callback=lambda result, error: responses.put((result, error)))
            self._streaming = True
        self.client.async_stream_infer(
            self.model,
            inputs,
            outputs=[grpcclient.InferRequestedOutput(name) for name in OUTPUTS],
            request_id=request_id,
            parameters={k: v for k, v in fields.items() if v is not None},
            enable_empty_final_response=True,
        )

    def generate(
        self,
        request: dict[str, Any],
        request_id: str,
        timeout_s: float = 300.0,
        on_progress: OnProgress | None = None,
    ) -> GenerateResult:
        """Send one request and wait for its FINAL response.

        With ``on_progress`` the request asks for per-step progress; the callback may return True to
        cancel the request (the stream is closed with cancel_requests=True, which Triton passes on to
        the model).
        """
        fields = dict(request)
        if on_progress is not None:
            fields.setdefault("progress", True)
        prompt = fields.pop("prompt")
        out = GenerateResult(request_id=request_id, prompt=prompt)
        inputs = [_bytes_input("PROMPT", prompt.encode("utf-8"))]
        # A source image (img2img) and a mask (inpainting): encoded files, sent as BYTES tensors.
        for name, tensor in (("image", "IMAGE"), ("mask_image", "MASK_IMAGE")):
            data = fields.pop(name, None)
            if data is not None:
                inputs.append(_bytes_input(tensor, data))
        started = time.perf_counter()
        try:
            self._send(inputs, request_id, fields)
        except InferenceServerException:
            # The stream broke with its connection (the server restarted): a new one, once.
            self._stop_stream(cancel=False)
            try:
                self._send(inputs, request_id, fields)
            except InferenceServerException as exc:
                self._stop_stream(cancel=False)
                out.error = f"UNAVAILABLE: the server cannot be reached now ({exc.message()})"
                return out
        try:
            while True:
                response, error = self._responses.get(timeout=timeout_s)
                if error is not None:
                    out.error = str(error)
                    break
                if response.as_numpy("STEP") is not None:
                    progress = _progress(response)
                    out.steps.append(progress.step)
                    if out.first_progress_s is None:
                        out.first_progress_s = time.perf_counter() - started
                    if on_progress is not None and on_progress(progress):
                        self._stop_stream(cancel=True)
                        out.cancelled, out.error = True, "cancelled by the client"
                        break
                if response.as_numpy("IMAGE") is not None:
                    _read_outputs(response, fields.get("output_encoding"), out)
                if response.get_response().parameters["triton_final_response"].bool_param:
                    break
        except queue.Empty:
            out.error = f"no final response within {timeout_s} s"
            self._stop_stream(cancel=True)
        out.latency_s = time.perf_counter() - started
        return out


def generate_one(
    request: dict[str, Any],
    request_id: str,
    url: str = "localhost:8001",
    model: str = "text_to_image",
    timeout_s: float = 300.0,
    on_progress: OnProgress | None = None,
) -> GenerateResult:
    """Send one request on a stream of its own and wait for its FINAL response."""
    with StreamSession(url, model) as session:
        return session.generate(request, request_id, timeout_s, on_progress)


def _bytes_input(name: str, value: bytes) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[value]], dtype=object))
    return tensor


def _progress(response: Any) -> Progress:
    preview = response.as_numpy("PREVIEW")
    return Progress(
        step=int(response.as_numpy("STEP").reshape(-1)[0]),
        total=int(response.as_numpy("TOTAL_STEPS").reshape(-1)[0]),
        preview=bytes(preview.reshape(-1)[0]) if preview is not None else None,
    )


def _read_outputs(response: Any, encoding: str | None, result: GenerateResult) -> None:
    images = response.as_numpy("IMAGE").reshape(-1)
    result.images = [base64.b64decode(x) if encoding == "base64" else bytes(x) for x in images]
    result.seeds = [int(s) for s in response.as_numpy("SEED").reshape(-1)]
    batch = response.as_numpy("BATCH")
    result.batch = json.loads(batch.reshape(-1)[0]) if batch is not None else None


def generate_many(
    requests: Sequence[dict[str, Any]],
    url: str = "localhost:8001",
    model: str = "text_to_image",
    timeout_s: float = 300.0,
    on_progress: Callable[[int, Progress], bool | None] | None = None,
) -> list[GenerateResult]:
    """Send each request (a dict with ``prompt`` and any other fields) concurrently; results in order.
    ``on_progress(index, progress)`` is called per progress response; return True to cancel that request."""
    return send_concurrently(generate_one, requests, url, model, timeout_s, on_progress)


def generate(
    prompts: str | Sequence[str],
    url: str = "localhost:8001",
    model: str = "text_to_image",
    timeout_s: float = 300.0,
    on_progress: Callable[[int, Progress], bool | None] | None = None,
    **fields: Any,
) -> list[GenerateResult]:
    """One request per prompt, all with the same fields (seed, height, width, num_inference_steps, ...)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    return generate_many([{"prompt": p, **fields} for p in prompts], url, model, timeout_s, on_progress)


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate images with a triton-diffusion model.")
    parser.add_argument("prompts", nargs="+", help="one request per prompt, sent concurrently")
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    parser.add_argument("--model", default="text_to_image")
    parser.add_argument("--out", default="out", help="folder for the images")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--height", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--steps", type=int, dest="num_inference_steps")
    parser.add_argument("--guidance", type=float, dest="guidance_scale")
    parser.add_argument("--negative", dest="negative_prompt")
    parser.add_argument("-n", "--images", type=int, dest="num_images_per_prompt")
    parser.add_argument("--format", dest="output_format", choices=["png", "jpeg", "webp"])
    parser.add_argument("--lora", help="LoRA adapters of the model's loras: name or name:scale,...")
    parser.add_argument("--image", type=Path, help="a source image file (img2img; every prompt)")
    parser.add_argument("--mask", type=Path, help="with --image: a mask file (inpainting: white repainted)")
    parser.add_argument("--strength", type=float, help="with --image: how much of the schedule runs")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any other field, e.g. --param scheduler=EulerDiscreteScheduler",
    )
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--no-progress", action="store_true", help="no per-request progress bars")
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
    bars: list[Any] = []
    if not args.no_progress:
        from tqdm import tqdm

        bars = [
            tqdm(total=None, desc=f"[{i}] {p[:30]}", position=i, unit="step", leave=True)
            for i, p in enumerate(args.prompts)
        ]
        if args.preview_every:
            fields["preview_every"] = args.preview_every

        def on_progress(index: int, progress: Progress) -> None:
            bars[index].total = progress.total
            bars[index].update(progress.step - bars[index].n)
            if progress.preview is not None:
                folder = Path(args.out) / "previews"
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"{index}_step{progress.step}.png").write_bytes(progress.preview)

    results = generate(args.prompts, args.url, args.model, args.timeout, on_progress, **fields)
    for bar in bars:
        bar.close()
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

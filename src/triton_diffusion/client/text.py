"""A streaming client for the diffusion language model (``diffusion_lm``) over gRPC.

Python:
    from triton_diffusion.client import generate_text
    result = generate_text("Tell me about the sea", gen_length=64, block_length=16)
    print(result.text, result.tokens, result.steps)

CLI (prints each block as the server commits it):
    triton-diffusion-generate-text "Tell me about the sea" --gen-length 64 --block-length 16

Each request is its own Triton request on its own stream; several run concurrently in threads. Only
PROMPT travels as an input tensor; every other field is a request parameter.
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from triton_diffusion.client.concurrency import send_concurrently

OUTPUTS = ("TEXT", "BLOCK", "TOKENS", "STEPS", "SEED")


@dataclass(frozen=True)
class Block:
    index: int
    text: str  # the text this block added
    tokens: int  # tokens generated so far
    at_s: float  # seconds after the request was sent
    wall: float  # time.time() when it arrived, to compare streams with each other


@dataclass
class TextResult:
    request_id: str
    prompt: str
    blocks: list[Block] = field(default_factory=list)
    text: str = ""  # the whole text, from the FINAL response
    tokens: int = 0
    steps: int = 0  # denoising steps the request took part in
    seed: int | None = None
    error: str | None = None
    sent_wall: float = 0.0  # time.time() when sent
    latency_s: float = 0.0  # to the FINAL response
    cancelled: bool = False  # cancelled by this client

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def first_block_s(self) -> float | None:
        return self.blocks[0].at_s if self.blocks else None


# Called for every streamed block; return True to cancel the request.
OnBlock = Callable[[Block], "bool | None"]


def _scalar(response: Any, name: str) -> Any:
    array = response.as_numpy(name)
    return None if array is None else array.reshape(-1)[0]


class TextSession:
    """One gRPC connection for requests sent one after another, each on a stream of its own (the stream
    callback reports an error without its request id, so one request per stream keeps errors apart)."""

    def __init__(self, url: str = "localhost:8001", model: str = "diffusion_lm") -> None:
        self.model = model
        self.client = grpcclient.InferenceServerClient(url)

    def __enter__(self) -> TextSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def generate(
        self,
        request: dict[str, Any],
        request_id: str = "0",
        timeout_s: float = 300.0,
        on_block: OnBlock | None = None,
    ) -> TextResult:
        """Send one request; return when its FINAL response arrives. ``on_block`` may return True to
        cancel the request (the stream closes with cancel_requests=True, which reaches the model)."""
        fields = dict(request)
        prompt = fields.pop("prompt")
        out = TextResult(request_id=request_id, prompt=prompt)
        responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: responses.put((result, error)))
        cancel = False
        try:
            prompt_tensor = grpcclient.InferInput("PROMPT", [1, 1], "BYTES")
            prompt_tensor.set_data_from_numpy(np.array([[prompt.encode("utf-8")]], dtype=object))
            out.sent_wall = time.time()
            started = time.perf_counter()
            self.client.async_stream_infer(
                self.model,
                [prompt_tensor],
                outputs=[grpcclient.InferRequestedOutput(name) for name in OUTPUTS],
                request_id=request_id,
                parameters={k: v for k, v in fields.items() if v is not None},
                enable_empty_final_response=True,
            )
            cancel = self._receive(responses, out, started, timeout_s, on_block)
            out.latency_s = time.perf_counter() - started
        finally:
            self.client.stop_stream(cancel_requests=cancel)
        return out

    @staticmethod
    def _receive(
        responses: queue.Queue, out: TextResult, started: float, timeout_s: float, on_block: OnBlock | None
    ) -> bool:
        """Read responses into ``out`` until the FINAL one. Returns True to cancel the request."""
        while True:
            try:
                response, error = responses.get(timeout=timeout_s)
            except queue.Empty:
                out.error = f"no final response within {timeout_s} s"
                return True
            if error is not None:
                out.error = error.message()
                return False
            final = response.get_response().parameters["triton_final_response"].bool_param
            text = _scalar(response, "TEXT")
            if final:
                if text is not None:
                    out.text = text.decode("utf-8")
                    out.tokens = int(_scalar(response, "TOKENS"))
                    out.steps = int(_scalar(response, "STEPS"))
                    out.seed = int(_scalar(response, "SEED"))
                return False
            if text is not None:
                block = Block(
                    index=int(_scalar(response, "BLOCK")),
                    text=text.decode("utf-8"),
                    tokens=int(_scalar(response, "TOKENS")),
                    at_s=time.perf_counter() - started,
                    wall=time.time(),
                )
                out.blocks.append(block)
                if on_block is not None and on_block(block):
                    out.cancelled, out.error = True, "cancelled by the client"
                    return True


def generate_text_one(
    request: dict[str, Any],
    request_id: str = "0",
    url: str = "localhost:8001",
    model: str = "diffusion_lm",
    timeout_s: float = 300.0,
    on_block: OnBlock | None = None,
) -> TextResult:
    """Send one request on a connection of its own; return when its FINAL response arrives."""
    with TextSession(url, model) as session:
        return session.generate(request, request_id, timeout_s, on_block)


def generate_text_many(
    requests: Sequence[dict[str, Any]],
    url: str = "localhost:8001",
    model: str = "diffusion_lm",
    timeout_s: float = 300.0,
    on_block: Callable[[int, Block], bool | None] | None = None,
) -> list[TextResult]:
    """Send every request concurrently, each on its own stream; results in request order.
    ``on_block(index, block)`` is called per streamed block; return True to cancel that request."""
    return send_concurrently(generate_text_one, requests, url, model, timeout_s, on_block)


def generate_text(
    prompt: str, url: str = "localhost:8001", model: str = "diffusion_lm", **fields: Any
) -> TextResult:
    return generate_text_one({"prompt": prompt, **fields}, url=url, model=model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate text with the diffusion language model.")
    parser.add_argument("prompts", nargs="+", help="one request per prompt, sent concurrently")
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    parser.add_argument("--model", default="diffusion_lm")
    parser.add_argument("--gen-length", type=int, dest="gen_length")
    parser.add_argument("--block-length", type=int, dest="block_length")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--remasking", choices=["low_confidence", "random"])
    parser.add_argument("--threshold", type=float)
    parser.add_argument("--cfg-scale", type=float, dest="cfg_scale")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--no-chat", action="store_false", dest="apply_chat_template", default=None)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    names = ("gen_length", "block_length", "steps", "temperature", "remasking", "threshold", "cfg_scale")
    fields = {
        n: getattr(args, n) for n in (*names, "seed", "apply_chat_template") if getattr(args, n) is not None
    }
    single = len(args.prompts) == 1

    def on_block(index: int, block: Block) -> None:
        if single:
            print(block.text, end="", flush=True)
        else:
            print(f"[{index}] block {block.index} ({block.at_s:.2f} s): {block.text!r}", flush=True)

    requests = [{"prompt": p, **fields} for p in args.prompts]
    results = generate_text_many(requests, args.url, args.model, args.timeout, on_block)
    if single:
        print()
    failed = 0
    for index, result in enumerate(results):
        if result.ok:
            print(
                f"[{index}] {result.tokens} tokens, {result.steps} steps, {result.latency_s:.2f} s, "
                f"seed {result.seed}: {result.text!r}",
                file=sys.stderr,
            )
        else:
            failed += 1
            print(f"[{index}] error: {result.error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

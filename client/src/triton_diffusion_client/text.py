"""A streaming client for the diffusion language model (``diffusion_lm``) over gRPC.

Python:
    from triton_diffusion_client import generate_text
    result = generate_text("Tell me about the sea", gen_length=64, block_length=16)
    print(result.text, result.tokens, result.steps)

CLI (prints each block as the server commits it):
    triton-diffusion-generate-text "Tell me about the sea" --gen-length 64 --block-length 16

Each request is its own Triton request; several run concurrently in threads, each on its own stream. A
request the server lost (restart, drain, broken connection) is resent with its resume key (retry.py).
Only PROMPT travels as an input tensor; every other field is a request parameter (streams.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from triton_diffusion_client.concurrency import send_concurrently
from triton_diffusion_client.images import add_retry_options
from triton_diffusion_client.retry import DEFAULT_RETRIES, RESUME_KEY_FIELD, RetryBudget, new_resume_key
from triton_diffusion_client.streams import ResponseError, StreamResponse, StreamSession


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
    attempts: int = 0  # requests sent: more than 1 when it was resent after a failure (retry.py)
    resume_key: str | None = None  # sent with the request (None: retry was off, or the server too old)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def first_block_s(self) -> float | None:
        return self.blocks[0].at_s if self.blocks else None


# Called for every streamed block; return True to cancel the request.
OnBlock = Callable[[Block], "bool | None"]


class TextSession(StreamSession):
    """One gRPC connection and stream to the diffusion LM, reused for requests sent one after another."""

    def __init__(self, url: str = "localhost:8001", model: str = "diffusion_lm") -> None:
        super().__init__(url, model)

    def generate(
        self,
        request: dict[str, Any],
        request_id: str = "0",
        timeout_s: float = 300.0,
        on_block: OnBlock | None = None,
        retries: int = DEFAULT_RETRIES,
    ) -> TextResult:
        """Send one request; return when its FINAL response arrives. ``on_block`` may return True to
        cancel the request (the stream closes with cancel_requests=True, which reaches the model). It is
        resent with its resume key after a restart, a drain or a lost connection, at most ``retries``
        times within ``timeout_s`` (0: never, and no key)."""
        fields = dict(request)
        if retries > 0 and fields.get(RESUME_KEY_FIELD) is None:
            fields[RESUME_KEY_FIELD] = new_resume_key()
        budget = RetryBudget(retries, timeout_s, fields.get(RESUME_KEY_FIELD))
        prompt = fields.pop("prompt")
        out = TextResult(request_id=request_id, prompt=prompt)
        out.sent_wall = time.time()
        started = time.perf_counter()
        tensors = {"PROMPT": prompt.encode("utf-8")}
        try:
            attempts = self.resilient_responses(tensors, fields, request_id, budget)
            with closing(attempts) as responses:
                for response in responses:
                    if _read_response(response, out, started, on_block):
                        out.cancelled, out.error = True, "cancelled by the client"
                        break  # closing the responses cancels the request
        except (ResponseError, TimeoutError) as exc:
            out.error = str(exc)
        out.latency_s = time.perf_counter() - started
        out.attempts, out.resume_key = budget.attempts, budget.resume_key
        return out


def _read_response(
    response: StreamResponse, out: TextResult, started: float, on_block: OnBlock | None
) -> bool:
    """One response into ``out``: a committed block, or the FINAL one's whole text. True to cancel."""
    text = response.scalar("TEXT")
    if text is None:
        return False
    if response.final:
        out.text = bytes(text).decode("utf-8")
        out.tokens = int(response.scalar("TOKENS"))
        out.steps = int(response.scalar("STEPS"))
        out.seed = int(response.scalar("SEED"))
        return False
    block = Block(
        index=int(response.scalar("BLOCK")),
        text=bytes(text).decode("utf-8"),
        tokens=int(response.scalar("TOKENS")),
        at_s=time.perf_counter() - started,
        wall=time.time(),
    )
    if block.index < len(out.blocks):  # a resend runs from the first block again: drop what was delivered
        if out.blocks[block.index].text != block.text:
            raise ResponseError(REPEAT_DIFFERS.format(index=block.index), "StatusCode.ABORTED")
        return False
    out.blocks.append(block)
    return on_block is not None and bool(on_block(block))


# The diffusion LM has no checkpoints: a resend generates again from its first block, with the seed its
# resume key gives (where the request has none), and so the same blocks. Where one differs (a request that
# gave another sampler's randomness, a server of other weights), what was delivered cannot be taken back.
REPEAT_DIFFERS = (
    "the request was resent after a failure and its block {index} came back different from the one "
    "already delivered; send it again as a new request"
)


def generate_text_one(
    request: dict[str, Any],
    request_id: str = "0",
    url: str = "localhost:8001",
    model: str = "diffusion_lm",
    timeout_s: float = 300.0,
    on_block: OnBlock | None = None,
    retries: int = DEFAULT_RETRIES,
) -> TextResult:
    """Send one request on a connection of its own; return when its FINAL response arrives."""
    with TextSession(url, model) as session:
        return session.generate(request, request_id, timeout_s, on_block, retries)


def generate_text_many(
    requests: Sequence[dict[str, Any]],
    url: str = "localhost:8001",
    model: str = "diffusion_lm",
    timeout_s: float = 300.0,
    on_block: Callable[[int, Block], bool | None] | None = None,
    retries: int = DEFAULT_RETRIES,
) -> list[TextResult]:
    """Send every request concurrently, each on its own stream; results in request order.
    ``on_block(index, block)`` is called per streamed block; return True to cancel that request."""
    send_one = partial(generate_text_one, retries=retries)
    return send_concurrently(send_one, requests, url, model, timeout_s, on_block)


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
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds for each request, its resends included"
    )
    add_retry_options(parser)
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
    retries = 0 if args.no_retry else args.retries
    results = generate_text_many(requests, args.url, args.model, args.timeout, on_block, retries)
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

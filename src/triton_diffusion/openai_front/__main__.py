"""Run the OpenAI front: ``triton-diffusion-openai --port 9000 --triton-grpc 127.0.0.1:8001``.

The launcher (``triton-diffusion-serve --openai-port 9000``) starts and supervises it beside tritonserver;
run it by hand to put it in front of a Triton started elsewhere.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import uvicorn
from triton_diffusion_client.retry import DEFAULT_RETRIES

from triton_diffusion.openai_front.app import create_app
from triton_diffusion.openai_front.front_state import DefaultModels, FrontState
from triton_diffusion.openai_front.keys import load_keys
from triton_diffusion.openai_front.triton_bridge import TritonBridge


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="An OpenAI-compatible HTTP front in front of Triton (gRPC).")
    p.add_argument(
        "--host",
        default=None,
        help="address to listen on (default: 0.0.0.0 with --api-key-file, else 127.0.0.1: a front open to "
        "anyone is reachable from this machine only unless this is given)",
    )
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--triton-grpc", default="127.0.0.1:8001", help="Triton's gRPC address")
    p.add_argument("--api-key-file", type=Path, help="bearer tokens, one per line; none: open to anyone")
    p.add_argument("--max-connections", type=int, default=512, help="more concurrent connections get 503")
    p.add_argument("--image-model", default=DefaultModels.image, help="model when a request names none")
    p.add_argument("--edit-model", default=DefaultModels.edit)
    p.add_argument("--video-model", default=DefaultModels.video)
    p.add_argument("--text-model", default=DefaultModels.text)
    p.add_argument(
        "--retries",
        type=int,
        default=DEFAULT_RETRIES,
        help="resend a request Triton lost (restart, drain) with its resume key, at most this many times",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        keys = load_keys(args.api_key_file)
    except (OSError, ValueError) as exc:
        sys.exit(f"triton-diffusion-openai: {exc}")
    host = args.host or ("0.0.0.0" if keys else "127.0.0.1")
    if not keys and host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("triton_diffusion.openai_front").warning(
            "OpenAI front: listening on %s without API keys: anyone who reaches port %d can generate",
            host,
            args.port,
        )
    models = DefaultModels(args.image_model, args.edit_model, args.video_model, args.text_model)
    front = FrontState(TritonBridge(args.triton_grpc, retries=args.retries), models=models, keys=keys)
    logging.getLogger("triton_diffusion.openai_front").info(
        "OpenAI front on %s:%d for Triton at %s (%s)",
        host,
        args.port,
        args.triton_grpc,
        f"{len(keys)} API key(s)" if keys else "no API key",
    )
    uvicorn.run(
        create_app(front),
        host=host,
        port=args.port,
        log_level="warning",
        limit_concurrency=args.max_connections,
        timeout_keep_alive=30,
        server_header=False,
    )


if __name__ == "__main__":
    main()

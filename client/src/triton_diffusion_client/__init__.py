"""The Python client for triton-diffusion over gRPC streaming: ``pip install ./client`` (tritonclient,
numpy and pillow; no torch, no server), then ``from triton_diffusion_client import generate``.

- ``images``: image and video models: :func:`generate`, :func:`generate_many`, :class:`ImageSession`
  (CLI ``triton-diffusion-generate``)
- ``text``: the diffusion language model: :func:`generate_text`, :func:`generate_text_many`,
  :class:`TextSession` (CLI ``triton-diffusion-generate-text``)
- ``streams``: the gRPC stream client they (and the server's OpenAI front) are built on
- ``retry``: which failures are resent with the request's resume key, and the budget for it (on by
  default; ``retries=0`` turns it off)

Applications written against the OpenAI API use the official ``openai`` package against the OpenAI
front instead (docs/usage/openai-front.md).
"""

from triton_diffusion_client.concurrency import send_concurrently
from triton_diffusion_client.images import (
    GenerateResult,
    ImageSession,
    Progress,
    generate,
    generate_many,
    generate_one,
)
from triton_diffusion_client.retry import DEFAULT_RETRIES, new_resume_key
from triton_diffusion_client.streams import ResponseError, StreamResponse, StreamSession
from triton_diffusion_client.text import (
    Block,
    TextResult,
    TextSession,
    generate_text,
    generate_text_many,
    generate_text_one,
)

__all__ = [
    "DEFAULT_RETRIES",
    "Block",
    "GenerateResult",
    "ImageSession",
    "Progress",
    "ResponseError",
    "StreamResponse",
    "StreamSession",
    "TextResult",
    "TextSession",
    "generate",
    "generate_many",
    "generate_one",
    "generate_text",
    "generate_text_many",
    "generate_text_one",
    "new_resume_key",
    "send_concurrently",
]

"""The Python client for triton-diffusion over gRPC streaming (``pip install`` the package, then
``from triton_diffusion.client import generate``).

- ``images``: image and video models: :func:`generate`, :func:`generate_many`, :class:`StreamSession`
  (CLI ``triton-diffusion-generate``)
- ``text``: the diffusion language model: :func:`generate_text`, :func:`generate_text_many`,
  :class:`TextSession` (CLI ``triton-diffusion-generate-text``)

Applications written against the OpenAI API use the official ``openai`` package against the OpenAI
front instead (README "OpenAI-compatible front").
"""

from triton_diffusion.client.concurrency import send_concurrently
from triton_diffusion.client.images import (
    GenerateResult,
    Progress,
    StreamSession,
    generate,
    generate_many,
    generate_one,
)
from triton_diffusion.client.text import (
    Block,
    TextResult,
    TextSession,
    generate_text,
    generate_text_many,
    generate_text_one,
)

__all__ = [
    "Block",
    "GenerateResult",
    "Progress",
    "StreamSession",
    "TextResult",
    "TextSession",
    "generate",
    "generate_many",
    "generate_one",
    "generate_text",
    "generate_text_many",
    "generate_text_one",
    "send_concurrently",
]

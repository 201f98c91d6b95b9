"""Kept for scripts that put ``client/`` on ``sys.path``: the client is ``triton_diffusion.client.text``
(installed with the package; CLI ``triton-diffusion-generate-text``).

    python client/dllm_client.py "Tell me about the sea" --gen-length 64 --block-length 16
"""

import sys

from triton_diffusion.client.text import (
    OUTPUTS,
    Block,
    OnBlock,
    TextResult,
    TextSession,
    generate_text,
    generate_text_many,
    generate_text_one,
    main,
)

__all__ = [
    "OUTPUTS",
    "Block",
    "OnBlock",
    "TextResult",
    "TextSession",
    "generate_text",
    "generate_text_many",
    "generate_text_one",
    "main",
]

if __name__ == "__main__":
    sys.exit(main())

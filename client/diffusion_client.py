"""Kept for scripts that put ``client/`` on ``sys.path``: the client is ``triton_diffusion.client.images``
(installed with the package; CLI ``triton-diffusion-generate``).

    python client/diffusion_client.py "a red cat" "a blue dog" --seed 7 --out out/
"""

import sys

from triton_diffusion.client.concurrency import send_concurrently
from triton_diffusion.client.images import (
    OUTPUTS,
    GenerateResult,
    OnProgress,
    Progress,
    StreamSession,
    generate,
    generate_many,
    generate_one,
    main,
)

__all__ = [
    "OUTPUTS",
    "GenerateResult",
    "OnProgress",
    "Progress",
    "StreamSession",
    "generate",
    "generate_many",
    "generate_one",
    "main",
    "send_concurrently",
]

if __name__ == "__main__":
    sys.exit(main())

"""API keys: bearer tokens read from a file, one per line (blank lines and ``#`` comments skipped).

No file: the front is open to anyone who reaches its port (a warning is logged at startup).
"""

from __future__ import annotations

import hmac
from pathlib import Path

from triton_diffusion.openai_front.errors import ApiError


def load_keys(path: Path | None) -> frozenset[str]:
    if path is None:
        return frozenset()
    keys = frozenset(
        line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")
    )
    if not keys:
        raise ValueError(f"the API key file {path} holds no key")
    return keys


def check_bearer(authorization: str | None, keys: frozenset[str]) -> None:
    """Raise 401 unless ``Authorization: Bearer <key>`` names one of ``keys`` (no keys: anything goes)."""
    if not keys:
        return
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    # Compare against every key in constant time, so the answer's timing tells nothing about a key.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token.encode(), key.encode())
    if scheme.lower() != "bearer" or not token or not matched:
        message = (
            "missing API key: send Authorization: Bearer <key>" if not token else "incorrect API key provided"
        )
        raise ApiError(401, message, "invalid_request_error", None, "invalid_api_key")

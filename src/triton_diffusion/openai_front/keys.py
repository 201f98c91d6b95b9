"""API keys: bearer tokens read from a file, one per line (blank lines and ``#`` comments skipped, also
when indented).

No file: the front is open to anyone who reaches its port (a warning is logged at startup), and it
listens on 127.0.0.1 unless told otherwise.

Each key is its own tenant for what the front keeps between requests (video jobs): a job records the
SHA-256 of the key that created it (:func:`key_owner`), never the key.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from triton_diffusion.openai_front.errors import ApiError


def load_keys(path: Path | None) -> frozenset[str]:
    if path is None:
        return frozenset()
    stripped = (line.strip() for line in path.read_text().splitlines())
    keys = frozenset(line for line in stripped if line and not line.startswith("#"))
    if not keys:
        raise ValueError(f"the API key file {path} holds no key")
    return keys


def _bearer(authorization: str | None) -> tuple[str, str]:
    scheme, _, token = (authorization or "").partition(" ")
    return scheme, token.strip()


def check_bearer(authorization: str | None, keys: frozenset[str]) -> None:
    """Raise 401 unless ``Authorization: Bearer <key>`` names one of ``keys`` (no keys: anything goes)."""
    if not keys:
        return
    scheme, token = _bearer(authorization)
    # Compare digests against every key in constant time, so the answer's timing tells nothing about a key
    # (compare_digest returns at once on inputs of different lengths: digests have one length).
    digest, matched = hashlib.sha256(token.encode()).digest(), False
    for key in keys:
        matched |= hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest())
    if scheme.lower() != "bearer" or not token or not matched:
        message = (
            "missing API key: send Authorization: Bearer <key>" if not token else "incorrect API key provided"
        )
        raise ApiError(401, message, "invalid_request_error", None, "invalid_api_key")


def key_owner(authorization: str | None, keys: frozenset[str]) -> str:
    """Who owns what a request creates: the SHA-256 (hex) of its key, or "" when the front has no keys
    (one tenant). Call it after :func:`check_bearer` accepted the request."""
    if not keys:
        return ""
    return hashlib.sha256(_bearer(authorization)[1].encode()).hexdigest()

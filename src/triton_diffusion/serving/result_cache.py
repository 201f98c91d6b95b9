"""Answers to repeated requests, kept in memory (config ``result_cache_mb``; 0, the default, is off).

Triton's own response cache refuses decoupled models, so a model keeps its own: a request whose every
output-affecting field equals an earlier one's (its seed given by the client, its source image and mask by
the hash of their decoded pixels, its LoRA adapters and step cache in their canonical text, its output
format) gets the earlier FINAL response's bytes again, at once, without running. A request without a seed
never hits (its seed is drawn). Least recently used answers go first when the bound is reached. BATCH says
``"result_cache": "hit"`` on an answer that came from here.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from PIL import Image

# Fields that change how a request is served, never what it answers (resume_key: where its work may
# resume from, recovery/resumes.py; min_inference_steps, degrade_step_cache: how far it may be degraded,
# and a degraded answer is never kept).
NOT_IN_KEY = frozenset(
    {
        "progress",
        "preview_every",
        "previews",
        "describe",
        "service_tier",
        "timeout",
        "resume_key",
        "min_inference_steps",
        "degrade_step_cache",
    }
)


def result_key(
    values: Mapping[str, Any], seed_given: bool, ignored: Iterable[str] = NOT_IN_KEY
) -> str | None:
    """The key of a request's answer, or None when it must not be cached (no seed given)."""
    if not seed_given:
        return None
    return values_digest(values, ignored)


def values_digest(values: Mapping[str, Any], ignored: Iterable[str] = NOT_IN_KEY) -> str:
    """A sha256 over a request's validated values in canonical form, those ``ignored`` left out: equal
    exactly when everything that decides its answer is (the result cache's key, a checkpoint's fields
    hash)."""
    skip = set(ignored)
    digest = hashlib.sha256()
    for name in sorted(values):
        if name in skip:
            continue
        digest.update(name.encode() + b"\0" + _canonical(values[name]) + b"\0")
    return digest.hexdigest()


def _canonical(value: Any) -> bytes:
    if value is None or isinstance(value, (bool, int, float, str)):
        return json.dumps(value).encode()
    if isinstance(value, bytes):
        return hashlib.sha256(value).digest()
    if isinstance(value, Image.Image):  # a decoded source image or mask: its pixels
        return f"{value.mode}:{value.size}:".encode() + hashlib.sha256(value.tobytes()).digest()
    raise TypeError(f"a request value of type {type(value).__name__} has no canonical form for the cache")


class ResultCache:
    """An LRU map of answers (a FINAL response's tensors) within ``max_bytes``. Thread-safe: execute()
    looks up, the response thread stores."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._answers: OrderedDict[str, tuple[dict[str, np.ndarray], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return self.max_bytes > 0

    def get(self, key: str | None) -> dict[str, np.ndarray] | None:
        if key is None:
            return None
        with self._lock:
            entry = self._answers.get(key)
            if entry is None:
                return None
            self._answers.move_to_end(key)
            return dict(entry[0])

    def put(self, key: str | None, outputs: Mapping[str, np.ndarray]) -> None:
        if key is None or not self.max_bytes:
            return
        answer = {name: np.array(array, copy=True) for name, array in outputs.items()}
        size = sum(_nbytes(array) for array in answer.values())
        if size > self.max_bytes:
            return  # one answer larger than the whole bound: never kept
        with self._lock:
            if key in self._answers:
                self._bytes -= self._answers.pop(key)[1]
            self._answers[key] = (answer, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, evicted) = self._answers.popitem(last=False)
                self._bytes -= evicted

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._answers)


def _nbytes(array: np.ndarray) -> int:
    if array.dtype == object:  # encoded images: their bytes
        return sum(len(item) if isinstance(item, (bytes, str)) else 64 for item in array.reshape(-1))
    return int(array.nbytes)

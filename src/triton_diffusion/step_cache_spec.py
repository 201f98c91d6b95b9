"""The request field ``step_cache`` (and the config parameter of the same name), parsed once: which step
cache a request's denoiser uses (adapters/step_caches.py runs them). Torch-free, so settings and fields can
read it.

- ``none``: every step computes every block;
- ``fbc:THRESHOLD``: First Block Cache, diffusers' ``FirstBlockCacheConfig(threshold=THRESHOLD)``,
  0 < THRESHOLD <= 1: the first block runs for every row; a job whose relative mean absolute change of its
  first-block residual (over its own rows) is at most the threshold reuses its cached residual of the other
  blocks;
- ``taylorseer:INTERVAL`` or ``taylorseer:INTERVAL:WARMUP``: TaylorSeer, diffusers'
  ``TaylorSeerCacheConfig(cache_interval=INTERVAL, disable_cache_before_step=WARMUP)`` (WARMUP default 3)
  with its other defaults: the attention outputs are computed every INTERVAL steps of the job's own and
  predicted by a first-order Taylor series in between.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from triton_diffusion.errors import invalid_field

METHODS = ("none", "fbc", "taylorseer")
ALLOWED = (
    "none, fbc:THRESHOLD (0 < THRESHOLD <= 1) or taylorseer:INTERVAL[:WARMUP] (INTERVAL >= 1, WARMUP >= 0)"
)
MAX_INTERVAL = 1000


@dataclass(frozen=True)
class StepCache:
    method: str = "none"
    threshold: float = 0.0  # fbc
    interval: int = 0  # taylorseer: cache_interval
    warmup: int = 3  # taylorseer: disable_cache_before_step

    @property
    def text(self) -> str:
        """The canonical spelling (what BATCH reports and the result cache keys on)."""
        if self.method == "fbc":
            return f"fbc:{self.threshold!r}"  # every digit: the request is served with this text
        if self.method == "taylorseer":
            return f"taylorseer:{self.interval}:{self.warmup}"
        return "none"

    def __bool__(self) -> bool:
        return self.method != "none"

    @property
    def first_skip(self) -> int | None:
        """The first step (0-based) at which a fresh cache may skip work: FBC's second (its first computes
        and keeps what the next compares with), TaylorSeer's first after its warm-up where its interval
        predicts; None where it never skips (no cache; TaylorSeer every step)."""
        if self.method == "fbc":
            return 1
        if self.method == "taylorseer" and self.interval > 1:
            return self.warmup
        return None


NO_CACHE = StepCache()


def parse_step_cache(text: str, field: str = "step_cache") -> StepCache:
    """``none``, ``fbc:0.08``, ``taylorseer:5`` or ``taylorseer:5:3``. Raises INVALID_ARG naming ``field``
    and what is allowed (settings turns it into a load error naming the key)."""
    method, _, rest = text.strip().lower().partition(":")
    parts = rest.split(":") if rest else []
    if method == "none" and not parts:
        return NO_CACHE
    if method == "fbc" and len(parts) == 1:
        try:
            threshold = float(parts[0])
        except ValueError:
            raise invalid_field(
                field, f"threshold {parts[0][:32]!r} is not a number (allowed: {ALLOWED})"
            ) from None
        if not (math.isfinite(threshold) and 0 < threshold <= 1):
            raise invalid_field(
                field, f"threshold {threshold:g} is outside 0 < threshold <= 1 (allowed: {ALLOWED})"
            )
        return StepCache("fbc", threshold=threshold)
    if method == "taylorseer" and len(parts) in (1, 2):
        try:
            numbers = [int(part) for part in parts]
        except ValueError:
            raise invalid_field(
                field, f"{text[:64]!r}: INTERVAL and WARMUP are integers (allowed: {ALLOWED})"
            ) from None
        interval, warmup = numbers[0], numbers[1] if len(numbers) > 1 else 3
        if not (1 <= interval <= MAX_INTERVAL and 0 <= warmup <= MAX_INTERVAL):
            raise invalid_field(
                field,
                f"{text[:64]!r}: INTERVAL 1..{MAX_INTERVAL}, WARMUP 0..{MAX_INTERVAL} (allowed: {ALLOWED})",
            )
        if warmup == 0 and interval > 1:  # diffusers' schedule would predict step 0 from nothing
            raise invalid_field(
                field, f"{text[:64]!r}: WARMUP 0 needs INTERVAL 1 (step 0 must compute; allowed: {ALLOWED})"
            )
        return StepCache("taylorseer", interval=interval, warmup=warmup)
    shown = text[:64]
    if method not in METHODS:
        raise invalid_field(field, f"unknown method {method[:32]!r} in {shown!r} (allowed: {ALLOWED})")
    raise invalid_field(field, f"{shown!r} is malformed (allowed: {ALLOWED})")

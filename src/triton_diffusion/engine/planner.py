"""Plan the fused pipeline calls for one ``execute()`` batch.

Requests are grouped by compatibility key (keys are never mixed), each group is cut into calls of at
most ``cap`` rows (images, not requests; a request with several images may span calls), arrival order is
kept inside a group, and calls are served oldest-first (by the oldest request they hold), so an
incompatible request at the head of the batch is never starved and never blocks the ones behind it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from triton_diffusion.compatibility import CompatibilityKey


@dataclass(frozen=True)
class PlannedRequest:
    index: int  # position in the list execute() received: the arrival order
    key: CompatibilityKey
    rows: int  # images this request asks for


@dataclass(frozen=True)
class Row:
    request_index: int
    image_index: int


@dataclass
class FusedCall:
    key: CompatibilityKey
    rows: list[Row]
    cap: int
    cut_reason: str  # why this call holds no more rows: "row_cap", "resolution_cap" or "drained"
    split_by: str | None = None  # first key field differing from the previous group's key

    @property
    def request_indices(self) -> list[int]:
        return list(dict.fromkeys(r.request_index for r in self.rows))


@dataclass(frozen=True)
class RowCaps:
    """Rows per fused call: a global cap and optional lower caps per resolution ("WxH", or a video's
    "WxHxFRAMES", which wins over its "WxH")."""

    max_rows: int
    by_resolution: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_config(cls, max_rows: int, by_resolution: Mapping[str, int] | None) -> RowCaps:
        """From ``max_rows_per_call`` and ``max_rows_by_resolution`` (parsed by settings.py)."""
        if max_rows < 1:
            raise ValueError(f"max rows per call must be >= 1, got {max_rows}")
        return cls(max_rows, dict(by_resolution or {}))

    def cap_for(self, key: CompatibilityKey) -> tuple[int, str]:
        """The cap for a key and the reason to name when it cuts a group: the size's cap (a video's frame
        count's if it has one) where it is lower than the global one; one image for a key with a step cache
        (``own_call``: diffusers' cache decides over a call's whole batch, the step engine per image)."""
        if key.get("own_call") is not None:
            return 1, "step_cache"
        return self.cap_for_size(key.get("height"), key.get("width"), key.get("num_frames"))

    def cap_for_shape(self, shape: Hashable) -> int:
        """The cap of a step-engine group: an image's (height, width), a video's (height, width, frames)."""
        return self.cap_for_size(*cast(tuple[int, ...], shape))[0]

    def cap_for_size(self, height: int, width: int, frames: int | None = None) -> tuple[int, str]:
        res_cap = self.by_resolution.get(f"{width}x{height}")
        if frames is not None:  # a video: its frame count's own cap first
            res_cap = self.by_resolution.get(f"{width}x{height}x{frames}", res_cap)
        if res_cap is not None and res_cap < self.max_rows:
            return res_cap, "resolution_cap"
        return self.max_rows, "row_cap"


def plan_groups(
    requests: Sequence[PlannedRequest], cap_for: Callable[[CompatibilityKey], tuple[int, str]]
) -> list[FusedCall]:
    groups: dict[CompatibilityKey, list[Row]] = {}
    for request in sorted(requests, key=lambda r: r.index):
        rows = groups.setdefault(request.key, [])
        rows.extend(Row(request.index, i) for i in range(request.rows))

    calls: list[FusedCall] = []
    previous_key: CompatibilityKey | None = None
    for key, rows in groups.items():
        cap, cap_reason = cap_for(key)
        split_by = key.first_difference(previous_key) if previous_key is not None else None
        for start in range(0, len(rows), cap):
            chunk = rows[start : start + cap]
            cut = cap_reason if start + cap < len(rows) else "drained"
            # split_by names why a new group began, so only its first call carries it.
            calls.append(FusedCall(key, chunk, cap, cut, split_by if start == 0 else None))
        previous_key = key
    calls.sort(key=lambda c: c.rows[0].request_index)
    return calls

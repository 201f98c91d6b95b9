"""Moving small host tensors to the model's device, and picking rows, without waiting for the GPU: the one
copy helper of the step adapters and the vectorised schedulers."""

from __future__ import annotations

import torch


def to_device(values: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor to the device without a sync: a copy from pageable memory would wait for the
    forward still queued on the GPU, so the next step could never be queued early. Made dense first: an
    expanded table (one coefficient row repeated for every row) would be copied through a pageable
    temporary otherwise, which waits too."""
    device = torch.device(device)
    if values.device == device:
        return values
    if values.device.type == "cpu" and device.type == "cuda":
        return values.contiguous().pin_memory().to(device, non_blocking=True)
    return values.to(device)


def take_rows(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``values[rows]`` by slices (no index tensor to copy to the device); the tensor itself when whole."""
    if rows == list(range(values.shape[0])):
        return values
    return torch.cat([values[r : r + 1] for r in rows])

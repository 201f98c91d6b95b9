"""The model instance's device and dtype; moving small host tensors to the device, and picking rows,
without waiting for the GPU: the one copy helper of the step adapters and the vectorised schedulers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from triton_diffusion.settings import ModelSettings


def instance_device(settings: ModelSettings) -> str:
    """``cuda:{model_instance_device_id}`` for a GPU instance, made this process's current device (each
    instance has a process of its own, so what names no device, as the check of a lost device, means
    its GPU); else ``cpu``. A GPU instance without CUDA in torch (a CPU build) is a load error, not a
    model quietly on the CPU."""
    kind, index = settings.instance_kind, settings.device_id
    if kind == "GPU" and not torch.cuda.is_available():
        raise ValueError(
            f"model {settings.name}: instance kind GPU, but torch {torch.__version__} sees no CUDA device "
            "(a CPU build, or CUDA_VISIBLE_DEVICES); use KIND_CPU or a CUDA build of torch"
        )
    if kind in ("GPU", "MODEL") and torch.cuda.is_available():
        torch.cuda.set_device(index)
        return f"cuda:{index}"
    return "cpu"


def instance_dtype(settings: ModelSettings, device: str) -> torch.dtype:
    """Config ``dtype``: ``auto`` is bfloat16 on a GPU, float32 on the CPU."""
    if settings.config.dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, settings.config.dtype)


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

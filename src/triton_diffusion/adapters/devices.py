"""The model instance's device and dtype; moving small host tensors to the device, and picking rows,
without waiting for the GPU: the one copy helper of the step adapters and the vectorised schedulers."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from triton_diffusion.engine.failures import probe_device

if TYPE_CHECKING:
    from triton_diffusion.settings import ModelSettings

log = logging.getLogger("triton_diffusion")


def instance_device(settings: ModelSettings) -> str:
    """``cuda:{model_instance_device_id}`` for a GPU instance, also the device the check of a lost device
    asks (failures.py: each instance has a process of its own); else ``cpu``. A GPU instance (KIND_GPU, or
    KIND_AUTO on a machine with GPUs) without CUDA in torch, a CPU build, runs on the CPU and says so."""
    kind, index = settings.instance_kind, settings.device_id
    if kind in ("GPU", "MODEL") and torch.cuda.is_available():
        probe_device(f"cuda:{index}")
        return f"cuda:{index}"
    if kind == "GPU":
        log.warning(
            "model %s: instance kind GPU, but torch %s sees no CUDA device (a CPU build, or "
            "CUDA_VISIBLE_DEVICES): it runs on the CPU",
            settings.name,
            torch.__version__,
        )
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

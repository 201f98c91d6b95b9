"""Classifier-free guidance for many rows in one op, each with its own scale, bit-identical to the per-row
formula the pipelines use."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from triton_diffusion.adapters.schedulers.core import Rounding, columns, vectorisable


def guide(uncond: torch.Tensor, cond: torch.Tensor, scales: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance ``uncond + g * (cond - uncond)`` with each row's own scale g (a Python
    float in the per-row formula), for ``[n, ...]`` rows in one op, bit-identical to the per-row formula."""
    values = [float(g) for g in (scales.tolist() if isinstance(scales, torch.Tensor) else scales)]
    first = values[0].hex()  # the same bits (== would take -0.0 for 0.0)
    if all(g.hex() == first for g in values):  # one scale (homogeneous traffic): the per-row formula
        return uncond + values[0] * (cond - uncond)
    if not vectorisable(uncond, cond):
        rows = [uncond[r : r + 1] + g * (cond[r : r + 1] - uncond[r : r + 1]) for r, g in enumerate(values)]
        return torch.cat(rows)
    # A Python float is a CPU scalar to the kernel: float32 on the CPU (the tensor's dtype), float
    # precision on CUDA.
    (column,) = columns(torch.tensor([values], dtype=torch.float32), uncond)
    return uncond + Rounding(uncond.device, host_scalars=True).mul(column, cond - uncond)

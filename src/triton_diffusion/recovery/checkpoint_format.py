"""What a job checkpoint is, the one type both sides of recovery share: the adapters take and restore
them (adapters/job_checkpoints.py) and the store keeps them on disk (recovery/checkpoint_store.py), so the
store imports no adapter module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FORMAT = 3  # the meta's layout: a checkpoint of another format does not fit


@dataclass(frozen=True)
class JobCheckpoint:
    """A job's state after ``step`` denoising steps: CPU tensors by name and JSON-serialisable meta."""

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]

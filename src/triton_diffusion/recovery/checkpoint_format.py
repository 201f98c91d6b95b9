"""What a job checkpoint is, the one type both sides of recovery share: the adapters take and restore
them (adapters/job_checkpoints.py) and the store keeps them on disk (recovery/checkpoint_store.py), so the
store imports no adapter module; and its file's format (safetensors, with a header and a digest: the
store's module docstring says what they hold)."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch

FORMAT = 3  # the meta's layout: a checkpoint of another format does not fit


@dataclass(frozen=True)
class JobCheckpoint:
    """A job's state after ``step`` denoising steps: CPU tensors by name and JSON-serialisable meta."""

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


@dataclass(frozen=True)
class Stored:
    """A checkpoint read back, with the fields hash of the request that wrote it."""

    fields_hash: str
    checkpoint: JobCheckpoint


# ---- the format --------------------------------------------------------------------------------------------
def digest(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the header's fields (canonical JSON) and every tensor (name, dtype, shape, bytes) in
    name order."""
    sha = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        sha.update(f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        sha.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def serialise(key: str, fields_hash: str, checkpoint: JobCheckpoint, created: float) -> bytes:
    header = {
        "key": key,
        "fields_hash": fields_hash,
        "step": checkpoint.step,
        "meta": checkpoint.meta,
        "created": created,
    }
    header["sha256"] = digest(header, checkpoint.tensors)
    return safetensors.torch.save(checkpoint.tensors, metadata={"checkpoint": json.dumps(header)})


def parse(data: bytes, key: str) -> Stored:
    """A file's checkpoint; raises (anything) where it does not parse or its digest does not match."""
    tensors = safetensors.torch.load(data)  # a truncated or malformed file raises here
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(json.loads(data[8 : 8 + length])["__metadata__"]["checkpoint"])
    sha256 = header.pop("sha256")
    if digest(header, tensors) != sha256:
        raise ValueError("its digest does not match its contents")
    if header["key"] != key:
        raise ValueError(f"it was written for key {header['key']!r}")
    return Stored(header["fields_hash"], JobCheckpoint(header["step"], tensors, header["meta"]))

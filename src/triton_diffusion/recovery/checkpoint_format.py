"""What a job checkpoint is, the one type both sides of recovery share: the adapters take and restore
them (adapters/job_checkpoints.py) and the store keeps them on disk (recovery/checkpoint_store.py), so the
store imports no adapter module; and its file's format (safetensors, with a header and a digest: the
store's module docstring says what they hold)."""

from __future__ import annotations

import hashlib
import json
import struct
import sys
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
# The dtypes a checkpoint is written for by :func:`serialise` itself, by their safetensors names (another
# dtype is written by ``safetensors.torch.save``; both are read by ``safetensors.torch.load``).
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

Row = tuple[str, torch.Tensor, bytes]  # a tensor's name, the tensor and its bytes


def digest(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the header's fields (canonical JSON) and every tensor (name, dtype, shape, bytes) in
    name order."""
    return _digest(header, _rows(tensors))


def _rows(tensors: dict[str, torch.Tensor]) -> list[Row]:
    rows = []
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        rows.append((name, tensor, tensor.reshape(-1).view(torch.uint8).numpy().tobytes()))
    return rows


def _digest(header: dict[str, Any], rows: list[Row]) -> str:
    sha = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for name, tensor, data in rows:
        sha.update(f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        sha.update(data)
    return sha.hexdigest()


def serialise(key: str, fields_hash: str, checkpoint: JobCheckpoint, created: float) -> bytes:
    header = {
        "key": key,
        "fields_hash": fields_hash,
        "step": checkpoint.step,
        "meta": checkpoint.meta,
        "created": created,
    }
    rows = _rows(checkpoint.tensors)  # each tensor's bytes taken once, for the digest and the file
    header["sha256"] = _digest(header, rows)
    metadata = {"checkpoint": json.dumps(header)}
    # Bytes as this host orders them: the library's file on a big-endian host (it swaps them).
    if sys.byteorder == "little" and all(tensor.dtype in SAFETENSORS_DTYPES for _, tensor, _ in rows):
        # The wider dtypes first, as the library lays them out: each tensor's bytes aligned to its dtype
        # (the digest holds them in name order, whatever the file's).
        return _safetensors(sorted(rows, key=lambda row: (-row[1].element_size(), row[0])), metadata)
    return safetensors.torch.save({name: tensor for name, tensor, _ in rows}, metadata=metadata)


def _safetensors(rows: list[Row], metadata: dict[str, str]) -> bytes:
    """The safetensors file of ``rows``: the header's length (8 bytes, little-endian), the header (JSON:
    the metadata, then each tensor's dtype, shape and byte range in the data), padded with spaces to a
    multiple of 8 bytes as the library pads it, then the tensors' bytes. Written here, where
    ``safetensors.torch.save`` would take each tensor's bytes again (the digest has them) and copy the
    whole file once more into ``bytes``; read back by the library (:func:`parse`), which checks the header
    and the byte ranges."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, tensor, data in rows:
        if name in header:  # the metadata's own name would replace it
            raise ValueError(f"a tensor named {name!r}")
        dtype = SAFETENSORS_DTYPES[tensor.dtype]
        header[name] = {
            "dtype": dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return b"".join([struct.pack("<Q", len(encoded)), encoded, *(data for _, _, data in rows)])


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

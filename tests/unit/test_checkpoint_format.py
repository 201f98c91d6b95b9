"""A checkpoint file's bytes (recovery/checkpoint_format.py): written by the store itself for the dtypes it
names, by ``safetensors.torch.save`` for any other, and read back by the library, tensor for tensor and
with its header, as the library's own file of the same checkpoint is."""

from __future__ import annotations

import json
import struct
import sys

import pytest
import safetensors.torch
import torch

from triton_diffusion.recovery.checkpoint_format import (
    SAFETENSORS_DTYPES,
    JobCheckpoint,
    parse,
    serialise,
)

KEY = "K" * 16


def tensors_of(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors of ``dtype`` with values that tell each byte apart: n-d, 0-d, empty, non-contiguous (each
    its own storage, as a snapshot's copies are)."""
    values = torch.arange(-12, 12, dtype=torch.float64) * 1.37
    if dtype == torch.bool:
        values = values > 0
    return {
        'scheduler.name "quoted" \\ é': values[:5].to(dtype).clone(),  # escaped in the JSON header
        "latents": values.to(dtype).reshape(2, 3, 4).clone(),
        "scheduler.final": values[7].to(dtype).clone(),
        "scheduler.empty": values[:0].to(dtype).clone(),
        "scheduler.strided": values.to(dtype).clone().reshape(4, 6).t(),  # written as its values
    }


def assert_same(read: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    assert set(read) == set(tensors)
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape, name
        assert torch.equal(read[name], tensor), name


@pytest.mark.parametrize("dtype", [*SAFETENSORS_DTYPES, torch.float8_e4m3fn, torch.complex64])
def test_a_checkpoint_reads_back_through_the_library_as_the_library_s_own_file(dtype):
    tensors = tensors_of(dtype)
    checkpoint = JobCheckpoint(3, tensors, {"scheduler": {"_step_index": 3}, "x": [1.5, None, "s"]})
    data = serialise(KEY, "hash", checkpoint, 12.5)
    assert_same(safetensors.torch.load(data), tensors)
    stored = parse(data, KEY)
    assert stored.fields_hash == "hash" and stored.checkpoint.step == 3
    assert stored.checkpoint.meta == checkpoint.meta
    assert_same(stored.checkpoint.tensors, tensors)
    # The header holds what the library's file of the same tensors and metadata holds.
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    library = safetensors.torch.save(
        {name: t.contiguous() for name, t in tensors.items()}, metadata=header["__metadata__"]
    )
    (library_length,) = struct.unpack("<Q", library[:8])
    expected = json.loads(library[8 : 8 + library_length])
    assert {k: {**v, "data_offsets": None} for k, v in header.items() if k != "__metadata__"} == {
        k: {**v, "data_offsets": None} for k, v in expected.items() if k != "__metadata__"
    }
    assert length % 8 == 0


def header_of(data: bytes) -> tuple[int, dict]:
    (length,) = struct.unpack("<Q", data[:8])
    return length, json.loads(data[8 : 8 + length])


def test_a_checkpoint_s_payload_is_the_library_s_size_each_tensor_aligned_to_its_dtype():
    tensors = {
        **{f"u8.{name}": t for name, t in tensors_of(torch.uint8).items()},
        **{f"f64.{name}": t for name, t in tensors_of(torch.float64).items()},
        **{f"bf16.{name}": t for name, t in tensors_of(torch.bfloat16).items()},
    }
    data = serialise(KEY, "hash", JobCheckpoint(1, tensors, {}), 0.0)
    length, header = header_of(data)
    library = safetensors.torch.save({name: t.contiguous() for name, t in tensors.items()})
    library_length, _ = header_of(library)
    assert len(data) - 8 - length == len(library) - 8 - library_length  # the same payload, nothing after
    for name, entry in header.items():
        if name != "__metadata__":  # the payload starts 8-aligned: each tensor on a multiple of its size
            assert entry["data_offsets"][0] % tensors[name].element_size() == 0, name


def test_a_tensor_named_as_the_metadata_is_refused():
    with pytest.raises(ValueError, match="__metadata__"):
        serialise(KEY, "hash", JobCheckpoint(1, {"__metadata__": torch.zeros(2)}, {}), 0.0)


def test_on_a_big_endian_host_the_library_writes_the_file(monkeypatch):
    written = []
    real = safetensors.torch.save

    def save(tensors, metadata=None):
        written.append(sorted(tensors))
        return real(tensors, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save", save)
    tensors = tensors_of(torch.float32)
    serialise(KEY, "hash", JobCheckpoint(1, tensors, {}), 0.0)
    assert written == []  # this host's own bytes are little-endian: written here
    # Said, not made, big-endian: the library then swaps this host's little-endian bytes, so the file is
    # not read back here (on a big-endian host its reader swaps them back).
    monkeypatch.setattr(sys, "byteorder", "big")
    serialise(KEY, "hash", JobCheckpoint(1, tensors, {}), 0.0)
    assert written == [sorted(tensors)]

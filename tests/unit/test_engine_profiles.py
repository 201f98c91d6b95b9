"""The engines benchmark's profiles (scripts/benchmarks/engine_runs.py), run on the tiny SD: what they time
and that they leave the pipeline as it was."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the benchmarks' package

from benchmarks import inprocess  # noqa: E402
from benchmarks.engine_runs import raw_loop_profile  # noqa: E402


def test_diffusers_own_call_is_timed_in_place_and_given_its_methods_back():
    """The engines benchmark's profile of diffusers' own call (benchmarks/engine_runs.py): the parts it
    times add up to less than the call, each is seen, and the pipeline is left as it was (no timing
    wrapper stays on it, its outputs as before)."""
    bench = inprocess.Bench("tiny-sd", 64, 64, 2, "cpu", torch.float32)
    requests = [bench.request(i, 2, 7.5) for i in range(2)]
    before = [np.asarray(image) for image in bench.raw_pipeline_call(requests)]
    raw = raw_loop_profile(bench, 2, 2)
    assert 0 < raw["denoiser_ms"] < raw["step_ms"] and raw["start_ms"] > 0 and raw["decode_ms"] > 0
    parts = raw["start_ms"] + raw["denoiser_ms"] + raw["decode_ms"] + raw["loop_ms"]
    assert parts == pytest.approx(raw["step_ms"]) and raw["loop_ms"] > 0
    owners = (bench.pipe, bench.pipe.unet, bench.pipe.vae, bench.pipe.image_processor)
    assert not any(name in vars(owner) for owner in owners for name in ("encode_prompt", "forward", "decode"))
    after = [np.asarray(image) for image in bench.raw_pipeline_call(requests)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))

"""The engines benchmark's profiles (scripts/benchmarks/engine_runs.py), run on the tiny SD: what they time
and that they leave the pipeline as it was."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the benchmarks' package

from benchmarks import inprocess  # noqa: E402
from benchmarks.engine_runs import raw_loop_profile  # noqa: E402


def test_diffusers_own_call_is_timed_in_place_and_given_its_methods_back():
    """The engines benchmark's profile of diffusers' own call (benchmarks/engine_runs.py): every part it
    names is found on the tiny SD pipeline and timed (each took time), the timed parts are less than the
    call (its loop's own work is what is left), and afterwards no wrapper is left on the pipeline, its
    modules or its pipeline module (each name is what it was before)."""
    bench = inprocess.Bench("tiny-sd", 64, 64, 2, "cpu", torch.float32)
    pipe = bench.pipe
    module = sys.modules[type(pipe).__module__]
    looked_up = {
        (pipe, "check_inputs"),
        (pipe, "encode_prompt"),
        (module, "retrieve_timesteps"),
        (pipe, "prepare_extra_step_kwargs"),
        (pipe, "prepare_latents"),
        (pipe.unet, "forward"),
        (pipe.vae, "decode"),
        (pipe.image_processor, "postprocess"),
    }
    before = {(id(owner), name): getattr(owner, name) for owner, name in looked_up}
    own_before = {(id(owner), name): name in vars(owner) for owner, name in looked_up}
    raw = raw_loop_profile(bench, 2, 2)
    assert sorted(raw["timed"]) == sorted(name for _, name in looked_up)
    assert 0 < raw["denoiser_ms"] < raw["step_ms"] and raw["start_ms"] > 0 and raw["decode_ms"] > 0
    assert raw["start_ms"] + raw["denoiser_ms"] + raw["decode_ms"] < raw["step_ms"] and raw["loop_ms"] > 0
    for owner, name in looked_up:
        key = (id(owner), name)
        assert (name in vars(owner)) == own_before[key], name  # an instance's wrapper removed
        assert getattr(owner, name) == before[key], name  # a module's function put back

"""Device profiles (adapters/device_profiles.py): the table read from the committed GPU artefact, its
interpolation, and the stand-ins on the real tiny SD pipeline, which wait what the table says for the
rows and positions they are given and compute nothing. ``time.sleep`` is recorded, never timed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.unit.step_harness import load_family
from triton_diffusion.adapters import device_profiles
from triton_diffusion.adapters.device_profiles import PROFILES, CostTable, apply_profile, load_table

SD15 = PROFILES["sd15-h100"]


def test_the_table_is_the_committed_artefacts_stage_costs_at_two_rows_an_image():
    report = json.loads((device_profiles.DOCS / SD15.artefact).read_text())
    table = load_table(SD15)
    costs = report["stage_costs"]
    positions = 64 * 64  # 512x512 through SD's 8x VAE
    assert table.forward == tuple(
        (int(k) * 2 * positions, v) for k, v in sorted(costs["forward"].items(), key=lambda kv: int(kv[0]))
    )
    assert table.decode == tuple(
        (int(k), v) for k, v in sorted(costs["decode"].items(), key=lambda kv: int(kv[0]))
    )


def test_interpolation_is_flat_below_linear_between_and_extended_above():
    table = CostTable(forward=((10.0, 1.0), (20.0, 1.0), (40.0, 3.0)), decode=((1.0, 0.5), (2.0, 1.0)))
    assert table.forward_s(1.0) == 1.0  # below the smallest forward: latency-bound
    assert table.forward_s(30.0) == pytest.approx(2.0)
    assert table.forward_s(80.0) == pytest.approx(7.0)  # the last segment's slope, 0.1 s a unit
    assert table.decode_s(4.0) == pytest.approx(2.0)


def test_an_artefact_without_stage_costs_is_refused_naming_the_file(tmp_path: Path):
    (tmp_path / "gpu/checks/engines_eager").mkdir(parents=True)
    (tmp_path / SD15.artefact).write_text(json.dumps({"size": "512x512"}))
    with pytest.raises(ValueError, match="bench_engines.json has no stage costs"):
        load_table(SD15, tmp_path)


def test_the_stand_ins_wait_the_tables_time_for_their_rows_and_compute_nothing(monkeypatch):
    pipe, _, _ = load_family("tiny-sd")
    slept: list[float] = []
    monkeypatch.setattr(device_profiles.time, "sleep", slept.append)
    table = apply_profile(pipe, "sd15-h100")
    out = pipe(
        ["a red fox", "a blue bird"],
        height=64,
        width=64,
        num_inference_steps=3,
        guidance_scale=7.5,
        output_type="np",
    )
    # Three forwards of 2 images x 2 guided rows at 8x8 positions, then one decode of 2 images.
    assert slept == [table.forward_s(4 * 8 * 8)] * 3 + [table.decode_s(2)]
    assert slept[0] == table.forward[0][1]  # below the smallest measured forward: its time
    images = np.asarray(out.images)
    assert images.shape == (2, 64, 64, 3) and np.ptp(images) == 0  # one grey: nothing was computed


def test_a_profile_for_another_pipeline_or_an_unknown_name_is_refused():
    pipe, _, _ = load_family("tiny-sd")
    with pytest.raises(ValueError, match="not one of sd15-h100"):
        apply_profile(pipe, "flux-b200")
    pipe, _, _ = load_family("tiny-sdxl")
    with pytest.raises(ValueError, match="times a StableDiffusionPipeline, not a StableDiffusionXLPipeline"):
        apply_profile(pipe, "sd15-h100")

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
    table = CostTable(forward=((10.0, 1.0), (20.0, 2.0), (40.0, 3.0)), decode=((1.0, 0.5), (2.0, 1.0)))
    assert table.forward_s(1.0) == 1.0  # below the smallest forward: latency-bound, not extrapolated
    assert table.forward_s(15.0) == pytest.approx(1.5)
    assert table.forward_s(30.0) == pytest.approx(2.5)
    assert table.forward_s(80.0) == pytest.approx(5.0)  # the last segment's slope, 0.05 s a unit
    assert table.decode_s(4.0) == pytest.approx(2.0)


def write_artefact(docs: Path, **fields) -> None:
    """A bench_engines.json as scripts/benchmarks/engines.py writes it, at 64x64 (8x8 latent positions)."""
    report = {
        "arch": "sd15",
        "size": "64x64",
        "cuda_graphs": False,
        "provenance": {"machine": {"gpu": "NVIDIA H100 80GB HBM3 x1"}},
        "stage_costs": {"forward": {"1": 0.01, "2": 0.02, "4": 0.04}, "decode": {"1": 0.1, "2": 0.3}},
        **fields,
    }
    (docs / SD15.artefact).parent.mkdir(parents=True, exist_ok=True)
    (docs / SD15.artefact).write_text(json.dumps(report))


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"stage_costs": None}, "has no stage costs"),
        ({"arch": "sdxl"}, "is not sd15, eager, on an H100"),
        ({"cuda_graphs": True}, "is not sd15, eager, on an H100"),
        ({"provenance": {"machine": {"gpu": "NVIDIA A10G"}}}, "is not sd15, eager, on an H100"),
    ],
)
def test_an_artefact_that_is_not_what_the_profile_names_is_refused_naming_the_file(tmp_path, fields, says):
    write_artefact(tmp_path, **fields)
    with pytest.raises(ValueError, match=f"bench_engines.json {says}"):
        load_table(SD15, tmp_path)


@pytest.mark.parametrize("guidance, rows", [(7.5, 4), (1.0, 2)])
def test_a_forward_waits_the_time_of_its_model_rows_times_positions(monkeypatch, tmp_path, guidance, rows):
    # Two images at 64x64: with guidance, 4 model rows of 8x8 positions (the artefact's 2 images, 0.02 s);
    # without, 2 rows (its 1 image, 0.01 s). A stand-in that counted images, or not positions, would not.
    write_artefact(tmp_path)
    pipe, _, _ = load_family("tiny-sd")
    slept: list[float] = []
    monkeypatch.setattr(device_profiles.time, "sleep", slept.append)
    apply_profile(pipe, "sd15-h100", tmp_path)
    pipe(["a red fox", "a blue bird"], height=64, width=64, num_inference_steps=2, guidance_scale=guidance)
    assert slept == [0.01 * rows / 2] * 2 + [0.3]
    slept.clear()
    pipe(["a red fox"] * 2, height=128, width=128, num_inference_steps=1, guidance_scale=guidance)
    assert slept[0] == pytest.approx(0.01 * rows / 2 * 4)  # 4x the positions: along the table


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


def test_model_info_says_a_profiled_model_serves_a_gpus_costs_not_images():
    from tests.unit.test_captured_forwards import load_model

    profiled = load_model(device_profile="sd15-h100").describe_more()["device_profile"]
    assert profiled == {"name": "sd15-h100", "what": PROFILES["sd15-h100"].what, "serves_images": False}
    assert "device_profile" not in load_model().describe_more()

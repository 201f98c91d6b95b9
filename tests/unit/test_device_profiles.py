"""Device profiles (adapters/device_profiles.py): the tables read from the committed GPU artefacts, their
interpolation, FLUX.1's arithmetic against diffusers' own blocks, and the stand-ins on the real tiny SD and
FLUX.1 pipelines, which wait what the profile says for the rows and positions they are given and compute
nothing. ``time.sleep`` is recorded, never timed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.step_harness import load_family
from triton_diffusion.adapters import device_profiles
from triton_diffusion.adapters.device_profiles import (
    FLUX1_DEV,
    FLUX_MEASURED_TEXT_TOKENS,
    PROFILES,
    CostTable,
    FlopCosts,
    TransformerShape,
    apply_profile,
    load_costs,
    load_table,
)

SD15 = PROFILES["sd15-h100"]
FLUX1 = PROFILES["flux1-h100"]


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
    # Three forwards of 2 images x 2 guided rows at 8x8 positions, then one decode of 2 images of 64x64.
    assert slept == [table.forward_s(4 * 8 * 8)] * 3 + [table.decode_s(2, 64 * 64)]
    assert slept[0] == table.forward[0][1]  # below the smallest measured forward: its time
    assert slept[-1] == table.decode[0][1]  # under one 512x512 image's pixels: its time
    images = np.asarray(out.images)
    assert images.shape == (2, 64, 64, 3) and np.ptp(images) == 0  # one grey: nothing was computed


def test_a_profile_for_another_pipeline_or_an_unknown_name_is_refused():
    pipe, _, _ = load_family("tiny-sd")
    with pytest.raises(ValueError, match="not one of flux1-h100, sd15-h100"):
        apply_profile(pipe, "flux-b200")
    pipe, _, _ = load_family("tiny-sdxl")
    with pytest.raises(ValueError, match="times a StableDiffusionPipeline, not a StableDiffusionXLPipeline"):
        apply_profile(pipe, "sd15-h100")


def test_model_info_says_a_profiled_model_serves_a_gpus_costs_not_images():
    from tests.unit.test_captured_forwards import load_model

    profiled = load_model(device_profile="sd15-h100").describe_more()["device_profile"]
    assert profiled == {"name": "sd15-h100", "what": PROFILES["sd15-h100"].what, "serves_images": False}
    assert "device_profile" not in load_model().describe_more()


def test_a_decode_of_other_sizes_takes_the_tables_time_for_as_many_pixels():
    table = CostTable(forward=((1.0, 1.0), (2.0, 2.0)), decode=((1.0, 0.5), (4.0, 2.0)), size=(64, 64))
    assert table.decode_s(2) == table.decode_s(2, 64 * 64) == pytest.approx(1.0)
    assert table.decode_s(1, 128 * 128) == pytest.approx(2.0)  # 4x the pixels: 4 images' worth


@pytest.mark.parametrize("rows, image_tokens", [(1, 1024), (3, 256)])
def test_flux1s_arithmetic_is_what_torch_counts_in_diffusers_own_blocks(rows, image_tokens):
    # One double and one single block of FLUX.1-dev's width on the meta device (no memory, no compute),
    # counted by torch's FLOP counter: within 2% (the per-row modulation and the embedders, left out).
    # A formula without attention would be 5.6% under at 1088 tokens; one token's stream counted twice
    # in a double block, a quarter over.
    from diffusers import FluxTransformer2DModel
    from torch.utils.flop_counter import FlopCounterMode

    text = 64
    with torch.device("meta"):
        model = FluxTransformer2DModel(
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            guidance_embeds=True,
        )
        inputs = {
            "hidden_states": torch.randn(rows, image_tokens, 64),
            "encoder_hidden_states": torch.randn(rows, text, 4096),
            "pooled_projections": torch.randn(rows, 768),
            "timestep": torch.ones(rows),
            "guidance": torch.ones(rows),
            "img_ids": torch.zeros(image_tokens, 3),
            "txt_ids": torch.zeros(text, 3),
        }
        with FlopCounterMode(display=False) as counter:
            model(**inputs)
    estimate = TransformerShape(double_layers=1, single_layers=1).flops(rows, image_tokens + text)
    assert counter.get_total_flops() == pytest.approx(estimate, rel=0.02)
    # FLUX.1-dev's own config (black-forest-labs/FLUX.1-dev, transformer/config.json): the full shape.
    assert (FLUX1_DEV.double_layers, FLUX1_DEV.single_layers, FLUX1_DEV.heads, FLUX1_DEV.head_dim) == (
        19,
        38,
        24,
        128,
    )


def test_flux1s_rate_is_the_committed_artefacts_uncached_forwards_and_its_decodes_sd15s():
    report = json.loads((device_profiles.DOCS / FLUX1.artefact).read_text())
    seconds = sorted(
        g["median_ms"] / 1000
        for run in report["rounds"]
        for g in run["closed"]["none"]["forward_groups"]
        if g["reused"] == 0 and g["rows"] == 2
    )
    costs = load_costs(FLUX1)
    assert isinstance(costs, FlopCosts) and costs.size == (1024, 1024)
    measured = 64 * 64 + FLUX_MEASURED_TEXT_TOKENS  # 1024x1024: 128x128 latents in 2x2 patches
    assert costs.forward_s(2, measured) == pytest.approx(seconds[len(seconds) // 2])
    assert costs.forward_s(1, measured) == pytest.approx(seconds[len(seconds) // 2] / 2)
    sd15 = load_table(SD15)
    assert costs.decode_s(1, 1024 * 1024) == pytest.approx(sd15.decode_s(4))  # 4 images of 512x512


def write_flux_artefact(
    docs: Path, config: dict | None = None, gpu: str = "NVIDIA H100 80GB HBM3 x1"
) -> None:
    """A bench_caches.json as scripts/bench_caches.py writes it, and the SD 1.5 one its decodes come from."""
    # One uncached forward and two that reused every row: only the uncached one is the transformer's time.
    groups = [
        {"jobs": 2, "rows": 2, "reused": 0, "median_ms": 300.0},
        {"jobs": 2, "rows": 2, "reused": 2, "median_ms": 9.0},
        {"jobs": 2, "rows": 2, "reused": 2, "median_ms": 9.5},
    ]
    report = {
        "config": config
        or {"arch": "tiny-flux (FLUX.1 transformer at full size)", "size": "64x64", "dtype": "bfloat16"},
        "provenance": {"machine": {"gpu": gpu}},
        "rounds": [{"closed": {"none": {"forward_groups": groups}}}],
    }
    (docs / FLUX1.artefact).parent.mkdir(parents=True, exist_ok=True)
    (docs / FLUX1.artefact).write_text(json.dumps(report))
    write_artefact(docs)


@pytest.mark.parametrize(
    "config, gpu, says",
    [
        ({"arch": "tiny-flux (its own)", "size": "64x64", "dtype": "bfloat16"}, "H100", "is not FLUX.1"),
        ({"arch": "FLUX.1 transformer at full size", "size": "64x64", "dtype": "float32"}, "H100", "is not"),
        (None, "NVIDIA A10G", "is not FLUX.1 transformer at full size, bfloat16, on an H100"),
        ({"arch": "FLUX.1 transformer at full size"}, "H100", "has no uncached forwards"),
    ],
)
def test_a_flux_artefact_that_is_not_what_the_profile_names_is_refused_naming_the_file(
    tmp_path, config, gpu, says
):
    write_flux_artefact(tmp_path, config, gpu)
    with pytest.raises(ValueError, match=f"bench_caches.json {says}"):
        load_costs(FLUX1, tmp_path)


def test_the_flux_stand_ins_wait_their_rows_arithmetic_padding_and_text_included(monkeypatch, tmp_path):
    # The artefact's one forward: 2 rows of 4x4 tokens (64x64) and 64 text tokens took 0.3 s. A stand-in
    # that left out the text, or counted latent pixels (8x8 a row) for tokens, would wait otherwise.
    write_flux_artefact(tmp_path)
    pipe, _, _ = load_family("tiny-flux")
    slept: list[float] = []
    monkeypatch.setattr(device_profiles.time, "sleep", slept.append)
    costs = apply_profile(pipe, "flux1-h100", tmp_path)
    assert isinstance(costs, FlopCosts)
    assert costs.forward_s(2, 16 + FLUX_MEASURED_TEXT_TOKENS) == pytest.approx(0.3)
    prompts = ["a red fox", "a blue bird"]
    out = pipe(prompts, height=64, width=64, num_inference_steps=2, max_sequence_length=32, output_type="np")
    assert slept == [costs.forward_s(2, 16 + 32)] * 2 + [costs.decode_s(2, 64 * 64)]
    assert slept[-1] == pytest.approx(0.3)  # the SD 1.5 artefact's 2 images at 64x64
    images = np.asarray(out.images)
    assert images.shape == (2, 64, 64, 3) and np.ptp(images) == 0  # one grey: nothing was computed
    slept.clear()
    pipe(["a red fox"], height=128, width=64, num_inference_steps=1, max_sequence_length=32)
    assert slept[0] == pytest.approx(costs.forward_s(1, 32 + 32))  # 8x4 tokens: twice the positions

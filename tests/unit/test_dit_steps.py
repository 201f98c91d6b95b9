"""The DiT step adapter (adapters/dit.py) against the diffusers pipelines themselves, in process, CPU fp32.

For PixArt-Sigma, PixArt-Alpha and Sana, requests with short and long prompts (so rows of one forward
carry different text attention masks), negative prompts present or not, other step counts, guidance
scales with and without CFG, sizes (other aspect-ratio bins, and two sizes of one bin that share
forwards and are resized back apart) and arrival steps run through the step engine; one more is
cancelled half-way. Each finished image must equal ``pipeline(...)`` for the same arguments and
generator (the pipeline alone, so a row fused with rows of other prompt lengths equals the row alone)
to one uint8 level. PixArt-Alpha's own loop (a 1024-pixel model's size conditioning, one-step jobs) has
its own test.
"""

from __future__ import annotations

import pytest

from tests.unit.step_harness import Host, assert_each_image_equals_the_pipelines_own, load_family, run_engine
from triton_diffusion.adapters.dit import DiTAdapter
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.step_adapters import step_adapter_for

# weights -> scheduler_choices (PixArt also with Euler: per-row scale_model_input and init_noise_sigma).
FAMILIES = {
    "tiny-pixart-sigma": "DPMSolverMultistepScheduler,EulerDiscreteScheduler",
    "tiny-pixart-alpha": "DPMSolverMultistepScheduler,DDIMScheduler",
    "tiny-sana": None,
}
SHORT = "a cat"
LONG = (
    "a lighthouse on a rocky coast at dusk with waves crashing, gulls circling above, warm light from "
    "the lamp, storm clouds far away and a small red boat returning to the harbour"
)
# (prompt, negative prompt, steps, guidance, (height, width), arrives at engine step). 64x64 and 128x128
# render at one bin (they share forwards) and are resized back to their own sizes; 64x96 and 96x64 are
# other bins. Guidance 1.0 runs without CFG.
REQUESTS = [
    (SHORT, None, 4, 4.5, (64, 64), 0),
    (LONG, "blurry", 3, 1.0, (64, 64), 0),
    (LONG, None, 5, 3.0, (128, 128), 0),
    ("a red tram", "dark, noisy", 4, 1.0, (64, 64), 2),
    (SHORT, None, 2, 7.5, (64, 96), 1),
    ("two green apples on a table", "noise", 3, 2.0, (96, 64), 0),
    (SHORT + " on a sofa", None, 6, 5.0, (64, 64), 3),
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return load_family(request.param, FAMILIES[request.param])


def test_every_image_equals_the_pipelines_own_amid_rows_of_other_prompt_lengths(family):
    pipe, facts, schedulers = family
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    assert isinstance(adapter, DiTAdapter), facts.class_name
    assert facts.default("use_resolution_binning") and adapter.bins is not None
    names = schedulers.names
    requests = [
        ImageParams(prompt, negative, 10 + i, 0, *size, steps, guidance, None, names[i % len(names)])
        for i, (prompt, negative, steps, guidance, size, _) in enumerate(REQUESTS)
    ]
    victim = ImageParams(LONG, None, 99, 0, 64, 64, 6, 4.5, None, names[0])  # cancelled after 2 steps
    host = Host()
    arrivals = [(spec[5], request) for spec, request in zip(REQUESTS, requests, strict=True)]
    jobs = run_engine(adapter, arrivals, host, victim)
    assert max(host.forwards) >= 4, "requests did not share forwards"
    assert jobs[6].stats.first_forward > 1, "the last request did not join mid-way"
    # The square jobs of 64 and 128 pixels render at one bin: one shape group, so they shared forwards.
    assert jobs[0].run.group == jobs[2].run.group != (64, 64) and jobs[4].run.group != jobs[5].run.group
    # Short and long prompts: rows of one forward had different text lengths (padding masked per row).
    tokens = {int(job.state.conditional["encoder_attention_mask"].sum()) for job in jobs[:3]}
    assert len(tokens) == 2 and jobs[0].stats.most_shared >= 3
    assert_each_image_equals_the_pipelines_own(family, requests, jobs)


# PixArt-Alpha's own loop, on a 1024-style transformer (sample_size 128: it takes the rendered resolution
# and aspect ratio) whose 1024-pixel bin table is swapped for small bins of the same shape, so the test
# renders 48- and 64-pixel images: (size asked, steps, scheduler, guidance, arrives at engine step). The
# asked sizes are not bins (a row conditioned on the asked size instead of the rendered one would differ);
# the one-step DDIM job keeps the predicted original sample, as the pipeline's loop does. DDIM here ends on
# alphas_cumprod[0] (not 1) from a trailing timestep, so its stepped sample is not its predicted original.
SMALL_1024_BINS = {"0.75": [48.0, 64.0], "1.0": [64.0, 64.0], "1.33": [64.0, 48.0]}
ALPHA_1024 = [
    ((72, 64), 4, "DPMSolverMultistepScheduler", 4.5, 0),
    ((64, 80), 3, "DDIMScheduler", 1.0, 0),
    ((60, 60), 1, "DDIMScheduler", 3.0, 1),
    ((64, 64), 3, "DPMSolverMultistepScheduler", 1.0, 1),
]


def test_pixart_alpha_1024_models_condition_each_row_on_its_rendered_size(monkeypatch):
    import torch
    from diffusers import DDIMScheduler, PixArtTransformer2DModel
    from diffusers.pipelines.pixart_alpha import pipeline_pixart_alpha

    monkeypatch.setattr(pipeline_pixart_alpha, "ASPECT_RATIO_1024_BIN", SMALL_1024_BINS)
    family = load_family(
        "tiny-pixart-alpha",
        "DPMSolverMultistepScheduler",
        scheduler=lambda: DDIMScheduler(set_alpha_to_one=False, timestep_spacing="trailing"),
    )
    pipe, facts, schedulers = family
    # One step keeps step(...)[1]: DDIM returns it, DPM-Solver does not (such requests are refused at
    # parse, naming scheduler).
    assert facts.traits.one_step_keeps_original
    assert schedulers.with_original_sample() == {"DDIMScheduler"}
    small = pipe.transformer
    # The size embeddings take a third of the inner dimension each: 2 heads of 24 (and the text as wide).
    config = {
        **small.config,
        "sample_size": 128,
        "use_additional_conditions": True,
        "attention_head_dim": 24,
        "cross_attention_dim": 48,
    }
    torch.manual_seed(1)
    transformer = PixArtTransformer2DModel.from_config(config)
    with torch.no_grad():  # so a wrong size visibly changes the image
        for parameter in transformer.adaln_single.emb.parameters():
            parameter.mul_(4.0)
    pipe.transformer = transformer.eval()
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    assert adapter.micro_conditions and adapter.bins is SMALL_1024_BINS
    requests = [
        ImageParams(f"a red tram {i}", None, 40 + i, 0, *size, steps, guidance, None, scheduler)
        for i, (size, steps, scheduler, guidance, _) in enumerate(ALPHA_1024)
    ]
    host = Host()
    arrivals = [(spec[4], r) for spec, r in zip(ALPHA_1024, requests, strict=True)]
    jobs = run_engine(adapter, arrivals, host)
    assert max(host.forwards) >= 3 and jobs[2].stats.most_shared >= 2
    assert {job.run.group for job in jobs} == {(64, 64), (48, 64)}
    assert_each_image_equals_the_pipelines_own(family, requests, jobs)

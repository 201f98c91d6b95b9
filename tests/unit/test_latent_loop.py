"""The latent step adapters against the diffusers pipelines themselves, in process, CPU fp32.

For each adapted family (SD 1.x, SDXL, FLUX.1, SD3), six requests with different prompts, negative prompts
(present or not), step counts, guidance scales, schedulers, sizes and arrival steps run through the step
engine; one more is cancelled half-way. Each finished image must equal ``pipeline(...)`` for the same
arguments and generator to one uint8 level, and requests must have shared forwards.

Image-conditioned jobs (img2img and inpainting for SD, SDXL, FLUX.1 and SD3) must equal
their img2img or inpaint pipeline's own image (built with ``from_pipe``), alone and while text-only jobs
with other steps and guidance join and leave around them.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from tests.unit.step_harness import (
    Host,
    assert_each_image_equals_the_pipelines_own,
    load_family,
    reference,
    run_engine,
    served,
)
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.latent_loop import LatentStepAdapter
from triton_diffusion.adapters.row_sizes import RowSizes
from triton_diffusion.adapters.starts import JobStarts
from triton_diffusion.adapters.step_adapters import STEP_ADAPTERS, step_adapter_for

FAMILIES = {
    "tiny-sd": "EulerDiscreteScheduler,DPMSolverMultistepScheduler,EulerAncestralDiscreteScheduler",
    "tiny-sdxl": "DDIMScheduler,DPMSolverMultistepScheduler,EulerAncestralDiscreteScheduler",
    "tiny-flux": None,
    "tiny-sd3": None,
}
# (negative prompt, steps, guidance, true CFG, (height, width), arrives at engine step); 96x64 and 64x96
# have one packed length but other positions (FLUX's image ids).
REQUESTS = [
    (None, 4, 7.5, 1.0, (64, 64), 0),
    ("blurry", 3, 1.0, 2.0, (96, 64), 0),
    (None, 5, 3.0, 3.0, (64, 64), 2),
    ("dark", 4, 5.0, 1.0, (64, 64), 3),
    (None, 2, 7.5, 2.0, (64, 96), 3),
    ("noise", 6, 2.0, 4.0, (64, 64), 5),
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return load_family(request.param, FAMILIES[request.param])


def test_every_image_equals_the_pipelines_own_amid_traffic(family):
    pipe, facts, schedulers = family
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    assert adapter is not None, facts.class_name
    names = schedulers.names
    picks = [names[i % len(names)] for i in range(len(REQUESTS))]  # mixed schedulers where there are
    requests = [
        ImageParams(f"prompt {i}", negative, 10 + i, 0, *size, steps, guidance, cfg, picks[i])
        for i, (negative, steps, guidance, cfg, size, _) in enumerate(REQUESTS)
    ]
    # A neighbour that is cancelled after its second step.
    victim = ImageParams("cancel me", None, 99, 0, 64, 64, 6, 7.5, 2.0, names[0])
    host = Host()
    arrivals = [(spec[5], request) for spec, request in zip(REQUESTS, requests, strict=True)]
    jobs = run_engine(adapter, arrivals, host, victim)
    assert max(host.forwards) >= 3, "requests did not share forwards"
    assert jobs[5].stats.first_forward > 1, "the last request did not join mid-way"
    assert_each_image_equals_the_pipelines_own(family, requests, jobs)


# Image-conditioned jobs per family: (start, scheduler or None for the pipeline's own, strength, steps,
# arrives at engine step). SD's: DPM-Solver (multistep: its history starts at the trimmed index), an
# inpaint job joining mid-way with Euler ancestral (its step noise follows the draws the pipeline took
# from the generator), and one at strength 1 with Euler (a pure noise start scaled by its sigma).
IMAGE_TARGETS = {
    "StableDiffusionPipeline": [
        ("image", "DPMSolverMultistepScheduler", 0.6, 5, 0),
        ("mask", "EulerAncestralDiscreteScheduler", 0.8, 4, 2),
        ("mask", "EulerDiscreteScheduler", 1.0, 3, 0),
    ],
    "StableDiffusionXLPipeline": [
        ("image", "DPMSolverMultistepScheduler", 0.75, 4, 0),
        # Euler ancestral: its step noise follows the masked source's draw from the row's generator.
        ("mask", "EulerAncestralDiscreteScheduler", 0.8, 4, 2),
    ],
    # FLUX.1 inpainting at strength 1: its pipeline noises the source to sigma 1 (the noise itself).
    "FluxPipeline": [("image", None, 0.7, 4, 0), ("mask", None, 0.8, 4, 2), ("mask", None, 1.0, 3, 1)],
    "StableDiffusion3Pipeline": [
        ("image", None, 0.65, 5, 0),
        ("image", None, 0.9, 3, 2),
        ("mask", None, 0.75, 4, 1),
        ("mask", None, 1.0, 3, 0),
    ],
}
# Text-only neighbours: (steps, guidance, true CFG, arrives at engine step); the second joins mid-way.
NEIGHBOURS = [(2, 3.0, 2.0, 0), (3, 1.0, 1.0, 1)]


def source_image(size: int = 64) -> Image.Image:
    """A source with structure (gradients, a bright square, seeded noise): another start changes it."""
    y, x = np.mgrid[0:size, 0:size]
    pixels = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], axis=-1)
    pixels[size // 4 : size // 2, size // 4 : size // 2] = 250
    pixels += np.random.default_rng(3).integers(0, 40, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def mask_image(size: int = 64) -> Image.Image:
    mask = np.zeros((size, size), dtype=np.uint8)
    mask[size // 4 : 3 * size // 4, 5 : size // 2 + 3] = (
        255  # not on the latent grid: resized as diffusers does
    )
    return Image.fromarray(mask).convert("RGB")


def test_image_conditioned_jobs_equal_their_pipelines_alone_and_amid_text_only_jobs(family):
    pipe, facts, schedulers = family
    if facts.class_name not in IMAGE_TARGETS:
        pytest.skip(f"{facts.class_name}: no image-conditioned start on the step engine")
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    names, source, mask = schedulers.names, source_image(), mask_image()
    targets = [
        (
            at,
            ImageParams(
                f"from an image {i}",
                "blurry" if i % 2 else None,
                20 + i,
                0,
                64,
                64,
                steps,
                5.0,
                2.0,
                pick or names[0],
                image=source,
                strength=strength,
                mask_image=mask if start == "mask" else None,
            ),
        )
        for i, (start, pick, strength, steps, at) in enumerate(IMAGE_TARGETS[facts.class_name])
    ]
    # A text-only twin of the first target (same prompt and seed): the source must change the image.
    twin = replace(targets[0][1], image=None, strength=None, steps=3)
    neighbours = [
        (at, ImageParams(f"text only {i}", "dark", 30 + i, 0, 64, 64, steps, guidance, cfg, names[0]))
        for i, (steps, guidance, cfg, at) in enumerate(NEIGHBOURS)
    ] + [(0, twin)]
    together = run_engine(adapter, targets + neighbours)
    assert together[len(targets) + 1].stats.first_forward > 1, "a text-only job did not join mid-way"
    for (_, request), job in zip(targets, together, strict=False):
        expected = np.asarray(reference(pipe, facts, schedulers, request), dtype=int)
        (alone,) = run_engine(adapter, [(0, request)])
        assert np.abs(served(alone) - expected).max() <= 1, ("alone", facts.class_name, request.start)
        assert np.abs(served(job) - expected).max() <= 1, ("amid text", facts.class_name, request.start)
        assert job.stats.most_shared >= 2 and alone.stats.most_shared == 1
        assert job.stats.forwards == job.run.total_steps == alone.run.total_steps <= request.steps
    assert np.abs(served(together[0]) - served(together[-1])).mean() > 5, "the source did not matter"


# An inpainting checkpoint (SD's and SDXL's 9-channel UNets, a FLUX.1 Fill transformer, SD3's 33-channel
# transformer: the mask and the masked source are model inputs) serves inpainting jobs only, each as its
# inpaint pipeline (StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline, FluxFillPipeline,
# StableDiffusion3InpaintPipeline, decoded with the VAE's shift) runs it: (scheduler, None for the
# pipeline's own; strength, steps, guidance, arrives at engine step). Strength 1 with the pipeline's own
# scheduler (the SD and SD3 pipelines never encode the source then; FLUX.1 Fill does); Euler ancestral
# without CFG joining mid-way (its step noise follows the masked source's draw from the row's generator);
# DPM-Solver at strength 0.6 (its history starts at the trimmed index). FLUX.1 and SD3 have their
# flow-matching Euler only.
CHECKPOINT_JOBS = [
    (None, 1.0, 4, 7.5, 0),
    ("EulerAncestralDiscreteScheduler", 0.75, 4, 1.0, 1),
    ("DPMSolverMultistepScheduler", 0.6, 5, 5.0, 2),
]


@pytest.mark.parametrize(
    ("checkpoint", "family_name"),
    [
        ("tiny-sd-inpaint", "tiny-sd"),
        ("tiny-sdxl-inpaint", "tiny-sdxl"),
        ("tiny-flux-fill", "tiny-flux"),
        ("tiny-sd3-inpaint", "tiny-sd3"),
    ],
)
def test_an_inpainting_checkpoint_serves_inpainting_jobs_each_equal_to_its_pipeline(checkpoint, family_name):
    family = load_family(checkpoint, FAMILIES[family_name])
    pipe, facts, schedulers = family
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    assert adapter.starter.starts == ("mask",), "an inpainting checkpoint cannot start from text or img2img"
    names, source, mask = schedulers.names, source_image(), mask_image()
    negatives = facts.accepts("negative_prompt")  # FluxFillPipeline takes none
    requests = [
        ImageParams(
            f"repaint {i}",
            "blurry" if i and negatives else None,
            50 + i,
            0,
            64,
            64,
            steps,
            guidance,
            None,
            pick if pick in names else names[0],  # None: the pipeline's own
            image=source,
            strength=strength,
            mask_image=mask,
        )
        for i, (pick, strength, steps, guidance, _) in enumerate(CHECKPOINT_JOBS)
    ]
    victim = replace(requests[0], prompt="cancel me", seed=99)
    host = Host()
    arrivals = [(spec[4], request) for spec, request in zip(CHECKPOINT_JOBS, requests, strict=True)]
    jobs = run_engine(adapter, arrivals, host, victim)
    assert max(host.forwards) >= 3, "inpainting jobs did not share forwards"
    assert jobs[2].stats.first_forward > 1, "the last request did not join mid-way"
    assert_each_image_equals_the_pipelines_own(family, requests, jobs)
    # The mask is an input of the model here: another mask, another image.
    other_mask = Image.fromarray(255 - np.asarray(mask))
    (other,) = run_engine(adapter, [(0, replace(requests[1], mask_image=other_mask))])
    assert np.abs(served(other) - served(jobs[1])).mean() > 5, "the mask did not matter"


def test_every_family_adapter_is_composed_not_mixed():
    """One base per family (the loop), no mixins: a family's start is a collaborator made with it (its
    ``starts_class``, one base at each level up to JobStarts), as its sizes are (a RowSizes, a class of
    its own)."""
    for name, adapter_class in STEP_ADAPTERS.items():
        assert adapter_class.__mro__[1:] == (LatentStepAdapter, object), name
        starts = adapter_class.starts_class
        assert issubclass(starts, JobStarts) and not issubclass(starts, LatentStepAdapter), name
        chain = starts.__mro__[: starts.__mro__.index(JobStarts) + 1]  # one base at each level
        assert all(len(level.__bases__) == 1 for level in chain) and chain[-1].__bases__ == (object,), name
    assert LatentStepAdapter.__bases__ == (object,) and RowSizes.__bases__ == (object,)
    assert JobStarts.__bases__ == (object,)

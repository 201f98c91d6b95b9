"""The Qwen-Image step adapter (adapters/qwen_image.py) against ``QwenImagePipeline`` itself, in process,
CPU fp32.

Requests with short and long prompts (rows of one forward have other text lengths: padded, masked per
row, and no mask where no row is padded), negative prompts present or not, true CFG on and off per row,
step counts, sizes (96x64 and 64x96: one packed length, other image positions) and arrival steps run
through the step engine; one more is cancelled half-way. Each image must equal ``pipeline(...)`` for the
same arguments and generator, alone, to one uint8 level.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.unit.step_harness import (
    Host,
    assert_each_image_equals_the_pipelines_own,
    load_family,
    reference,
    run_engine,
    served,
)
from tests.unit.test_latent_loop import source_image
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.qwen_image import QwenImageAdapter
from triton_diffusion.adapters.step_adapters import step_adapter_for

NAME = "tiny-qwen-image"
SHORT = "a cat"
LONG = (
    "a lighthouse on a rocky coast at dusk with waves crashing, gulls circling above, warm light from "
    "the lamp, storm clouds far away and a small red boat returning to the harbour"
)
# (prompt, negative prompt, steps, true CFG, (height, width), arrives at engine step). True CFG acts only
# with a negative prompt and a scale above 1.
REQUESTS = [
    (SHORT, None, 4, 4.0, (64, 64), 0),
    (LONG, "blurry", 3, 2.5, (64, 64), 0),
    (LONG, "dark", 5, 1.0, (64, 64), 0),
    ("a red tram", "dark, noisy, blurry, washed out, low contrast, grainy", 4, 3.0, (64, 64), 2),
    (SHORT, "noise", 2, 4.0, (96, 64), 1),
    ("two green apples on a table", None, 3, 1.0, (64, 96), 1),
    (SHORT + " on a sofa", None, 6, 4.0, (64, 64), 3),
]


@pytest.fixture(scope="module")
def family():
    return load_family(NAME)


def test_every_image_equals_the_pipelines_own_amid_rows_of_other_prompt_lengths(family):
    pipe, facts, schedulers = family
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    assert isinstance(adapter, QwenImageAdapter)
    scheduler = schedulers.names[0]
    requests = [
        ImageParams(prompt, negative, 10 + i, 0, *size, steps, None, cfg, scheduler)
        for i, (prompt, negative, steps, cfg, size, _) in enumerate(REQUESTS)
    ]
    victim = ImageParams(LONG, "blurry", 99, 0, 64, 64, 6, None, 4.0, scheduler)  # cancelled after 2 steps
    host = Host()
    arrivals = [(spec[5], request) for spec, request in zip(REQUESTS, requests, strict=True)]
    jobs = run_engine(adapter, arrivals, host, victim)
    assert max(host.forwards) >= 4 and jobs[0].stats.most_shared >= 4, "requests did not share forwards"
    assert jobs[6].stats.first_forward > 1, "the last request did not join mid-way"
    assert [job.state.unconditional is not None for job in jobs] == [False, True, False, True, True] + [
        False,
        False,
    ]
    # Short and long prompts: rows of one forward had different text lengths.
    tokens = {int(job.state.conditional["encoder_hidden_states_mask"].sum()) for job in jobs[:3]}
    assert len(tokens) == 2
    assert_each_image_equals_the_pipelines_own(family, requests, jobs)


# img2img jobs (QwenImageImg2ImgPipeline): (prompt, negative prompt, true CFG, strength, steps, arrives at,
# (height, width)).
IMAGE_REQUESTS = [
    ("a cat in the snow", None, 1.0, 0.6, 4, 0, (64, 64)),
    (LONG, "blurry", 3.0, 0.85, 3, 1, (64, 64)),
    ("a wide street", None, 2.0, 0.7, 4, 0, (64, 96)),  # not square: height and width not swapped
]


def test_img2img_jobs_equal_their_pipeline_alone_and_amid_text_only_jobs(family):
    pipe, facts, schedulers = family
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    assert adapter.starter.starts == ("text", "image")
    scheduler, source = schedulers.names[0], source_image()
    targets = [
        (
            at,
            ImageParams(p, n, 30 + i, 0, *size, steps, None, cfg, scheduler, image=source, strength=strength),
        )
        for i, (p, n, cfg, strength, steps, at, size) in enumerate(IMAGE_REQUESTS)
    ]
    text = [(0, ImageParams(SHORT, "dark", 40, 0, 64, 64, 5, None, 2.0, scheduler))]
    text.append((2, ImageParams(LONG, None, 41, 0, 64, 64, 3, None, 1.0, scheduler)))
    text.append((0, ImageParams(SHORT, None, 42, 0, 64, 96, 4, None, 1.0, scheduler)))  # the wide one's mate
    jobs = run_engine(adapter, targets + text)
    for (_, request), job in zip(targets, jobs, strict=False):
        expected = np.asarray(reference(pipe, facts, schedulers, request), dtype=int)
        (alone,) = run_engine(adapter, [(0, request)])
        assert np.abs(served(alone) - expected).max() <= 1, "alone"
        assert np.abs(served(job) - expected).max() <= 1, "amid text"
        assert job.stats.most_shared >= 2 and job.stats.forwards == job.run.total_steps <= request.steps
    assert jobs[0].run.total_steps == 3, "strength 0.6 of 4 steps runs 3 (the trim, unrounded)"
    twin = replace(targets[0][1], image=None, strength=None)
    (text_only,) = run_engine(adapter, [(0, twin)])
    assert np.abs(served(text_only) - served(jobs[0])).mean() > 5, "the source did not matter"

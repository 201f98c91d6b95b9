"""The Z-Image step adapter (adapters/z_image.py) against ``ZImagePipeline`` itself, in process, CPU fp32.

Requests with short and long prompts (the transformer gets every row's own caption length), negative
prompts present or not, guidance on (> 0, as the pipeline decides) and off, step counts, sizes and
arrival steps run through the step engine; one more is cancelled half-way. Each image must equal
``pipeline(...)`` for the same arguments and generator, alone, to one uint8 level.
"""

from __future__ import annotations

import pytest

from tests.unit.step_harness import Host, assert_each_image_equals_the_pipelines_own, load_family, run_engine
from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.step_adapters import step_adapter_for
from triton_diffusion.adapters.z_image import ZImageAdapter

NAME = "tiny-z-image"
SHORT = "a cat"
LONG = (
    "a lighthouse on a rocky coast at dusk with waves crashing, gulls circling above, warm light from "
    "the lamp, storm clouds far away and a small red boat returning to the harbour"
)
# (prompt, negative prompt, steps, guidance, (height, width), arrives at engine step); guidance 0 runs
# without CFG.
REQUESTS = [
    (SHORT, None, 4, 5.0, (64, 64), 0),
    (LONG, "blurry", 3, 0.0, (64, 64), 0),
    (LONG, None, 5, 1.0, (64, 64), 0),
    ("a red tram", "dark, noisy, blurry, washed out, low contrast", 4, 3.0, (64, 64), 2),
    (SHORT, "noise", 2, 4.0, (96, 64), 1),
    ("two green apples on a table", None, 3, 0.0, (64, 96), 1),
    (SHORT + " on a sofa", None, 6, 2.0, (64, 64), 3),
]


@pytest.fixture(scope="module")
def family():
    return load_family(NAME)


def test_every_image_equals_the_pipelines_own_amid_rows_of_other_prompt_lengths(family):
    pipe, facts, schedulers = family
    adapter = step_adapter_for(pipe, facts, schedulers, None)
    assert isinstance(adapter, ZImageAdapter)
    scheduler = schedulers.names[0]
    requests = [
        ImageParams(prompt, negative, 10 + i, 0, *size, steps, guidance, None, scheduler)
        for i, (prompt, negative, steps, guidance, size, _) in enumerate(REQUESTS)
    ]
    victim = ImageParams(LONG, "blurry", 99, 0, 64, 64, 6, 5.0, None, scheduler)  # cancelled after 2 steps
    host = Host()
    arrivals = [(spec[5], request) for spec, request in zip(REQUESTS, requests, strict=True)]
    jobs = run_engine(adapter, arrivals, host, victim)
    assert max(host.forwards) >= 4 and jobs[0].stats.most_shared >= 4, "requests did not share forwards"
    assert jobs[6].stats.first_forward > 1, "the last request did not join mid-way"
    guided = [job.state.unconditional is not None for job in jobs]
    assert guided == [True, False, True, True, True, False, True]
    # Short and long prompts: rows of one forward had different caption lengths.
    assert len({int(job.state.conditional["cap_length"]) for job in jobs[:3]}) == 2
    assert_each_image_equals_the_pipelines_own(family, requests, jobs)

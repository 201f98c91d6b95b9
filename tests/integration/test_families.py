"""The family matrix: every diffusers family a user points ``model`` at, served from the shipped config with
only ``model`` changed (plus the tests' longer queue delay, so concurrent requests fuse reliably).

Each family is a tiny random-weight pipeline built from the real diffusers classes (tiny_models/), big
enough that the prompt visibly changes the image. For each: it loads; a request gives an image of the
requested size; a request alone equals itself fused among 7 others (<= 1 uint8); requests with and
without a negative prompt are exact and share a call only where the pipeline treats None as ""; progress
and previews arrive; guidance_scale / true_cfg_scale are accepted only where the pipeline uses them.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pytest
from diffusion_client import generate_many
from PIL import Image

from triton_diffusion.serving.server_process import WEIGHTS, copy_model, set_batching, start_server
from triton_diffusion.tiny_models import TINY_DEFAULTS, TINY_FAMILIES, build_missing

from .conftest import QUEUE_DELAY_US
from .test_text_to_image import max_diff, pixels


@dataclass(frozen=True)
class Family:
    config: str  # the shipped model_repository folder it is served from
    weights: str
    negative_fused: bool  # None and "" are the same to the pipeline: rows with and without share calls
    guidance_scale: bool  # the pipeline uses guidance_scale
    true_cfg_scale: bool  # the pipeline takes true_cfg_scale (true CFG with a negative prompt)
    step_engine: bool = False  # served by the step engine (a step adapter exists), else request-level


FAMILIES = {
    "sdxl": Family("text_to_image", "tiny-sdxl", False, True, False, step_engine=True),
    "sd3": Family("text_to_image", "tiny-sd3", True, True, False, step_engine=True),
    "flux": Family("text_to_image", "tiny-flux", False, True, True, step_engine=True),
    "qwen_image": Family("text_to_image", "tiny-qwen-image", False, False, True, step_engine=True),
    "sana": Family("text_to_image", "tiny-sana", True, True, False, step_engine=True),
    "pixart_sigma": Family("text_to_image", "tiny-pixart-sigma", True, True, False, step_engine=True),
    "z_image": Family("text_to_image", "tiny-z-image", True, True, False, step_engine=True),
    # The img2img classes of the step-engine families run on the step engine too (their image_to_image).
    "sdxl_img2img": Family("image_to_image", "tiny-sdxl", False, True, False, step_engine=True),
    "flux_img2img": Family("image_to_image", "tiny-flux", False, True, True, step_engine=True),
    "sd3_img2img": Family("image_to_image", "tiny-sd3", True, True, False, step_engine=True),
}
MATES = ["a lighthouse at dusk", "two green apples", "a city in fog", "an old red tram", "waves on rocks"]


def source_png(width: int = 96, height: int = 64) -> bytes:
    rng = np.random.default_rng(7)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def family_server(tmp_path_factory):
    build_missing(WEIGHTS, only=TINY_DEFAULTS + TINY_FAMILIES)
    repo = tmp_path_factory.mktemp("family_repository")
    for name, family in FAMILIES.items():
        copy_model(family.config, repo, name, {"model": str(WEIGHTS / family.weights)})
        set_batching(repo, name, QUEUE_DELAY_US)
    running = start_server(repo, tmp_path_factory.mktemp("family_logs") / "server.log", list(FAMILIES))
    yield running
    running.stop()


@pytest.fixture(params=list(FAMILIES))
def name(request):
    return request.param


def send(server, name, requests):
    family = FAMILIES[name]
    if family.config == "image_to_image":
        requests = [{"image": source_png(), "strength": 0.75, **r} for r in requests]
    return generate_many(requests, url=server.grpc_url, model=name, timeout_s=180)


def rows_shared(result) -> int:
    """The most rows the request shared one pipeline call (request-level) or one forward (step) with."""
    batch = result.batch
    return batch["most_rows_shared"] if batch.get("engine") == "step" else batch["fused_calls"][0]["rows"]


def extra(name: str) -> dict:
    """true CFG needs a scale above 1 to act on a negative prompt (Flux's default is 1)."""
    return {"true_cfg_scale": 2.0} if FAMILIES[name].true_cfg_scale else {}


def test_loads_and_renders_the_requested_size_and_the_prompt_matters(family_server, name):
    red, blue = send(
        family_server,
        name,
        [
            {"prompt": "a red cat", "seed": 3, "height": 64, "width": 96},
            {"prompt": "a blue dog", "seed": 3, "height": 64, "width": 96},
        ],
    )
    assert red.ok and blue.ok, (red.error, blue.error)
    assert pixels(red.images[0]).shape == (64, 96, 3)
    assert red.batch["key"]["height"] == 64 and red.batch["key"]["width"] == 96
    assert (red.batch.get("engine") == "step") == FAMILIES[name].step_engine
    difference = np.abs(pixels(red.images[0]) - pixels(blue.images[0]))
    assert difference.mean() > 5, "the prompt does not change the image: the test would prove nothing"


def test_alone_equals_fused_among_seven_others_with_and_without_negative_prompts(family_server, name):
    family = FAMILIES[name]
    with_negative = {"prompt": "a castle", "negative_prompt": "blurry, dark", "seed": 5, **extra(name)}
    without = {"prompt": "a castle on a hill", "seed": 6, **extra(name)}
    alone = [send(family_server, name, [request])[0] for request in (with_negative, without)]
    mates = [
        {"prompt": p, "seed": 40 + i, **extra(name), **({"negative_prompt": "noise"} if i % 2 else {})}
        for i, p in enumerate(MATES + ["snow on pines"])
    ]
    batch = send(family_server, name, [with_negative, *mates[:2], without, *mates[2:]])
    assert all(r.ok for r in batch), [r.error for r in batch]
    among = [batch[0], batch[3]]
    for solo, fused in zip(alone, among, strict=True):
        assert rows_shared(solo) == 1
        assert rows_shared(fused) > 1, "not fused with others"
        assert max_diff(solo.images[0], fused.images[0]) <= 1
    if family.step_engine:
        return  # per-row conditioning: with and without a negative prompt share forwards in every family
    calls_with = {c["id"] for c in among[0].batch["fused_calls"]}
    calls_without = {c["id"] for c in among[1].batch["fused_calls"]}
    if family.negative_fused:
        assert calls_with == calls_without, "None and '' are the same here: they must share a call"
    else:
        assert calls_with.isdisjoint(calls_without), "a structural switch: they must never share a call"


IMG2IMG_PROGRESS = {"image": source_png(), "strength": 1.0}  # every one of the 4 steps runs


def test_progress_and_previews(family_server, name):
    events = []
    (result,) = generate_many(
        [
            {
                "prompt": "progress",
                "seed": 1,
                "num_inference_steps": 4,
                "preview_every": 2,
                **(IMG2IMG_PROGRESS if FAMILIES[name].config == "image_to_image" else {}),
            }
        ],
        url=family_server.grpc_url,
        model=name,
        timeout_s=180,
        on_progress=lambda index, progress: events.append(progress) and None,
    )
    assert result.ok, result.error
    assert [e.step for e in events] == list(range(1, len(events) + 1)) and events
    assert len({e.total for e in events}) == 1 and events[-1].step == events[-1].total
    previews = [e for e in events if e.preview is not None]
    assert previews and all(e.step % 2 == 0 for e in previews)
    assert all(Image.open(io.BytesIO(e.preview)).format == "PNG" for e in previews)


def test_guidance_fields_are_accepted_only_where_the_pipeline_uses_them(family_server, name):
    family = FAMILIES[name]
    guided, true_cfg = send(
        family_server,
        name,
        [
            {"prompt": "guided", "seed": 1, "guidance_scale": 3.0},
            {"prompt": "true cfg", "seed": 1, "true_cfg_scale": 3.0, "negative_prompt": "x"},
        ],
    )
    cases = [(guided, family.guidance_scale, "guidance_scale")]
    cases.append((true_cfg, family.true_cfg_scale, "true_cfg_scale"))
    for result, used, field in cases:
        if used:
            assert result.ok, (field, result.error)
        else:
            assert not result.ok and f"{field}: is not supported" in result.error, result.error

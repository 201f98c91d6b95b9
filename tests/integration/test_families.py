"""The family matrix: every diffusers family a user points ``model`` at, served from the shipped config with
only ``model`` changed (and a short queue delay: every family here is on the step engine; and the test-only
hold of faults.py, which acts on prompts carrying ``__hold__`` alone).

Each family is a tiny random-weight pipeline built from the real diffusers classes (tiny_models/), big
enough that the prompt visibly changes the image. For each: it loads; a request gives an image of the
requested size; a request alone equals itself fused among 7 others (<= 1 uint8); requests with and
without a negative prompt are exact and share a call only where the pipeline treats None as ""; progress
and previews arrive; guidance_scale / true_cfg_scale are accepted only where the pipeline uses them.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image
from triton_diffusion_client import generate_many

from tests.faults import copy_model
from tests.unit.step_harness import sd3_inpaint_with_shift
from triton_diffusion.serving.server_process import WEIGHTS, set_batching, start_server
from triton_diffusion.tiny_models import TINY_DEFAULTS, TINY_FAMILIES, build_missing

from .test_step_engine import mask_png
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
    "pixart_alpha": Family("text_to_image", "tiny-pixart-alpha", True, True, False, step_engine=True),
    "z_image": Family("text_to_image", "tiny-z-image", True, True, False, step_engine=True),
    # The img2img classes of the step-engine families run on the step engine too (their image_to_image).
    "sdxl_img2img": Family("image_to_image", "tiny-sdxl", False, True, False, step_engine=True),
    "flux_img2img": Family("image_to_image", "tiny-flux", False, True, True, step_engine=True),
    "sd3_img2img": Family("image_to_image", "tiny-sd3", True, True, False, step_engine=True),
    "qwen_image_img2img": Family("image_to_image", "tiny-qwen-image", False, False, True, step_engine=True),
}
# Every family here runs on the step engine, which joins requests at the next step whichever execute()
# brings them: a short queue delay, so a request sent while another runs is not held in Triton's queue
# until that one has finished (the 300 ms the request-level tests use is longer than a tiny model's run).
STEP_QUEUE_DELAY_US = 20_000
# Served beside them, outside the text-to-image matrix: inpainting checkpoints (the mask and the masked
# source are inputs of the denoiser): model name -> (weights, its diffusers pipeline class).
INPAINTING_CHECKPOINTS = {
    "sd_inpaint": ("tiny-sd-inpaint", "StableDiffusionInpaintPipeline"),  # a 9-channel UNet
    "flux_fill": ("tiny-flux-fill", "FluxFillPipeline"),  # a FLUX.1 Fill transformer
}


# faults.py's hold: a request whose prompt carries HOLD waits before its second forward until another
# job arrives, so a request sent after its first progress response certainly joins it.
HOLD = "__hold__"
HOLD_FAULTS = '{"hold_on_prompt": "' + HOLD + '"}'


def second_joins_first(server, name: str, first: dict, second: dict) -> tuple:
    """Send ``first`` (its prompt carrying HOLD, with progress) and, once it has taken a step, ``second``:
    the first waits before its second forward until the second has arrived, so they share forwards
    whatever the machine's speed (the second joins at the next engine step)."""
    assert HOLD in first["prompt"], "the first request must carry the hold marker"
    stepped, results = threading.Event(), {}

    def run_first() -> None:
        (results["first"],) = generate_many(
            [{**first, "progress": True}],
            url=server.grpc_url,
            model=name,
            timeout_s=180,
            on_progress=lambda index, progress: stepped.set(),
        )

    thread = threading.Thread(target=run_first)
    thread.start()
    assert stepped.wait(120), "the first request never took a step"
    (results["second"],) = generate_many([second], url=server.grpc_url, model=name, timeout_s=180)
    thread.join(180)
    return results["first"], results["second"]


MATES = ["a lighthouse at dusk", "two green apples", "a city in fog", "an old red tram", "waves on rocks"]


def with_holder(server, name: str, holder: dict, requests: list[dict]) -> list:
    """Send ``holder`` (its prompt carrying HOLD with ``of N``, with progress) and, once it has taken a
    step, ``requests``; their results, in order."""
    stepped, results = threading.Event(), {}
    if FAMILIES[name].config == "image_to_image":  # as send() makes its requests
        holder = {"image": source_png(), "strength": 0.75, **holder}

    def run_holder() -> None:
        (results["holder"],) = generate_many(
            [{**holder, "progress": True}],
            url=server.grpc_url,
            model=name,
            timeout_s=180,
            on_progress=lambda index, progress: stepped.set(),
        )

    thread = threading.Thread(target=run_holder)
    thread.start()
    assert stepped.wait(120), "the holder never took a step"
    batch = send(server, name, requests)
    thread.join(180)
    assert results["holder"].ok, results["holder"].error
    return batch


def source_png(width: int = 96, height: int = 64) -> bytes:
    rng = np.random.default_rng(7)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def family_server(tmp_path_factory):
    checkpoints = [weights for weights, _ in INPAINTING_CHECKPOINTS.values()]
    build_missing(WEIGHTS, only=TINY_DEFAULTS + TINY_FAMILIES + checkpoints)
    repo = tmp_path_factory.mktemp("family_repository")
    models = {name: (family.config, family.weights) for name, family in FAMILIES.items()}
    for name, (weights, _) in INPAINTING_CHECKPOINTS.items():
        models[name] = ("text_to_image", weights)
    for name, (config, weights) in models.items():
        # Packing always (packing_gate false): these tests check what packed forwards compute, which the
        # gate's timing-based choice would otherwise decide on each host.
        params = {"model": str(WEIGHTS / weights), "fault_injection": HOLD_FAULTS, "packing_gate": "false"}
        copy_model(config, repo, name, params)
        set_batching(repo, name, STEP_QUEUE_DELAY_US)
    running = start_server(
        repo, tmp_path_factory.mktemp("family_logs") / "server.log", list(models), timeout_s=420
    )
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


def test_alone_equals_fused_among_six_others_with_and_without_negative_prompts(family_server, name):
    family = FAMILIES[name]
    with_negative = {"prompt": "a castle", "negative_prompt": "blurry, dark", "seed": 5, **extra(name)}
    without = {"prompt": "a castle on a hill", "seed": 6, **extra(name)}
    alone = [send(family_server, name, [request])[0] for request in (with_negative, without)]
    # Five mates: seven requests, with the holder eight jobs, which the running set (max_rows_per_call 8)
    # holds at once.
    # With one more, whichever request reached the engine last waited for a slot and, all of them taking
    # the same steps, ran its every forward alone after the others finished (a CI run saw it).
    mates = [
        {"prompt": p, "seed": 40 + i, **extra(name), **({"negative_prompt": "noise"} if i % 2 else {})}
        for i, p in enumerate(MATES)
    ]
    fused = [with_negative, *mates[:2], without, *mates[2:]]
    if family.step_engine:
        # Certain overlap whatever the machine's speed: a holder, once it runs, waits before its second
        # forward until the engine holds it and the whole batch (faults.py's hold), so every request of
        # the batch is admitted while it and the others run (Triton may hand the batch over in parts).
        holder = {"prompt": f"a harbour {HOLD}1of{len(fused) + 1}", "seed": 99, **extra(name)}
        batch = with_holder(family_server, name, holder, fused)
    else:
        batch = send(family_server, name, fused)
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


@pytest.mark.parametrize("name", ["sdxl", "sd3", "flux"])
def test_inpainting_on_the_text_to_image_model_shares_forwards_and_equals_the_inpaint_pipeline(
    family_server, name
):
    """The family's text_to_image model takes a mask too: the inpaint request runs beside a text-only one
    in the same forwards and equals the family's inpaint pipeline (SDXL's, SD3's, FLUX.1's) alone."""
    source = source_png(64, 64)
    # guidance_scale sent: where a request leaves it out the model's default (its text pipeline's) applies,
    # and the inpaint pipelines default to other ones.
    inpaint = {
        "prompt": "a red door",
        "seed": 9,
        "num_inference_steps": 20,
        "strength": 0.75,
        "guidance_scale": 4.0,
        **extra(name),
    }
    text, edit = second_joins_first(
        family_server,
        name,
        {"prompt": f"a quiet street {HOLD}", "seed": 8, "num_inference_steps": 50, "height": 64, "width": 64},
        {**inpaint, "image": source, "mask_image": mask_png()},
    )
    assert text.ok and edit.ok, (text.error, edit.error)
    assert edit.batch["engine"] == "step" and edit.batch["most_rows_shared"] >= 2
    pipe = diffusers.AutoPipelineForInpainting.from_pretrained(WEIGHTS / FAMILIES[name].weights)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {
        **{k: v for k, v in inpaint.items() if k != "seed"},
        "prompt": [inpaint["prompt"]],
        "image": Image.open(io.BytesIO(source)).convert("RGB"),
        "mask_image": Image.open(io.BytesIO(mask_png())).convert("RGB"),
        "height": 64,
        "width": 64,
        "generator": [torch.Generator().manual_seed(inpaint["seed"])],
    }
    if name == "sd3":
        expected = sd3_inpaint_with_shift(pipe, kwargs)  # diffusers' SD3 inpaint decode lacks the shift
    else:
        expected = pipe(**kwargs).images[0]
    assert np.abs(pixels(edit.images[0]) - np.asarray(expected, dtype=int)).max() <= 1


@pytest.mark.parametrize("checkpoint", list(INPAINTING_CHECKPOINTS))
def test_an_inpainting_checkpoint_serves_inpainting_only_each_request_as_its_pipeline(
    family_server, checkpoint
):
    """An inpainting checkpoint (a 9-channel UNet, a FLUX.1 Fill transformer) on the text_to_image config:
    requests without a source and a mask are refused by name; two inpainting requests of other strengths
    share forwards, each equal to its inpaint pipeline (StableDiffusionInpaintPipeline, FluxFillPipeline)
    alone."""
    weights, pipeline_class = INPAINTING_CHECKPOINTS[checkpoint]
    common = {
        "num_inference_steps": 30,
        "guidance_scale": 6.0,
        "height": 64,
        "width": 64,
        "image": source_png(64, 64),
        "mask_image": mask_png(),
    }
    requests = [
        {"prompt": f"a blue window {HOLD}", "seed": 4, "strength": 1.0, **common},
        {"prompt": "a green door", "seed": 5, "strength": 0.75, **common},
        {"prompt": "text only", "seed": 6},
    ]
    (text,) = generate_many(requests[2:], url=family_server.grpc_url, model=checkpoint, timeout_s=180)
    first, second = second_joins_first(family_server, checkpoint, requests[0], requests[1])
    assert not text.ok and "image: is required: this model inpaints" in text.error, text.error
    assert first.ok and second.ok, (first.error, second.error)
    assert first.batch["most_rows_shared"] >= 2 and second.batch["most_rows_shared"] >= 2
    pipe = getattr(diffusers, pipeline_class).from_pretrained(WEIGHTS / weights)
    pipe.set_progress_bar_config(disable=True)
    for request, result in ((requests[0], first), (requests[1], second)):
        expected = pipe(
            prompt=[request["prompt"]],
            image=Image.open(io.BytesIO(request["image"])).convert("RGB"),
            mask_image=Image.open(io.BytesIO(request["mask_image"])).convert("RGB"),
            strength=request["strength"],
            num_inference_steps=30,
            guidance_scale=6.0,
            height=64,
            width=64,
            generator=[torch.Generator().manual_seed(request["seed"])],
        ).images[0]
        assert np.abs(pixels(result.images[0]) - np.asarray(expected, dtype=int)).max() <= 1


def test_pixart_alpha_refuses_one_step_with_a_scheduler_that_has_no_predicted_original(family_server):
    """PixArt-Alpha keeps the scheduler's predicted original sample after one step; its DPM-Solver returns
    none, so a one-step request is refused by name (the pipeline would raise an IndexError), and two
    steps are served."""
    one, two = send(
        family_server,
        "pixart_alpha",
        [
            {"prompt": "one step", "seed": 1, "num_inference_steps": 1},
            {"prompt": "two steps", "seed": 1, "num_inference_steps": 2},
        ],
    )
    assert not one.ok and "scheduler: DPMSolverMultistepScheduler returns no predicted original" in one.error
    assert two.ok, two.error


# The three CPU sizes (WIDTHxHEIGHT 64x64, 96x64, 64x128): each a size of its own in one forward.
PACKED_SIZES = [(64, 64), (96, 64), (64, 128)]


@pytest.mark.parametrize("packed", ["flux", "sd3"])
def test_three_sizes_share_forwards_through_the_server_each_equal_to_its_pipeline_alone(
    family_server, packed
):
    """FLUX.1 and SD3 pack images of different sizes into one forward (adapters/packed_rows.py): a request
    of each size joins a held 64x64 one and equals ``pipeline(...)`` alone at its size and seed; the 96x64
    and 64x128 ones, each the only one of its size, share forwards (so with another size)."""
    # SD3 unguided, one row a request: four rows on the 8x6-token canvas of these sizes, within the tokens
    # of the largest forward of one of these sizes (8 images of 64x128), as guided rows would be too.
    unguided = {"guidance_scale": 1.0} if packed == "sd3" else {}
    requests = [
        {
            "prompt": f"a boat {w}x{h}",
            "seed": 60 + i,
            "width": w,
            "height": h,
            "num_inference_steps": 6,
            **extra(packed),
            **unguided,
        }
        for i, (w, h) in enumerate(PACKED_SIZES)
    ]
    holder = {
        "prompt": f"a harbour {HOLD}1of{len(requests) + 1}",
        "seed": 99,
        "width": 64,
        "height": 64,
        **unguided,
    }
    batch = with_holder(family_server, packed, {**holder, **extra(packed)}, requests)
    assert all(r.ok for r in batch), [r.error for r in batch]
    pipe = diffusers.DiffusionPipeline.from_pretrained(WEIGHTS / FAMILIES[packed].weights)
    pipe.set_progress_bar_config(disable=True)
    for request, result in zip(requests, batch, strict=True):
        assert result.batch["most_rows_shared"] >= 2, (request["width"], request["height"], result.batch)
        kwargs = {k: v for k, v in request.items() if k != "seed"}
        kwargs.update(prompt=[request["prompt"]], generator=[torch.Generator().manual_seed(request["seed"])])
        expected = np.asarray(pipe(**kwargs).images[0], dtype=int)
        image = pixels(result.images[0])
        assert image.shape == expected.shape == (request["height"], request["width"], 3)
        assert np.abs(image - expected).max() <= 1, (packed, request["width"], request["height"])

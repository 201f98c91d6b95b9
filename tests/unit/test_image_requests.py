"""How text_to_image reads an image-conditioned request (no pipeline, no Triton): which starts it serves,
the source and mask decoded and resized to the output size, the strength of each start, and errors that
name the field."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from tests.unit.recording import tracked
from triton_diffusion.adapters.flow_matching import FluxAdapter, StableDiffusion3Adapter
from triton_diffusion.adapters.stable_diffusion import StableDiffusionAdapter
from triton_diffusion.errors import RequestError
from triton_diffusion.models.source_images import SourceImages
from triton_diffusion.models.text_to_image import TEXT_TO_IMAGE_FIELDS, TextToImageModel
from triton_diffusion.serving.engines import StepEngineKind
from triton_diffusion.settings import ModelConfig, ModelSettings


class FakeStarts:
    """A step adapter's starter (adapters/starts.py JobStarts) as source images read it."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        self.starts = starts

    def default_strength(self, start: str) -> float:
        return {"image": 0.8, "mask": 1.0}[start]


def model(starts: tuple[str, ...] = ("text", "image", "mask")) -> TextToImageModel:
    m = TextToImageModel.__new__(TextToImageModel)
    m.OPTIONAL_CALL_FIELDS = ()
    config = ModelConfig(max_image_pixels=512 * 512)
    m.settings = ModelSettings("m", Path("."), config, {}, 8, "CPU", 0)
    m.engine_kind = StepEngineKind(None)
    facts = SimpleNamespace(class_name="StableDiffusionPipeline", accepts=lambda name: False)
    m.sources = SourceImages.at_load(
        "TextToImageModel", TEXT_TO_IMAGE_FIELDS, config, FakeStarts(starts), facts, ("text",), ()
    )
    unsupported = m.sources.unsupported
    defaults = {"default_height": "64", "default_width": "96", "default_num_inference_steps": "4"}
    m.fields = TEXT_TO_IMAGE_FIELDS.configured(
        {**defaults, "height_multiple_of": "8", "width_multiple_of": "8", "max_mask_image_length": "5000"},
        unsupported,
    )
    return m


def png(width: int, height: int, color: tuple[int, int, int] = (200, 40, 90)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def read(m: TextToImageModel, **raw) -> dict:
    return m.parse(0, {"prompt": "p", "seed": 1, **raw}, tracked("r")).values


def test_a_text_only_request_is_unchanged():
    values = read(model())
    assert values["image"] is None and values["mask_image"] is None and values["strength"] is None


def test_source_and_mask_are_resized_to_the_output_size_and_each_start_has_its_strength():
    m = model()
    img2img = read(m, image=png(300, 200))
    assert (
        img2img["image"].size == (96, 64) and img2img["strength"] == 0.8
    )  # the default size, not the source's
    inpaint = read(m, image=png(300, 200), mask_image=png(30, 20, (255, 255, 255)), strength=0.5)
    assert inpaint["mask_image"].size == (96, 64) and inpaint["strength"] == 0.5
    assert read(m, image=png(64, 64), mask_image=png(64, 64))["strength"] == 1.0  # the inpaint default


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"mask_image": png(64, 64)}, "mask_image: applies only to a request with a source image"),
        ({"strength": 0.5}, "strength: applies only to a request with a source image"),
        ({"image": png(64, 64), "mask_image": b"%% not an image"}, "mask_image: is neither an image nor"),
        ({"image": png(64, 64), "mask_image": png(600, 600)}, "mask_image: is 600x600 = 360000 pixels"),
        ({"image": png(64, 64), "mask_image": b"\x89PNG" + b"x" * 6000}, "mask_image: is 6004 bytes"),
        ({"image": png(64, 64), "strength": 1.5}, "strength: got 1.5 (allowed: 0..1)"),
        ({"image": png(64, 64), "strength": 0.1}, "strength: 0.1 with num_inference_steps 4 runs no"),
    ],
)
def test_errors_name_the_field(raw, message):
    with pytest.raises(RequestError) as error:
        read(model(), **raw)
    assert str(error.value.message).startswith(message), error.value.message


def test_starts_the_engine_cannot_serve_are_refused_by_name():
    with pytest.raises(RequestError, match="mask_image: is not supported"):
        read(model(("text", "image")), image=png(64, 64), mask_image=png(64, 64))
    with pytest.raises(RequestError, match="image: is not supported"):
        read(model(("text",)), image=png(64, 64))


def test_an_inpainting_checkpoint_requires_a_source_and_a_mask():
    m = model(("mask",))
    for raw, field in (({}, "image"), ({"image": png(64, 64)}, "mask_image")):
        with pytest.raises(RequestError, match=f"{field}: is required: this model inpaints"):
            read(m, **raw)
    values = read(m, image=png(64, 64), mask_image=png(64, 64))
    assert values["mask_image"].size == (96, 64) and values["strength"] == 1.0


def test_a_model_kind_that_cannot_send_any_start_the_checkpoint_serves_is_refused_at_load():
    from triton_diffusion.models.image_to_image import ImageToImageModel

    m = ImageToImageModel.__new__(ImageToImageModel)  # an inpainting checkpoint on image_to_image
    m.facts = type("Facts", (), {"class_name": "StableDiffusionImg2ImgPipeline"})()
    with pytest.raises(ValueError, match="serves only mask jobs here, which ImageToImageModel cannot serve"):
        SourceImages.at_load(
            "ImageToImageModel", m.FIELDS, ModelConfig(), FakeStarts(("mask",)), m.facts, ("image",), ()
        )


@pytest.mark.parametrize(
    ("adapter_class", "planned"),
    [(StableDiffusionAdapter, 5), (FluxAdapter, 6), (StableDiffusion3Adapter, 6)],
)
def test_an_image_starts_planned_steps_follow_its_familys_own_first_step(adapter_class, planned):
    # 10 steps at strength 0.55: SD's get_timesteps rounds 5.5 down (5 run), FLUX.1's and SD3's subtract it
    # unrounded (6 run). The scheduler's estimates plan with what the job will run.
    m = model()
    starts_class = adapter_class.starts_class  # the family's starter: first_step reads nothing loaded
    m.adapter = SimpleNamespace(starter=starts_class.__new__(starts_class))
    values = {"num_inference_steps": 10, "strength": 0.55, "image": object()}
    assert m.planned_steps(values) == planned
    assert m.planned_steps({**values, "image": None}) == 10  # a text start runs them all

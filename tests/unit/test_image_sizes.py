"""How image-to-image resolves the output size of a source image (before planning: it is in the key)."""

import pytest
from PIL import Image

from triton_diffusion.config_values import parse_sizes
from triton_diffusion.errors import RequestError
from triton_diffusion.models.image_to_image import ImageToImageModel
from triton_diffusion.models.interfaces import IMAGE_TO_IMAGE_FIELDS
from triton_diffusion.models.source_images import SourceImages


def model(buckets="", max_size=512):
    m = ImageToImageModel.__new__(ImageToImageModel)  # only the size logic: no pipeline, no Triton
    m.fields = IMAGE_TO_IMAGE_FIELDS.configured(
        {
            "height_multiple_of": "8",
            "width_multiple_of": "8",
            "max_height": str(max_size),
            "max_width": str(max_size),
        }
    )
    m.sources = SourceImages(buckets=parse_sizes(buckets))
    return m


def size(m, source_width, source_height, **requested):
    source = Image.new("RGB", (source_width, source_height))
    return m.sources.output_size(source, requested.get("width"), requested.get("height"), m.fields)


def test_source_size_is_rounded_down_to_the_multiple():
    assert size(model(), 70, 100) == (64, 96)


def test_large_sources_are_fitted_into_the_limits_keeping_the_aspect_ratio():
    assert size(model(), 1024, 768) == (512, 384)
    assert size(model(), 2000, 500) == (512, 128)


def test_small_sources_are_raised_to_the_minimum():
    assert size(model(), 32, 32) == (64, 64)


def test_a_requested_size_wins_and_one_side_keeps_the_aspect_ratio():
    assert size(model(), 300, 200, width=128, height=256) == (128, 256)
    assert size(model(), 300, 200, width=240) == (240, 160)


def test_buckets_pick_the_nearest_aspect_ratio():
    m = model("512x512,640x448,448x640")
    assert size(m, 1000, 980) == (512, 512)
    assert size(m, 1600, 1100) == (640, 448)
    assert size(m, 300, 500) == (448, 640)


def test_a_source_that_cannot_fit_is_an_invalid_image():
    with pytest.raises(RequestError, match="image: cannot be fitted"):
        size(model(), 10000, 10)

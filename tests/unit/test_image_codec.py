"""Uploaded images (codecs/image.py): a JPEG whose scans would each be decoded over the whole image is
refused by their count before any is decoded; ordinary JPEGs, progressive ones included, decode."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from triton_diffusion.codecs.image import MAX_JPEG_SCANS, decode_image
from triton_diffusion.errors import ErrorCode, RequestError

LIMITS = {"max_bytes": 10 << 20, "max_pixels": 4096 * 4096, "formats": ("PNG", "JPEG", "WEBP")}


def jpeg(progressive: bool) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 90)).save(out, "JPEG", progressive=progressive, quality=90)
    return out.getvalue()


@pytest.mark.parametrize("progressive", [False, True])
def test_ordinary_and_progressive_jpegs_decode(progressive):
    data = jpeg(progressive)
    assert 1 <= data.count(b"\xff\xda") <= MAX_JPEG_SCANS
    assert decode_image(data, "image", **LIMITS).size == (64, 48)


def test_a_jpeg_of_thousands_of_scans_is_refused_before_any_is_decoded():
    # Thousands of empty scans after a real progressive image's: a few kilobytes that would each be
    # decoded over the whole image (minutes at 4096x4096).
    data = jpeg(True)
    empty_scan = b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00"
    bomb = data[:-2] + empty_scan * 5000 + b"\xff\xd9"
    with pytest.raises(RequestError) as refused:
        decode_image(bomb, "image", **LIMITS)
    assert refused.value.code is ErrorCode.INVALID_ARG
    assert (
        refused.value.message
        == f"image: is a JPEG of more than {MAX_JPEG_SCANS} scans (allowed: at most that)"
    )


def test_only_the_images_own_scans_count_not_bytes_in_its_segments_or_after_its_end():
    # An FF DA pair inside an APPn payload (an EXIF thumbnail, an ICC or XMP payload) or after the end of
    # the image (a motion photo's video, a gain map) is no scan: such photos decode.
    data = jpeg(True)
    payload = b"\xff\xda" * 300
    app15 = b"\xff\xef" + (len(payload) + 2).to_bytes(2, "big") + payload
    with_segment = data[:2] + app15 + data[2:]
    appended = data + b"\x00\xff\xda" * 300  # past EOI
    for photo in (with_segment, appended):
        assert photo.count(b"\xff\xda") > MAX_JPEG_SCANS
        assert decode_image(photo, "image", **LIMITS).size == (64, 48)

"""Encoding generated images for the response (applied per request, after the fused call)."""

from __future__ import annotations

import base64
import io

from PIL import Image, ImageOps

IMAGE_FORMATS = ("png", "jpeg", "webp")
OUTPUT_ENCODINGS = ("binary", "base64")  # base64 keeps bytes intact through HTTP generate's JSON


def encode_image(image: Image.Image, image_format: str, encoding: str = "binary") -> bytes:
    buffer = io.BytesIO()
    if image_format == "png":
        image.save(buffer, format="PNG", compress_level=1)  # fast; PNG stays lossless
    elif image_format == "jpeg":
        image.convert("RGB").save(buffer, format="JPEG", quality=90)
    elif image_format == "webp":
        image.save(buffer, format="WEBP", quality=90)
    else:
        raise ValueError(f"unknown image format {image_format!r}")
    data = buffer.getvalue()
    return base64.b64encode(data) if encoding == "base64" else data


# Magic numbers of the accepted formats; anything else is tried as base64 text (HTTP generate's JSON).
_MAGIC = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"RIFF": "WEBP"}
# A progressive JPEG's scans are each decoded over the whole image, and libjpeg limits their number not
# (libjpeg-turbo leaves it to the application): a small file of thousands of empty scans takes minutes to
# decode. Encoders write about ten.
MAX_JPEG_SCANS = 100


def jpeg_scans(data: bytes, most: int = MAX_JPEG_SCANS) -> int:
    """The image's scans (SOS markers), its marker segments walked from SOI to EOI: a segment's payload
    (an EXIF thumbnail, an ICC profile) is skipped by its length, a scan's entropy-coded data to its next
    marker (an FF there is followed by 00, or is a restart marker), and what follows EOI (a motion
    photo's video, a gain map) is not read. Stops counting past ``most``; a malformed stream ends the
    walk (Pillow judges it)."""
    i, end, scans = 2, len(data), 0
    while i + 1 < end and scans <= most:
        if data[i] != 0xFF:
            break
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
        elif marker == 0xD9:  # EOI
            break
        elif 0xD0 <= marker <= 0xD7 or marker == 0x01:  # RSTn, TEM: no length
            i += 2
        else:
            i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
            if marker != 0xDA:
                continue
            scans += 1
            while (
                (j := data.find(b"\xff", i)) != -1
                and j + 1 < end
                and (data[j + 1] == 0x00 or 0xD0 <= data[j + 1] <= 0xD7)
            ):
                i = j + 2
            i = end if j == -1 else j
    return scans


def _from_base64(data: bytes) -> bytes | None:
    """Standard or URL-safe base64, with or without a ``data:image/...;base64,`` prefix, line breaks
    (MIME, the ``base64`` tool's default) or missing padding. None when it is not base64."""
    if data[:5].lower() == b"data:":
        header, comma, data = data.partition(b",")
        if not comma or not header.lower().endswith(b";base64"):
            return None
    text = data.translate(None, b" \t\r\n")
    if b"-" in text or b"_" in text:
        text = text.replace(b"-", b"+").replace(b"_", b"/")
    text += b"=" * (-len(text) % 4)
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        return None


def decode_image(
    data: bytes, field: str, max_bytes: int, max_pixels: int, formats: tuple[str, ...]
) -> Image.Image:
    """Decode an uploaded image safely, or raise INVALID_ARG naming the field and the problem.

    Only the allowed formats' Pillow plugins ever parse the bytes, the size is checked from the header
    before any pixel is decoded (a decompression bomb never allocates), truncated or corrupt data is
    refused, and the EXIF orientation is applied (a phone photo comes out upright).
    """
    from triton_diffusion.errors import invalid_field

    allowed = ", ".join(formats)
    if not data:
        raise invalid_field(field, f"is empty (expected an encoded {allowed} image)")
    if len(data) > max_bytes:
        raise invalid_field(field, f"is {len(data)} bytes (allowed: at most {max_bytes} bytes)")
    if not any(data.startswith(magic) for magic in _MAGIC):
        decoded = _from_base64(data)
        if decoded is None:
            raise invalid_field(field, f"is neither an image nor base64 text (allowed formats: {allowed})")
        data = decoded
    sniffed = next((name for magic, name in _MAGIC.items() if data.startswith(magic)), None)
    if sniffed is not None and sniffed not in formats:
        raise invalid_field(field, f"format {sniffed} is not allowed (allowed: {allowed})")
    if sniffed == "JPEG" and jpeg_scans(data) > MAX_JPEG_SCANS:
        raise invalid_field(field, f"is a JPEG of more than {MAX_JPEG_SCANS} scans (allowed: at most that)")
    try:
        image: Image.Image = Image.open(io.BytesIO(data), formats=formats)
    except Image.DecompressionBombError:  # Pillow's own guard, for sizes far above any sane limit
        raise invalid_field(field, f"is too large to decode (allowed: at most {max_pixels} pixels)") from None
    except (OSError, ValueError, SyntaxError):
        # Pillow's message names a BytesIO object and its memory address: say what is wrong instead.
        raise invalid_field(field, f"is not a readable {allowed} image") from None
    width, height = image.size
    if width * height > max_pixels:
        raise invalid_field(
            field, f"is {width}x{height} = {width * height} pixels (allowed: at most {max_pixels} pixels)"
        )
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError) as exc:
        raise invalid_field(field, f"is corrupt or truncated ({type(exc).__name__})") from None
    return image.convert("RGB")

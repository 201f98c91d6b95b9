"""Image-to-image on the real server: batch invariance, sources of different sizes never sharing a forward,
bad images. The model loads the img2img pipeline of tiny SD, which the step engine serves."""

import base64
import io
import json
import re
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from PIL import Image

from .test_reliability import send_raw
from .test_text_to_image import http_generate as http_generate_on
from .test_text_to_image import max_diff

MODEL = "image_to_image"


def png(width, height, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format="PNG")
    return buffer.getvalue()


def run_concurrently(function, items):
    """function(item) for every item at once (so Triton can batch them); results in order."""
    results = [None] * len(items)

    def run(index, item):
        results[index] = function(item)

    threads = [threading.Thread(target=run, args=(i, item)) for i, item in enumerate(items)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


def generate(server, requests):
    """requests: dicts with prompt, image (bytes) and other fields; returns (ok, error, outputs) each."""

    def one(request):
        fields = dict(request)
        prompt, image = fields.pop("prompt").encode(), fields.pop("image")
        client = grpcclient.InferenceServerClient(server.grpc_url)
        results = []
        client.start_stream(callback=lambda result, error: results.append((result, error)))
        inputs = []
        for name, value in (("PROMPT", prompt), ("IMAGE", image)):
            tensor = grpcclient.InferInput(name, [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[value]], dtype=object))
            inputs.append(tensor)
        client.async_stream_infer(MODEL, inputs, parameters=fields)
        client.stop_stream()  # returns once the stream is done: the final response has arrived
        client.close()
        result, error = results[-1]
        if error is not None:
            return False, str(error), None
        batch = json.loads(result.as_numpy("BATCH").reshape(-1)[0])
        return True, None, {"image": bytes(result.as_numpy("IMAGE").reshape(-1)[0]), "batch": batch}

    return run_concurrently(one, requests)


def test_batch_invariance(server):
    target = {"prompt": "make it a painting", "image": png(64, 64, seed=1), "seed": 5, "strength": 0.7}
    (alone,) = generate(server, [target])
    others = [
        {"prompt": f"other {i}", "image": png(64, 64, seed=10 + i), "seed": 20 + i, "strength": 0.7}
        for i in range(5)
    ]
    batch = generate(server, [*others[:2], target, *others[2:]])
    assert all(ok for ok, _, _ in batch), [e for _, e, _ in batch]
    assert alone[2]["batch"]["engine"] == "step" and alone[2]["batch"]["most_rows_shared"] == 1
    assert batch[2][2]["batch"]["most_rows_shared"] > 1
    assert max_diff(alone[2]["image"], batch[2][2]["image"]) <= 1


def test_two_source_sizes_never_share_a_forward_and_both_succeed(server):
    requests = [
        {"prompt": f"size test {i}", "image": png(64 if i % 2 else 96, 64, seed=i), "seed": i}
        for i in range(6)
    ]
    outcomes = generate(server, requests)
    assert all(ok for ok, _, _ in outcomes), [e for _, e, _ in outcomes]
    for request, (_, _, out) in zip(requests, outcomes, strict=True):
        decoded = Image.open(io.BytesIO(out["image"]))
        width = 64 if requests.index(request) % 2 else 96
        assert decoded.size == (width, 64)  # the output keeps the (rounded) source size
        assert out["batch"]["key"]["width"] == width
        # One latent shape per forward: at most the 3 sources of its own size.
        assert 1 <= out["batch"]["most_rows_shared"] <= 3


def test_sizes_are_rounded_to_the_multiple_and_fitted_into_the_limits(server):
    outcomes = generate(
        server,
        [
            {"prompt": "odd size", "image": png(70, 100, seed=3), "seed": 1},
            {"prompt": "too big", "image": png(1024, 768, seed=4), "seed": 1},
        ],
    )
    sizes = [Image.open(io.BytesIO(out["image"])).size for ok, _, out in outcomes]
    assert sizes == [(64, 96), (512, 384)]


def flat_png(width, height):
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 200)).save(buffer, format="PNG")  # a few kilobytes
    return buffer.getvalue()


def bomb_png():
    buffer = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buffer, format="PNG")  # 400 megapixels in a few kilobytes
    return buffer.getvalue()


def test_bad_images_fail_alone_with_a_clear_error(server):
    good = png(64, 64, seed=9)
    cases = {
        "corrupt": (b"\x89PNG\r\n\x1a\n" + b"\x00garbage" * 20, "is not a readable PNG, JPEG, WEBP image"),
        "truncated": (good[: len(good) // 2], "corrupt or truncated"),
        "zero-byte": (b"", "is empty"),
        "decompression-bomb": (bomb_png(), "(allowed: at most 16777216 pixels)"),
        "over-the-pixel-limit": (
            flat_png(4100, 4100),
            "= 16810000 pixels (allowed: at most 16777216 pixels)",
        ),
        "not-an-image": (b"hello world, not an image", "is neither an image nor base64 text"),
        "gif": (_gif(), "allowed formats: PNG, JPEG, WEBP"),
    }
    requests = [{"prompt": name, "image": data, "seed": 1} for name, (data, _) in cases.items()]
    requests += [{"prompt": "valid", "image": good, "seed": i} for i in range(2)]
    outcomes = generate(server, requests)
    for (name, (_, words)), (ok, error, _) in zip(cases.items(), outcomes, strict=False):
        assert not ok and error.startswith("image: ") and words in error, (name, error)
        assert not re.search(r"0x[0-9a-f]{6,}", error) and "BytesIO" not in error, (name, error)
    assert [ok for ok, _, _ in outcomes[len(cases) :]] == [True, True]
    assert send_raw(server.grpc_url, "text_to_image", b"still up")[0]


def _gif():
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="GIF")
    return buffer.getvalue()


def test_http_generate_accepts_a_base64_image(server):
    body = {
        "PROMPT": "over http",
        "IMAGE": base64.b64encode(png(64, 64, seed=2)).decode(),
        "parameters": {"seed": 3, "output_encoding": "base64"},
    }
    request = urllib.request.Request(
        f"{server.http_url}/v2/models/{MODEL}/generate", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        image = base64.b64decode(json.loads(response.read())["IMAGE"])
    assert Image.open(io.BytesIO(image)).size == (64, 64)


def http_generate(server, body):
    return http_generate_on(server, MODEL, body)


def test_base64_variants_and_image_as_a_parameter_give_the_same_image(server):
    source = png(64, 64, seed=6)
    plain = base64.b64encode(source).decode()
    variants = {
        "mime-line-breaks": "\n".join(plain[i : i + 76] for i in range(0, len(plain), 76)) + "\n",
        "data-url": "data:image/png;base64," + plain,
        "url-safe-unpadded": base64.urlsafe_b64encode(source).decode().rstrip("="),
    }
    images = {}
    for name, text in variants.items():
        parameters = {"seed": 4, "output_encoding": "base64"}
        status, body = http_generate(server, {"PROMPT": "variants", "IMAGE": text, "parameters": parameters})
        assert status == 200, (name, body)
        images[name] = base64.b64decode(body["IMAGE"])
    # The image as a request parameter (base64 text), as the docs say every field can be sent.
    status, body = http_generate(
        server, {"PROMPT": "variants", "parameters": {"image": plain, "seed": 4, "output_encoding": "base64"}}
    )
    assert status == 200, body
    images["parameter"] = base64.b64decode(body["IMAGE"])
    (raw,) = generate(server, [{"prompt": "variants", "image": source, "seed": 4}])
    for name, image in images.items():
        assert max_diff(image, raw[2]["image"]) == 0, name


def test_exif_orientation_is_applied(server):
    # A 96x64 photo whose EXIF says "rotate 90": the upright picture is 64 wide and 96 high.
    buffer = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(
        buffer, format="JPEG", exif=exif
    )
    (outcome,) = generate(server, [{"prompt": "upright", "image": buffer.getvalue(), "seed": 1}])
    assert outcome[0], outcome[1]
    assert Image.open(io.BytesIO(outcome[2]["image"])).size == (64, 96)


@pytest.mark.parametrize("strength, steps", [(0.0, 4), (0.1, 4), (0.5, 1)])
def test_a_strength_that_runs_no_step_is_refused_naming_strength(server, strength, steps):
    outcomes = generate(
        server,
        [
            {"prompt": "weak", "image": png(64, 64), "strength": strength, "num_inference_steps": steps},
            {"prompt": "fine", "image": png(64, 64), "seed": 2},
        ],
    )
    (ok, error, _), (fine, _, _) = outcomes
    assert not ok and error is not None and "strength: " in error and "runs no denoising step" in error, error
    assert fine
    # An invalid argument, not an internal failure: HTTP says 400.
    body = {"PROMPT": "weak", "IMAGE": base64.b64encode(png(64, 64)).decode()}
    body["parameters"] = {"strength": strength, "num_inference_steps": steps}
    status, answer = http_generate(server, body)
    assert status == 400 and answer["error"].startswith("strength: "), answer

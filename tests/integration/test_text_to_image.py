"""Text-to-image on a real tritonserver with the tiny models, over gRPC streaming and HTTP generate.

Every test runs on both families (UNet/CLIP tiny SD and flow-matching tiny Flux) through the same code.
"""

import base64
import io
import json
import urllib.error
import urllib.request
from collections import defaultdict

import numpy as np
import pytest
from PIL import Image
from triton_diffusion_client import generate_many

# Flux turns true CFG on for the whole call when any row has a negative prompt; > 1 makes it matter.
FAMILY_FIELDS = {"text_to_image": {}, "text_to_image_flux": {"true_cfg_scale": 2.0}}
OTHER_PROMPTS = [
    "a lighthouse at dusk",
    "two green apples",
    "a city in fog",
    "an old red tram",
    "waves on rocks",
    "a paper crane",
    "snow on pines",
]


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def max_diff(a: bytes, b: bytes) -> int:
    return int(np.abs(pixels(a) - pixels(b)).max())


def send(server, family, requests):
    results = generate_many(requests, url=server.grpc_url, model=family, timeout_s=120)
    return results


def calls_of(result):
    return [c["id"] for c in result.batch["fused_calls"]]


def test_concurrent_requests_are_fused_by_key_only(server, family):
    sizes = [(64, 64), (128, 64)] * 4
    requests = [
        {"prompt": f"prompt {i}", "seed": i, "height": h, "width": w} for i, (h, w) in enumerate(sizes)
    ]
    results = send(server, family, requests)
    assert all(r.ok for r in results), [r.error for r in results]

    members = defaultdict(list)
    for request, result in zip(requests, results, strict=True):
        assert pixels(result.images[0]).shape == (request["height"], request["width"], 3)
        assert result.batch["key"]["height"] == request["height"]
        for call_id in calls_of(result):
            members[call_id].append(result)
    for call_id, in_call in members.items():
        keys = {json.dumps(r.batch["key"], sort_keys=True) for r in in_call}
        assert len(keys) == 1, f"fused call {call_id} mixed keys: {keys}"
        reported_rows = {c["rows"] for r in in_call for c in r.batch["fused_calls"] if c["id"] == call_id}
        assert reported_rows == {len(in_call)}
    assert max(len(m) for m in members.values()) > 1, "nothing was fused"
    assert len(members) >= 2  # two resolutions can never share a call


def test_batch_invariance(server, family):
    extra = FAMILY_FIELDS[family]
    target = {"prompt": "a red cat on a sofa", "seed": 1234, **extra}
    alone = send(server, family, [target])[0]
    others = [{"prompt": p, "seed": 10 + i, **extra} for i, p in enumerate(OTHER_PROMPTS)]
    batch = send(server, family, others[:3] + [target] + others[3:])
    assert all(r.ok for r in batch), [r.error for r in batch]
    among = batch[3]
    assert alone.batch["fused_calls"][0]["rows"] == 1
    assert among.batch["fused_calls"][0]["rows"] > 1, "the target was not fused with others"
    assert max_diff(alone.images[0], among.images[0]) <= 1


def test_invariance_with_and_without_negative_prompt(server, family):
    extra = FAMILY_FIELDS[family]
    with_negative = {"prompt": "a castle", "negative_prompt": "blurry, dark", "seed": 5, **extra}
    without_negative = {"prompt": "a castle", "seed": 6, **extra}
    alone = [send(server, family, [r])[0] for r in (with_negative, without_negative)]
    mates = [
        {"prompt": p, "seed": 40 + i, **extra, **({"negative_prompt": "noise"} if i % 2 else {})}
        for i, p in enumerate(OTHER_PROMPTS[:6])
    ]
    batch = send(server, family, [with_negative, *mates[:3], without_negative, *mates[3:]])
    assert all(r.ok for r in batch), [r.error for r in batch]
    for solo, among in zip(alone, (batch[0], batch[4]), strict=True):
        assert among.batch["fused_calls"][0]["rows"] > 1
        assert max_diff(solo.images[0], among.images[0]) <= 1
    if "has_negative_prompt" in batch[0].batch["key"]:
        # Structural switch (Flux true CFG): rows with and without a negative prompt never share a call.
        assert set(calls_of(batch[0])).isdisjoint(calls_of(batch[4]))


def test_same_seed_same_image_and_different_seeds_differ(server, family):
    a, b, c, d = send(
        server,
        family,
        [
            {"prompt": "a blue bird", "seed": 77},
            {"prompt": "a blue bird", "seed": 77},
            {"prompt": "a blue bird", "seed": 78},
            {"prompt": "a blue bird"},
        ],
    )
    assert a.seeds == b.seeds == [77] and c.seeds == [78]
    assert max_diff(a.images[0], b.images[0]) <= 1  # same seed, other batch position: rounding only
    assert max_diff(a.images[0], c.images[0]) > 10
    # A request without a seed gets one drawn for it, and that seed reproduces its image.
    (again,) = send(server, family, [{"prompt": "a blue bird", "seed": d.seeds[0]}])
    assert max_diff(d.images[0], again.images[0]) <= 1


def test_images_per_prompt_use_consecutive_seeds(server, family):
    several, single = send(
        server,
        family,
        [
            {"prompt": "a kite", "seed": 900, "num_images_per_prompt": 3},
            {"prompt": "a kite", "seed": 901},
        ],
    )
    assert several.seeds == [900, 901, 902] and len(several.images) == 3
    assert max_diff(several.images[1], single.images[0]) <= 1


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"height": 100000}, "height"),
        ({"prompt": ""}, "prompt"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"guidance_scale": -1.0}, "guidance_scale"),
        ({"stepz": 3}, "stepz"),
    ],
)
def test_an_invalid_request_fails_alone_with_a_clear_error(server, family, bad, field):
    requests = [{"prompt": f"valid {i}", "seed": i} for i in range(4)]
    requests.insert(2, {"prompt": "bad one", "seed": 9, **bad})
    results = send(server, family, requests)
    assert results[2].error is not None and f"{field}: " in results[2].error
    assert "allowed" in results[2].error or "did you mean" in results[2].error
    assert [r.ok for i, r in enumerate(results) if i != 2] == [True] * 4
    assert max(c["rows"] for c in results[0].batch["fused_calls"]) > 1


def test_a_failing_pipeline_call_fails_only_its_request(server):
    requests = [{"prompt": f"fine {i}", "seed": i} for i in range(3)]
    requests.insert(1, {"prompt": "this one will __explode__", "seed": 3})
    results = send(server, "text_to_image_faults", requests)
    assert results[1].error is not None and "injected failure" in results[1].error
    assert all(r.ok for i, r in enumerate(results) if i != 1), [r.error for r in results]
    # A later request is served normally: the model stayed up.
    assert send(server, "text_to_image_faults", [{"prompt": "after", "seed": 1}])[0].ok


def test_out_of_memory_splits_the_call_and_every_request_succeeds(server):
    results = send(server, "text_to_image_faults", [{"prompt": f"oom {i}", "seed": i} for i in range(6)])
    assert all(r.ok for r in results), [r.error for r in results]
    served_rows = {c["rows"] for r in results for c in r.batch["fused_calls"]}
    assert max(served_rows) <= 3  # the simulated limit: the 6-row call was halved
    reference = send(server, "text_to_image", [{"prompt": "oom 4", "seed": 4}])[0]
    assert max_diff(results[4].images[0], reference.images[0]) <= 1


def http_generate(server, model, body):
    request = urllib.request.Request(
        f"{server.http_url}/v2/models/{model}/generate", data=json.dumps(body).encode(), method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_http_generate_returns_the_same_image_as_grpc(server, family):
    status, body = http_generate(
        server,
        family,
        {
            "PROMPT": "a yellow boat",
            "parameters": {"seed": 31, "output_encoding": "base64"},
        },
    )
    assert status == 200, body
    png = base64.b64decode(body["IMAGE"])
    assert png.startswith(b"\x89PNG") and body["SEED"] == 31
    (grpc_result,) = send(server, family, [{"prompt": "a yellow boat", "seed": 31}])
    assert max_diff(png, grpc_result.images[0]) == 0

    status, body = http_generate(server, family, {"PROMPT": "a yellow boat", "parameters": {"width": 100}})
    assert status == 400 and body["error"].startswith("width: got 100 (allowed: 64..512, multiple of")

"""Per-request LoRA adapters on the real server (tiny SD with two tiny adapters, conftest's sd_lora models).

Concurrent requests with different adapters, scales or none: on the step engine they share forwards, on
the request-level engine the adapters split fused calls; every image equals diffusers' own
``load_lora_weights`` + ``set_adapters`` + ``pipe(...)`` computed here (<= 1 uint8). Bad values are refused
per request, naming the field, while the others succeed.
"""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch
from triton_diffusion_client import generate_many

from triton_diffusion.adapters.lora import LoraLimits, lora_text, parse_lora
from triton_diffusion.serving.server_process import WEIGHTS, read_metrics

from .conftest import LORA_WEIGHTS
from .test_text_to_image import pixels

_REFERENCE: list = []
LIMITS = LoraLimits(tuple(LORA_WEIGHTS), 2.0, 4)


def reference(request: dict) -> np.ndarray:
    if not _REFERENCE:
        pipe = diffusers.DiffusionPipeline.from_pretrained(WEIGHTS / "tiny-sd", use_safetensors=True)
        pipe.set_progress_bar_config(disable=True)
        for name, folder in LORA_WEIGHTS.items():
            pipe.load_lora_weights(str(WEIGHTS / folder), adapter_name=name)
        _REFERENCE.append(pipe)
    pipe = _REFERENCE[0]
    adapters = parse_lora(request.get("lora"), LIMITS)
    if adapters:
        pipe.enable_lora()
        pipe.set_adapters([name for name, _ in adapters], adapter_weights=[scale for _, scale in adapters])
    else:
        pipe.disable_lora()
    image = pipe(
        prompt=[request["prompt"]],
        height=64,
        width=64,
        num_inference_steps=request["num_inference_steps"],
        generator=[torch.Generator().manual_seed(request["seed"])],
    ).images[0]
    return np.asarray(image, dtype=np.int16)


MIXED = [None, "ink", "ink:0.5,neon:1.3", "neon:-0.8", "ink"]


@pytest.mark.parametrize("model", ["sd_lora", "sd_lora_request"])
def test_requests_with_different_adapters_are_each_exact(server, model):
    before = read_metrics(server)
    # On sd_lora, each waits before its second forward until the engine holds all five (tests/faults.py):
    # they share forwards whatever the machine's speed. (Only text to the reference and the request engine.)
    requests = [
        {"prompt": "a red house __hold__1of5", "seed": 5, "num_inference_steps": 3 if i < 4 else 2}
        for i in range(len(MIXED))
    ]
    for request, lora in zip(requests, MIXED, strict=True):
        if lora is not None:
            request["lora"] = lora
    results = generate_many(requests, url=server.grpc_url, model=model)
    assert all(r.ok for r in results), [r.error for r in results]
    images = [pixels(r.images[0]) for r in results]
    assert np.abs(images[0] - images[1]).max() > 20, "the adapter does not visibly change the image"
    for request, result, image in zip(requests, results, images, strict=True):
        assert np.abs(image - reference(request)).max() <= 1, request
        if "lora" in request:  # BATCH names the adapters and their exact scales
            assert result.batch["key"]["lora"] == lora_text(parse_lora(request["lora"], LIMITS))
    after = read_metrics(server)
    if model == "sd_lora":  # rows with different adapters shared forwards, and the metric saw them
        assert max(r.batch["most_rows_shared"] for r in results) >= 4
        key = f'triton_diffusion_forward_adapters_sum{{model="{model}"}}'
        assert after.get(key, 0) - before.get(key, 0) >= 2
    else:  # the adapters are part of the key: one adapter set per fused call
        adapters_of_call: dict[int, set] = {}
        for result in results:
            for call in result.batch["fused_calls"]:
                adapters_of_call.setdefault(call["id"], set()).add(result.batch["key"].get("lora"))
        assert all(len(adapters) == 1 for adapters in adapters_of_call.values())
        assert len(adapters_of_call) == len({(r.get("lora"), r["num_inference_steps"]) for r in requests})


def test_bad_adapters_are_refused_per_request_and_the_others_succeed(server):
    requests = [
        {"prompt": "fine", "seed": 1, "num_inference_steps": 2, "lora": "ink"},
        {"prompt": "bad", "seed": 1, "num_inference_steps": 2, "lora": "pixel-art"},
        {"prompt": "bad", "seed": 1, "num_inference_steps": 2, "lora": "ink:9"},
        {"prompt": "fine", "seed": 2, "num_inference_steps": 2},
    ]
    results = generate_many(requests, url=server.grpc_url, model="sd_lora")
    assert results[0].ok and results[3].ok, [r.error for r in results]
    assert "lora" in results[1].error and "allowed names: ink, neon" in results[1].error
    assert "lora" in results[2].error and "-2..2" in results[2].error
    # A model without adapters refuses the field by name.
    (plain,) = generate_many([{**requests[0]}], url=server.grpc_url, model="sd_step")
    assert plain.error is not None and "lora" in plain.error

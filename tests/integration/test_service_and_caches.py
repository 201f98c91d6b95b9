"""Step caches, the result cache, service tiers and deadlines through the real server.

- ``flux_cached`` (tiny FLUX.1 on the step engine, ``result_cache_mb`` 16): a request's ``step_cache``
  gives the image diffusers' own cache gives it alone, amid uncached rows; BATCH and Prometheus count
  the rows reused; one allowed a ``degrade_step_cache`` with room runs without it (the uncached image); a
  bad value of either field is refused by name; a repeated seeded request is answered from memory with
  the same bytes.
- ``flux_cached`` and ``flux_img2img_request`` (image_to_image over the same weights on the request-level
  engine): one img2img request with true CFG and a step cache gives one image on both engines, the one
  FluxImg2ImgPipeline gives under diffusers' cache with a state per CFG branch.

Each cached reference differs from the uncached image by more than 5 uint8 levels, and its transformer's
blocks computed fewer rows than uncached (counted by forward hooks, in this process: the server's own
transformer is out of reach, so what it computed shows in its image equalling the cached reference).
- ``sd_tiers`` (tiny SD, one running job, a stalled step): a ``priority`` request pauses a running
  ``flex`` one, which resumes and still equals its image alone; a bad tier is refused by name; a deadline
  (tritonclient's ``timeout=`` over gRPC, the ``timeout`` parameter over HTTP) that cannot be met is
  refused at once, one that passes while running ends the request.
"""

from __future__ import annotations

import io
import json
import threading
import time

import diffusers
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig
from PIL import Image
from triton_diffusion_client import generate_many, generate_one

from tests.unit.test_step_caches import ComputedRows
from triton_diffusion.serving.server_process import read_metrics

from .test_step_engine import _PIPES, reference
from .test_text_to_image import http_generate, pixels

pytestmark = pytest.mark.integration


def cache_config(text: str):
    method, _, rest = text.partition(":")
    if method == "fbc":
        return FirstBlockCacheConfig(threshold=float(rest))
    interval, _, warmup = rest.partition(":")
    return TaylorSeerCacheConfig(cache_interval=int(interval), disable_cache_before_step=int(warmup or 3))


def flux_pipe():
    if "tiny-flux" not in _PIPES:
        reference("tiny-flux", {"prompt": "load", "seed": 0, "num_inference_steps": 1})
    return _PIPES["tiny-flux"][0]


def cached_reference(request: dict) -> tuple[np.ndarray, int]:
    """FluxPipeline's image with diffusers' own cache (``transformer.enable_cache``) for this request, and
    the rows its transformer's blocks computed (FluxPipeline names its calls' cache contexts itself)."""
    pipe = flux_pipe()
    with ComputedRows(pipe.transformer) as rows:
        if not request.get("step_cache"):
            return reference("tiny-flux", request), rows.rows
        pipe.transformer.enable_cache(cache_config(request["step_cache"]))
        try:
            image = reference("tiny-flux", request)
        finally:
            pipe.transformer.disable_cache()
    return image, rows.rows


def uncached(request: dict) -> dict:
    return {k: v for k, v in request.items() if k != "step_cache"}


def test_step_caches_per_request_equal_diffusers_amid_uncached_rows(server):
    before = read_metrics(server)
    requests = [
        {"prompt": "a lighthouse", "seed": 5, "num_inference_steps": 8, "step_cache": "fbc:1.0"},
        {"prompt": "a harbour", "seed": 6, "num_inference_steps": 8, "step_cache": "taylorseer:2:1"},
        {"prompt": "a boat", "seed": 7, "num_inference_steps": 6},
    ]
    # The plain one may be given a step cache where its deadline needs it; with room it runs without.
    degradable = {"degrade_step_cache": "fbc:0.9", "timeout": 60_000_000}
    results = generate_many(
        [*requests[:2], {**requests[2], **degradable}], url=server.grpc_url, model="flux_cached"
    )
    assert all(r.ok for r in results), [r.error for r in results]
    for request, result in zip(requests[:2], results[:2], strict=True):
        cache = result.batch["step_cache"]
        assert cache["cache"].startswith(request["step_cache"].split(":")[0]) and cache["rows_reused"] > 0
        expected, rows = cached_reference(request)
        plain, plain_rows = cached_reference(uncached(request))
        assert np.abs(expected - plain).max() > 5 and rows < plain_rows, "the cache changed nothing"
        assert np.abs(pixels(result.images[0]) - expected).max() <= 1
    assert "step_cache" not in results[2].batch and "degraded" not in results[2].batch, results[2].batch
    plain = reference("tiny-flux", requests[2])
    assert np.abs(pixels(results[2].images[0]) - plain).max() <= 1
    # That cache, had it run from the first step, is visibly another image: the check above can fail.
    cached, _ = cached_reference({**requests[2], "step_cache": degradable["degrade_step_cache"]})
    assert np.abs(cached - plain).max() > 5
    after = read_metrics(server)
    reused = 'triton_diffusion_cache_rows_total{method="fbc",model="flux_cached",outcome="reused"}'
    assert after.get(reused, 0) - before.get(reused, 0) >= results[0].batch["step_cache"]["rows_reused"]


def source_png() -> bytes:
    """A 64x64 source with shapes and noise, as PNG."""
    y, x = np.indices((64, 64))
    pixels = np.stack([x * 4, y * 4, ((x // 16 + y // 16) % 2) * 200], axis=-1)
    pixels = pixels + np.random.default_rng(3).integers(0, 40, pixels.shape)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def img2img_reference(request: dict) -> tuple[np.ndarray, int]:
    """FluxImg2ImgPipeline's image for this request over the tiny-flux weights (max_sequence_length 64, as
    both models' configs set it), and the rows its transformer's blocks computed. With a step cache:
    diffusers' own (``transformer.enable_cache``), each denoiser call under its CFG branch's context (the
    pipeline sets none): "uncond" for the call with the negative prompt's pooled embeddings, else "cond"."""
    pipe = diffusers.FluxImg2ImgPipeline.from_pipe(flux_pipe())
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = _PIPES["tiny-flux"][1]
    kwargs = {
        "prompt": [request["prompt"]],
        "negative_prompt": [request["negative_prompt"]],
        "true_cfg_scale": request["true_cfg_scale"],
        "guidance_scale": request["guidance_scale"],
        "image": Image.open(io.BytesIO(request["image"])).convert("RGB"),
        "strength": request["strength"],
        "height": 64,
        "width": 64,
        "num_inference_steps": request["num_inference_steps"],
        "generator": [torch.Generator().manual_seed(request["seed"])],
        "max_sequence_length": 64,
    }
    transformer = pipe.transformer
    with ComputedRows(transformer) as rows:
        if not request.get("step_cache"):
            return np.asarray(pipe(**kwargs).images[0], dtype=np.int16), rows.rows
        _, negative, _ = pipe.encode_prompt(
            prompt=kwargs["negative_prompt"], prompt_2=None, max_sequence_length=64
        )
        forward = transformer.forward

        def named(*args, **call):
            uncond = torch.equal(call["pooled_projections"], negative)
            with transformer.cache_context("uncond" if uncond else "cond"):
                return forward(*args, **call)

        transformer.enable_cache(cache_config(request["step_cache"]))
        transformer.forward = named
        try:
            image = pipe(**kwargs).images[0]
        finally:
            del transformer.forward
            transformer.disable_cache()
    return np.asarray(image, dtype=np.int16), rows.rows


@pytest.mark.parametrize("cache", ["fbc:1.0", "taylorseer:2:1"])
def test_img2img_with_true_cfg_and_a_step_cache_is_one_image_on_both_engines(server, cache):
    # text_to_image on the step engine (per-row caches) and image_to_image on the request-level engine
    # (diffusers' cache on a call of its own): the same request, the same weights, one image.
    request = {
        "prompt": "a harbour at night",
        "seed": 21,
        "num_inference_steps": 8,
        "image": source_png(),
        "strength": 0.9,
        "negative_prompt": "blurry",
        "true_cfg_scale": 4.0,
        "guidance_scale": 3.5,  # sent: the models' defaults differ (FluxPipeline's 3.5, FluxImg2Img's 7.0)
        "step_cache": cache,
    }
    (step,) = generate_many([request], url=server.grpc_url, model="flux_cached")
    (call,) = generate_many([request], url=server.grpc_url, model="flux_img2img_request")
    assert step.ok and call.ok, (step.error, call.error)
    assert step.batch["engine"] == "step" and step.batch["step_cache"]["rows_reused"] > 0, step.batch
    assert call.batch["step_cache"] == {"cache": cache, "own_calls": True}, call.batch
    expected, rows = img2img_reference(request)
    plain, plain_rows = img2img_reference(uncached(request))
    assert np.abs(expected - plain).max() > 5 and rows < plain_rows, "the cache changed nothing"
    step_image, call_image = pixels(step.images[0]), pixels(call.images[0])
    assert np.abs(step_image - expected).max() <= 1, np.abs(step_image - expected).max()
    assert np.abs(call_image - expected).max() <= 1, np.abs(call_image - expected).max()
    assert np.abs(step_image - call_image).max() <= 1, "the two engines differ"


def test_a_bad_step_cache_is_refused_by_name_and_its_neighbours_succeed(server):
    requests = [
        {"prompt": "fine", "seed": 1, "num_inference_steps": 2},
        {"prompt": "bad", "seed": 2, "step_cache": "fbc:7"},
        {"prompt": "fine too", "seed": 3, "num_inference_steps": 2, "step_cache": "fbc:0.1"},
        {"prompt": "two caches", "seed": 4, "step_cache": "fbc:0.1", "degrade_step_cache": "fbc:0.2"},
    ]
    results = generate_many(requests, url=server.grpc_url, model="flux_cached")
    assert results[0].ok and results[2].ok, [r.error for r in results]
    assert results[1].error.startswith("step_cache: threshold 7 is outside 0 < threshold <= 1")
    assert results[3].error.startswith("degrade_step_cache: the request runs step_cache fbc:0.1 already")
    # A UNet family has no step cache: refused by name, saying what is allowed.
    unets = [{"prompt": "x", "step_cache": "fbc:0.1"}, {"prompt": "y", "degrade_step_cache": "fbc:0.1"}]
    unet, degrade = generate_many(unets, url=server.grpc_url, model="sd_step")
    assert (
        unet.error.startswith("step_cache: fbc is not served by this model") and "allowed: none" in unet.error
    )
    assert degrade.error.startswith("degrade_step_cache: fbc is not served by this model"), degrade.error


def test_a_repeated_seeded_request_is_answered_from_memory_with_the_same_bytes(server):
    request = {"prompt": "a red kite", "seed": 77, "num_inference_steps": 3}
    first = generate_one(request, "first", server.grpc_url, "flux_cached")
    before = read_metrics(server)
    again = generate_one({**request, "progress": False}, "again", server.grpc_url, "flux_cached")
    assert first.ok and again.ok and again.images == first.images and again.seeds == first.seeds
    assert again.batch["result_cache"] == "hit" and "result_cache" not in first.batch
    hits = 'triton_diffusion_result_cache_hits_total{model="flux_cached"}'
    assert read_metrics(server).get(hits, 0) - before.get(hits, 0) == 1
    unseeded = [
        generate_one({"prompt": "a red kite"}, f"u{i}", server.grpc_url, "flux_cached") for i in range(2)
    ]
    assert all("result_cache" not in r.batch for r in unseeded)  # a drawn seed never hits


def test_a_priority_request_pauses_a_flex_one_which_resumes_unchanged(server):
    # Held after its second step until the engine holds the urgent one too (tests/faults.py), so the urgent
    # one comes while flex runs, whatever the machine's speed.
    flex = {
        "prompt": "a long flex job __hold__2",
        "seed": 11,
        "num_inference_steps": 12,
        "service_tier": "flex",
    }
    urgent = {"prompt": "urgent", "seed": 12, "num_inference_steps": 2, "service_tier": "priority"}
    results: dict = {}
    running = threading.Event()

    def run_flex() -> None:
        def on_progress(progress):
            if progress.step == 2:
                running.set()

        results["flex"] = generate_one(flex, "flex", server.grpc_url, "sd_tiers", on_progress=on_progress)
        results["flex_done"] = time.monotonic()

    thread = threading.Thread(target=run_flex)
    thread.start()
    assert running.wait(60)
    results["urgent"] = generate_one(urgent, "urgent", server.grpc_url, "sd_tiers")
    urgent_done = time.monotonic()
    thread.join(120)
    assert results["flex"].ok and results["urgent"].ok, (results["flex"].error, results["urgent"].error)
    assert urgent_done < results["flex_done"]  # the one running slot went to the higher tier
    service = results["flex"].batch["service"]
    assert service["tier"] == "flex" and service["paused_times"] >= 1 and service["paused_s"] > 0
    assert results["urgent"].batch["service"]["tier"] == "priority"
    alone = {k: v for k, v in flex.items() if k != "service_tier"}
    assert np.abs(pixels(results["flex"].images[0]) - reference("tiny-sd", alone)).max() <= 1
    assert "image 0 paused at step" in server.log()


def test_a_bad_tier_or_timeout_is_refused_by_name(server):
    results = generate_many(
        [
            {"prompt": "ok", "seed": 1, "num_inference_steps": 1, "service_tier": "default"},
            {"prompt": "bad", "service_tier": "gold"},
            {"prompt": "ok too", "seed": 2, "num_inference_steps": 1},
        ],
        url=server.grpc_url,
        model="sd_tiers",
    )
    assert results[0].ok and results[2].ok, [r.error for r in results]
    assert results[1].error.startswith("service_tier: got 'gold' (allowed: one of priority, default, flex)")
    for timeout in (-5, 10**15):  # over HTTP the timeout is an ordinary parameter, checked as the field
        status, body = http_generate(server, "sd_tiers", {"PROMPT": "x", "parameters": {"timeout": timeout}})
        assert status == 400 and body["error"].startswith(
            f"timeout: got {timeout} (allowed: 1..86400000000"
        ), body


def grpc_with_timeout(server, prompt: str, steps: int, timeout_us: int) -> tuple[dict | None, str | None]:
    """One request through tritonclient's own ``timeout=`` (what reaches the model as request.timeout())."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: list = []
    done = threading.Event()

    def callback(result, error):
        answers.append((result, error))
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    prompt_input = grpcclient.InferInput("PROMPT", [1, 1], "BYTES")
    prompt_input.set_data_from_numpy(np.array([[prompt.encode()]], dtype=object))
    client.start_stream(callback=callback)
    try:
        client.async_stream_infer(
            "sd_tiers",
            [prompt_input],
            request_id=prompt,
            parameters={"num_inference_steps": steps, "seed": 3},
            timeout=timeout_us,
            enable_empty_final_response=True,
        )
        assert done.wait(120)
    finally:
        client.stop_stream()
        client.close()
    for result, error in answers:
        if error is not None:
            return None, str(error)
        if result.as_numpy("BATCH") is not None:
            return json.loads(result.as_numpy("BATCH").reshape(-1)[0]), None
    return None, None


def test_a_deadline_from_the_grpc_timeout_refuses_what_cannot_finish_and_ends_what_overruns(server):
    # Warm the engine's estimate: a few forwards of the stalled step (60 ms each) are measured.
    warm = generate_one(
        {"prompt": "warm", "seed": 1, "num_inference_steps": 4}, "warm", server.grpc_url, "sd_tiers"
    )
    assert warm.ok
    started = time.monotonic()
    batch, error = grpc_with_timeout(server, "hopeless", steps=40, timeout_us=300_000)
    assert batch is None and "deadline" in error and "300 ms" in error and "estimated" in error, error
    assert time.monotonic() - started < 2.0  # refused at once, not computed and then dropped
    assert "[UNAVAILABLE]" in error
    batch, error = grpc_with_timeout(server, "in time", steps=2, timeout_us=20_000_000)
    assert error is None and batch["service"]["deadline_ms"] == 20000.0
    assert "request hopeless image 0 left (refused)" in server.log()


def test_the_http_timeout_parameter_is_the_same_deadline(server):
    warm = generate_one(
        {"prompt": "warm", "seed": 1, "num_inference_steps": 4}, "warm", server.grpc_url, "sd_tiers"
    )
    assert warm.ok  # the engine has measured its forwards: its estimate can refuse
    status, body = http_generate(
        server,
        "sd_tiers",
        {
            "PROMPT": "hopeless over http",
            "parameters": {
                "seed": 4,
                "num_inference_steps": 40,
                "timeout": 300_000,
                "output_encoding": "base64",
            },
        },
    )
    assert status != 200 and "deadline" in body["error"] and "300 ms" in body["error"], body
    status, body = http_generate(
        server,
        "sd_tiers",
        {
            "PROMPT": "fine over http",
            "parameters": {
                "seed": 4,
                "num_inference_steps": 2,
                "timeout": 20_000_000,
                "output_encoding": "base64",
            },
        },
    )
    assert status == 200, body
    assert json.loads(body["BATCH"])["service"]["deadline_ms"] == 20000.0

"""The step engine on the real server (the default engine for SD and FLUX.1): requests join and leave a
running denoising loop, and every image still equals the diffusers pipeline's own for its arguments.

References are computed here, in the test process, with the same weights through ``pipeline(...)``.
"""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time

import diffusers
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from PIL import Image
from triton_diffusion_client import ImageSession, generate_many, generate_one

from triton_diffusion.serving.server_process import WEIGHTS, read_metrics

from .test_text_to_image import pixels

MODELS = {"sd_step_slow": "tiny-sd", "flux_step_slow": "tiny-flux"}
# The slow models' hold (conftest STEP_SLOW, faults.py): a request whose prompt carries it, alone so far,
# waits before its second forward (HOLD + "10": its eleventh) until another job arrives, so a request
# sent after its progress says it runs certainly joins it, however fast or slow the machine.
HOLD = "__hold__"
_PIPES: dict[str, object] = {}


def reference(weights: str, request: dict) -> np.ndarray:
    """``pipeline(...)`` for one request, as diffusers runs it alone."""
    if weights not in _PIPES:
        pipe = diffusers.DiffusionPipeline.from_pretrained(WEIGHTS / weights, use_safetensors=True)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[weights] = (pipe, pipe.scheduler)
    pipe, own = _PIPES[weights]
    kwargs = {
        "prompt": [request["prompt"]],
        "height": request.get("height", 64),
        "width": request.get("width", 64),
        "num_inference_steps": request["num_inference_steps"],
        "generator": [torch.Generator().manual_seed(request["seed"])],
    }
    if "mask_image" in request:  # inpainting: the inpaint pipeline over the same modules
        pipe = diffusers.AutoPipelineForInpainting.from_pipe(pipe)
        pipe.set_progress_bar_config(disable=True)
        kwargs.update(
            image=Image.open(io.BytesIO(request["image"])).convert("RGB"),
            mask_image=Image.open(io.BytesIO(request["mask_image"])).convert("RGB"),
            strength=request["strength"],
        )
    elif "image" in request:  # img2img: the img2img pipeline over the same modules, as diffusers builds it
        pipe = diffusers.AutoPipelineForImage2Image.from_pipe(pipe)
        pipe.set_progress_bar_config(disable=True)
        kwargs.update(
            image=Image.open(io.BytesIO(request["image"])).convert("RGB"), strength=request["strength"]
        )
        del kwargs["height"], kwargs["width"]  # SD img2img takes the size from the image
    name = request.get("scheduler")
    pipe.scheduler = own if name is None else getattr(diffusers, name).from_config(own.config)
    if weights == "tiny-flux":
        kwargs["max_sequence_length"] = 64  # as text_to_image_flux's config.pbtxt sets it
    for field in ("negative_prompt", "guidance_scale", "true_cfg_scale"):
        if field in request:
            kwargs[field] = request[field] if field != "negative_prompt" else [request[field]]
    image = pipe(**kwargs).images[0]
    return np.asarray(image, dtype=np.int16)


@pytest.mark.parametrize("model", list(MODELS))
def test_a_request_joining_mid_way_equals_the_pipelines_own_and_a_cancelled_neighbour_leaves(server, model):
    weights = MODELS[model]
    sd = weights == "tiny-sd"
    # Held before its fourth forward until the target arrives: the target joins at its fifth of 14.
    long_request = {
        "prompt": f"a long one {HOLD}3",
        "seed": 1,
        "num_inference_steps": 14,
        "guidance_scale": 7.5,
    }
    target = {
        "prompt": "a lighthouse at dusk",
        "negative_prompt": "fog",
        "seed": 42,
        "num_inference_steps": 6,
        "guidance_scale": 3.0 if sd else 4.0,
        **({"scheduler": "EulerDiscreteScheduler"} if sd else {"true_cfg_scale": 2.0}),
    }
    victim = {"prompt": "cancel me", "seed": 7, "num_inference_steps": 12, "guidance_scale": 1.0}
    results: dict = {}
    started, target_stepped = threading.Event(), threading.Event()

    def run_long():
        def on_progress(progress):
            if progress.step == 3:
                started.set()

        results["long"] = generate_one(long_request, "long", server.grpc_url, model, on_progress=on_progress)
        results["long_done"] = time.monotonic()

    def run_target():
        results["target"] = generate_one(
            target, "target", server.grpc_url, model, on_progress=lambda p: target_stepped.set()
        )
        results["target_done"] = time.monotonic()

    def run_victim():
        results["victim"] = generate_one(
            victim, "victim", server.grpc_url, model, on_progress=lambda progress: progress.step >= 2
        )

    threads = [threading.Thread(target=run, daemon=True) for run in (run_long, run_target, run_victim)]
    threads[0].start()
    assert started.wait(60)  # the long request is at step 3 of 14 (and held there for the target)
    threads[1].start()
    assert target_stepped.wait(60)  # the target runs beside it; the victim joins the two
    threads[2].start()
    for thread in threads:
        thread.join(120)
    target_done = results["target_done"]

    long_result, target_result, victim_result = results["long"], results["target"], results["victim"]
    assert long_result.ok and target_result.ok, (long_result.error, target_result.error)
    assert victim_result.cancelled
    # The target joined a running loop, stepped with others, and finished while the long one still ran.
    batch = target_result.batch
    assert batch["engine"] == "step" and batch["forwards"] == 6 and batch["most_rows_shared"] >= 2
    assert target_done < results["long_done"]
    # Exactly the pipeline's own image, although it shared forwards with other steps, guidance and rows.
    served = pixels(target_result.images[0])
    assert np.abs(served - reference(weights, target)).max() <= 1
    assert np.abs(pixels(long_result.images[0]) - reference(weights, long_request)).max() <= 1
    # The cancelled neighbour was answered at once and left within a few steps of its cancel (sent after step
    # 2 of 12; the way back is given 6 stalled steps on a busy machine), not at its end.
    deadline = time.monotonic() + 20
    line = None
    while line is None and time.monotonic() < deadline:
        line = re.search(r"request victim image 0 left \(cancelled\) after (\d+)/12 steps", server.log())
        time.sleep(0.1)
    assert line is not None and 2 <= int(line.group(1)) <= 8, server.log()[-2000:]


def test_progress_and_a_preview_every_step(server):
    events = []
    (result,) = generate_many(
        [{"prompt": "progress", "seed": 3, "num_inference_steps": 5, "preview_every": 1}],
        url=server.grpc_url,
        model="sd_step",
        on_progress=lambda index, progress: events.append(progress) and None,
    )
    assert result.ok, result.error
    assert [e.step for e in events] == [1, 2, 3, 4, 5] and {e.total for e in events} == {5}
    assert all(Image.open(io.BytesIO(e.preview)).format == "PNG" for e in events)


def test_steps_guidance_schedulers_and_sizes_share_the_engine_and_each_is_exact(server):
    # Each waits before its second forward until the engine holds all six (tests/faults.py): they share
    # forwards whatever the machine's speed.
    requests = [
        {
            "prompt": f"mixed {i} __hold__1of6",
            "seed": 100 + i,
            "num_inference_steps": steps,
            "guidance_scale": guidance,
        }
        for i, (steps, guidance) in enumerate([(4, 1.0), (8, 5.0), (2, 7.5), (4, 5.0), (8, 1.0), (2, 7.5)])
    ]
    requests[1]["scheduler"] = "DPMSolverMultistepScheduler"
    requests[3]["scheduler"] = "EulerDiscreteScheduler"
    requests[4]["height"] = 96  # another shape group
    results = generate_many(requests, url=server.grpc_url, model="sd_step_slow")
    assert all(r.ok for r in results), [r.error for r in results]
    assert max(r.batch["most_rows_shared"] for r in results) >= 3
    for request, result in zip(requests, results, strict=True):
        assert result.batch["forwards"] == request["num_inference_steps"]
        assert np.abs(pixels(result.images[0]) - reference("tiny-sd", request)).max() <= 1


def test_a_failing_forward_fails_only_its_request_and_out_of_memory_shrinks_forwards(server):
    requests = [{"prompt": f"fine {i}", "seed": i, "num_inference_steps": 3} for i in range(3)]
    requests.insert(1, {"prompt": "this one will __explode__", "seed": 9, "num_inference_steps": 3})
    results = generate_many(requests, url=server.grpc_url, model="sd_step_faults")
    assert results[1].error is not None and "injected failure" in results[1].error
    assert all(r.ok for i, r in enumerate(results) if i != 1), [r.error for r in results]
    # More rows than the simulated memory holds (3): forwards are split and capped, nobody fails.
    results = generate_many(
        [{"prompt": f"oom {i}", "seed": i, "num_inference_steps": 3} for i in range(6)],
        url=server.grpc_url,
        model="sd_step_faults",
    )
    assert all(r.ok for r in results), [r.error for r in results]
    assert max(r.batch["most_rows_shared"] for r in results) <= 3
    (alone,) = generate_many(
        [{"prompt": "oom 4", "seed": 4, "num_inference_steps": 3}], url=server.grpc_url, model="sd_step"
    )
    assert np.abs(pixels(results[4].images[0]) - pixels(alone.images[0])).max() <= 1


def test_step_engine_metrics_and_log_lines(server):
    before = read_metrics(server)
    results = generate_many(
        [{"prompt": f"metrics {i}", "seed": i, "num_inference_steps": 3} for i in range(3)],
        url=server.grpc_url,
        model="flux_step",
    )
    assert all(r.ok for r in results)
    after = read_metrics(server)
    label = '{model="flux_step"}'

    def grew(name: str) -> float:
        return after.get(name + label, 0.0) - before.get(name + label, 0.0)

    assert grew("triton_diffusion_forward_images_count") >= 3
    # each forward timed once (on a CPU in its own step's report: StepReport.timed)
    assert grew("triton_diffusion_step_seconds_count") == grew("triton_diffusion_forward_images_count")
    assert grew("triton_diffusion_step_seconds_sum") > 0
    assert grew("triton_diffusion_admission_wait_seconds_count") == 3
    assert grew("triton_diffusion_first_step_seconds_count") == 3
    assert after["triton_diffusion_rows_in_flight" + label] == 0
    log = server.log()
    assert re.search(r"request \d image 0 admitted: 64x64, 3 steps", log)
    assert re.search(r"request \d image 0 left \(finished\) after 3/3 steps", log)


def structured_png(size: int = 64) -> bytes:
    """A source with structure (gradients, a bright square, seeded noise), so its start matters."""
    y, x = np.mgrid[0:size, 0:size]
    pixels = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], axis=-1)
    pixels[size // 4 : size // 2, size // 4 : size // 2] = 250
    pixels += np.random.default_rng(5).integers(0, 40, pixels.shape)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def send_with_parameters(server, model: str, requests: list[dict]) -> list[tuple[str | None, dict]]:
    """Each request as a PROMPT tensor and parameters only (a source image as the ``image`` parameter,
    base64 text), sent at once: with one set of input tensors Triton hands them to one execute()."""
    answers: list = [None] * len(requests)

    def one(index: int, request: dict) -> None:
        fields = dict(request)
        if "image" in fields:
            fields["image"] = base64.b64encode(fields["image"]).decode()
        prompt = grpcclient.InferInput("PROMPT", [1, 1], "BYTES")
        prompt.set_data_from_numpy(np.array([[fields.pop("prompt").encode()]], dtype=object))
        client, results = grpcclient.InferenceServerClient(server.grpc_url), []
        client.start_stream(callback=lambda result, error: results.append((result, error)))
        client.async_stream_infer(model, [prompt], parameters=fields)
        client.stop_stream()  # returns once the final response has arrived
        client.close()
        result, error = results[-1]
        if error is not None:
            answers[index] = (str(error), {})
            return
        batch = json.loads(result.as_numpy("BATCH").reshape(-1)[0])
        answers[index] = (None, {"image": bytes(result.as_numpy("IMAGE").reshape(-1)[0]), "batch": batch})

    threads = [threading.Thread(target=one, args=item) for item in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return answers


def test_a_text_only_and_an_image_conditioned_request_share_forwards_on_text_to_image(server):
    # Both carry the hold: whichever the engine starts first waits for the other before its second step.
    text = {
        "prompt": f"a harbour at night {HOLD}",
        "seed": 11,
        "num_inference_steps": 4,
        "guidance_scale": 5.0,
    }
    edit = {
        "prompt": f"make it a watercolor {HOLD}",
        "image": structured_png(),
        "strength": 0.75,  # int(4 x 0.75) = 3 of the 4 steps run
        "seed": 12,
        "num_inference_steps": 4,
        "guidance_scale": 7.5,
        "scheduler": "EulerDiscreteScheduler",
    }
    (text_error, text_out), (edit_error, edit_out) = send_with_parameters(
        server, "sd_step_slow", [text, edit]
    )
    assert text_error is None and edit_error is None, (text_error, edit_error)
    # One model (text_to_image's config), one step engine: the two shared their forwards.
    assert text_out["batch"]["engine"] == edit_out["batch"]["engine"] == "step"
    assert text_out["batch"]["forwards"] == 4 and edit_out["batch"]["forwards"] == 3
    assert text_out["batch"]["most_rows_shared"] == edit_out["batch"]["most_rows_shared"] == 2
    # Each equals its own diffusers pipeline: StableDiffusionPipeline, StableDiffusionImg2ImgPipeline.
    assert np.abs(pixels(text_out["image"]) - reference("tiny-sd", text)).max() <= 1
    assert np.abs(pixels(edit_out["image"]) - reference("tiny-sd", edit)).max() <= 1


def mask_png(size: int = 64) -> bytes:
    """White (repaint) over the middle, black (keep) elsewhere."""
    mask = np.zeros((size, size), dtype=np.uint8)
    mask[size // 4 : 3 * size // 4, size // 8 : size // 2 + 5] = 255
    buffer = io.BytesIO()
    Image.fromarray(mask).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_short_inpaint_request_sent_at_step_10_of_a_long_one_starts_at_once_and_finishes_first(server):
    # The project's client sends the source and the mask as IMAGE and MASK_IMAGE tensors.
    # Held before its eleventh forward until the short one arrives.
    long = {
        "prompt": f"a long walk by the sea {HOLD}10",
        "seed": 21,
        "num_inference_steps": 30,
        "guidance_scale": 5.0,
    }
    short = {
        "prompt": "a red door",
        "image": structured_png(),
        "mask_image": mask_png(),
        "strength": 0.75,  # 3 of its 4 steps run
        "seed": 22,
        "num_inference_steps": 4,
        "guidance_scale": 7.5,
    }
    at_step_10 = threading.Event()
    long_step = [0]  # the long request's latest step, as its progress reports it
    finished: list[str] = []
    results: dict[str, object] = {}

    def on_long(progress) -> None:
        long_step[0] = progress.step
        if progress.step >= 10:
            at_step_10.set()

    def run_long() -> None:
        with ImageSession(server.grpc_url, "sd_step_slow") as session:
            results["long"] = session.generate(long, "long", 120, on_long)
        finished.append("long")

    thread = threading.Thread(target=run_long)
    thread.start()
    assert at_step_10.wait(60), "the long request never reached step 10"
    long_step_at_first: list[int] = []
    with ImageSession(server.grpc_url, "sd_step_slow") as session:
        results["short"] = session.generate(
            {**short, "progress": True}, "short", 120, lambda p: long_step_at_first.append(long_step[0])
        )
        finished.append("short")
    thread.join(120)
    long_out, short_out = results["long"], results["short"]
    assert long_out.ok and short_out.ok, (long_out.error, short_out.error)
    # It took its first step a few of the long request's steps after it was sent (not after the long
    # one's 20 remaining steps), shared its forwards, and finished first.
    assert long_step_at_first[0] <= 15, long_step_at_first
    assert finished == ["short", "long"]
    assert short_out.steps == [1, 2, 3] and short_out.batch["most_rows_shared"] == 2
    assert short_out.batch["forwards"] == 3 and long_out.batch["forwards"] == 30
    # Each equals its own pipeline: StableDiffusionPipeline and StableDiffusionInpaintPipeline.
    assert np.abs(pixels(short_out.images[0]) - reference("tiny-sd", short)).max() <= 1
    assert np.abs(pixels(long_out.images[0]) - reference("tiny-sd", long)).max() <= 1


def test_on_the_shipped_config_256x256_requests_fill_their_row_cap_and_short_ones_join_a_long_one(server):
    """The shipped text_to_image caps a 256x256 forward at 4 images (max_rows_by_resolution) and sets no
    token budget: three short 256x256 requests sent while a long one runs join it at its next step, all
    four share forwards, and the short ones finish first (a budget of 8 guided 64x64 images, the old
    default, let each run alone: the short ones waited out the starvation bound and finished after)."""
    size = {"height": 256, "width": 256, "guidance_scale": 7.5}
    # Held before its fourth forward until the engine holds all four jobs.
    long = {"prompt": f"a long one {HOLD}3of4", "seed": 1, "num_inference_steps": 16, **size}
    shorts = [{"prompt": f"short {i}", "seed": 10 + i, "num_inference_steps": 4, **size} for i in range(3)]
    at_step_3 = threading.Event()
    long_step = [0]
    first_seen: dict[int, int] = {}  # each short one's first step: the long one's latest step then
    done: dict[str, float] = {}
    results: dict[str, object] = {}

    def on_long(progress) -> None:
        long_step[0] = progress.step
        if progress.step >= 3:
            at_step_3.set()

    def run(name: str, request: dict, on_progress) -> None:
        results[name] = generate_one(request, name, server.grpc_url, "sd_step_slow", on_progress=on_progress)
        done[name] = time.monotonic()

    def on_short(i: int):
        def seen(progress) -> None:
            first_seen.setdefault(i, long_step[0])

        return seen

    threads = [threading.Thread(target=run, args=("long", long, on_long))]
    threads += [threading.Thread(target=run, args=(f"s{i}", s, on_short(i))) for i, s in enumerate(shorts)]
    threads[0].start()
    assert at_step_3.wait(60), "the long request never reached step 3"  # held there until all arrive
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(r.ok for r in results.values()), {k: r.error for k, r in results.items()}
    assert max(first_seen.values()) <= 6, first_seen  # their first step within a few of the long one's
    assert max(results[f"s{i}"].batch["most_rows_shared"] for i in range(3)) == 4
    assert all(done[f"s{i}"] < done["long"] for i in range(3)), done
    assert results["long"].batch["forwards"] == 16


def test_model_info_and_the_metrics_show_the_cost_model_the_engine_prices_by(server):
    """MODEL_INFO ``cost_model`` and ``triton_diffusion_forward_cost_seconds``: once forwards of two token
    counts ran, the line by tokens (deadlines, the drain) is in MODEL_INFO, not negative, with start and
    decode times; after a forward past the metric's once-a-second throttle, the metric holds its fixed
    and per-token parts in seconds (a tiny model's fixed part is under a second: milliseconds written as
    seconds would not be); the request-level engine's model describes no cost model."""
    from triton_diffusion_client.streams import StreamSession

    from triton_diffusion.serving.engine_host import COST_METRICS_EVERY_S

    model = "sd_step"
    # Two token counts determine the line; the third request runs once the metric's throttle has passed
    # (a wait, not a race), so its forward sets the metric with the line determined.
    for index, size in enumerate((64, 128, 64)):
        if index == 2:
            time.sleep(COST_METRICS_EVERY_S + 0.1)
        request = {
            "prompt": f"a cost at {size}",
            "seed": 3,
            "num_inference_steps": 2,
            "height": size,
            "width": size,
        }
        generate_one(request, f"cost-{index}", server.grpc_url, model)

    def described(name: str) -> dict:
        with StreamSession(server.grpc_url, name) as session:
            (answer,) = list(session.responses({"PROMPT": b""}, {"describe": True}, f"describe-{name}"))
        return json.loads(answer.scalar("MODEL_INFO"))

    cost = described(model)["cost_model"]
    line = cost["forward_by_tokens"]
    assert cost["token_counts_measured"] >= 2 and line is not None, cost
    assert (
        line["fixed_ms"] >= 0
        and line["per_1k_tokens_ms"] >= 0
        and line["fixed_ms"] + line["per_1k_tokens_ms"] > 0
    )
    assert cost["decode_ms"] > 0 and cost["start_ms"] > 0, cost
    name = "triton_diffusion_forward_cost_seconds"
    parts = {part: f'{name}{{fit="tokens",model="{model}",part="{part}"}}' for part in ("fixed", "per_token")}
    deadline = time.monotonic() + 30
    while True:  # set on the response thread, after the answer that followed it may have gone out
        values = {part: read_metrics(server).get(key) for part, key in parts.items()}
        if None not in values.values() or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert None not in values.values(), sorted(k for k in read_metrics(server) if "cost" in k)
    assert 0 <= values["fixed"] < 1 and 0 <= values["per_token"] < 0.01, values
    assert "cost_model" not in described("text_to_image"), "the request-level engine prices nothing"

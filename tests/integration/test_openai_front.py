"""The OpenAI-compatible front with the official ``openai`` client, against a real tritonserver started by
the launcher with ``--openai-port`` (tiny models, few steps): images, edits, streamed partial images,
chat and completions, video jobs, every error status, hostile bodies, and a client that goes away."""

from __future__ import annotations

import base64
import io
import shutil
import threading
import time

import av
import httpx
import openai
import pytest
from PIL import Image
from triton_diffusion_client import generate_one

from tests.faults import copy_model
from triton_diffusion.serving.server_process import WEIGHTS, free_port, read_metrics, start_server

from .headless_chromium import HeadlessChromium

KEY = "sk-test-front-key"
MODELS = ["text_to_image", "image_to_image", "text_to_video", "diffusion_lm", "text_to_image_slow"]


class FrontWatch:
    """Polls the front's /health while the server starts, to see it not ready before Triton is."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.statuses: list[int] = []
        self.generation_while_loading: int | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.stop.is_set():
                try:
                    status = client.get(f"{self.url}/health").status_code
                except httpx.HTTPError:
                    status = 0  # the front is not listening yet
                self.statuses.append(status)
                if status == 503 and self.generation_while_loading is None:
                    self.generation_while_loading = client.post(
                        f"{self.url}/v1/images/generations",
                        json={"prompt": "too early"},
                        headers={"Authorization": f"Bearer {KEY}"},
                    ).status_code
                time.sleep(0.2)


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    repo = tmp_path_factory.mktemp("openai_repo")
    for name, weights in (
        ("text_to_image", "tiny-sd"),
        ("image_to_image", "tiny-sd"),
        ("text_to_video", "tiny-wan"),
        ("diffusion_lm", "tiny-dllm"),
    ):
        copy_model(name, repo, name, {"model": str(WEIGHTS / weights)})
    # A stalled step, so a request is still running when its client goes away.
    slow = {"model": str(WEIGHTS / "tiny-sd"), "fault_injection": '{"step_delay_s": 0.15}'}
    copy_model("text_to_image", repo, "text_to_image_slow", slow)
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# the test's key\n{KEY}\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    watch = FrontWatch(url)
    log_path = tmp_path_factory.mktemp("logs") / "server.log"
    args = [f"--openai-port={port}", f"--openai-api-key-file={key_file}", "--openai-address=127.0.0.1"]
    server = start_server(repo, log_path, MODELS, extra_args=args)
    deadline = time.monotonic() + 30
    while (not watch.statuses or watch.statuses[-1] != 200) and time.monotonic() < deadline:
        time.sleep(0.2)
    watch.stop.set()
    watch.thread.join()
    server.openai_url, server.watch = url, watch
    yield server
    server.stop()


@pytest.fixture
def client(front):
    return openai.OpenAI(base_url=f"{front.openai_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def png(data: str | bytes) -> Image.Image:
    raw = base64.b64decode(data) if isinstance(data, str) else data
    return Image.open(io.BytesIO(raw))


def source_png(color: str = "red", size: tuple[int, int] = (64, 64)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def triton_ready(front) -> bool:
    return httpx.get(f"{front.http_url}/v2/health/ready", timeout=5).status_code == 200


def test_not_ready_while_triton_loads_then_ready_and_models_listed(front, client):
    statuses = [s for s in front.watch.statuses if s]  # 0: the front was not listening yet
    assert 503 in statuses and statuses[-1] == 200, front.watch.statuses
    assert statuses.index(200) > statuses.index(503)  # not ready first, then ready with Triton
    assert front.watch.generation_while_loading == 503
    kinds = {model.id: model.model_extra["kind"] for model in client.models.list()}
    assert kinds == {
        "text_to_image": "text_to_image",
        "text_to_image_slow": "text_to_image",
        "image_to_image": "image_to_image",
        "text_to_video": "text_to_video",
        "diffusion_lm": "text_generation",
    }


def test_generations_n2_b64_json_with_extras_equal_the_grpc_path(front, client):
    fields = {"seed": 7, "num_inference_steps": 3, "negative_prompt": "blurry", "guidance_scale": 5.0}
    result = client.images.generate(
        prompt="a red cat", n=2, size="96x64", response_format="b64_json", extra_body=fields
    )
    assert [image.model_extra["seed"] for image in result.data] == [7, 8]  # image i has seed + i
    assert result.size == "96x64" and all(png(i.b64_json).size == (96, 64) for i in result.data)
    grpc = generate_one(
        {"prompt": "a red cat", "num_images_per_prompt": 2, "width": 96, "height": 64, **fields},
        "grpc",
        url=front.grpc_url,
    )
    assert grpc.ok, grpc.error
    assert [base64.b64decode(i.b64_json) for i in result.data] == grpc.images  # the same PNG bytes
    # height and width as our own fields where size is absent (the `openai` package's size literals need
    # not list the model's sizes).
    extras = {"seed": 7, "height": 64, "width": 96}
    jpeg = client.images.generate(prompt="a red cat", output_format="jpeg", extra_body=extras)
    assert len(jpeg.data) == 1 and png(jpeg.data[0].b64_json).format == "JPEG"
    assert png(jpeg.data[0].b64_json).size == (96, 64) and jpeg.size == "96x64"


def test_streamed_partial_images_then_completed(client):
    events = list(
        client.images.generate(
            prompt="a lighthouse",
            stream=True,
            partial_images=2,
            extra_body={"seed": 3, "num_inference_steps": 5},
        )
    )
    types = [event.type for event in events]
    assert types == ["image_generation.partial_image"] * 2 + ["image_generation.completed"], types
    assert [event.partial_image_index for event in events[:2]] == [0, 1]
    assert all(png(event.b64_json).format == "PNG" for event in events)
    assert png(events[-1].b64_json).size == (64, 64) and events[-1].model_extra["seed"] == 3
    assert png(events[0].b64_json).size[0] < 64  # previews are low resolution


def test_edits_with_and_without_a_mask(client):
    image = ("source.png", source_png(), "image/png")
    edited = client.images.edit(
        image=image, prompt="a blue cat", n=2, extra_body={"strength": 0.75, "seed": 1}
    )
    assert len(edited.data) == 2 and png(edited.data[0].b64_json).size == (64, 64)
    assert edited.size == "64x64"  # the source's size, as the model reports it rendered (WIDTH, HEIGHT)
    resized = client.images.edit(image=image, prompt="a blue cat", size="96x64", extra_body={"seed": 1})
    assert png(resized.data[0].b64_json).size == (96, 64) and resized.size == "96x64"
    # image_to_image declares no mask: the mask is refused by name, not dropped.
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(image=image, mask=("mask.png", source_png("white"), "image/png"), prompt="x")
    assert refused.value.body["param"] == "mask" and "mask" in refused.value.body["message"]
    # The model spreads the previews over the steps the edit runs: 6 of 10 at strength 0.6.
    edit = {"strength": 0.6, "num_inference_steps": 10}
    streamed = list(
        client.images.edit(image=image, prompt="a boat", stream=True, partial_images=2, extra_body=edit)
    )
    assert [e.type for e in streamed] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]
    assert [e.partial_image_index for e in streamed[:2]] == [0, 1]


def test_chat_completions_streamed_and_not(client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me about the sea"},
    ]
    whole = client.chat.completions.create(model="diffusion_lm", messages=messages, max_tokens=32, seed=5)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens > 0 and whole.usage.prompt_tokens > 5
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            model="diffusion_lm",
            messages=messages,
            max_tokens=32,
            seed=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert 1 <= len(pieces) <= 2  # one chunk per committed block (32 tokens in blocks of 16)
    assert "".join(pieces) == text  # greedy: the same text, streamed
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    completion = client.completions.create(model="diffusion_lm", prompt="The sea is", max_tokens=16)
    assert completion.choices[0].text and completion.usage.completion_tokens > 0
    # finish_reason is the model's FINISH_REASON: "length" when every token asked for was generated.
    reason = completion.choices[0].finish_reason
    assert reason == ("length" if completion.usage.completion_tokens == 16 else "stop")


def test_service_tier_and_step_cache_reach_the_model(client):
    chat = client.chat.completions.create(
        model="diffusion_lm", messages=[{"role": "user", "content": "hi"}], max_tokens=8, service_tier="flex"
    )
    assert chat.choices[0].message.content is not None and chat.service_tier == "flex"
    auto = client.chat.completions.create(
        model="diffusion_lm", messages=[{"role": "user", "content": "hi"}], max_tokens=8, service_tier="auto"
    )
    assert auto.service_tier == "default"  # "auto": the model's default tier (nothing sent)
    with pytest.raises(openai.BadRequestError) as tier:
        client.chat.completions.create(
            model="diffusion_lm", messages=[{"role": "user", "content": "hi"}], service_tier="scale"
        )
    assert tier.value.body["param"] == "service_tier" and "scale" in tier.value.body["message"]
    image = client.images.generate(
        prompt="x", extra_body={"service_tier": "priority", "step_cache": "none", "num_inference_steps": 2}
    )
    assert len(image.data) == 1
    with pytest.raises(openai.BadRequestError) as tier:
        client.images.generate(prompt="x", extra_body={"service_tier": "gold"})
    assert tier.value.body["param"] == "service_tier"
    # tiny-sd's UNet has no step cache: refused by the model, naming the field.
    with pytest.raises(openai.BadRequestError) as cache:
        client.images.generate(prompt="x", extra_body={"step_cache": "fbc:0.1"})
    assert cache.value.body["param"] == "step_cache" and not cache.value.body["message"].endswith("]")


def test_video_created_polled_downloaded_deleted(client):
    video = client.videos.create(
        model="text_to_video", prompt="a boat", size="64x64", extra_body={"num_frames": 5, "seed": 2}
    )
    assert video.status in ("queued", "in_progress") and video.id.startswith("video_")
    seen = {video.status}
    deadline = time.monotonic() + 120
    while video.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        video = client.videos.retrieve(video.id)
        seen.add(video.status)
    assert video.status == "completed" and video.progress == 100, video
    assert video.expires_at > video.completed_at
    data = client.videos.download_content(video.id).read()
    with av.open(io.BytesIO(data)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (64, 64, 3)
    assert client.videos.delete(video.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    failed = client.videos.create(model="text_to_video", prompt="x", extra_body={"num_frames": 6})
    while failed.status in ("queued", "in_progress"):
        time.sleep(0.1)
        failed = client.videos.retrieve(failed.id)
    assert failed.status == "failed" and failed.error.message.startswith("num_frames: got 6")


def test_error_statuses_name_the_field(front, client):
    with pytest.raises(openai.BadRequestError) as too_big:
        client.images.generate(prompt="x", size="4096x64")
    body = too_big.value.body
    assert body["param"] == "size" and body["message"].startswith("width: got 4096 (allowed: 64..512")
    assert body["type"] == "invalid_request_error" and not body["message"].endswith("[INVALID_ARG]")
    with pytest.raises(openai.BadRequestError) as typo:
        client.images.generate(prompt="x", extra_body={"heigth": 64})
    assert "did you mean 'height'" in typo.value.body["message"]
    with pytest.raises(openai.BadRequestError) as steps:
        client.chat.completions.create(
            model="diffusion_lm", messages=[{"role": "user", "content": "x"}], extra_body={"steps": 3}
        )
    assert steps.value.body["param"] == "steps"
    with pytest.raises(openai.NotFoundError) as missing:
        client.images.generate(model="no_such_model", prompt="x")
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):  # the right model for the wrong endpoint
        client.images.generate(model="diffusion_lm", prompt="x")
    for key in (None, "sk-wrong"):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        response = httpx.post(
            f"{front.openai_url}/v1/images/generations", json={"prompt": "x"}, headers=headers
        )
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{front.openai_url}/v1/models").status_code == 401
    assert httpx.get(f"{front.openai_url}/health").status_code == 200  # probes need no key


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (
            b'{"prompt":"x","seed":' + b"[" * 150_000 + b"]" * 150_000 + b"}",
            400,
            None,
        ),  # crashes Triton's HTTP
        (b'{"prompt":"' + b"a" * (4 << 20) + b'"}', 413, None),  # 4 MiB string
        (b'{"prompt":"x","n":"two"}', 400, "n"),
        (b'{"prompt":"x","seed":"abc"}', 400, "seed"),
        (b'{"prompt":["x"]}', 400, "prompt"),
        (b'{"prompt":"x","size":640}', 400, "size"),
        (b'{"prompt":"x","n":1000000000000000000000000000000}', 400, "n"),
        (b'{"prompt":"x","seed":100000000000000000000000}', 400, "seed"),
        (b'{"prompt":"x","num_inference_steps":4294967297}', 400, "num_inference_steps"),
        (b'{"prompt":"x","guidance_scale":1e999}', 400, "guidance_scale"),
        (b'{"prompt":"x","seed":' + b"9" * 5000 + b"}", 400, None),
        (b"[1, 2]", 400, None),
        (b"not json", 400, None),
    ],
)
def test_hostile_bodies_get_4xx_and_triton_stays_up(front, body, status, param):
    response = httpx.post(
        f"{front.openai_url}/v1/images/generations",
        content=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == status, response.text[:300]
    assert response.json()["error"]["param"] == param, response.text[:300]
    assert triton_ready(front)


def test_hostile_multipart_gets_4xx(front):
    headers = {"Authorization": f"Bearer {KEY}"}
    url = f"{front.openai_url}/v1/images/edits"
    files = [("image", ("a.png", source_png(), "image/png"))] + [
        (f"extra{i}", (f"{i}.png", b"x", "image/png")) for i in range(3)
    ]
    assert httpx.post(url, files=files, data={"prompt": "x"}, headers=headers).status_code == 400
    response = httpx.post(
        url, files={"image": ("a.png", b"not an image")}, data={"prompt": "x"}, headers=headers
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "image"
    response = httpx.post(
        url, files={"image": ("a.png", source_png())}, data={"prompt": "x", "seed": "7x"}, headers=headers
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "seed"
    assert triton_ready(front)


def test_a_client_that_goes_away_cancels_its_triton_request(front):
    metric = 'triton_diffusion_requests_failed_total{code="CANCELLED",model="text_to_image_slow"}'
    before = read_metrics(front).get(metric, 0)
    body = {
        "model": "text_to_image_slow",
        "prompt": "slow",
        "stream": True,
        "partial_images": 3,
        "num_inference_steps": 40,
    }
    with httpx.stream(
        "POST",
        f"{front.openai_url}/v1/images/generations",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: image_generation.partial_image"):
                break  # running now: leave (40 steps of 150 ms would take 6 s)
    deadline = time.monotonic() + 60  # a wait, not a bound: a request run to its end is not CANCELLED
    while read_metrics(front).get(metric, 0) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert read_metrics(front).get(metric, 0) == before + 1  # cancelled at a step, not run to the end


def test_a_non_streamed_request_whose_client_goes_away_is_cancelled(front):
    metric = 'triton_diffusion_requests_failed_total{code="CANCELLED",model="text_to_image_slow"}'
    before = read_metrics(front).get(metric, 0)
    body = {"model": "text_to_image_slow", "prompt": "slow, not streamed", "num_inference_steps": 40}
    # The client gives up after 3 s and closes the connection: the request is running by then, on a busy
    # machine too, and has at least half of its 40 stalled steps (150 ms each) left.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{front.openai_url}/v1/images/generations",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=httpx.Timeout(30, read=3.0),
        )
    deadline = time.monotonic() + 30  # a wait, not a bound
    while read_metrics(front).get(metric, 0) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    # Counted as CANCELLED: the engine dropped it at a step, before its last one (a request that runs to
    # the end is counted as answered, not cancelled).
    assert read_metrics(front).get(metric, 0) == before + 1


# The playground's state as the page shows it (None until the page has loaded).
PAGE_STATE = """({
  status: document.getElementById("status").textContent,
  error: document.getElementById("status").className === "error",
  models: [...document.querySelectorAll("#model option")].map((o) => o.value),
  results: [...document.querySelectorAll("#results img")].map((i) => i.src.split(",")[1]),
  previews: document.querySelectorAll("#previews figure").length,
  url: location.href,
  key: document.getElementById("key").value,
})"""


@pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="needs a headless browser: apt-get install chromium (.ci/run does, as root)",
)
def test_the_playground_page_generates_in_a_headless_browser(front, tmp_path):
    # ?autorun=1 submits the form once the model list has loaded; #key= sets the API key. The page is
    # read over the DevTools protocol until it shows a finished image or an error.
    browser = HeadlessChromium(str(tmp_path / "profile"))
    state = None
    try:
        browser.open(f"{front.openai_url}/?prompt=a+lighthouse&autorun=1#key={KEY}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = browser.evaluate(PAGE_STATE)
            if state and (state["results"] or state["error"]):
                break
            time.sleep(0.3)
    finally:
        browser.close()
    assert state is not None and not state["error"], state
    assert "text_to_image" in state["models"]  # /v1/models answered with the key from the fragment
    assert state["key"] == KEY and "#key" not in state["url"]  # and the key left the address bar
    assert state["status"].startswith("done in") and len(state["results"]) == 1, state["status"]
    assert png(state["results"][0]).size == (64, 64)
    assert state["previews"] == 1  # a live preview was shown while denoising (each replaces the last)

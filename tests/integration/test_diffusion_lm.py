"""The diffusion LM on the real server: block streaming, joining mid-generation, cancellation, bad input.

``diffusion_lm`` runs the tiny EuroBERT in float64, so its tokens can be compared with the one-request
reference run here; ``diffusion_lm_slow`` stalls every step by 25 ms and fails the forward while a
prompt contains ``__explode__``.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from triton_diffusion_client import generate_text_many, generate_text_one

from triton_diffusion.adapters.masked_diffusion import DecodeParams, generate_reference  # noqa: E402
from triton_diffusion.adapters.masked_lm import MaskedLMForward, prompt_token_ids  # noqa: E402
from triton_diffusion.serving.server_process import WEIGHTS, read_metrics  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def reference_lm():
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    model = AutoModelForMaskedLM.from_pretrained(WEIGHTS / "tiny-dllm", dtype=torch.float64).eval()
    return MaskedLMForward(model), AutoTokenizer.from_pretrained(WEIGHTS / "tiny-dllm")


def reference_text(reference_lm, request: dict) -> tuple[str, int, int]:
    forward, tokenizer = reference_lm
    params = DecodeParams(
        request["gen_length"],
        request["block_length"],
        request["steps"],
        temperature=request.get("temperature", 0.0),
        remasking=request.get("remasking", "low_confidence"),
        threshold=request.get("threshold"),
        cfg_scale=request.get("cfg_scale", 0.0),
    )
    prompt = torch.tensor(prompt_token_ids(tokenizer, request["prompt"], chat=True))
    generator = torch.Generator().manual_seed(request["seed"])
    result = generate_reference(
        forward.unpadded, prompt, params, tokenizer.mask_token_id, generator, (tokenizer.eos_token_id,)
    )
    return tokenizer.decode(result.tokens, skip_special_tokens=True), len(result.tokens), result.steps_used


CONCURRENT = [
    {"prompt": "Tell me a story about the sea", "gen_length": 48, "block_length": 16, "steps": 24, "seed": 1},
    {"prompt": "hi", "gen_length": 16, "block_length": 4, "steps": 8, "temperature": 0.7, "seed": 2},
    {
        "prompt": "what is a diffusion language model and how does it work",
        "gen_length": 32,
        "block_length": 8,
        "steps": 32,
        "temperature": 1.0,
        "remasking": "random",
        "seed": 3,
    },
    {"prompt": "red", "gen_length": 24, "block_length": 12, "steps": 12, "cfg_scale": 1.0, "seed": 4},
    {"prompt": "blue", "gen_length": 32, "block_length": 16, "steps": 32, "threshold": 0.02, "seed": 5},
]


def test_concurrent_streams_get_their_blocks_in_order_and_the_reference_text(server, reference_lm):
    results = generate_text_many(CONCURRENT, server.grpc_url, "diffusion_lm")
    for request, result in zip(CONCURRENT, results, strict=True):
        assert result.ok, result.error
        text, tokens, steps = reference_text(reference_lm, request)
        assert result.text == text, request
        assert (result.tokens, result.steps) == (tokens, steps), request
        assert result.seed == request["seed"]
        # Blocks arrive in order, each as soon as it is final; together they are the final text.
        assert [b.index for b in result.blocks] == list(range(len(result.blocks)))
        assert 1 <= len(result.blocks) <= request["gen_length"] // request["block_length"]
        assert "".join(b.text for b in result.blocks) == result.text
        assert [b.at_s for b in result.blocks] == sorted(b.at_s for b in result.blocks)
    # The threshold finished its blocks in fewer steps than it was allowed.
    assert results[4].steps < CONCURRENT[4]["steps"]


def test_a_request_sent_mid_generation_starts_before_the_first_finishes(server):
    long = {"prompt": "a long one", "gen_length": 64, "block_length": 8, "steps": 64, "seed": 1}
    short = {"prompt": "a short one", "gen_length": 8, "block_length": 4, "steps": 4, "seed": 2}
    first_block = threading.Event()
    results = {}

    def run_long():
        results["long"] = generate_text_one(
            long, "long", server.grpc_url, "diffusion_lm_slow", on_block=lambda b: first_block.set()
        )

    thread = threading.Thread(target=run_long)
    thread.start()
    assert first_block.wait(60)
    results["short"] = generate_text_one(short, "short", server.grpc_url, "diffusion_lm_slow")
    thread.join(120)
    long_result, short_result = results["long"], results["short"]
    assert long_result.ok and short_result.ok, (long_result.error, short_result.error)
    long_done = long_result.sent_wall + long_result.latency_s
    short_done = short_result.sent_wall + short_result.latency_s
    # The short request was sent after the long one's first block, streamed its first block and
    # finished while the long one still had most of its 64 steps (25 ms each) to go.
    assert short_result.sent_wall > long_result.blocks[0].wall
    assert short_result.blocks[0].wall < long_done
    assert short_done < long_result.blocks[-2].wall
    # It took 4 steps of its own, not a place behind the long request.
    assert short_result.steps == 4 and long_result.steps == 64


def test_a_cancelled_request_stops_at_once(server):
    request = {"prompt": "cancel me", "gen_length": 128, "block_length": 8, "steps": 128, "seed": 1}
    result = generate_text_one(
        request, "dllm-cancel", server.grpc_url, "diffusion_lm_slow", on_block=lambda block: True
    )
    assert result.cancelled and len(result.blocks) == 1
    # The server answered CANCELLED within a few steps of the first block (step 8 of 128): the cancel's way
    # back (the client's stream, Triton, the engine's poll) is given 16 steps (400 ms) on a busy machine.
    deadline = time.monotonic() + 30
    line = None
    while line is None and time.monotonic() < deadline:
        line = re.search(r"request dllm-cancel cancelled after step (\d+)/128", server.log())
        time.sleep(0.1)
    assert line is not None, server.log()[-3000:]
    assert 8 <= int(line.group(1)) <= 24
    metrics = read_metrics(server)
    assert metrics['triton_diffusion_lm_requests_cancelled_total{model="diffusion_lm_slow"}'] >= 1


BAD_INPUTS = [
    ({"gen_length": 30, "block_length": 8, "steps": 15}, "block_length", "1, 2, 3, 5, 6, 10, 15, 30"),
    ({"gen_length": 32, "block_length": 8, "steps": 10}, "steps", "a multiple of 4"),
    ({"remasking": "entropy"}, "remasking", "'low_confidence', 'random'"),
    ({"gen_length": 1000}, "gen_length", "1..256"),
    ({"temperature": -1.0}, "temperature", "0..2"),
    ({"cfg_scale": "strong"}, "cfg_scale", "must be a number"),
    ({"block_lenght": 8}, "block_lenght", "did you mean 'block_length'"),
]


def test_bad_inputs_fail_alone_and_name_the_field(server):
    good = {"prompt": "fine", "gen_length": 16, "block_length": 8, "steps": 8, "seed": 9}
    requests = [good, *({"prompt": "bad", **fields} for fields, _, _ in BAD_INPUTS), good]
    failed = 'triton_diffusion_requests_failed_total{code="INVALID_ARG",model="diffusion_lm"}'
    before = read_metrics(server).get(failed, 0)
    results = generate_text_many(requests, server.grpc_url, "diffusion_lm")
    assert results[0].ok and results[-1].ok and results[0].text == results[-1].text
    for result, (_, field, allowed) in zip(results[1:-1], BAD_INPUTS, strict=True):
        assert not result.ok
        assert result.error.startswith(f"{field}:") and allowed in result.error, result.error
    # gRPC streaming drops the error code; the metric keeps it, and HTTP turns it into 400.
    assert read_metrics(server)[failed] - before == len(BAD_INPUTS)
    body = {"PROMPT": "bad", "parameters": {"gen_length": 30, "block_length": 8}}
    request = urllib.request.Request(
        f"{server.http_url}/v2/models/diffusion_lm/generate", data=json.dumps(body).encode(), method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == 400 and "block_length:" in json.loads(caught.value.read())["error"]


def test_a_failing_forward_answers_its_requests_and_the_model_goes_on(server):
    results = generate_text_many(
        [{"prompt": "__explode__", "gen_length": 8, "block_length": 8, "steps": 2}],
        server.grpc_url,
        "diffusion_lm_slow",
    )
    assert not results[0].ok and "injected failure" in results[0].error
    after = generate_text_one(
        {"prompt": "after", "gen_length": 8, "block_length": 4, "steps": 4},
        "after",
        server.grpc_url,
        "diffusion_lm_slow",
    )
    assert after.ok and after.steps == 4


def test_http_generate_stream_sends_each_block_then_the_whole_text(server):
    body = {"PROMPT": "over http", "parameters": {"gen_length": 16, "block_length": 4, "steps": 8, "seed": 7}}
    request = urllib.request.Request(
        f"{server.http_url}/v2/models/diffusion_lm/generate_stream",
        data=json.dumps(body).encode(),
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        events = [
            json.loads(line[len(b"data: ") :])
            for line in response.read().splitlines()
            if line.startswith(b"data: ")
        ]
    blocks, final = events[:-1], events[-1]
    assert [e["BLOCK"] for e in blocks] == list(range(len(blocks))) and blocks
    assert "".join(e["TEXT"] for e in blocks) == final["TEXT"]
    assert final["STEPS"] <= 8 and final["SEED"] == 7
    grpc = generate_text_one(
        {"prompt": "over http", "gen_length": 16, "block_length": 4, "steps": 8, "seed": 7},
        "grpc",
        server.grpc_url,
        "diffusion_lm",
    )
    assert grpc.text == final["TEXT"]
    # HTTP generate (not streaming) takes exactly one response: stream false sends the FINAL one only.
    body["parameters"]["stream"] = False
    request = urllib.request.Request(
        f"{server.http_url}/v2/models/diffusion_lm/generate", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        assert json.loads(response.read())["TEXT"] == final["TEXT"]


def test_metrics_count_forwards_rows_and_tokens(server):
    before = read_metrics(server)
    results = generate_text_many(
        [
            {"prompt": f"count {i}", "gen_length": 16, "block_length": 8, "steps": 8, "seed": i}
            for i in range(4)
        ],
        server.grpc_url,
        "diffusion_lm_slow",  # 25 ms steps: the four overlap
    )
    after = read_metrics(server)
    label = '{model="diffusion_lm_slow"}'

    def grew(name: str) -> float:
        return after[name + label] - before.get(name + label, 0.0)

    assert grew("triton_diffusion_lm_tokens_total") == sum(r.tokens for r in results)
    forwards = grew("triton_diffusion_lm_forwards_total")
    # 4 requests of 8 steps: shared forwards, fewer than 32 solo ones.
    assert 8 <= forwards < 32
    assert grew("triton_diffusion_lm_forward_rows_sum") == sum(r.steps for r in results)
    assert after["triton_diffusion_lm_running_requests" + label] == 0


def test_without_a_seed_a_resend_with_its_key_generates_the_same_text(server, reference_lm):
    """The diffusion LM has no checkpoints: a resend runs again from its first block. With the seed its
    resume key gives (the request has none), it is the same sampled text, so the client and the front can
    drop the blocks they delivered; another key draws another seed."""
    from triton_diffusion.recovery.resumes import seed_from_key

    sampled = {"prompt": "hi", "gen_length": 16, "block_length": 4, "steps": 8, "temperature": 1.0}
    key = "resend-the-same-text-0001"
    first, again = (
        generate_text_one({**sampled, "resume_key": key}, retries=0, url=server.grpc_url) for _ in range(2)
    )
    other = generate_text_one({**sampled, "resume_key": "another-key-of-its-own-1"}, url=server.grpc_url)
    assert first.ok and again.ok and other.ok, (first.error, again.error, other.error)
    assert first.seed == again.seed == seed_from_key(key) != other.seed
    assert first.text == again.text == reference_text(reference_lm, {**sampled, "seed": first.seed})[0]
    assert [b.text for b in first.blocks] == [b.text for b in again.blocks]

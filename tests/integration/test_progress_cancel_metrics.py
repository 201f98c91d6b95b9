"""Progress responses, cancellation between denoising steps, and the batching metrics, on a real server."""

import json
import queue
import re
import threading
import time
import urllib.request
import uuid

import numpy as np
import tritonclient.grpc as grpcclient
from triton_diffusion_client import generate_many, generate_one
from triton_diffusion_client.streams import stop_cancelling

from tests.unit.test_stream_threads import left_behind, request_threads
from triton_diffusion.serving.server_process import read_metrics

from .test_text_to_image import max_diff, send

STEPS = 10  # with the *_slow models' 80 ms stall per step: about a second per call


def test_progress_arrives_in_order_before_the_final_image(server, family):
    previews = []

    def on_progress(index, progress):
        if progress.preview is not None:
            previews.append((index, progress.step, progress.preview))

    requests = [
        {
            "prompt": f"progress {i}",
            "seed": i,
            "num_inference_steps": 5,
            "progress": True,
            "preview_every": 2 if i == 0 else 0,
        }
        for i in range(3)
    ]
    requests.append({"prompt": "no progress", "seed": 9, "num_inference_steps": 5, "progress": False})
    results = generate_many(
        requests, url=server.grpc_url, model=family, timeout_s=120, on_progress=on_progress
    )
    assert all(r.ok for r in results), [r.error for r in results]
    for result in results[:3]:
        assert result.steps == [1, 2, 3, 4, 5] and len(result.images) == 1
    assert results[3].steps == [] and len(results[3].images) == 1
    assert [(i, step) for i, step, _ in previews] == [(0, 2), (0, 4)]
    assert all(png.startswith(b"\x89PNG") for _, _, png in previews)
    assert results[0].batch["fused_calls"][0]["rows"] == 4  # progress never splits a batch


def test_cancelling_one_row_of_a_fused_call(server, family):
    model = f"{family}_slow"
    requests = [
        {"prompt": f"cancel test {i}", "seed": 100 + i, "num_inference_steps": STEPS} for i in range(4)
    ]
    reference = generate_many(requests, url=server.grpc_url, model=model, timeout_s=120)
    assert all(r.ok for r in reference) and reference[0].batch["fused_calls"][0]["rows"] == 4

    before = read_metrics(server)
    target = 2
    requests[target]["progress"] = True
    results = generate_many(
        requests,
        url=server.grpc_url,
        model=model,
        timeout_s=120,
        on_progress=lambda index, progress: index == target and progress.step >= 2,
    )
    assert results[target].cancelled
    others = [i for i in range(4) if i != target]
    assert all(results[i].ok for i in others), [r.error for r in results]
    for i in others:
        assert results[i].batch["fused_calls"][0]["rows"] == 4
        assert max_diff(results[i].images[0], reference[i].images[0]) <= 1

    after = read_metrics(server)
    label = f'{{model="{model}"}}'
    assert (
        after[f"triton_diffusion_rows_cancelled_total{label}"]
        - before.get(f"triton_diffusion_rows_cancelled_total{label}", 0)
        == 1
    )
    cancel_code = f'triton_diffusion_requests_failed_total{{code="CANCELLED",model="{model}"}}'
    assert after[cancel_code] - before.get(cancel_code, 0) == 1
    # The server answered within a few steps of the client's cancel (sent after step 2; the way back is
    # given 4 stalled steps on a busy machine), not at the call's end.
    steps_seen = [int(s) for s in re.findall(rf"cancelled after step (\d+)/{STEPS}", server.log())]
    assert steps_seen and steps_seen[-1] <= 6
    compacted = re.findall(
        r"compacted fused call after step (\d+): dropped 1 row\(s\), 3 go on", server.log()
    )
    if family == "text_to_image":  # SD + DDIM compacts; Flux keeps computing the cancelled row
        assert compacted and int(compacted[-1]) == steps_seen[-1]


def test_all_rows_cancelled_stops_the_call_early(server):
    model = "text_to_image_slow"
    abandoned = "fused call abandoned: every row ended"
    before = server.log().count(abandoned)
    results = generate_many(
        [
            {"prompt": f"all cancelled {i}", "seed": i, "num_inference_steps": 40, "progress": True}
            for i in range(2)
        ],
        url=server.grpc_url,
        model=model,
        timeout_s=120,
        on_progress=lambda index, progress: progress.step >= 2,
    )
    assert all(r.cancelled for r in results)
    # The call stopped at the step where its last row was cancelled (the model says so), rather than run its
    # 40 stalled steps out; the next request is served.
    (after,) = send(server, model, [{"prompt": "next", "seed": 1, "num_inference_steps": 2}])
    assert after.ok
    assert server.log().count(abandoned) > before, "the call ran on with every row cancelled"


def test_a_request_cancelled_in_the_queue_never_reaches_the_model(server):
    model = "text_to_image_slow"
    running_id, queued_id = f"running-{uuid.uuid4().hex[:8]}", f"queued-{uuid.uuid4().hex[:8]}"
    first_step = queue.Queue()
    runner = threading.Thread(
        target=lambda: first_step.put(
            generate_one(
                {"prompt": "long", "seed": 1, "num_inference_steps": STEPS},
                running_id,
                server.grpc_url,
                model,
                120,
                on_progress=lambda progress: first_step.put("started") and None,
            )
        )
    )
    runner.start()
    assert first_step.get(timeout=60) == "started"  # the instance is busy with the first request now

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: None)
    prompt = grpcclient.InferInput("PROMPT", [1, 1], "BYTES")
    prompt.set_data_from_numpy(np.array([[b"queued"]], dtype=object))
    client.async_stream_infer(model, [prompt], request_id=queued_id, parameters={"seed": 2})
    # Cancelled as soon as Triton counts it pending (in the dynamic batcher's queue for its 300 ms delay),
    # not after a guessed time: the request certainly reached the server and has not left the queue.
    pending = f'nv_inference_pending_request_count{{model="{model}",version="1"}}'
    waiting = time.monotonic()
    while read_metrics(server).get(pending, 0) < 1:
        assert time.monotonic() - waiting < 30, "the queued request never showed as pending"
        time.sleep(0.005)
    stop_cancelling(client)  # the cancel, ending the requests side too (the last test checks that)
    client.close()

    runner.join(timeout=60)
    while (item := first_step.get(timeout=5)) == "started":
        pass
    assert item.ok
    time.sleep(1.0)  # give a (wrongly) surviving queued request the time to be executed
    assert running_id in server.log()
    assert queued_id not in server.log()


def test_metrics_match_what_was_sent(server):
    model = "text_to_image"
    before = read_metrics(server)
    requests = [{"prompt": f"metrics {i}", "seed": i, "height": 64} for i in range(3)]
    requests[0]["num_images_per_prompt"] = 2
    requests += [{"prompt": f"metrics tall {i}", "seed": i, "height": 128} for i in range(4)]
    requests.append({"prompt": "bad", "num_inference_steps": 0})
    results = send(server, model, requests)  # 8 requests: one Triton batch (max_batch_size 8)
    assert [r.ok for r in results] == [True] * 7 + [False]
    call_ids = {c["id"] for r in results[:7] for c in r.batch["fused_calls"]}
    after = read_metrics(server)

    def delta(name, **labels):
        labels = {"model": model, **labels}
        key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        return after.get(key, 0) - before.get(key, 0)

    assert delta("triton_diffusion_fused_calls_total") == len(call_ids) == 2
    assert delta("triton_diffusion_fused_call_rows_sum") == 8  # images generated: 2 + 1 + 1 + 4
    assert delta("triton_diffusion_fused_call_rows_count") == 2
    assert delta("triton_diffusion_execute_requests_count") == 1
    assert delta("triton_diffusion_execute_requests_sum") == 8
    assert delta("triton_diffusion_requests_failed_total", code="INVALID_ARG") == 1
    assert delta("triton_diffusion_groups_cut_total", reason="key:height") == 1
    assert delta("triton_diffusion_pipeline_seconds_count") == 2
    assert delta("triton_diffusion_first_step_seconds_count") == 7
    assert after[f'triton_diffusion_rows_in_flight{{model="{model}"}}'] == 0


def test_http_generate_stream_sends_progress_events_then_the_image(server, family):
    body = {
        "PROMPT": "sse",
        "parameters": {"seed": 3, "progress": True, "num_inference_steps": 3, "output_encoding": "base64"},
    }
    request = urllib.request.Request(
        f"{server.http_url}/v2/models/{family}/generate_stream", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        events = [
            json.loads(line[len(b"data: ") :])
            for line in response.read().splitlines()
            if line.startswith(b"data: ")
        ]
    assert [e["STEP"] for e in events[:-1]] == [1, 2, 3]
    assert all(e["TOTAL_STEPS"] == 3 for e in events[:-1])
    assert "IMAGE" in events[-1] and "STEP" not in events[-1]


def test_every_request_gets_exactly_one_final_response(server, family):
    responses = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    ids = [f"final-{i}" for i in range(5)]
    for i, request_id in enumerate(ids):
        prompt = grpcclient.InferInput("PROMPT", [1, 1], "BYTES")
        prompt.set_data_from_numpy(np.array([[f"final {i}".encode()]], dtype=object))
        client.async_stream_infer(
            family,
            [prompt],
            request_id=request_id,
            enable_empty_final_response=True,
            parameters={"seed": i, "progress": True, "num_inference_steps": 3},
        )
    finals, steps = {}, {request_id: [] for request_id in ids}
    deadline = time.monotonic() + 120
    while len(finals) < len(ids) and time.monotonic() < deadline:
        result, error = responses.get(timeout=120)
        assert error is None, error
        response = result.get_response()
        if result.as_numpy("STEP") is not None:
            steps[response.id].append(int(result.as_numpy("STEP")[0][0]))
        if response.parameters["triton_final_response"].bool_param:
            finals[response.id] = finals.get(response.id, 0) + 1
    time.sleep(1.0)  # anything still arriving now would be a duplicate
    while not responses.empty():
        result, _ = responses.get()
        response = result.get_response()
        assert not response.parameters["triton_final_response"].bool_param, f"second FINAL for {response.id}"
    client.stop_stream()
    client.close()
    assert finals == {request_id: 1 for request_id in ids}
    assert all(s == [1, 2, 3] for s in steps.values()), steps


def test_answered_and_cancelled_requests_leave_no_stream_thread_behind(server):
    # Each generate_one opens a stream and closes it; each close used to leave gRPC's request-reading
    # thread blocked for good (client/.../streams.py end_request_iterator): one per request, which slowed
    # a long benchmark's client to a crawl.
    before = request_threads()
    for i in range(4):
        request = {"prompt": f"threads {i}", "seed": i, "num_inference_steps": 2}
        assert generate_one(request, f"threads-{i}", server.grpc_url, "text_to_image", timeout_s=120).ok
    request = {"prompt": "threads cancelled", "seed": 9, "num_inference_steps": STEPS}
    cancelled = generate_one(
        request, "threads-cancelled", server.grpc_url, "text_to_image_slow", 120, lambda progress: True
    )
    assert not cancelled.ok and "cancel" in (cancelled.error or "").lower()
    assert left_behind(before) == set()

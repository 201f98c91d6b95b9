"""Deadlines through the real server (``sd_tiers``: tiny SD, one running job, a stalled step of 60 ms, and
the hold of faults.py). test_service_and_caches.py checks the refusal at admission; here a request the
estimate admits, overrun because a higher tier takes the one running slot, is ended with the deadline's
error and counted missed; and a request that allows fewer steps (``min_inference_steps``) is run with
fewer where its deadline needs it, its image then ``pipeline(num_inference_steps=k)``'s for the k it ran,
and with what it asked where there is room."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from triton_diffusion_client import generate_one

from triton_diffusion.serving.server_process import read_metrics

from .test_step_engine import reference
from .test_text_to_image import pixels

pytestmark = pytest.mark.integration


def stream_with_timeout(
    server, prompt: str, steps: int, timeout_us: int, on_step: Callable[[], None]
) -> str | None:
    """One request with tritonclient's own ``timeout=`` and progress; ``on_step`` at each progress
    response. Returns its error message, or None when it succeeded."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    outcome: list[str | None] = []
    done = threading.Event()

    def callback(result, error) -> None:
        if error is not None:
            outcome.append(str(error))
            done.set()
        elif result.get_response().parameters["triton_final_response"].bool_param:
            outcome.append(None)
            done.set()
        elif result.as_numpy("STEP") is not None:
            on_step()

    prompt_input = grpcclient.InferInput("PROMPT", [1, 1], "BYTES")
    prompt_input.set_data_from_numpy(np.array([[prompt.encode()]], dtype=object))
    client.start_stream(callback=callback)
    try:
        client.async_stream_infer(
            "sd_tiers",
            [prompt_input],
            request_id="overrun",
            parameters={"num_inference_steps": steps, "seed": 5, "progress": True},
            timeout=timeout_us,
            enable_empty_final_response=True,
        )
        assert done.wait(120), "no final response"
    finally:
        client.stop_stream()
        client.close()
    return outcome[0]


def test_a_grpc_timeout_that_passes_while_the_request_runs_ends_it_with_the_deadline_error(server):
    # The estimate admits it (4 steps in 2.5 s); it holds before its second forward until the priority
    # request arrives, which then takes the one running slot for its 50 stalled steps (3 s at least):
    # its deadline certainly passes before it can finish, whatever the machine's speed.
    before = read_metrics(server)
    stepped, results = threading.Event(), {}

    def run_overrun() -> None:
        results["overrun"] = stream_with_timeout(server, "overrun __hold__", 4, 2_500_000, stepped.set)

    thread = threading.Thread(target=run_overrun, daemon=True)
    thread.start()
    assert stepped.wait(60), "the request with the deadline never took a step"
    urgent = {"prompt": "urgent", "seed": 6, "num_inference_steps": 50, "service_tier": "priority"}
    results["urgent"] = generate_one(urgent, "urgent", server.grpc_url, "sd_tiers", timeout_s=120)
    thread.join(120)
    error = results["overrun"]
    assert error is not None and "[UNAVAILABLE]" in error, error
    assert re.search(r"deadline: the request's timeout of 2500 ms passed after step [1-3]/4", error), error
    assert results["urgent"].ok, results["urgent"].error
    assert re.search(r"request overrun image 0 left \(expired\) after [1-3]/4 steps", server.log())
    missed = 'triton_diffusion_deadlines_total{model="sd_tiers",outcome="missed"}'
    assert read_metrics(server).get(missed, 0) - before.get(missed, 0) == 1


def test_a_request_that_allows_fewer_steps_is_degraded_only_where_its_deadline_needs_it(server):
    url = server.grpc_url
    warm = generate_one({"prompt": "warm", "seed": 1, "num_inference_steps": 4}, "warm", url, "sd_tiers")
    assert warm.ok  # the engine has measured its forwards (60 ms at least: the stalled step)
    before = read_metrics(server)
    asked = {"prompt": "a boat at dawn", "seed": 21, "num_inference_steps": 40, "min_inference_steps": 2}
    # 40 steps take 2.4 s at least: past each of these deadlines on any machine, so each is cut; the
    # cut aims at 90% of the time left, so a slow step may still make one expire: the next is longer.
    tight, expired = None, 0
    for timeout_us in (1_500_000, 2_000_000, 2_300_000):
        result = generate_one({**asked, "timeout": timeout_us}, "tight", url, "sd_tiers", timeout_s=120)
        if result.ok:
            tight = result
            break
        expired += 1  # ended by its deadline, after steps of a cut schedule (k of fewer than 40)
        assert re.search(r"passed after step \d+/([2-9]|[1-3]\d) ", result.error), result.error
    assert tight is not None, "every cut request expired"
    degraded = tight.batch["degraded"]
    assert degraded["steps_asked"] == 40 and 2 <= degraded["steps_run"] < 40, degraded
    assert degraded["reason"].startswith("deadline: 40 steps estimated") and degraded["images"] == 1
    assert degraded["rules"] == ["deadline"]
    image = pixels(tight.images[0])
    ran = {**asked, "num_inference_steps": degraded["steps_run"]}
    assert np.abs(image - reference("tiny-sd", ran)).max() <= 1
    full = reference("tiny-sd", asked)
    assert np.abs(image - full).max() > 5  # the cut shows: it is not the image of the steps asked
    # With room (a deadline 40 steps meet), the same request runs what it asked.
    roomy = generate_one({**asked, "timeout": 60_000_000}, "roomy", url, "sd_tiers", timeout_s=120)
    assert roomy.ok and "degraded" not in roomy.batch, roomy.batch
    assert np.abs(pixels(roomy.images[0]) - full).max() <= 1
    counted = 'triton_diffusion_degraded_total{model="sd_tiers",tier="default"}'
    assert read_metrics(server).get(counted, 0) - before.get(counted, 0) == 1  # answered degraded: one

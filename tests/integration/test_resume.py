"""A crash loses no work (issue 43), through the real server: a request with a resume_key on a model that
writes checkpoints every 2 steps dies with its process after its 7th step (faults.py ``exit_on_seed``:
``os._exit``, as the OOM killer kills); the supervisor restarts the server; the same request sent again
resumes from step 6 and its image equals the uninterrupted one (the same request on a twin model without
checkpoints, which accepts the key and ignores it). A resend with other fields is refused naming
resume_key; a truncated checkpoint starts its image over, with a warning in BATCH."""

from __future__ import annotations

import io
import json
import queue
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from PIL import Image

from tests.faults import copy_model
from triton_diffusion.serving.server_process import WEIGHTS, RunningServer, start_server
from triton_diffusion.tiny_models import build_missing

from .test_drain import checkpoints_gone
from .test_self_healing import status

RESUMING, PLAIN = "sd_resume", "sd_plain"
SEED, DIES_AFTER, EVERY = 1234, 7, 2
REQUEST = {"num_inference_steps": 12, "seed": SEED, "guidance_scale": 7.5}


def answer(server: RunningServer, model: str, prompt: str, fields: dict[str, Any]) -> tuple[str | None, Any]:
    """One request on its own stream (PROMPT as a tensor, every other field a parameter): (None,
    (image pixels, BATCH)) or (the error, None): a failed request, or a stream the server closed when it
    died. Bounded: a lost answer fails the test, it never hangs it."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    tensor = grpcclient.InferInput("PROMPT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[prompt.encode()]], dtype=object))
    try:
        client.async_stream_infer(model, [tensor], parameters=fields, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                return str(error), None
            if not result.get_response().parameters["triton_final_response"].bool_param:
                continue
            png = bytes(result.as_numpy("IMAGE").reshape(-1)[0])
            pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)
            return None, (pixels, json.loads(result.as_numpy("BATCH").reshape(-1)[0]))
    finally:
        client.stop_stream()
        client.close()


def restarts(server: RunningServer) -> str:
    try:
        with urllib.request.urlopen(f"{server.health_url}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return ""
    return "\n".join(line for line in text.splitlines() if "server_restarts_total" in line)


def wait_restarted(server: RunningServer, times: int) -> None:
    """Until the supervisor has restarted the server ``times`` times in all (its stub died) and both
    models are ready again: certain, not a sleep."""
    wanted = f'triton_diffusion_server_restarts_total{{reason="stub died",model="{RESUMING}"}} {times}'
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        ready = all(status(f"{server.http_url}/v2/models/{m}/ready") == 200 for m in (RESUMING, PLAIN))
        if wanted in restarts(server) and ready:
            return
        time.sleep(0.2)
    raise AssertionError(f"not restarted and ready ({restarts(server)!r}):\n{server.log()[-3000:]}")


def test_a_request_resumed_after_its_process_died_equals_the_uninterrupted_one(tmp_path: Path):
    build_missing(WEIGHTS, only=["tiny-sd"])
    repo, checkpoints = tmp_path / "repo", tmp_path / "checkpoints"
    repo.mkdir()
    fault = f'{{"exit_on_seed": {SEED}, "exit_after_step": {DIES_AFTER}}}'
    weights = {"model": str(WEIGHTS / "tiny-sd")}
    copy_model(
        "text_to_image",
        repo,
        RESUMING,
        {
            **weights,
            "checkpoint_every_steps": str(EVERY),
            "checkpoint_dir": str(checkpoints),
            "fault_injection": fault,
        },
    )
    copy_model("text_to_image", repo, PLAIN, weights)
    server = start_server(
        repo, tmp_path / "server.log", [RESUMING, PLAIN], extra_args=["--exit-timeout-secs=5"]
    )
    marker = checkpoints.with_name(checkpoints.name + ".exited")
    first_key, second_key = "first-request-0123456789", "second-request-0123456789"
    try:
        # The reference: the same request, uninterrupted, on the twin model that takes no checkpoints (it
        # accepts the key and says so).
        error, reference = answer(server, PLAIN, "a red fox", {**REQUEST, "resume_key": first_key})
        assert error is None, error
        expected, plain_batch = reference
        assert plain_batch["checkpoints"] == "off" and "resumed_from_step" not in plain_batch

        # 1. It dies after its 7th step: the stream ends in an error, not an answer.
        error, _ = answer(server, RESUMING, "a red fox", {**REQUEST, "resume_key": first_key})
        assert error is not None
        assert marker.exists(), "the process died, but not by the injected fault"
        wait_restarted(server, 1)
        assert (checkpoints / f"{first_key}.0.safetensors").exists()

        # 2. A resend with other fields is refused naming resume_key; the checkpoint stays.
        changed = {**REQUEST, "guidance_scale": 3.0, "resume_key": first_key}
        error, _ = answer(server, RESUMING, "a red fox", changed)
        assert error is not None and "resume_key: belongs to a request with other fields" in error, error
        assert (checkpoints / f"{first_key}.0.safetensors").exists()

        # 3. The same request resumes from its last checkpoint and equals the uninterrupted image; once
        #    answered its checkpoint is gone.
        error, resumed = answer(server, RESUMING, "a red fox", {**REQUEST, "resume_key": first_key})
        assert error is None, error
        pixels, batch = resumed
        assert batch["checkpoints"] == "on" and "warnings" not in batch, batch
        assert DIES_AFTER - EVERY <= batch["resumed_from_step"] <= DIES_AFTER
        assert batch["resumed_from_step"] == 6
        assert np.abs(pixels - expected).max() <= 1
        assert checkpoints_gone(checkpoints, first_key)

        # 4. Dies again (the fault re-armed); its checkpoint is truncated on disk while the server restarts:
        #    the resend starts over, says why, and still equals the reference.
        marker.unlink()
        error, _ = answer(server, RESUMING, "a red fox", {**REQUEST, "resume_key": second_key})
        assert error is not None and marker.exists()
        wait_restarted(server, 2)
        stored = checkpoints / f"{second_key}.0.safetensors"
        stored.write_bytes(stored.read_bytes()[: stored.stat().st_size // 2])
        error, again = answer(server, RESUMING, "a red fox", {**REQUEST, "resume_key": second_key})
        assert error is None, error
        pixels, batch = again
        assert "resumed_from_step" not in batch, batch
        (warning,) = batch["warnings"]
        assert warning.startswith("image 0: its checkpoint could not be read"), warning
        assert np.abs(pixels - expected).max() <= 1
    finally:
        server.stop()

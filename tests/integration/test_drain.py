"""Drain on SIGTERM (issue 43), through the real launcher: a request of 30 slow steps (0.3 s each, faults.py
``step_delay_s``) with a resume_key runs on a model that checkpoints every 2 steps; once its progress is
past step 6 the launcher gets SIGTERM with ``--drain-s 3``. The request cannot finish in the drain: it is
checkpointed and answered UNAVAILABLE naming its key, every model marks itself drained, the launcher exits.
A new server on the same checkpoint_dir resumes the resent request from where the drain left it, and its
image equals the uninterrupted one (the same request on a twin model without checkpoints or faults)."""

from __future__ import annotations

import io
import json
import queue
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from PIL import Image
from triton_diffusion_client.retry import hint_of

from tests.faults import copy_model
from triton_diffusion.serving.server_process import WEIGHTS, RunningServer, start_server
from triton_diffusion.tiny_models import build_missing

DRAINING, PLAIN = "sd_drain", "sd_plain"
KEY = "drained-request-0123456789"
REQUEST = {"num_inference_steps": 30, "seed": 4321, "guidance_scale": 7.5, "resume_key": KEY}
EVERY, STEP_DELAY_S, DRAIN_S = 2, 0.3, 3


class Stream:
    """One request on its own gRPC stream, its responses read as they come."""

    def __init__(self, server: RunningServer, model: str, fields: dict[str, Any]) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))
        tensor = grpcclient.InferInput("PROMPT", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[b"a lighthouse at dusk"]], dtype=object))
        self.client.async_stream_infer(model, [tensor], parameters=fields, enable_empty_final_response=True)

    def next(self) -> tuple[int | None, str | None, Any]:
        """(the step of a progress response, None, None), or for the final one (None, the error, None) or
        (None, None, (pixels, BATCH)). Bounded: a lost answer fails the test, it never hangs it."""
        result, error = self.responses.get(timeout=120)
        if error is not None:
            return None, str(error), None
        if not result.get_response().parameters["triton_final_response"].bool_param:
            return int(result.as_numpy("STEP").reshape(-1)[0]), None, None
        png = bytes(result.as_numpy("IMAGE").reshape(-1)[0])
        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)
        return None, None, (pixels, json.loads(result.as_numpy("BATCH").reshape(-1)[0]))

    def final(self) -> tuple[str | None, Any]:
        while True:
            step, error, answer = self.next()
            if step is None:
                return error, answer

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def answer(server: RunningServer, model: str, fields: dict[str, Any]) -> tuple[str | None, Any]:
    stream = Stream(server, model, fields)
    try:
        return stream.final()
    finally:
        stream.close()


def checkpoints_gone(checkpoints: Path, key: str, timeout_s: float = 30.0) -> bool:
    """Whether the key's checkpoints are gone within ``timeout_s``: they are removed after the answer goes
    out (the checkpoint store's writer thread deletes them), so the client can read the answer first."""
    deadline = time.monotonic() + timeout_s
    while list(checkpoints.glob(f"{key}*")):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def make_repo(repo: Path, checkpoints: Path, slow: bool) -> None:
    weights = {"model": str(WEIGHTS / "tiny-sd")}
    edits = {**weights, "checkpoint_every_steps": str(EVERY), "checkpoint_dir": str(checkpoints)}
    if slow:
        edits["fault_injection"] = f'{{"step_delay_s": {STEP_DELAY_S}}}'
    copy_model("text_to_image", repo, DRAINING, edits)
    copy_model("text_to_image", repo, PLAIN, weights)


def test_sigterm_checkpoints_what_cannot_finish_and_a_new_server_resumes_it(tmp_path: Path):
    build_missing(WEIGHTS, only=["tiny-sd"])
    checkpoints = tmp_path / "checkpoints"
    first_repo, second_repo = tmp_path / "repo", tmp_path / "repo2"
    make_repo(first_repo, checkpoints, slow=True)
    make_repo(second_repo, checkpoints, slow=False)  # the same model and checkpoint_dir, at full speed
    args = [f"--drain-s={DRAIN_S}", "--exit-timeout-secs=5"]
    server = start_server(first_repo, tmp_path / "server.log", [DRAINING, PLAIN], extra_args=args)
    try:
        error, reference = answer(server, PLAIN, REQUEST)  # uninterrupted; no checkpoints, no faults
        assert error is None, error
        expected, plain_batch = reference
        assert plain_batch["checkpoints"] == "off"

        stream = Stream(server, DRAINING, {**REQUEST, "progress": True})
        try:
            step = 0
            while step <= 6:  # past step 6: its checkpoint at step 6 was taken
                step, error, _ = stream.next()
                assert step is not None, error
            server.process.send_signal(signal.SIGTERM)  # the launcher: drain, then stop
            error, result = stream.final()
        finally:
            stream.close()
        assert result is None and error is not None, "a request of 30 slow steps finished within the drain"
        assert error.rstrip().endswith("[UNAVAILABLE]") and f"resend with resume_key {KEY}" in error, error
        checkpointed = int(error.split("checkpointed at step ")[1].split(";")[0])
        assert hint_of(error) == {"retry": "resume", "resume_key": KEY, "step": checkpointed}, error
        assert checkpointed >= 7, error  # taken at the drain, past the last periodic one
        assert server.process.wait(timeout=60) is not None  # the launcher exits ...
        log = server.log()
        assert "every model drained" in log, log[-4000:]  # ... once both models marked themselves
        assert (checkpoints / f"{KEY}.0.safetensors").exists()
    finally:
        server.stop()

    server = start_server(second_repo, tmp_path / "server2.log", [DRAINING])
    try:
        error, resumed = answer(server, DRAINING, REQUEST)  # the client's resend: the same key and fields
        assert error is None, error
        pixels, batch = resumed
        assert batch["checkpoints"] == "on" and "warnings" not in batch, batch
        assert batch["resumed_from_step"] == checkpointed >= 6
        assert np.abs(pixels - expected).max() <= 1
        assert checkpoints_gone(checkpoints, KEY)  # answered: its checkpoint goes
    finally:
        server.stop()

"""A killed Python backend stub is noticed, reported and recovered without a person (the launcher's
supervisor restarts the server), no request hangs, the OpenAI front follows Triton down and back up, a
streamed diffusion-LM reply cut by the kill is resent by the project client and by the front without a
block repeated or changed, and the server still stops on SIGTERM afterwards."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import httpx
import openai
import pytest
from triton_diffusion_client.text import generate_text_one
from tritonclient.utils import InferenceServerException

from tests.faults import copy_model
from triton_diffusion.serving.server_process import (
    WEIGHTS,
    free_port,
    read_metrics,
    set_batching,
    start_server,
)
from triton_diffusion.serving.supervisor import list_stubs

from .test_reliability import send_raw


def recovery_s(start_s: float) -> float:
    """How long a restart may take here: a whole server's start (every model loads again), measured in the
    test as its first start, three times over (a busier moment) and a minute for the notice and the old
    server's exit. A supervisor that took a minute more to come back fails it."""
    return 3 * start_s + 60


def status(url: str) -> int:
    """The HTTP status, or 0 when nothing answers (the server is restarting)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


def read(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def test_a_killed_stub_is_noticed_reported_and_recovered(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_model(
        "text_to_image",
        repo,
        "text_to_image",
        {"model": str(WEIGHTS / "tiny-sd"), "fault_injection": '{"step_delay_s": 0.1}'},
    )
    copy_model(  # slowed so that a reply is mid-stream when its stub is killed; float64, so that replies
        # that shared forwards and one that ran alone sample the same tokens (docs/contributing.md#exactness)
        "diffusion_lm",
        repo,
        "diffusion_lm",
        {
            "model": str(WEIGHTS / "tiny-dllm"),
            "dtype": "float64",
            "fault_injection": '{"step_delay_s": 0.1}',
        },
    )
    log_path = tmp_path / "server.log"
    front_port = free_port()
    front = f"http://127.0.0.1:{front_port}"
    args = ["--exit-timeout-secs=5", f"--openai-port={front_port}", "--openai-address=127.0.0.1"]
    starting = time.monotonic()
    server = start_server(repo, log_path, ["diffusion_lm", "text_to_image"], extra_args=args)
    limit_s = recovery_s(time.monotonic() - starting)
    ready_url = f"{server.http_url}/v2/models/text_to_image/ready"
    image = {"prompt": "through the front", "num_inference_steps": 2, "response_format": "b64_json"}
    try:
        assert send_raw(server.grpc_url, "text_to_image", b"warm up")[0]
        deadline = time.monotonic() + 60
        while status(f"{front}/health") != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        # One line says the server is ready, with where to reach it (the supervisor's next poll prints it).
        while "READY" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        ready = next(line for line in server.log().splitlines() if "triton-diffusion: READY" in line)
        assert (
            "2 models (diffusion_lm, text_to_image)" in ready and f"http://localhost:{front_port}/v1" in ready
        ), ready
        # The front keeps this request's gRPC stream for the next one: the restart must not strand it.
        assert httpx.post(f"{front}/v1/images/generations", json=image, timeout=60).status_code == 200
        in_flight = queue.Queue()
        threading.Thread(
            target=lambda: in_flight.put(
                send_raw(server.grpc_url, "text_to_image", b"long", parameters={"num_inference_steps": 50})
            ),
            daemon=True,
        ).start()
        # Two streamed LM replies, 8 blocks of 4 tokens in 32 stalled steps (3.2 s): one through the project
        # client, one through the front; both have delivered a block when the stubs die.
        lm = {"gen_length": 32, "block_length": 4, "steps": 32, "temperature": 1.0}
        streamed = {name: threading.Event() for name in ("client", "front")}
        client_reply = queue.Queue()
        threading.Thread(
            target=lambda: client_reply.put(
                generate_text_one(
                    {"prompt": "the sea", **lm},
                    url=server.grpc_url,
                    timeout_s=120,
                    on_block=lambda block: streamed["client"].set(),
                )
            ),
            daemon=True,
        ).start()
        front_client = openai.OpenAI(base_url=f"{front}/v1", api_key="unused", max_retries=0, timeout=120)
        chat = {"model": "diffusion_lm", "messages": [{"role": "user", "content": "the sea"}], "seed": 11}
        front_body = {"block_length": 4, "steps": 32, "temperature": 1.0}
        front_pieces = queue.Queue()
        pieces: list[str] = []  # the front's streamed pieces so far (one a block)

        def front_stream() -> None:
            try:
                chunks = front_client.chat.completions.create(
                    **chat, max_tokens=32, stream=True, extra_body=front_body
                )
                for chunk in chunks:
                    if chunk.choices and chunk.choices[0].delta.content:
                        pieces.append(chunk.choices[0].delta.content)
                        streamed["front"].set()
                front_pieces.put(pieces)
            except Exception as exc:  # noqa: BLE001  (the main thread reports it)
                front_pieces.put(exc)

        threading.Thread(target=front_stream, daemon=True).start()
        time.sleep(1.5)  # the image request is now running (50 stalled steps: 5 s)
        waited = {name: event.wait(20) for name, event in streamed.items()}
        assert all(waited.values()), (waited, list(front_pieces.queue), list(client_reply.queue))
        stubs = [s for s in list_stubs(server.process.pid) if s.model in ("text_to_image", "diffusion_lm")]
        assert len(stubs) == 2, stubs
        # text_to_image's first, and gone from the listing before the second kill: a supervisor poll after
        # both sees it dead (the log check below), one between them too, and the restart ends
        # diffusion_lm's stub anyway. (Killed together, the larger process can take longer to exit: a
        # poll could then see only diffusion_lm's gone.)
        first, second = sorted(stubs, key=lambda s: s.model != "text_to_image")
        os.kill(first.pid, signal.SIGKILL)
        gone_by = time.monotonic() + 10
        while first.pid in {s.pid for s in list_stubs(server.process.pid)}:
            assert time.monotonic() < gone_by, "the killed text_to_image stub stayed listed"
            time.sleep(0.01)
        # Only if it is still that stub: a restart begun in between may have ended it (and its pid be reused).
        if second.shm_region in {s.shm_region for s in list_stubs(server.process.pid) if s.pid == second.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(second.pid, signal.SIGKILL)
        killed = time.monotonic()
        front_at_kill = len(pieces)

        # Noticed within seconds: not ready (the supervisor restarts the server).
        seen_not_ready = False
        while time.monotonic() - killed < 10 and not seen_not_ready:
            seen_not_ready = status(f"{server.health_url}/readyz") != 200 and status(ready_url) != 200
            time.sleep(0.05)
        assert seen_not_ready, "the dead model kept reporting ready"
        front_down = False  # the front follows Triton: not ready while it restarts
        while time.monotonic() - killed < 20 and not front_down:
            front_down = status(f"{front}/health") == 503
            time.sleep(0.05)
        assert front_down, "the front kept reporting ready while Triton was down"
        ok, error = in_flight.get(timeout=30)  # the request that was running: an error, not a hang
        assert not ok and error, error
        # A request sent meanwhile is refused at once (the server is down: gRPC UNAVAILABLE).
        started = time.monotonic()
        try:
            ok, error = send_raw(server.grpc_url, "text_to_image", b"during recovery", timeout_s=30)
        except InferenceServerException as exc:
            ok, error = False, str(exc)
        if not ok:
            assert time.monotonic() - started < 5 and error, error

        # Recovered without a person (the supervisor says so once the new server serves: the old one may
        # answer its HTTP ready while it stops), within limit_s.
        def recovered() -> bool:
            return status(f"{server.health_url}/readyz") == 200 and status(ready_url) == 200

        while not recovered() and time.monotonic() - killed < limit_s:
            time.sleep(0.2)
        assert recovered(), f"not back within {limit_s:.0f} s"

        # A gRPC channel to the address backs off reconnecting after the refusals of the restart (gRPC shares
        # subchannels across clients): a few seconds more at most.
        def after_recovery() -> tuple[bool, str]:
            try:
                return send_raw(server.grpc_url, "text_to_image", b"after recovery")
            except InferenceServerException as exc:  # the stream of a channel still backing off
                return False, f"failed to connect: {exc}"

        ok, error = after_recovery()
        while not ok and "failed to connect" in str(error) and time.monotonic() - killed < limit_s:
            time.sleep(0.5)
            ok, error = after_recovery()
        assert ok, error
        # The front recovers with Triton, on a fresh stream (the pooled one went with the old server).
        while status(f"{front}/health") != 200 and time.monotonic() - killed < limit_s:
            time.sleep(0.2)
        answers = [httpx.post(f"{front}/v1/images/generations", json=image, timeout=60) for _ in range(2)]
        assert [a.status_code for a in answers] == [200, 200], answers[0].text
        # The LM replies cut by the kill were resent and end in what one uninterrupted run streams: the
        # client's blocks are those of a fresh request with its resume key (its seed), none repeated; the
        # front's pieces are the text of a fresh request with its seed.
        reply = client_reply.get(timeout=120)
        assert reply.ok and reply.attempts >= 2, (reply.error, reply.attempts)
        again = generate_text_one(
            {"prompt": "the sea", **lm, "resume_key": reply.resume_key}, url=server.grpc_url
        )
        assert again.ok and again.attempts == 1, again.error
        # Every block once, in order, as one uninterrupted run streams them (up to 8: the seed, drawn from
        # the random resume key, may sample an EOS earlier, which ends the reply after that block).
        assert [b.index for b in reply.blocks] == list(range(len(again.blocks)))
        assert 1 <= len(again.blocks) <= 8
        assert [b.text for b in reply.blocks] == [b.text for b in again.blocks] and reply.text == again.text
        streamed_pieces = front_pieces.get(timeout=120)
        assert isinstance(streamed_pieces, list), streamed_pieces
        assert 1 <= front_at_kill < 8  # cut mid-stream: the rest came from its resend
        whole = front_client.chat.completions.create(**chat, max_tokens=32, extra_body=front_body)
        assert "".join(streamed_pieces) == whole.choices[0].message.content

        log = server.log()
        assert re.search(r"Python backend stub [^\n]*text_to_image_0_0[^\n]* died", log), log
        assert "serves again" in log
        metrics = read(f"{server.health_url}/metrics")
        assert 'triton_diffusion_server_restarts_total{reason="stub died",model="text_to_image"} 1' in metrics
        assert "triton_diffusion_up 1" in metrics
        assert status(f"{server.health_url}/readyz") == 200 and status(f"{server.health_url}/healthz") == 200
        # Clients cannot load or unload models (model control stays Triton's default: none).
        unload = urllib.request.Request(
            f"{server.http_url}/v2/repository/models/text_to_image/unload", data=b"{}", method="POST"
        )
        try:
            urllib.request.urlopen(unload, timeout=5)
            raise AssertionError("clients can unload models")
        except urllib.error.HTTPError as error:
            assert error.code >= 400

        # The server still stops on SIGTERM: within its exit timeout (5 s), the supervisor's kill after it
        # (10 s more) and a slow machine's margin.
        stopping = time.monotonic()
        os.killpg(server.process.pid, signal.SIGTERM)
        server.process.wait(timeout=60)
        assert time.monotonic() - stopping < 30
    finally:
        server.stop()


# Each engine once and each fault once (a server start and a restart each, about 30 s): the worker that
# answers what was held and asks for the exit is one for both engines, and both faults on both engines are
# covered in process (tests/unit/test_step_engine.py: the stall watchdog and device loss through the worker;
# tests/unit/test_executor.py: device loss in a fused call).
@pytest.mark.parametrize("engine, fault", [("step", "device_lost"), ("request", "stall")])
def test_a_failed_gpu_or_a_stuck_engine_answers_what_it_held_and_the_model_comes_back(
    tmp_path, engine, fault
):
    """A sticky CUDA error (simulated: the fault raises what torch raises) leaves nothing runnable in the
    process; a forward that never returns (a deadlock, a hung kernel) leaves the engine stuck while the
    stub lives on. Either way every request held is answered UNAVAILABLE, the stub exits, the supervisor
    restarts the server."""
    repo = tmp_path / "repo"
    repo.mkdir()
    trigger = "xid" if fault == "device_lost" else "hang"
    faults = f'{{"{fault}_on_prompt": "{trigger}", "step_delay_s": 0.05}}'
    parameters = {"model": str(WEIGHTS / "tiny-sd"), "engine": engine, "fault_injection": faults}
    if fault == "stall":
        parameters["engine_stall_s"] = "3"
    expected = "accelerator failed" if fault == "device_lost" else "reported nothing"
    copy_model("text_to_image", repo, "text_to_image", parameters)
    # The request engine: the long one and the trigger in one fused call, a batch of 2 whenever both came.
    if engine == "request":
        set_batching(repo, "text_to_image", 3_000_000, max_batch_size=2)
    starting = time.monotonic()
    server = start_server(
        repo, tmp_path / "server.log", ["text_to_image"], extra_args=["--exit-timeout-secs=5"]
    )
    limit_s = recovery_s(time.monotonic() - starting)
    ready_url = f"{server.http_url}/v2/models/text_to_image/ready"
    try:
        assert send_raw(server.grpc_url, "text_to_image", b"warm up")[0]
        answers = queue.Queue()

        def send(prompt: bytes) -> None:
            answers.put(
                (
                    prompt,
                    send_raw(
                        server.grpc_url, "text_to_image", prompt, parameters={"num_inference_steps": 40}
                    ),
                )
            )

        threading.Thread(target=send, args=(b"a long one",), daemon=True).start()
        if engine == "step":  # the long one running before the trigger comes (the request engine: its batch)
            running = 'triton_diffusion_rows_in_flight{model="text_to_image"}'
            started = time.monotonic()
            while read_metrics(server).get(running, 0) < 1:
                assert time.monotonic() - started < 60, "the long request never ran"
                time.sleep(0.05)
        failed_at = time.monotonic()
        threading.Thread(target=send, args=(trigger.encode(),), daemon=True).start()
        got = dict(answers.get(timeout=60) for _ in range(2))
        for prompt, (ok, error) in got.items():  # each answered, none hangs
            assert not ok and "restarting" in error, (prompt, error)
            assert expected in error, (prompt, error)

        restarted = 'triton_diffusion_server_restarts_total{reason="stub died",model="text_to_image"} 1'
        while time.monotonic() - failed_at < limit_s:
            if restarted in read(f"{server.health_url}/metrics") and status(ready_url) == 200:
                break
            time.sleep(0.2)
        ok, error = send_raw(server.grpc_url, "text_to_image", b"after recovery")
        assert ok, error
        assert "exiting so the server restarts" in server.log()
    finally:
        server.stop()

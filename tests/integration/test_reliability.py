"""Bad input, queue policy, shutdown and request-side security, on the real server."""

import json
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from tests.faults import copy_model
from triton_diffusion.serving.launcher import REPO_ROOT
from triton_diffusion.serving.server_process import (
    WEIGHTS,
    set_batching,
    start_server,
)

VALID = b"a valid prompt"


def send_raw(url, model, prompt, tensors=None, parameters=None, timeout_s=60.0):
    """One request on its own stream: PROMPT (bytes, or None to leave it out), extra input tensors and
    request parameters exactly as given. Returns (ok, error message)."""
    client = grpcclient.InferenceServerClient(url)
    responses = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = []
    arrays = dict(tensors or {})
    if prompt is not None:
        arrays = {"PROMPT": np.array([[prompt]], dtype=object), **arrays}
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    try:
        client.async_stream_infer(
            model, inputs, parameters=parameters or {}, enable_empty_final_response=True
        )
        while True:
            result, error = responses.get(timeout=timeout_s)
            if error is not None:
                return False, str(error)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return True, None
    finally:
        client.stop_stream()
        client.close()


# Valid values of the same inputs, so batch-mates carry the same set of inputs as the bad request.
VALID_TENSORS = {
    "HEIGHT": np.array([[64]], dtype=np.int32),
    "WIDTH": np.array([[64]], dtype=np.int32),
    "NUM_INFERENCE_STEPS": np.array([[4]], dtype=np.int32),
    "NEGATIVE_PROMPT": np.array([[b"blurry"]], dtype=object),
}


SD, FLUX = "text_to_image", "text_to_image_flux"
I32 = np.int32
# (case id, model, prompt, tensors, parameters, field the error must name)
BAD_INPUT = [
    ("missing-prompt", SD, None, None, {"seed": 1}, "PROMPT"),
    ("empty-prompt", SD, b"", None, None, "prompt"),
    ("blank-prompt", SD, b"   ", None, None, "prompt"),
    ("prompt-too-long", SD, b"x" * 2001, None, None, "prompt"),
    ("prompt-not-utf8", SD, b"\xff\xfe cat", None, None, "prompt"),
    (
        "negative-prompt-not-utf8",
        SD,
        VALID,
        {"NEGATIVE_PROMPT": np.array([[b"\xc3\x28"]], dtype=object)},
        None,
        "negative_prompt",
    ),
    ("negative-prompt-too-long", SD, VALID, None, {"negative_prompt": "n" * 2001}, "negative_prompt"),
    ("unknown-parameter", SD, VALID, None, {"heigth": 64}, "heigth"),
    ("unknown-parameter-part", SD, VALID, None, {"steps": 4}, "steps"),
    ("request-names-a-model-path", SD, VALID, None, {"model": "/etc/passwd"}, "model"),
    ("request-names-a-lora", SD, VALID, None, {"lora": "../../weights/x.safetensors"}, "lora"),
    ("height-string", SD, VALID, None, {"height": "64"}, "height"),
    ("height-float", SD, VALID, None, {"height": 64.5}, "height"),
    ("height-bool", SD, VALID, None, {"height": True}, "height"),
    ("height-not-multiple", SD, VALID, None, {"height": 100}, "height"),
    ("height-zero", SD, VALID, None, {"height": 0}, "height"),
    ("height-negative", SD, VALID, None, {"height": -64}, "height"),
    ("height-over-limit", SD, VALID, None, {"height": 100000}, "height"),
    ("width-not-multiple", SD, VALID, None, {"width": 68}, "width"),
    ("width-zero", SD, VALID, None, {"width": 0}, "width"),
    ("width-negative", SD, VALID, None, {"width": -8}, "width"),
    ("width-over-limit", SD, VALID, None, {"width": 4096}, "width"),
    ("flux-height-not-multiple-of-16", FLUX, VALID, None, {"height": 72}, "height"),
    ("steps-zero", SD, VALID, None, {"num_inference_steps": 0}, "num_inference_steps"),
    ("steps-negative", SD, VALID, None, {"num_inference_steps": -1}, "num_inference_steps"),
    ("steps-over-limit", SD, VALID, None, {"num_inference_steps": 51}, "num_inference_steps"),
    ("guidance-nan", SD, VALID, None, {"guidance_scale": float("nan")}, "guidance_scale"),
    ("guidance-inf", SD, VALID, None, {"guidance_scale": float("inf")}, "guidance_scale"),
    ("guidance-negative", SD, VALID, None, {"guidance_scale": -1.0}, "guidance_scale"),
    ("guidance-over-limit", SD, VALID, None, {"guidance_scale": 31.0}, "guidance_scale"),
    ("guidance-string", SD, VALID, None, {"guidance_scale": "high"}, "guidance_scale"),
    ("true-cfg-on-a-pipeline-without-it", SD, VALID, None, {"true_cfg_scale": 2.0}, "true_cfg_scale"),
    ("flux-true-cfg-negative", FLUX, VALID, None, {"true_cfg_scale": -1.0}, "true_cfg_scale"),
    ("seed-negative", SD, VALID, None, {"seed": -1}, "seed"),
    ("seed-float", SD, VALID, None, {"seed": 1.5}, "seed"),
    ("images-per-prompt-zero", SD, VALID, None, {"num_images_per_prompt": 0}, "num_images_per_prompt"),
    ("images-per-prompt-over-cap", SD, VALID, None, {"num_images_per_prompt": 5}, "num_images_per_prompt"),
    ("unknown-scheduler", SD, VALID, None, {"scheduler": "PNDMScheduler"}, "scheduler"),
    ("scheduler-path", SD, VALID, None, {"scheduler": "../../etc/passwd"}, "scheduler"),
    ("unknown-output-format", SD, VALID, None, {"output_format": "gif"}, "output_format"),
    ("unknown-output-encoding", SD, VALID, None, {"output_encoding": "hex"}, "output_encoding"),
    ("progress-not-bool", SD, VALID, None, {"progress": "yes"}, "progress"),
    ("preview-every-negative", SD, VALID, None, {"preview_every": -1}, "preview_every"),
    ("tensor-and-parameter", SD, VALID, {"HEIGHT": np.array([[64]], dtype=I32)}, {"height": 64}, "height"),
    ("parameters-differing-by-case", SD, VALID, None, {"height": 64, "HEIGHT": 128}, "HEIGHT"),
    ("service-tier-empty", SD, VALID, None, {"service_tier": ""}, "service_tier"),
    ("service-tier-blank", SD, VALID, None, {"service_tier": "  "}, "service_tier"),
    ("prompt-with-nul", SD, b"a\0b", None, None, "prompt"),
    (
        "negative-prompt-with-nul-tensor",
        SD,
        VALID,
        {"NEGATIVE_PROMPT": np.array([[b"fog\0rain"]], dtype=object)},
        None,
        "negative_prompt",
    ),
    ("tensor-wrong-dtype", SD, VALID, {"HEIGHT": np.array([[64.0]], dtype=np.float32)}, None, "HEIGHT"),
    ("tensor-wrong-shape", SD, VALID, {"WIDTH": np.array([[64, 64]], dtype=I32)}, None, "WIDTH"),
    (
        "tensor-out-of-range",
        SD,
        VALID,
        {"NUM_INFERENCE_STEPS": np.array([[0]], dtype=I32)},
        None,
        "num_inference_steps",
    ),
]
EXPLANATIONS = (
    "allowed",
    "known:",
    "did you mean",
    "not supported",
    "UTF-8",
    "both as an input",
    "expects",
    "shape",
    "missing required",
    "NUL",
    "differ only by case",
)


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_fails_alone_with_a_clear_error(server, case):
    _, model, prompt, tensors, parameters, field = case
    mates_tensors = {name: VALID_TENSORS[name] for name in tensors or {}}
    mates_parameters = {"seed": 1} if parameters and "seed" in parameters else {}
    outcomes = [None] * 4

    def run(slot, *args):
        outcomes[slot] = send_raw(server.grpc_url, model, *args)

    threads = [threading.Thread(target=run, args=(0, prompt, tensors, parameters))]
    threads += [
        threading.Thread(target=run, args=(slot, VALID, mates_tensors, mates_parameters))
        for slot in (1, 2, 3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    ok, error = outcomes[0]
    assert not ok and field in error and any(word in error for word in EXPLANATIONS), error
    assert [o[0] for o in outcomes[1:]] == [True] * 3, outcomes
    assert send_raw(server.grpc_url, model, b"the next request")[0]  # the server answers normally


@pytest.mark.parametrize(
    "parameters, field",
    [
        ({"height": 100000}, "height"),
        ({"seed": 2**63}, "seed"),
        ({"num_images_per_prompt": 9}, "num_images_per_prompt"),
    ],
)
def test_bad_input_over_http_is_a_400_naming_the_field(server, parameters, field):
    body = json.dumps({"PROMPT": "x", "parameters": parameters}).encode()
    request = urllib.request.Request(
        f"{server.http_url}/v2/models/text_to_image/generate", data=body, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 400
    error = json.loads(info.value.read())["error"]
    assert error.startswith(f"{field}: ") and "allowed" in error


TIERS = "(allowed: one of priority, default, flex)"


@pytest.mark.parametrize(
    "prompt, tensors, parameters, says",
    [
        (VALID, None, {"service_tier": ""}, f"service_tier: got '' {TIERS}"),
        (VALID, None, {"service_tier": "  "}, f"service_tier: got '  ' {TIERS}"),
        (b"a\0b", None, None, "prompt: contains a NUL character at position 1 (allowed: no NUL"),
        (
            VALID,
            {"NEGATIVE_PROMPT": np.array([[b"a\0" + b"n" * 5000]], dtype=object)},
            None,
            "negative_prompt: contains a NUL character at position 1 (allowed: no NUL",
        ),
        (
            VALID,
            None,
            {"height": 64, "HEIGHT": 128},
            "height: sent twice, as request parameters whose names differ only by case:",
        ),
    ],
    ids=["tier-empty", "tier-blank", "prompt-nul", "negative-prompt-nul", "names-by-case"],
)
def test_hostile_strings_and_names_are_refused_saying_what_they_are(
    server, prompt, tensors, parameters, says
):
    ok, error = send_raw(server.grpc_url, SD, prompt, tensors, parameters)
    assert not ok and says in error and error.rstrip().endswith("[INVALID_ARG]"), error
    if parameters and "HEIGHT" in parameters:
        assert "'height'" in error and "'HEIGHT'" in error, error  # both names


def test_a_nul_in_a_request_parameter_is_cut_by_triton_before_the_model_sees_it(server):
    """A limit, pinned (docs/operations/security.md): Triton hands a string parameter to the model cut at
    its first NUL (its frontends pass it on as a C string), so "a\\0" and 5,000 more characters reach the
    model as "a", which it cannot refuse. As an input tensor the same value is refused by name (above);
    the project's client refuses it before sending (streams.py check_sendable). Should Triton ever pass
    the whole value on, this request is refused and the docs' paragraph must change."""
    ok, error = send_raw(server.grpc_url, SD, VALID, parameters={"negative_prompt": "a\0" + "n" * 5000})
    assert ok, error


def test_invalid_utf8_in_a_raw_grpc_request_ends_its_stream_unanswered_and_the_server_serves_on(server):
    """A limit, pinned (docs/operations/security.md): Triton's gRPC layer cannot parse a request whose
    request id or string parameter is not valid UTF-8 (protobuf refuses it); on a stream it then ends the
    whole stream with status OK, answering neither that request nor the ones sent after it on the stream.
    The model never sees it. The server itself serves on."""
    import grpc
    from tritonclient.grpc import service_pb2

    def raw(request_id: str, parameters: dict[str, str]) -> bytes:
        request = service_pb2.ModelInferRequest(model_name=SD, id=request_id)
        request.inputs.add(name="PROMPT", datatype="BYTES", shape=[1, 1])  # bytes: raw_input_contents
        request.raw_input_contents.append(len(VALID).to_bytes(4, "little") + VALID)
        for name, value in parameters.items():
            request.parameters[name].string_param = value
        request.parameters["seed"].int64_param = 1
        return request.SerializeToString()

    channel = grpc.insecure_channel(server.grpc_url)
    stream = channel.stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer",
        request_serializer=lambda message: message,
        response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
    )
    bad_id = raw("XXXX", {}).replace(b"XXXX", b"\xff\xfe\xfd\xfc")
    bad_parameter = raw("bad", {"negative_prompt": "XXXX"}).replace(b"XXXX", b"\xff\xfe\xfd\xfc")
    try:
        for bad in (bad_id, bad_parameter):
            answered = [r.infer_response.id for r in stream(iter([bad, raw("after", {})]), timeout=120)]
            assert answered == [], answered  # ended with status OK (no RpcError), nothing answered
    finally:
        channel.close()
    assert send_raw(server.grpc_url, SD, b"the next request")[0]


@pytest.fixture(scope="module")
def small_queue_server(tmp_path_factory):
    """The slow SD model with one request at a time and a queue of two, rejecting overflow at once."""
    repo = tmp_path_factory.mktemp("queue_repo")
    copy_model(
        "text_to_image",
        repo,
        "text_to_image",
        {
            "model": str(WEIGHTS / "tiny-sd"),
            "fault_injection": '{"step_delay_s": 0.05}',
            # One job held, no waiting room and no room for deadlines: execute() blocks on the second
            # request, so the queue fills however fast the host (with the default capacity of 16 all 10 were
            # taken at once).
            "max_running": "1",
            "waiting_room": "0",
            "deadline_room": "0",
        },
    )
    set_batching(repo, "text_to_image", 0, max_batch_size=1)
    config = repo / "text_to_image" / "config.pbtxt"
    config.write_text(
        config.read_text().replace(
            "max_queue_delay_microseconds: 0",
            "max_queue_delay_microseconds: 0\n  default_queue_policy { max_queue_size: 2 "
            "default_timeout_microseconds: 60000000 timeout_action: REJECT }",
        )
    )
    running = start_server(repo, tmp_path_factory.mktemp("queue_logs") / "server.log", ["text_to_image"])
    yield running
    running.stop()


def test_overload_is_rejected_quickly_by_the_queue_policy(small_queue_server):
    outcomes = []
    lock = threading.Lock()

    def run(i):
        started = time.perf_counter()
        result = send_raw(
            small_queue_server.grpc_url,
            "text_to_image",
            b"overload",
            parameters={"seed": i, "num_inference_steps": 10},
        )
        with lock:
            outcomes.append((result, time.perf_counter() - started))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    rejected = [(error, seconds) for (ok, error), seconds in outcomes if not ok]
    served = [seconds for (ok, _), seconds in outcomes if ok]
    assert len(outcomes) == 10 and served and rejected
    # Beyond the one job held, the request execute() waits with, Triton's batcher's payloads and the queue
    # of two (its timeout far off), the rest overflow the queue: how many depends on when the batcher
    # took each, so only that some did and every rejection is the queue's is checked.
    assert all("queue" in error.lower() for error, _ in rejected), rejected
    assert min(seconds for _, seconds in rejected) < 0.5  # refused at once, not after waiting in line


def test_shutdown_with_a_request_in_flight_gives_the_client_an_error_not_a_hang(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_model(
        "text_to_image",
        repo,
        "text_to_image",
        {
            "model": str(WEIGHTS / "tiny-sd"),
            # 50 steps of 400 ms: the request outlives the exit timeout (2 s) and the supervisor's kill
            # (10 s later), so even a Triton that hangs in its abort handler with connections open
            # cannot deliver its answer.
            "fault_injection": '{"step_delay_s": 0.4}',
        },
    )
    # No drain (--drain-s=0): what a request cut off by shutdown gets (a drain lets it finish first, or
    # checkpoints it: tests/integration/test_drain.py).
    running = start_server(
        repo, tmp_path / "server.log", ["text_to_image"], extra_args=["--exit-timeout-secs=2", "--drain-s=0"]
    )
    outcome = queue.Queue()
    threading.Thread(
        target=lambda: outcome.put(
            send_raw(
                running.grpc_url,
                "text_to_image",
                b"long",
                parameters={"num_inference_steps": 50},
                timeout_s=60,
            )
        ),
        daemon=True,
    ).start()
    time.sleep(2.0)  # the request is now running (50 stalled steps: 20 s)
    started = time.perf_counter()
    running.process.send_signal(signal.SIGTERM)
    try:
        ok, error = outcome.get(timeout=30)
        assert not ok and error, "a request cut off by shutdown must fail, not succeed silently"
        assert time.perf_counter() - started < 30
        running.process.wait(timeout=30)
    finally:
        running.stop()  # also ends the stub Triton leaves running after its exit timeout


def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path):
    report_path = tmp_path / "soak.json"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "soak.py"),
            # 60 requests whatever the machine's speed (each of the four hostile kinds 3 times, every 10th
            # request invalid); the duration only bounds it.
            "--requests",
            "60",
            "--duration",
            "180",
            "--warmup",
            "4",
            "--concurrency",
            "6",
            "--hostile",
            "0.2",
            "--json",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=420,  # its server's start (at most 180 s), the warm-up, the 180 s and the checks
    )
    report = json.loads(report_path.read_text())
    assert result.returncode == 0, report
    assert report["sent"] == 60 and report.get("lost", 0) == 0 and report.get("unexpected", 0) == 0
    assert report["sent_http"] > 0 and report["sent_grpc"] > 0 and report["provoked_errors"] == 12 + 6
    assert report["sent_hostile_grpc"] == 9 and report["sent_hostile_http-raw"] == 3
    assert all(report["checks"].values()), report["checks"]


def post_raw(server, model, body: bytes, stream: bool = False):
    """POST raw bytes to generate (or generate_stream); returns (status, text)."""
    endpoint = "generate_stream" if stream else "generate"
    url = f"{server.http_url}/v2/models/{model}/{endpoint}"
    request = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


@pytest.mark.parametrize("model", [SD, FLUX, "image_to_image", "text_to_video", "diffusion_lm"])
def test_an_undecodable_parameter_fails_only_its_own_request(server, model):
    """Invalid UTF-8 in one request's string parameter (possible over HTTP) used to fail its whole batch."""
    image = {"IMAGE": "data:image/png;base64," + _PNG} if model == "image_to_image" else {}
    valid = json.dumps({"PROMPT": "valid", **image, "parameters": {"seed": 1}}).encode()
    parameters = {"seed": 2, "negative_prompt": "__X__"}
    bad = json.dumps({"PROMPT": "bad", **image, "parameters": parameters}).encode()
    bad = bad.replace(b"__X__", b"ab\xff\xfe")
    if model == "diffusion_lm":
        valid = valid.replace(b'"seed": 1', b'"seed": 1, "stream": false')
        bad = bad.replace(b'"negative_prompt"', b'"stream": false, "prompt_note"')
    outcomes = [None] * 5

    def run(slot, body):
        outcomes[slot] = post_raw(server, model, body)

    threads = [threading.Thread(target=run, args=(slot, bad if slot == 2 else valid)) for slot in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    status, text = outcomes[2]
    assert status == 400 and "parameters: a request parameter is not valid UTF-8" in text, outcomes[2]
    assert [o[0] for i, o in enumerate(outcomes) if i != 2] == [200] * 4, outcomes


def _small_png_base64() -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


_PNG = _small_png_base64()


@pytest.mark.parametrize(
    "parameters, field",
    [
        ({"scheduler": "x" * 1_000_000}, "scheduler"),
        ({"y" * 1_000_000: 1}, "'yyyy"),
        ({"output_format": "z" * 100_000}, "output_format"),
    ],
)
def test_error_messages_quote_at_most_a_short_prefix_of_what_was_sent(server, parameters, field):
    ok, error = send_raw(server.grpc_url, SD, VALID, parameters=parameters)
    assert not ok and field in error and len(error) < 1000, error[:300]

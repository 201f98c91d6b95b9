"""Text-to-video on the real server (the step engine: Wan has a step adapter): batch invariance on raw
frames, MP4 output, frames in the shape group, progress with previews."""

import base64
import io
import json

import av
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from PIL import Image

from .test_image_to_image import run_concurrently

MODEL = "text_to_video"


def send(server, requests, partials=None):
    """requests: dicts of fields (prompt included); returns (error, outputs) for each, concurrently.
    ``partials``: a list that receives the progress responses' outputs (STEP, TOTAL_STEPS, PREVIEW)."""

    def one(request):
        fields = dict(request)
        prompt = grpcclient.InferInput("PROMPT", [1, 1], "BYTES")
        prompt.set_data_from_numpy(np.array([[fields.pop("prompt").encode()]], dtype=object))
        client = grpcclient.InferenceServerClient(server.grpc_url)
        results = []
        client.start_stream(callback=lambda result, error: results.append((result, error)))
        client.async_stream_infer(MODEL, [prompt], parameters=fields)
        client.stop_stream()
        client.close()
        result, error = results[-1]
        for partial, _ in results[:-1]:
            if partials is not None and partial is not None:
                partials.append({name: partial.as_numpy(name) for name in ("STEP", "TOTAL_STEPS", "PREVIEW")})
        if error is not None:
            return str(error), None
        outputs = {name: result.as_numpy(name) for name in ("VIDEO", "FRAMES", "SEED", "BATCH")}
        outputs["BATCH"] = json.loads(outputs["BATCH"].reshape(-1)[0])
        return None, outputs

    return run_concurrently(one, requests)


def test_batch_invariance_on_raw_frames(server):
    target = {"prompt": "a boat at sea", "seed": 3, "output_format": "frames"}
    ((error, alone),) = send(server, [target])
    assert error is None, error
    others = [{"prompt": f"other video {i}", "seed": 10 + i, "output_format": "frames"} for i in range(3)]
    batch = send(server, [others[0], target, *others[1:]])
    assert all(e is None for e, _ in batch), batch
    among = batch[1][1]
    assert alone["BATCH"]["engine"] == among["BATCH"]["engine"] == "step"
    assert alone["BATCH"]["most_rows_shared"] == 1 and among["BATCH"]["most_rows_shared"] >= 2
    assert alone["BATCH"]["forwards"] == among["BATCH"]["forwards"] == 3  # the configured default steps
    assert alone["FRAMES"].shape == (1, 1, 9, 64, 64, 3) and alone["FRAMES"].dtype == np.uint8
    assert np.abs(alone["FRAMES"].astype(int) - among["FRAMES"].astype(int)).max() <= 1


def test_mp4_decodes_to_the_requested_frames_and_size(server):
    ((error, out),) = send(
        server, [{"prompt": "a red kite", "seed": 1, "num_frames": 13, "height": 64, "width": 96, "fps": 8}]
    )
    assert error is None, error
    data = bytes(out["VIDEO"].reshape(-1)[0])
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        assert stream.average_rate == 8
    assert len(frames) == 13 and frames[0].shape == (64, 96, 3)


def test_frame_counts_are_in_the_key(server):
    results = send(
        server,
        [
            {"prompt": f"frames {i}", "seed": i, "num_frames": 5 if i % 2 else 9, "output_format": "frames"}
            for i in range(4)
        ],
    )
    for error, out in results:
        assert error is None, error
        frames = out["FRAMES"].shape[2]
        assert out["BATCH"]["key"] == {"height": 64, "width": 64, "num_frames": frames}
        # Two videos of each frame count: a forward never holds videos of the other count.
        assert out["BATCH"]["most_rows_shared"] <= 2
    assert max(out["BATCH"]["most_rows_shared"] for _, out in results) == 2


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"num_frames": 10}, "num_frames: got 10 (allowed: 5..33, 4k+1)"),
        ({"num_frames": 101}, "num_frames: got 101"),
        ({"fps": 0}, "fps: got 0"),
        ({"output_format": "gif"}, "output_format: got 'gif'"),
    ],
)
def test_bad_video_fields_fail_alone(server, fields, words):
    results = send(server, [{"prompt": "bad", "seed": 1, **fields}, {"prompt": "good", "seed": 2}])
    assert results[0][0] is not None and words in results[0][0], results[0][0]
    assert results[1][0] is None


def test_fps_is_applied_after_the_split_and_base64_is_honoured(server):
    results = send(
        server,
        [
            {"prompt": "fps 8", "seed": 1, "fps": 8, "output_encoding": "base64"},
            {"prompt": "fps 24", "seed": 2, "fps": 24},
        ],
    )
    (error_a, a), (error_b, b) = results
    assert error_a is None and error_b is None, results
    # Different frame rates share forwards: fps only sets the MP4's rate.
    assert a["BATCH"]["most_rows_shared"] == b["BATCH"]["most_rows_shared"] == 2
    assert "fps" not in a["BATCH"]["key"]
    encoded = bytes(a["VIDEO"].reshape(-1)[0])
    assert not encoded.startswith(b"\x00\x00\x00") and encoded[:4] != bytes(b["VIDEO"].reshape(-1)[0])[:4]
    for data, rate in ((base64.b64decode(encoded, validate=True), 8), (bytes(b["VIDEO"].reshape(-1)[0]), 24)):
        with av.open(io.BytesIO(data)) as container:
            assert container.streams.video[0].average_rate == rate


def test_progress_and_a_preview_of_the_middle_frame_every_step(server):
    partials = []
    ((error, out),) = send(
        server,
        [{"prompt": "progress", "seed": 5, "num_inference_steps": 4, "progress": True, "preview_every": 1}],
        partials,
    )
    assert error is None, error
    assert [int(p["STEP"].reshape(-1)[0]) for p in partials] == [1, 2, 3, 4]
    assert {int(p["TOTAL_STEPS"].reshape(-1)[0]) for p in partials} == {4}
    previews = [Image.open(io.BytesIO(bytes(p["PREVIEW"].reshape(-1)[0]))) for p in partials]
    assert all(preview.format == "PNG" and preview.size == (8, 8) for preview in previews)  # latent size

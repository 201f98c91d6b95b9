"""A stream the client cancels leaves no thread behind (client/.../streams.py ``end_request_iterator``):
tritonclient's cancelling stop leaves gRPC's request-reading thread blocked for good unless the requests
side is ended first, through one private name of tritonclient, which this test also pins."""

from __future__ import annotations

import sys
import time
import traceback

import pytest
import tritonclient.grpc as grpcclient
from triton_diffusion_client.streams import ResponseError, StreamSession, end_request_iterator

from triton_diffusion.serving.server_process import free_port


def request_threads() -> list[int]:
    """gRPC's threads that read a stream's request iterator (in ``consume_request_iterator``)."""
    found = []
    for ident, frame in sys._current_frames().items():
        names = [f.f_code.co_name for f, _ in traceback.walk_stack(frame)]
        if "consume_request_iterator" in names:
            found.append(ident)
    return found


def settled(count: int, timeout_s: float = 5.0) -> int:
    """The number of such threads once it falls to ``count`` (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while len(request_threads()) > count and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(request_threads())


def test_a_cancelled_stream_leaves_no_request_thread():
    url = f"localhost:{free_port()}"  # nothing listens: each request fails, and its stream is cancelled
    before = len(request_threads())
    with StreamSession(url, "text_to_image") as session:
        for i in range(5):
            with pytest.raises(ResponseError):
                list(session.responses({"PROMPT": b"x"}, {}, f"r{i}", timeout_s=10.0))
    assert settled(before) == before


def test_without_it_tritonclient_leaves_the_thread_and_its_private_name_is_where_it_is_used():
    # What end_request_iterator is for: a cancelling stop alone leaves the thread (were tritonclient to
    # end it itself, this fails, and the private piece can go).
    client = grpcclient.InferenceServerClient(f"localhost:{free_port()}")
    before = len(request_threads())
    client.start_stream(callback=lambda result, error: None)
    stream = client._stream
    client.stop_stream(cancel_requests=True)
    assert settled(before, timeout_s=0.5) == before + 1
    stream._request_queue.put(None)  # the private name end_request_iterator uses, as it uses it
    assert settled(before) == before
    client.start_stream(callback=lambda result, error: None)
    end_request_iterator(client)
    client.stop_stream(cancel_requests=True)
    assert settled(before) == before
    client.close()

"""A stream the client cancels leaves no thread behind (client/.../streams.py ``end_request_iterator``):
tritonclient's cancelling stop leaves gRPC's request-reading thread blocked for good unless the requests
side is ended first, through private attributes of tritonclient, which this test also pins. Each stream
here has sent nothing, so that thread is waiting for a request when the stream stops (as it is after a
request was sent and answered: tests/integration/test_progress_cancel_metrics.py through a server)."""

from __future__ import annotations

import sys
import time
import traceback

import tritonclient.grpc as grpcclient
from triton_diffusion_client.streams import StreamSession, stop_cancelling

from triton_diffusion.serving.server_process import free_port


def request_threads() -> set[int]:
    """gRPC's threads that read a stream's request iterator (in ``consume_request_iterator``)."""
    found = set()
    for ident, frame in sys._current_frames().items():
        names = [f.f_code.co_name for f, _ in traceback.walk_stack(frame)]
        if "consume_request_iterator" in names:
            found.add(ident)
    return found


def left_behind(before: set[int], timeout_s: float = 5.0) -> set[int]:
    """Such threads not in ``before`` once none is left (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (new := request_threads() - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    return new


def test_a_closed_session_leaves_no_request_thread():
    before = request_threads()
    session = StreamSession(f"localhost:{free_port()}", "text_to_image")
    session.client.start_stream(callback=lambda result, error: None)
    session._streaming = True  # as after a request answered on it
    session.close()
    assert left_behind(before) == set()


def test_without_it_tritonclient_leaves_the_thread_and_its_private_names_are_where_they_are_used():
    # What end_request_iterator is for: a cancelling stop alone leaves the thread (were tritonclient to
    # end it itself, this fails, and the private piece can go).
    client = grpcclient.InferenceServerClient(f"localhost:{free_port()}")
    before = request_threads()
    client.start_stream(callback=lambda result, error: None)
    stream = client._stream
    client.stop_stream(cancel_requests=True)
    assert len(left_behind(before, timeout_s=0.5)) == 1
    stream._request_queue.put(None)  # the private names stop_cancelling uses, as it uses them
    assert left_behind(before) == set()
    client.start_stream(callback=lambda result, error: None)
    stop_cancelling(client)
    assert left_behind(before) == set()
    client.close()

"""A response channel that writes down what a request was sent: the stand-in for a Triton response
sender in unit tests of the engines (integration tests use the real server)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from triton_diffusion.errors import RequestError
from triton_diffusion.serving.cancellations import ClientAborts
from triton_diffusion.serving.requests import TrackedRequest


class RecordingChannel:
    def __init__(self, cancelled: bool | Callable[[], bool] = False, fail_final: bool = False) -> None:
        self.partials: list[Any] = []
        self.finals: list[Any] = []  # outputs, or a RequestError
        self.cancelled = cancelled
        self.fail_final = fail_final

    def send_partial(self, outputs: Any) -> None:
        self.partials.append(outputs)

    def send_final(self, outputs: Any) -> None:
        if self.fail_final:
            raise RuntimeError("shared memory full")
        self.finals.append(outputs)

    def send_error(self, error: RequestError) -> None:
        self.finals.append(error)

    def is_cancelled(self) -> bool:
        return self.cancelled() if callable(self.cancelled) else self.cancelled


def tracked(name: str, **channel: Any) -> TrackedRequest:
    return TrackedRequest(name, RecordingChannel(**channel))


def deliver_errors(report: Any) -> None:
    """What the serving host does with a step report's departures: the error an engine decided for a
    request (a failure, a cancellation, a deadline) ends it and goes out (TrackedRequest.end, then
    TrackedRequest.deliver; each a no-op the second time)."""
    for left in report.left:
        if left.error is not None:
            left.job.request.end(left.error)
    for left in report.left:
        if left.reason != "finished":
            left.job.request.deliver()


def step_as_worker(engine: Any) -> Any:
    """One engine step as the host's worker runs it: the aborts of the requests the engine holds (cancelled
    by their clients, or answered already) handed in first."""
    held = engine.held_requests()
    if held:
        engine.abort(ClientAborts().aborted(held))
    return engine.step()

"""What the engines need of a request (a :class:`Request`): whether it has ended, to end it with an error,
to ask whether its client cancelled it. The serving layer's TrackedRequest (serving/requests.py) is the
one implementation: it also sends the answers, which the engines never do."""

from __future__ import annotations

from typing import Protocol

from triton_diffusion.errors import RequestError


class Request(Protocol):
    request_id: str
    entered: float  # perf_counter time it reached execute(): what deadlines count from

    @property
    def ended(self) -> bool:
        """An answer is decided: nothing more is computed for it."""

    @property
    def error(self) -> RequestError | None:
        """The error an engine decided for it, if any."""

    def start(self) -> None:
        """Its first job started running."""

    def end(self, error: RequestError) -> bool:
        """Decide its error (sent by the serving layer, in order). False if it had ended already."""

    def is_cancelled(self) -> bool:
        """Ask its client (a round trip to the server)."""

"""Requests as the engines see them: data in, data out.

An engine reads two attributes of a host's request (:class:`Request`: its id and when it entered) and
calls none of its methods. What the engine knows of a request it holds jobs of is its own record
(:class:`RequestStatus`, one per request, shared by the request's jobs): whether it ended and with which
error. Cancellations come in as data, an :class:`Abort` list: the host's worker hands it to the engine
before each step (``engine.abort``, for the requests ``engine.held_requests()`` lists); inside a fused
call, between two denoising steps, the request-level engine asks an :class:`AbortSource` for it.
What ended, and why, leaves in the step's report (``StepReport.left``), and only the host answers.
This is vLLM's engine-core boundary: aborts in, outputs out, no client request object inside.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from triton_diffusion.errors import ErrorCode, RequestError

if TYPE_CHECKING:
    from triton_diffusion.engine.jobs import Job

log = logging.getLogger("triton_diffusion")


class Request(Protocol):
    """A host's request, as data: the engines read these and nothing else."""

    @property
    def request_id(self) -> str: ...

    @property
    def entered(self) -> float:
        """perf_counter time it reached execute(): what deadlines count from."""


@dataclass(frozen=True)
class Abort:
    """A held request the engine must drop: its client cancelled it (``error`` None: the engine words the
    CANCELLED error, with where it was), or the host ended it already with ``error``."""

    request: Request
    error: RequestError | None = None


class AbortSource(Protocol):
    """Where aborts come from (the serving host asks Triton, at most once per poll interval each)."""

    def aborted(self, held: Sequence[Request]) -> list[Abort]:
        """Of these held requests (none ended in the engine), those to drop now."""


class NoAborts:
    """Nothing is ever aborted (an engine driven without a host: benchmarks, tests)."""

    def aborted(self, held: Sequence[Request]) -> list[Abort]:
        return []


@dataclass(eq=False)
class RequestStatus:
    """The engine's record of one request: its jobs held, and its end (an error decided here, or an
    abort's). Its jobs leave once it ended."""

    request: Request
    jobs: int = 0
    error: RequestError | None = None

    @property
    def ended(self) -> bool:
        return self.error is not None

    @property
    def cancelled(self) -> bool:
        return self.error is not None and self.error.code is ErrorCode.CANCELLED

    def end(self, error: RequestError) -> bool:
        """End it with ``error``. False if it had ended."""
        if self.error is not None:
            return False
        self.error = error
        return True


class RequestTable:
    """Each held request's :class:`RequestStatus`, found from its jobs (``job.status``). Jobs of one request
    are the jobs that share one request object; a record lives while it has jobs held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_request: dict[int, RequestStatus] = {}  # id(request): its jobs hold it, so the id is live
        self._held: set[int] = set()  # id() of the jobs attached and not detached

    def attach(self, *jobs: Job) -> None:
        """The jobs of one request (or of several), together: none can leave before all share the record."""
        with self._lock:
            for job in jobs:
                status = self._by_request.get(id(job.request))
                if status is None:
                    status = self._by_request[id(job.request)] = RequestStatus(job.request)
                status.jobs += 1
                job.status = status
                self._held.add(id(job))

    def detach(self, job: Job) -> None:
        """The job left (a no-op for one that left already)."""
        with self._lock:
            if id(job) not in self._held:
                return
            self._held.discard(id(job))
            status = job.status
            status.jobs -= 1
            if status.jobs <= 0 and self._by_request.get(id(job.request)) is status:
                del self._by_request[id(job.request)]

    def __len__(self) -> int:
        """Requests held."""
        with self._lock:
            return len(self._by_request)


def held_requests(jobs: Sequence[Job]) -> list[Request]:
    """The requests of these jobs not ended yet, once each, in order."""
    first: dict[int, Request] = {}
    for job in jobs:
        if not job.status.ended:
            first.setdefault(id(job.request), job.request)
    return list(first.values())


def apply_aborts(
    jobs: Sequence[Job], aborts: Sequence[Abort], where: str | None = None
) -> list[RequestStatus]:
    """End the requests of these jobs that ``aborts`` names: one its client cancelled with CANCELLED
    ("cancelled after step 3/8": ``where``, else its first job's steps), one the host ended with the
    host's error. Returns the statuses ended here."""
    if not aborts:
        return []
    first: dict[int, Job] = {}
    for job in jobs:
        first.setdefault(id(job.request), job)
    ended = []
    for abort in aborts:
        held = first.get(id(abort.request))
        if held is None:
            continue  # it left meanwhile
        error = abort.error
        if error is None:
            at = where or f"after step {held.run.steps_done}/{held.planned}"
            error = RequestError(ErrorCode.CANCELLED, f"cancelled {at}")
        if held.status.end(error):
            if abort.error is None:  # "request 7 cancelled after step 3/8" (operators and tests grep it)
                log.info("request %s %s", abort.request.request_id, error.message)
            else:
                log.info("request %s ended by the host: %s", abort.request.request_id, error.message)
            ended.append(held.status)
    return ended


def take_aborts(jobs: Sequence[Job], source: AbortSource, where: str | None = None) -> list[RequestStatus]:
    """Ask ``source`` about the requests of these jobs not ended yet, and end those it aborts."""
    held = held_requests(jobs)
    return apply_aborts(jobs, source.aborted(held) if held else [], where)

"""Asynchronous video jobs (OpenAI's ``/v1/videos`` shape): queued, in_progress with progress, completed
or failed; deleting a job cancels its Triton request.

Everything is kept in this process's memory under a random id (never a path): at most ``max_jobs`` jobs,
``max_running`` of them generating at once, finished results for ``ttl_s`` seconds and at most
``max_bytes`` of MP4 in all (the oldest results are dropped first). A new job that would pass
``max_jobs`` drops the oldest finished (completed or failed) jobs; it is refused only when too many are
queued or generating.

Each job belongs to the API key that created it (``owner``: the key's SHA-256, never the key): every
lookup names the owner, and another key's job is answered as if it did not exist. Without keys every
client is the one owner "".
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from triton_diffusion.openai_front.errors import ApiError, no_final
from triton_diffusion.openai_front.triton_bridge import ModelInfo, TritonBridge
from triton_diffusion.openai_front.video_translation import VideoCall

log = logging.getLogger("triton_diffusion.openai_front")

QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"


@dataclass(frozen=True)
class VideoLimits:
    max_jobs: int = 64  # held at once; past it the oldest finished ones are dropped for a new one
    max_running: int = 8  # generating at once; more is a 429
    max_bytes: int = 512 << 20  # MP4 bytes kept in all
    ttl_s: float = 3600.0  # how long a finished job is kept
    timeout_s: float = 1800.0  # the longest one video may take


@dataclass
class VideoJob:
    id: str
    model: str
    prompt: str
    size: str | None
    seconds: str | None
    created_at: int
    status: str = QUEUED
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, Any] | None = None
    content: bytes | None = None
    task: asyncio.Task | None = field(default=None, repr=False)
    owner: str = ""  # the creating API key's SHA-256 (hex); "" without keys

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "video",
            "model": self.model,
            "status": self.status,
            "progress": self.progress,
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": self.expires_at,
            "prompt": self.prompt,
            "size": self.size or "auto",
            "seconds": self.seconds or "auto",
            "error": self.error,
        }


def new_video_id() -> str:
    return "video_" + secrets.token_hex(16)


class VideoJobs:
    def __init__(
        self, bridge: TritonBridge, limits: VideoLimits | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.bridge = bridge
        self.limits = limits or VideoLimits()
        self.clock = clock
        self.jobs: dict[str, VideoJob] = {}  # in creation order

    def create(self, call: VideoCall, info: ModelInfo, owner: str) -> VideoJob:
        self.expire()
        active = sum(1 for job in self.jobs.values() if job.status in (QUEUED, IN_PROGRESS))
        if active < self.limits.max_running:
            self._make_room(self.limits.max_jobs - 1, owner)
        if active >= self.limits.max_running or len(self.jobs) >= self.limits.max_jobs:
            raise ApiError(
                429,
                f"too many video jobs (allowed: {self.limits.max_running} generating, "
                f"{self.limits.max_jobs} held); retry later",
                "rate_limit_error",
                None,
                "too_many_jobs",
            )
        job = VideoJob(
            new_video_id(), info.name, call.prompt, call.size, call.seconds, int(self.clock()), owner=owner
        )
        self.jobs[job.id] = job
        job.task = asyncio.get_running_loop().create_task(self._run(job, call, info), name=job.id)
        return job

    def get(self, video_id: str, owner: str) -> VideoJob:
        """The owner's job; 404 for an unknown one and for another owner's (which is not told apart)."""
        self.expire()
        job = self.jobs.get(video_id)
        if job is None or not hmac.compare_digest(job.owner, owner):
            raise ApiError(
                404,
                f"no video {video_id[:64]!r} (unknown, deleted or expired)",
                param="video_id",
                code="video_not_found",
            )
        return job

    def listing(self, owner: str) -> list[VideoJob]:
        """The owner's jobs, oldest first."""
        self.expire()
        return [job for job in self.jobs.values() if hmac.compare_digest(job.owner, owner)]

    async def delete(self, video_id: str, owner: str) -> VideoJob:
        """Forget the owner's job; a running one is cancelled first (its Triton request with it)."""
        job = self.get(video_id, owner)
        await self._forget(job)
        return job

    async def close(self) -> None:
        for job in list(self.jobs.values()):
            await self._forget(job)

    async def _forget(self, job: VideoJob) -> None:
        self.jobs.pop(job.id, None)
        if job.task is not None and not job.task.done():
            job.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job.task

    def _make_room(self, keep: int, owner: str) -> None:
        """Drop the longest-finished jobs (completed or failed) until at most ``keep`` jobs are held, the
        ``owner``'s own first: a key making room drops another's results only where it holds none;
        queued and generating jobs stay."""
        finished = [job for job in self.jobs.values() if job.status in (COMPLETED, FAILED)]
        # Stable: creation order among equals.
        finished.sort(key=lambda job: (not hmac.compare_digest(job.owner, owner), job.completed_at or 0))
        for job in finished[: max(0, len(self.jobs) - keep)]:
            del self.jobs[job.id]

    def expire(self) -> None:
        """Drop finished jobs past their time, then the oldest results while over the byte budget."""
        now = self.clock()
        for video_id, job in list(self.jobs.items()):
            if job.expires_at is not None and job.expires_at <= now:
                del self.jobs[video_id]
        held = sum(len(job.content or b"") for job in self.jobs.values())
        for video_id, job in list(self.jobs.items()):
            if held <= self.limits.max_bytes:
                break
            if job.content is not None:
                held -= len(job.content)
                del self.jobs[video_id]

    async def _run(self, job: VideoJob, call: VideoCall, info: ModelInfo) -> None:
        try:
            async with contextlib.aclosing(
                self.bridge.stream(call.request, info, self.limits.timeout_s)
            ) as stream:
                async for response in stream:
                    step, total = response.scalar("STEP"), response.scalar("TOTAL_STEPS")
                    if step is not None and total:
                        job.status = IN_PROGRESS
                        job.progress = min(99, int(100 * int(step) / int(total)))
                    if response.final:
                        self._completed(job, bytes(response.outputs["VIDEO"].reshape(-1)[0]))
                        return
            raise no_final()
        except ApiError as error:
            self._failed(job, error.code or "failed", error.message, error.param)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001  (a job fails alone, with a reason)
            log.exception("video job %s failed", job.id)
            self._failed(job, "server_error", f"{type(exc).__name__}: {exc}", None)

    def _completed(self, job: VideoJob, content: bytes) -> None:
        if len(content) > self.limits.max_bytes:
            self._failed(
                job,
                "too_large",
                f"the video is {len(content)} bytes (kept: at most {self.limits.max_bytes})",
                None,
            )
            return
        now = int(self.clock())
        job.content, job.status, job.progress = content, COMPLETED, 100
        job.completed_at, job.expires_at = now, now + int(self.limits.ttl_s)
        self.expire()

    def _failed(self, job: VideoJob, code: str, message: str, param: str | None) -> None:
        now = int(self.clock())
        job.status, job.error = FAILED, {"code": code, "message": message, "param": param}
        job.completed_at, job.expires_at = now, now + int(self.limits.ttl_s)

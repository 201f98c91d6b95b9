"""What the host does with a parsed request before its jobs are made, and with its answer: where a request
meets what the model kept. The model kind's parse decides and reads nothing (models/); here:

- the result cache (serving/result_cache.py): the answer of an earlier identical request, sent again at
  once (its BATCH saying ``result_cache: hit`` and this request's own tier), and an answer kept for later
  (never a degraded one: it is not what the fields ask);
- the resume lookup (recovery/resumes.py): each image's checkpoint under the request's ``resume_key``
  (refused INVALID_ARG naming resume_key where one belongs to a request with other fields), the request
  watched until it is answered (its checkpoints kept, then removed), each job spec given the checkpoint it
  starts from; and BATCH's part on checkpoints.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from triton_diffusion.engine.jobs import Job, JobSpec
from triton_diffusion.errors import ErrorCode
from triton_diffusion.recovery.resumes import Resume, Resumes
from triton_diffusion.serving.metrics import BatchingMetrics
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.serving.result_cache import ResultCache

RESULT_CACHE_HITS = "triton_diffusion_result_cache_hits_total"
# BATCH's part on checkpoints (Intake.report): a request's own, never copied from a cached answer.
CHECKPOINT_REPORT = ("checkpoints", "resumed_from_step", "warnings")


class Kept(Protocol):
    """A parsed request, as what the model kept is looked up by (engine_host.py's ``Parsed``)."""

    @property
    def jobs(self) -> Sequence[JobSpec]:
        """Its jobs (images, videos, the LM request), as the kind decided them."""

    @property
    def values(self) -> Mapping[str, Any]:
        """Its validated values: what its checkpoints are bound to."""

    @property
    def result_key(self) -> str | None:
        """Its answer's key in the result cache (None: not cached)."""

    @property
    def resume_key(self) -> str | None:
        """The resume_key it gave (None: none, or its kind takes no checkpoints)."""


@dataclass(frozen=True)
class Intake:
    """One model's result cache and checkpoints, as the host uses them."""

    model: str
    tiers: tuple[str, ...]
    metrics: BatchingMetrics
    results: ResultCache
    resumes: Resumes | None = None

    def resume(self, tracked: TrackedRequest, parsed: Kept) -> Resume | None:
        """Its images' checkpoints, the request watched from now until answered (None: nothing is
        checkpointed for it). Raises INVALID_ARG naming resume_key (recovery/resumes.py)."""
        if self.resumes is None or not parsed.resume_key:
            return None
        hashed = self.resumes.hash_of(self.model, parsed.values)
        found = self.resumes.lookup(parsed.resume_key, len(parsed.jobs), hashed)
        self.resumes.watch(tracked, found)
        return found

    @staticmethod
    def specs(parsed: Kept, resume: Resume | None) -> list[JobSpec]:
        """Its job specs, each with the checkpoint its image starts from (where one was found) and the
        steps that did: the scheduler prices what it leaves."""
        if resume is None:
            return list(parsed.jobs)
        return [
            spec if checkpoint is None else replace(spec, resume=checkpoint, resumed_steps=checkpoint.step)
            for spec, checkpoint in zip(parsed.jobs, resume.checkpoints, strict=True)
        ]

    def cached(self, parsed: Kept) -> dict[str, Any] | None:
        """The answer of an earlier identical request, with this one's tier in its BATCH (nothing waited or
        was paused for it) and its own part on checkpoints (:meth:`report`: nothing resumed for it), not the
        first one's; None where there is none."""
        answer = self.results.get(parsed.result_key)
        if answer is None:
            return None
        self.metrics.increment(RESULT_CACHE_HITS)
        batch = json.loads(answer["BATCH"].reshape(-1)[0])
        service = {"tier": self.tiers[parsed.jobs[0].tier], "paused_times": 0, "paused_s": 0.0}
        for name in CHECKPOINT_REPORT:
            batch.pop(name, None)
        batch.update(self.report(parsed, None, ()), result_cache="hit", service=service)
        return {**answer, "BATCH": np.array([[json.dumps(batch).encode()]], dtype=object)}

    def keep(self, parsed: Kept, jobs: Sequence[Job], answer: Mapping[str, np.ndarray]) -> None:
        """Keep a request's answer for the identical requests after it (not a degraded one)."""
        if parsed.result_key is not None and not any(job.degraded for job in jobs):
            self.results.put(parsed.result_key, answer)

    def report(self, parsed: Kept, resume: Resume | None, jobs: Sequence[Job]) -> dict[str, Any]:
        """BATCH's part on checkpoints, for a request that gave a resume_key: whether the model takes them
        ("on", "off", or "not kept: why" where its checkpoints could not be written); the step its images
        resumed from (the smallest: an image that started over counts 0; absent when none resumed); and
        why a checkpoint found was not used."""
        key = parsed.resume_key
        if not key:
            return {}
        report: dict[str, Any] = {"checkpoints": "on" if self.resumes is not None else "off"}
        why = self.resumes.store.not_kept(key) if self.resumes is not None else None
        if why is not None:  # what the store failed to write, as far as known when the answer goes out
            report["checkpoints"] = f"not kept: {why}"
        if any(job.stats.resumed_from_step for job in jobs):
            report["resumed_from_step"] = min(job.stats.resumed_from_step or 0 for job in jobs)
        warnings = [*(resume.warnings if resume is not None else ())]
        warnings += [
            f"image {job.spec.index}: {job.stats.start_warning}" for job in jobs if job.stats.start_warning
        ]
        if warnings:
            report["warnings"] = warnings
        return report

    def answered(self, tracked: TrackedRequest, code: ErrorCode | None) -> None:
        """A request was answered: its checkpoints go, unless it was answered UNAVAILABLE (recovery/
        resumes.py)."""
        if self.resumes is not None:
            self.resumes.answered(tracked, code)

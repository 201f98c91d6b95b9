"""A crash loses no work: the serving side of job checkpoints (config ``checkpoint_every_steps``,
``checkpoint_dir``, ``checkpoint_max_mb``, ``checkpoint_ttl_s``; the request field ``resume_key``).

When a model's process dies (the OOM killer, a CUDA fault) the launcher restarts the server and every
request in flight is lost; its client resends. A request that carries a ``resume_key`` of the client's
making has its running jobs' state written every ``checkpoint_every_steps`` denoising steps, so the
resend goes on from the last one instead of starting over. Data flows one way:

- the step engine decides when a job is due one and the adapter takes it (a CPU copy); the step report
  carries it here (:meth:`Resumes.persist`, on the engine thread), and the store writes it on its own
  thread (recovery/checkpoint_store.py: atomic files, bounded in bytes and age);
- a request is read (models/diffusion_model.py): :meth:`Resumes.lookup` finds each image's checkpoint
  (key ``<resume_key>.<image>``), checks it belongs to a request with the same fields (its
  :func:`fields_hash`: one client can neither resume nor read another's job by reusing its key; a
  checkpoint is never returned to a client), and the job starts from it;
- a request is answered (:meth:`Resumes.answered`): its checkpoints are removed, unless it was answered
  UNAVAILABLE: that is what a client is told when the model fails and restarts ("retry shortly"), and
  the retry is exactly what should resume. A checkpoint nobody resumes goes with ``checkpoint_ttl_s``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from triton_diffusion.engine.jobs import StepReport
from triton_diffusion.errors import ErrorCode, invalid_field
from triton_diffusion.recovery.checkpoint_format import JobCheckpoint
from triton_diffusion.recovery.checkpoint_store import CheckpointStore, CorruptCheckpoint
from triton_diffusion.serving.requests import TrackedRequest
from triton_diffusion.serving.result_cache import NOT_IN_KEY, values_digest
from triton_diffusion.settings import ModelSettings

if TYPE_CHECKING:  # engine_host imports this module
    from triton_diffusion.serving.engine_host import RequestRecord

log = logging.getLogger("triton_diffusion")

# How long the pending checkpoints are waited for when the model unloads (and by the tests' exit fault,
# tests/faults.py, before it dies).
FLUSH_S = 30.0


def seed_from_key(resume_key: str) -> int:
    """The seed of a request that gives a resume_key and no seed: derived from the key (as a drawn seed,
    below 2**32), so a resend of the same request draws the same noise and its checkpoints fit it."""
    return int.from_bytes(hashlib.sha256(b"seed:" + resume_key.encode()).digest()[:4], "big")


def fields_hash(model: str, values: Mapping[str, Any]) -> str:
    """What a checkpoint is bound to: the model (its name and what it was loaded from: ``model_identity``)
    and every validated value that decides the request's images (all but resume_key, progress and
    previews, service tier and timeout, describe: the result cache's key, serving/result_cache.py), the
    seed among them."""
    return hashlib.sha256(f"{model}\0{values_digest(values, NOT_IN_KEY)}".encode()).hexdigest()


def _version() -> str:
    try:
        return importlib.metadata.version("triton-diffusion")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "source"


def model_identity(settings: ModelSettings) -> str:
    """The model as loaded, for ``fields_hash``: its name, its weights folder's files (path, size, mtime),
    its LoRA adapters' config, and the versions of diffusers, torch and this package. A checkpoint taken
    under other weights (a rollout onto a shared checkpoint folder) fits no request of this one."""
    import diffusers
    import torch

    parts = [settings.name, str(settings.config.loras), diffusers.__version__, torch.__version__, _version()]
    source = Path(settings.model_source())
    if source.is_dir():
        for path in sorted(source.rglob("*")):
            if path.is_file():
                stat = path.stat()
                parts.append(f"{path.relative_to(source)}:{stat.st_size}:{stat.st_mtime_ns}")
    else:
        parts.append(str(source))  # a hub id (its files live in the hub's cache)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Resume:
    """What a request's lookup found: each image's checkpoint (None: it starts from the beginning) and
    why a checkpoint found could not be used (for BATCH); and the resume key and fields hash its
    checkpoints are taken under once the host watches it (:meth:`Resumes.watch`)."""

    checkpoints: tuple[JobCheckpoint | None, ...]
    warnings: tuple[str, ...]
    key: str
    hashed: str

    @property
    def found(self) -> bool:
        return any(checkpoint is not None for checkpoint in self.checkpoints)


class Resumes:
    """One model's checkpoints: its store, and the requests whose jobs are checkpointed (``resume_key`` and
    fields hash, until answered)."""

    def __init__(self, store: Any, every: int, identity: str = "") -> None:
        self.store = store  # a recovery/checkpoint_store.py CheckpointStore (or a test's)
        self.every = every
        self.identity = identity  # the model as loaded (model_identity): part of every fields hash
        self._lock = threading.Lock()
        self._watched: dict[TrackedRequest, tuple[str, str]] = {}  # -> (resume_key, fields hash)

    def hash_of(self, model: str, values: Mapping[str, Any]) -> str:
        """A request's fields hash on this model as loaded (its identity, where known)."""
        return fields_hash(f"{model}:{self.identity}" if self.identity else model, values)

    @classmethod
    def from_settings(cls, settings: ModelSettings) -> Resumes | None:
        """The model's checkpoints where ``checkpoint_every_steps`` turns them on (None: off). Its folder
        is ``checkpoint_dir``, relative to the model's folder unless absolute."""
        config = settings.config
        if not config.checkpoint_every_steps:
            return None
        assert config.checkpoint_dir is not None  # ModelConfig.parse refuses checkpoints without one
        directory = Path(config.checkpoint_dir).expanduser()
        if not directory.is_absolute():
            directory = settings.model_dir / directory
        directory.mkdir(parents=True, exist_ok=True)
        store = CheckpointStore(directory, int(config.checkpoint_max_mb * 2**20), config.checkpoint_ttl_s)
        log.info(
            "%s: checkpoints every %d steps in %s (at most %g MB, %g s)",
            settings.name,
            config.checkpoint_every_steps,
            directory,
            config.checkpoint_max_mb,
            config.checkpoint_ttl_s,
        )
        identity = model_identity(settings)
        return cls(store, config.checkpoint_every_steps, identity)

    # ---- execute() thread: reading a request --------------------------------------------------------
    def lookup(self, resume_key: str, images: int, hashed: str) -> Resume:
        """Each image's checkpoint for a request: none (it starts normally); one of a request with other
        fields (refused INVALID_ARG naming resume_key: the key is someone else's, or the fields changed);
        an unreadable one (the store deleted it: it starts over, and BATCH says so); else its checkpoint."""
        checkpoints: list[JobCheckpoint | None] = []
        warnings: list[str] = []
        for image in range(images):
            try:
                stored = self.store.get(f"{resume_key}.{image}")
            except CorruptCheckpoint as exc:
                warnings.append(f"image {image}: its checkpoint could not be read ({exc}): started over")
                checkpoints.append(None)
                continue
            if stored is not None and stored.fields_hash != hashed:
                raise invalid_field(
                    "resume_key",
                    "belongs to a request with other fields (resend the same fields to resume it, or "
                    "send another key)",
                )
            checkpoints.append(None if stored is None else stored.checkpoint)
        return Resume(tuple(checkpoints), tuple(warnings), resume_key, hashed)

    def watch(self, tracked: TrackedRequest, resume: Resume) -> None:
        """This request's jobs are checkpointed (under its ``resume.key``, bound to ``resume.hashed``)
        until it is answered: the host calls it once the request is parsed. Refused INVALID_ARG naming
        resume_key while a request with other fields holds the key (the two would write and delete each
        other's checkpoints)."""
        resume_key, hashed = resume.key, resume.hashed
        with self._lock:
            if any(key == resume_key and other != hashed for key, other in self._watched.values()):
                raise invalid_field(
                    "resume_key",
                    "is held by a request in flight with other fields (send another key, or wait for its "
                    "answer)",
                )
            self._watched[tracked] = (resume_key, hashed)
        self.store.forget_not_kept(resume_key)  # this attempt's own checkpoints are what BATCH reports

    def resume_key(self, tracked: TrackedRequest) -> str | None:
        """The resume key of a request whose jobs are checkpointed (None: not one of those)."""
        with self._lock:
            watched = self._watched.get(tracked)
        return None if watched is None else watched[0]

    # ---- the engine thread --------------------------------------------------------------------------
    def persist(self, report: StepReport) -> None:
        """Hand the checkpoints of a step report to the store (it writes on its own thread), those of
        requests still unanswered."""
        for job, checkpoint in report.checkpoints:
            # The host's record (engine_host.record_of, which this module cannot import at run time).
            tracked = cast("RequestRecord", job.record).tracked
            # Checked and handed over under the lock ``answered`` takes: a request answered meanwhile has
            # either had this put removed with it, or is no longer watched (nothing to resume).
            with self._lock:
                watched = self._watched.get(tracked)
                if watched is None or tracked.ended or job.spec.checkpoint_key is None:
                    continue
                self.store.put(job.spec.checkpoint_key, watched[1], checkpoint)

    # ---- whichever thread answers -------------------------------------------------------------------
    def answered(self, tracked: TrackedRequest, code: ErrorCode | None) -> None:
        """A request was answered: its checkpoints go, unless the answer was UNAVAILABLE (the model failed
        and restarts, or is at capacity: the client's retry is what resumes from them)."""
        with self._lock:  # no longer watched: persist hands the store none of its checkpoints from now on
            watched = self._watched.pop(tracked, None)
            if watched is not None:
                self.store.forget_not_kept(watched[0])
        # Outside the lock persist takes: a slow folder must not hold up the engine thread. A put handed
        # over just before the pop above is already pending, and this removal cancels it.
        if watched is not None and code is not ErrorCode.UNAVAILABLE:
            self.store.remove_request(watched[0])

    def close(self) -> None:
        """Write what is queued, then stop the store's writer (the model unloads)."""
        self.store.flush(FLUSH_S)
        self.store.close()

"""Job checkpoints on disk (adapters/job_checkpoints.py), so a request resubmitted after a crash resumes
its images where they were.

- One file per image, ``<key>.safetensors``, the key a request's resume key and, per image, ``.<index>``
  (:func:`valid_key`: nothing else, so a key can never name a path outside the directory, which comes
  from the config only).
- Safetensors only (no pickle: a file read back can hold nothing but tensors and a JSON header), its
  metadata one JSON string: the request's fields hash (a resumed request must be the same request), the
  step, the checkpoint's meta, when it was written and a SHA-256 over all of that and every tensor's
  bytes in name order, so a flipped bit is detected; a truncated file does not parse. Either is a
  :class:`CorruptCheckpoint`, and the file is deleted.
- Written by a thread of its own: :meth:`CheckpointStore.put` is called from the engine's host thread,
  which must not wait for a disk. A key's latest pending checkpoint replaces an older pending one (only
  the newest state is worth writing). The writer takes every pending checkpoint at once, a batch: each
  written in full under a hidden name in the same directory and renamed onto the key's name, so a reader,
  or a process that dies, finds the old checkpoint or the new one, never half of one (the hidden file is
  a spare where there is one: recovery/checkpoint_files.py says why; a leftover hidden file is removed by
  a later sweep once old). A batch that wrote a new file (no spare was free) ends with one fsync of the
  directory: its renames are made durable, and on ext4 (data=ordered, ``auto_da_alloc``) a new file's
  bytes too where it replaced the key's previous file (a rename onto a free name forces no write-back of
  them); a batch written into spares only is not synced, as a directory's fsync would not make bytes
  written over in place durable.
  Checkpoints guard against a stub or server process dying, which the page cache survives; after a host
  crash the checkpoints of the last half minute may be lost (checkpoint_files.py): a file that is not a
  whole checkpoint of its key fails its digest or its key check, is deleted, and its request starts over
  (exact, only slower).
- Bounded: after each batch the oldest files go until the directory holds at most ``max_bytes``; files
  older than ``ttl_s`` are dropped, swept at start and then at most every ``SWEEP_S`` (a file's
  modification time is set to its ``created`` time by the store's clock, so age and order survive a
  restart without reading every header).
- Removals on the writer thread too: an answered request's checkpoints (and a pending write of them) are
  dropped by a call that returns at once; the writer deletes the files with its next batch, before its
  writes (a put after a removal is newer than it), keeping them as spares to write into while there is
  room (their bytes stay on disk, hidden and never read as checkpoints, until written over or deleted at
  close). The thread that answers never touches the folder. After close, or while the folder hangs
  (below), a removal is not queued: the TTL clears those files.
- Bounded in time: a request's read runs on a thread of its own and waits at most ``FOLDER_S`` for the
  folder (a hung network volume): past it the read finds nothing (the request starts over) and, while
  that call is still stuck, later ones skip the folder at once; so do they while a batch of writes and
  removals has been under way for longer than ``FOLDER_S`` (a write that hangs). A read of a key whose
  removal is queued waits for it (it finds nothing). A file that fails to parse, has expired or is not a
  regular file is deleted only where the key still names it, unchanged (its identity: checkpoint_files.py,
  checked under the lock the writer's renames take); else a write or removal raced the read, and the
  key's file now is read once more.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triton_diffusion.recovery.checkpoint_files import (
    TEMPORARY,
    FileWriter,
    Identity,
    fsync_directory,
    identity,
    names_other,
    read_regular,
)
from triton_diffusion.recovery.checkpoint_format import JobCheckpoint, Stored, parse, serialise

log = logging.getLogger("triton_diffusion")

SUFFIX = ".safetensors"
_KEY = re.compile(r"[A-Za-z0-9_-]{16,128}(\.[0-9]{1,9})?")
# Longest a caller waits for a write under way (a stuck disk must not stall the threads that read or
# answer requests), and the age past which a hidden file is a crash's leftover (a write it cut short, a
# dead store's spare), not a write under way.
WAIT_S = 10.0
LEFTOVER_S = 600.0
BATCH_S = 0.25  # how long the writer gathers checkpoints into one batch when nobody waits for them
NOT_KEPT_MOST = 4096  # keys whose failed write is remembered for BATCH
# How long a request's read waits for the folder (a hung network volume); a call stuck longer, or a batch
# under way longer, marks it hung: reads find nothing and removals are left to the TTL meanwhile.
FOLDER_S = 5.0
SWEEP_S = 60.0  # at most this long between two sweeps for expired files (a get checks its own file's age)


def valid_key(key: str) -> bool:
    """A request's resume key (16 to 128 of ``[A-Za-z0-9_-]``), optionally ``.<image index>``."""
    return isinstance(key, str) and _KEY.fullmatch(key) is not None


def request_of(key: str) -> str:
    """The resume key of a checkpoint key (``<resume key>`` or ``<resume key>.<image index>``)."""
    return key.partition(".")[0]


@dataclass
class Removals:
    """Checkpoints to delete: by key, and every image of a request by its resume key."""

    keys: set[str] = field(default_factory=set)
    requests: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.keys or self.requests)

    def of(self, key: str) -> bool:
        """Whether ``key``'s checkpoint is among them."""
        return key in self.keys or request_of(key) in self.requests


class CorruptCheckpoint(Exception):
    """A checkpoint file that does not parse or whose digest does not match (it has been deleted)."""


class CheckpointStore:
    """Checkpoints in ``directory`` (created if missing), at most ``max_bytes`` of them, each kept
    ``ttl_s`` seconds by ``clock``. Thread-safe; writes happen on its own writer thread."""

    def __init__(
        self, directory: Path, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.bytes_used = 0  # bytes of checkpoint files in the directory (for a metric)
        self._pending: dict[str, tuple[str, JobCheckpoint, float]] = {}  # key: fields hash, checkpoint, at
        self._writing: frozenset[str] = frozenset()  # the keys of the batch being written now
        # Removals the writer thread carries out (keys; requests, by resume key), and those it is doing now.
        self._removals = Removals()
        self._removing = Removals()
        # Writes and removals handed over, and of them those done: a flush waits for those before it only.
        self._queued = 0
        self._done = 0
        self._writing_since: float | None = None  # when that batch began (time.monotonic), None: none is
        self._not_kept: dict[str, str] = {}  # key: why its last checkpoint could not be written
        self._closed = False
        self._swept_at = 0.0  # when the last sweep ran, by ``clock``
        self._waiting = 0  # callers waiting for the writer (get, flush): it does not gather a batch
        self._idle = False  # the writer waits for work (a put wakes it), not gathering or writing a batch
        self._changed = threading.Condition()  # guards the pending writes and the key being written
        self._files = threading.RLock()  # guards the directory's files and bytes_used
        self._hung: threading.Thread | None = None  # a folder call that did not return within FOLDER_S
        self._hung_lock = threading.Lock()
        self._file_writer = FileWriter(self.directory, max_bytes // 4, self._files)  # the writer thread's
        self._new_files = False  # the writer thread's: whether its batch wrote a new file (not a spare)
        self.sweep()
        self._thread = threading.Thread(target=self._write_loop, name="checkpoint-writer", daemon=True)
        self._thread.start()

    # ---- the caller's side ------------------------------------------------------------------------------
    def put(self, key: str, fields_hash: str, checkpoint: JobCheckpoint) -> None:
        """Write ``checkpoint`` under ``key`` on the writer thread (returns at once); a newer put of the
        same key before it is written replaces it."""
        self._check(key)
        created = self.clock()
        with self._changed:
            if self._closed:
                raise RuntimeError("the checkpoint store is closed")
            self._pending[key] = (fields_hash, checkpoint, created)
            self._handed_over()

    def get(self, key: str) -> Stored | None:
        """The key's checkpoint (after its pending write, if any), or None if there is none or it expired
        (then it is deleted). Raises CorruptCheckpoint (and deletes the file) if it is damaged."""
        self._check(key)
        if self._folder_hung(f"checkpoint {key}"):
            return None
        with self._changed:
            if not self._wait_for_writes(
                lambda: (
                    key not in self._pending
                    and key not in self._writing
                    and not self._removals.of(key)
                    and not self._removing.of(key)
                ),
                FOLDER_S,
            ):
                log.warning(
                    "checkpoint %s: its write is still under way after %g s: read as none", key, FOLDER_S
                )
                return None  # a stuck disk must not stall admission: the request starts over
        return self._bounded(f"checkpoint {key}", lambda: self._read(key), None)

    def _read(self, key: str, again: bool = True) -> Stored | None:
        # The file's I/O without the lock: a read stuck in the kernel must not hold up the writer.
        path = self._path(key)
        try:
            entry = path.lstat()
        except FileNotFoundError:
            return None
        seen = identity(entry)
        if not stat.S_ISREG(entry.st_mode):  # a directory, link, FIFO...: not ours, never opened
            if self._delete_unchanged(path, seen):
                raise CorruptCheckpoint(f"checkpoint {key}: not a regular file")
        elif self._expired(entry.st_mtime):
            if self._delete_unchanged(path, seen):
                return None
        else:
            try:
                data, seen = read_regular(path, self.max_bytes)
                return parse(data, key)
            except FileNotFoundError:  # evicted or expired between the lstat and the open
                return None
            except Exception as exc:
                if self._delete_unchanged(path, seen):
                    raise CorruptCheckpoint(f"checkpoint {key}: {exc}") from exc
        # The key names another file than the one looked at: a write or removal raced the read (the file
        # read may since have been written over as a spare). The key's file now is read instead.
        return self._read(key, again=False) if again else None

    def _delete_unchanged(self, path: Path, seen: Identity) -> bool:
        """Delete ``path`` if it still names the file ``seen``, under the lock the writer's renames take:
        never a checkpoint written there since. Whether it did (False: it names another file now)."""
        with self._files:
            if names_other(path, seen):
                return False
            self._delete(path)
            self._count()  # damaged or expired from outside: its size may not be the one counted
            return True

    def remove(self, key: str) -> None:
        """Drop the key's checkpoint and its pending write. Returns at once: the writer thread deletes the
        file (after a write of it under way; a later put of the key is written after the removal); after
        close or while the folder hangs, its TTL does."""
        self._check(key)
        with self._changed:
            self._pending.pop(key, None)
            if self._closed or self._folder_hung(f"checkpoint {key}"):
                self._changed.notify_all()  # a read waiting for the dropped write goes on
                return  # its TTL clears it
            self._removals.keys.add(key)
            self._handed_over()

    def _handed_over(self) -> None:
        """One write or removal more for the writer (``_changed`` held). It is woken only where it waits for
        work: while it gathers or writes a batch, a wakeup per call would cost the callers' threads (the
        engine's, the one that answers) a thread switch each for nothing. No caller waits for a call to
        be handed over (they wait for its end)."""
        self._queued += 1
        if self._idle:
            self._changed.notify_all()

    def remove_request(self, resume_key: str) -> None:
        """Drop the checkpoint of every image of a request (``resume_key`` and ``resume_key.<i>``) and their
        pending writes, as :meth:`remove` does: the caller (the thread that answers) never waits for the
        folder or spawns a thread, and a hung folder holds up only the writer."""
        self._check(resume_key)
        with self._changed:
            for key in [key for key in self._pending if request_of(key) == resume_key]:
                del self._pending[key]
            for key in [key for key in self._not_kept if request_of(key) == resume_key]:
                del self._not_kept[key]
            if self._closed or self._folder_hung(f"checkpoints of {resume_key}"):
                self._changed.notify_all()  # a read waiting for a dropped write goes on
                return  # their TTL clears them
            self._removals.requests.add(resume_key)
            self._handed_over()

    def _folder_hung(self, what: str) -> bool:
        """Whether a folder call is still stuck past FOLDER_S, or a batch of writes has been under way for
        longer (then the caller skips the folder at once)."""
        with self._hung_lock:
            hung = self._hung is not None and self._hung.is_alive()
        since = self._writing_since  # set and cleared by the writer thread alone
        hung = hung or (since is not None and time.monotonic() - since > FOLDER_S)
        if hung:
            log.warning("%s: the checkpoint folder still does not answer: skipped", what)
        return hung

    def _bounded(self, what: str, call: Callable[[], Any], default: Any) -> Any:
        """``call()`` on a thread of its own, waited for at most FOLDER_S: a folder that does not answer (a
        hung network volume, a stuck disk) must not stall admission or answers. Past the bound, and while
        such a call is still stuck, ``default`` (a read finds no checkpoint: the request starts over; a
        removal is left to the TTL). What ``call`` raises is raised here."""
        if self._folder_hung(what):
            return default
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = call()
            except BaseException as exc:  # noqa: BLE001  (raised on the caller's thread)
                outcome["error"] = exc

        thread = threading.Thread(target=run, name="checkpoint-folder", daemon=True)
        thread.start()
        thread.join(FOLDER_S)
        if thread.is_alive():
            with self._hung_lock:
                self._hung = thread
            log.warning("%s: the checkpoint folder did not answer in %g s: skipped", what, FOLDER_S)
            return default
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value", default)

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every write and removal handed over before the call (not those
        that keep coming meanwhile: requests answered while a drain flushes); whether they are all done."""
        with self._changed:
            target = self._queued

            def done() -> bool:  # those before it done, or nothing left at all (a put a removal dropped)
                idle = not (self._pending or self._writing or self._removals or self._removing)
                return self._done >= target or idle

            return self._wait_for_writes(done, timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Finish the pending writes (up to ``timeout_s``) and stop the writer thread."""
        self.flush(timeout_s)
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():  # a writer stuck in the folder may still use its spares
            self._file_writer.close()

    def sweep(self) -> None:
        """Delete the checkpoints older than ``ttl_s`` and the hidden files a crash left, and count the
        bytes the directory holds: at construction, then on the writer thread at most every ``SWEEP_S``
        before a batch (the writer thread's spares are read here)."""
        now = self.clock()
        self._swept_at = now
        with self._files:
            for path, entry in self._checkpoint_files():
                if self._expired(entry.st_mtime, now):
                    self._delete(path)
            self._count()
        # A write a crash cut short, a dead store's spares: old ones only, not its own spares (another
        # replica's write under way, in a folder replicas share, has written its file since it began).
        for leftover in self.directory.glob(f".*{TEMPORARY}"):
            try:
                entry = leftover.lstat()
                if (
                    stat.S_ISREG(entry.st_mode)
                    and abs(now - entry.st_mtime) > LEFTOVER_S  # a future time too (a clock set back)
                    and not self._file_writer.owns(leftover)
                ):
                    leftover.unlink(missing_ok=True)
            except OSError:  # gone meanwhile, or not ours to remove: never a reason not to load
                pass

    def _wait_for_writes(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (holding ``_changed``) up to ``timeout_s`` for ``predicate``; the writer meanwhile writes at
        once rather than gather a batch (only where the caller must wait: a read of a key with no write
        pending ends no gathering)."""
        if predicate():
            return True
        self._waiting += 1
        self._changed.notify_all()
        try:
            return self._changed.wait_for(predicate, timeout_s)
        finally:
            self._waiting -= 1

    # ---- the writer thread ------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._changed:
                self._idle = True
                self._changed.wait_for(lambda: self._pending or self._removals or self._closed)
                self._idle = False
                # Gather what else comes in ``BATCH_S`` (unless someone waits for the writes): a few wakeups
                # of this thread cost the engine's thread less than one per checkpoint.
                self._changed.wait_for(lambda: self._closed or self._waiting > 0, BATCH_S)
                if not self._pending and not self._removals:  # closed with nothing left
                    if self._closed:
                        return
                    continue
                batch, self._pending = self._pending, {}
                self._removing, self._removals = self._removals, Removals()
                taking = self._queued  # every one handed over so far is in this batch (or replaced)
                self._writing = frozenset(batch)
                self._writing_since = time.monotonic()
            try:
                if abs(self.clock() - self._swept_at) >= SWEEP_S:
                    self.sweep()
                try:  # first: a put after a removal is newer than it
                    self._remove(self._removing)
                except Exception:  # a folder that cannot be listed: the TTL clears them; the writes go on
                    log.exception("checkpoint removals failed")
                self._write(batch)
            except Exception as exc:  # lost checkpoints are a slower resume, not a failed request
                log.exception("checkpoints %s: write failed", ", ".join(batch))
                for key in batch:
                    self._lost(key, f"the write failed ({type(exc).__name__})")
            finally:
                with self._changed:
                    self._writing, self._writing_since = frozenset(), None
                    self._removing = Removals()
                    self._done = taking
                    self._changed.notify_all()

    def _remove(self, removals: Removals) -> None:
        """Delete the files of the keys and requests removed (a request's: found in one listing)."""
        with self._files:
            for key in removals.keys:
                self._delete(self._path(key), retire=True)
            if removals.requests:
                for path, _ in self._checkpoint_files():
                    if request_of(path.name[: -len(SUFFIX)]) in removals.requests:
                        self._delete(path, retire=True)

    def _write(self, batch: dict[str, tuple[str, JobCheckpoint, float]]) -> None:
        """Each checkpoint of the batch to its file, then, where one went into a new file, one fsync of the
        directory, and one eviction."""
        written = []
        self._new_files = False
        try:
            for key, (fields_hash, checkpoint, created) in batch.items():
                if self._write_one(key, fields_hash, checkpoint, created):
                    written.append(self._path(key))
        finally:  # what was written is made durable where it can be and counted, whatever failed after it
            if self._new_files:
                fsync_directory(self.directory)
            if written:
                with self._files:
                    self._evict(keep=frozenset(written))

    def _write_one(self, key: str, fields_hash: str, checkpoint: JobCheckpoint, created: float) -> bool:
        """One checkpoint to its file (recovery/checkpoint_files.py: written in full, then renamed onto the
        key's name); whether it was written. A failure loses this checkpoint only."""
        try:
            data = serialise(key, fields_hash, checkpoint, created)
            if len(data) > self.max_bytes:
                return self._lost(key, f"one checkpoint takes {len(data)} bytes, above checkpoint_max_mb")
            # Outside the files' lock but for its renames: a reader of this key waits for its write, and of
            # another key reads its own file.
            if self._file_writer.write(self._path(key), data, created, key):
                self._new_files = True
        except Exception as exc:  # noqa: BLE001  (one lost checkpoint is a slower resume, not a failure)
            return self._lost(key, f"the write failed ({type(exc).__name__}: {str(exc)[:120]})")
        with self._changed:
            self._not_kept.pop(key, None)
        return True

    def _lost(self, key: str, why: str) -> bool:
        """A checkpoint not written: said once per key in the log, and kept for :meth:`not_kept`."""
        with self._changed:
            first = key not in self._not_kept
            self._not_kept.pop(key, None)
            self._not_kept[key] = why
            while len(self._not_kept) > NOT_KEPT_MOST:  # bounded: the oldest reasons go first
                del self._not_kept[next(iter(self._not_kept))]
        if first:
            log.warning("checkpoint %s: not kept: %s", key, why)
        return False

    def forget_not_kept(self, resume_key: str) -> None:
        """A new attempt of this request, or its answer: what its earlier checkpoints could not keep is
        no longer its story."""
        with self._changed:
            for key in [k for k in self._not_kept if k == resume_key or k.startswith(resume_key + ".")]:
                del self._not_kept[key]

    def not_kept(self, resume_key: str) -> str | None:
        """Why the last checkpoint of an image of this request could not be written (None: every one
        handed over so far was, or is being, written)."""
        with self._changed:
            for key, why in self._not_kept.items():
                if key == resume_key or key.startswith(resume_key + "."):
                    return why
        return None

    def _evict(self, keep: frozenset[Path]) -> None:
        """The oldest checkpoints go until the directory holds at most ``max_bytes`` (``keep``, the ones
        just written, each fits alone and they go last)."""
        files = [
            (path in keep, entry.st_mtime, path.name, entry.st_size, path)
            for path, entry in self._checkpoint_files()
        ]
        total = sum(size for *_, size, _ in files)
        for _, _, _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            self._delete(path)  # or gone already; one it cannot delete is logged, and its bytes not held
            total -= size  # against the others (they would all go for it, batch after batch)
        self.bytes_used = total  # counted from the same listing (a second one cost as much again)

    # ---- files ------------------------------------------------------------------------------------------
    @staticmethod
    def _check(key: str) -> None:
        if not valid_key(key):
            raise ValueError(f"invalid checkpoint key {key!r}")

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def _expired(self, mtime: float, now: float | None = None) -> bool:
        """Older than the TTL, or as far in the future (a clock set back, or a file touched from outside:
        a future time must not keep it for ever)."""
        return abs((self.clock() if now is None else now) - mtime) > self.ttl_s

    def _checkpoint_files(self) -> list[tuple[Path, os.stat_result]]:
        """The regular files named like checkpoints, each with its ``lstat`` (anything else there is not
        counted, swept or evicted: a read of its key removes it, or says why it cannot)."""
        files = []
        with os.scandir(self.directory) as listing:
            for item in listing:
                if not (item.name.endswith(SUFFIX) and valid_key(item.name[: -len(SUFFIX)])):
                    continue
                try:
                    entry = item.stat(follow_symlinks=False)
                except FileNotFoundError:  # deleted since the listing
                    continue
                if stat.S_ISREG(entry.st_mode):
                    files.append((Path(item.path), entry))
        return files

    def _delete(self, path: Path, retire: bool = False) -> None:
        """Delete ``path`` (a directory there, if empty, is removed). ``retire`` (the writer thread's
        removals): the file may be kept as a spare to write into."""
        try:
            entry = path.lstat()
            if stat.S_ISDIR(entry.st_mode):
                path.rmdir()  # an empty one; one with files in it is left, and logged
                return
            if retire and stat.S_ISREG(entry.st_mode):
                self._file_writer.retire(path, entry.st_size)
            else:
                path.unlink()  # a file, or a link itself (never what it points to)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("checkpoint %s: could not be removed (%s)", path.name, exc)
            return
        if stat.S_ISREG(entry.st_mode):
            self.bytes_used = max(0, self.bytes_used - entry.st_size)

    def _count(self) -> None:
        self.bytes_used = sum(entry.st_size for _, entry in self._checkpoint_files())

"""The checkpoint store's file work: a checkpoint written in full into a spare file, renamed onto its key's
name; a file read back without following a link.

Used by recovery/checkpoint_store.py. The rename makes a write atomic: a reader, or a process that dies,
finds the old checkpoint or the new one, never half of one.

The hidden file is a spare where there is one: a file a rename replaced, or a removal retired, kept under a
hidden name and written over in place, rather than a new file each time. Before the rename, the file the key
names gets a second, spare name (a hard link), so the rename replaces a name, never a file that anything still
needs. Why: ext4 (``auto_da_alloc``) starts writing back at once a new file renamed over another, and creating
a file allocates an inode; a spare's blocks and inode are already there. What a checkpoint costs an engine
step, and this store beside an earlier one (``--against``): ``scripts/bench.py checkpoint-cost``
(docs/performance/cpu.md). The price: data written over in place is not ordered before the rename (and an
fsync of the directory, which the store does after a batch with a new file, does not make it durable), so
after a host crash (not a process's) the checkpoints of about the last half minute (the kernel writes dirty
pages back once they are 30 s old, by default) may be lost, and with them the previous ones, whose files had
become spares: a file that is not a whole checkpoint of its key fails its digest or its key check; one that is
a whole older checkpoint of its key is resumed from (exact too).

Spares are at most ``SPARES_MOST`` files and ``spare_bytes`` bytes; they are hidden temporary files
(``.spare-<random>.tmp``: never a checkpoint's name), deleted at close; a crash's are leftovers, which the
store sweeps once they are old (its ``LEFTOVER_S``). Used by the store's writer thread only.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from pathlib import Path

TEMPORARY = ".tmp"  # a hidden file the store writes is ``.<name>.tmp``: never ``*.safetensors``
SPARE = ".spare-"
SPARES_MOST = 64


class FileWriter:
    """Atomic writes into ``directory``, reusing spare files (at most ``spare_bytes`` of them). ``names``
    is held while a write changes a checkpoint's name (the link aside and the rename): whoever deletes a
    checkpoint it found damaged holds it too, so it never deletes one renamed there since it looked."""

    def __init__(self, directory: Path, spare_bytes: int, names: threading.RLock) -> None:
        self.directory = directory
        self.spare_bytes = spare_bytes
        self._names = names
        self._spares: list[tuple[Path, int]] = []  # a spare file and its size, newest last
        self._held = 0  # bytes the spares hold

    def write(self, path: Path, data: bytes, created: float, hidden_name: str) -> bool:
        """``data`` to ``path``, its modification time ``created``: into a spare (or a new hidden file
        ``.<hidden_name>.<random>.tmp``), then renamed onto ``path``; the file it replaces becomes a spare.
        Whether it wrote a new file (not a spare). Raises OSError where it cannot (``path`` then holds what
        it held)."""
        spare = self._open_spare()
        temporary, fd, size = spare or self._create(hidden_name)
        try:
            try:
                view = memoryview(data)
                written = 0
                while written < len(data):
                    written += os.pwrite(fd, view[written:], written)
                if size > len(data):  # a larger spare's tail cut (a truncation is a syscall of its own)
                    os.ftruncate(fd, len(data))
                os.utime(fd, (created, created))
            finally:
                os.close(fd)
        except BaseException:
            _unlink(temporary)
            raise
        with self._names:
            old = self._link_aside(path)
            try:
                os.rename(temporary, path)
            except BaseException:
                _unlink(temporary)
                if old is not None:  # still a name of the file at ``path``: never written over
                    _unlink(old[0])
                raise
        if old is not None:  # now its only name
            self._keep(*old)
        return spare is None

    def retire(self, path: Path, size: int) -> None:
        """Remove the regular file at ``path`` (``size`` bytes): kept as a spare while there is room, else
        deleted. Raises OSError where it cannot be removed."""
        if len(self._spares) >= SPARES_MOST or self._held + size > self.spare_bytes:
            path.unlink()
            return
        spare = self._spare_name()
        os.rename(path, spare)  # onto a free name: no write-back forced
        self._keep(spare, size)

    def owns(self, path: Path) -> bool:
        """Whether ``path`` is one of its spares (a sweep of leftovers leaves it)."""
        return any(spare == path for spare, _ in self._spares)

    def close(self) -> None:
        """Delete the spares."""
        for spare, _ in self._spares:
            _unlink(spare)
        self._spares.clear()
        self._held = 0

    # ---- spares -------------------------------------------------------------------------------------------
    def _spare_name(self) -> Path:
        return self.directory / f"{SPARE}{os.urandom(8).hex()}{TEMPORARY}"

    def _keep(self, spare: Path, size: int) -> None:
        if len(self._spares) >= SPARES_MOST or self._held + size > self.spare_bytes:
            _unlink(spare)
            return
        self._spares.append((spare, size))
        self._held += size

    def _open_spare(self) -> tuple[Path, int, int] | None:
        """The newest spare opened for writing, with its size now, or None: a spare gone or changed from
        outside (a leftover sweep of another store sharing the folder) is dropped."""
        while self._spares:
            spare, size = self._spares.pop()
            self._held -= size
            try:  # without following a link or blocking on a FIFO: a regular file or nothing
                fd = os.open(spare, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                _unlink(spare)
                continue
            try:
                entry = os.fstat(fd)
            except OSError:
                entry = None
            # One name only: a file that another name shares (a checkpoint, another store's spare in a
            # folder replicas share) is never written over.
            if entry is not None and stat.S_ISREG(entry.st_mode) and entry.st_nlink == 1:
                return spare, fd, entry.st_size
            os.close(fd)
            _unlink(spare)
        return None

    def _create(self, hidden_name: str) -> tuple[Path, int, int]:
        temporary = self.directory / f".{hidden_name}.{os.urandom(6).hex()}{TEMPORARY}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        return temporary, os.open(temporary, flags, 0o666), 0

    def _link_aside(self, path: Path) -> tuple[Path, int] | None:
        """The file at ``path`` also under a new spare name, with its size (None: nothing there, or a
        folder without hard links; the rename then replaces the file itself)."""
        spare = self._spare_name()
        try:
            os.link(path, spare, follow_symlinks=False)
            entry = os.lstat(spare)
        except OSError:
            _unlink(spare)
            return None
        if not stat.S_ISREG(entry.st_mode):  # a link, FIFO or device planted there: never a spare
            _unlink(spare)
            return None
        return spare, entry.st_size


Identity = tuple[int, int, int, int, int]


def identity(entry: os.stat_result) -> Identity:
    """A file as it is now: device, inode, size, modification and change time, so that a spare written
    over in place is another file though its inode is the same (its modification time is set to its
    checkpoint's own ``created`` time, to well under a microsecond; the change time, moved by a write,
    link or rename, may tick coarsely)."""
    return entry.st_dev, entry.st_ino, entry.st_size, entry.st_mtime_ns, entry.st_ctime_ns


def read_regular(path: Path, limit: int) -> tuple[bytes, Identity]:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes, else ValueError: opened
    without following a link and without blocking (a FIFO swapped in since the check cannot hang it). With
    the file's :func:`identity` when it was opened: see :func:`names_other`."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        entry = os.fstat(fd)
        if not stat.S_ISREG(entry.st_mode):
            raise ValueError("not a regular file")
        if entry.st_size > limit:
            raise ValueError(f"{entry.st_size} bytes, more than checkpoint_max_mb allows")
        chunks, left = [], entry.st_size
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), identity(entry)
    finally:
        os.close(fd)


def names_other(path: Path, read: Identity) -> bool:
    """Whether ``path`` now names another file than the one read (or none): a write or a removal replaced
    it while it was read, and the file read may since have been written over as a spare."""
    try:
        entry = path.lstat()
    except FileNotFoundError:
        return True
    return identity(entry) != read


def fsync_directory(directory: Path) -> None:
    """The renames made durable (where the platform can open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):  # gone already, or not ours to remove: a leftover at worst
        path.unlink()

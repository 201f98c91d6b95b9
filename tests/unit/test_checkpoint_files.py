"""The checkpoint store's file work (recovery/checkpoint_files.py) through the store: spare files written
over in place instead of a new file per checkpoint, never one that another name still shares, bounded,
deleted at close, a dead store's swept once old, a larger one cut to size, the folder fsynced only after a
new file; and a read that a write or removal raced is not taken for damage."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from tests.unit.test_checkpoint_store import KEY, checkpoint, checkpoints, files, spares
from triton_diffusion.recovery import checkpoint_files, checkpoint_store
from triton_diffusion.recovery.checkpoint_store import LEFTOVER_S, CheckpointStore, CorruptCheckpoint


@pytest.fixture
def store(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints", 1 << 20, 3600.0)
    yield store
    store.close()


def write(store: CheckpointStore, key: str, step: int) -> None:
    store.put(key, "h", checkpoint(step))
    assert store.flush(5)


def inode(path: Path) -> int:
    return path.lstat().st_ino


def test_a_replaced_file_becomes_the_spare_the_next_write_goes_into(store):
    path = store.directory / f"{KEY}.safetensors"
    write(store, KEY, 1)
    first = inode(path)
    write(store, KEY, 2)  # step 1's file: now a spare, under a hidden name only
    (spare,) = spares(store.directory)
    assert inode(store.directory / spare) == first and inode(path) != first
    write(store, KEY, 3)  # written into that spare, which is renamed onto the key: no new file
    assert inode(path) == first
    assert len(spares(store.directory)) == 1  # step 2's file, the next spare
    stored = store.get(KEY)
    assert stored is not None and stored.checkpoint.step == 3
    assert checkpoints(store.directory) == [f"{KEY}.safetensors"]


def test_a_smaller_checkpoint_written_into_a_larger_spare_is_cut_to_its_size(store):
    path = store.directory / f"{KEY}.safetensors"
    store.put(KEY, "h", checkpoint(1, size=256))
    assert store.flush(5)
    large = path.stat().st_size
    store.put(KEY, "h", checkpoint(2, size=256))  # step 1's file: a spare of the larger size
    assert store.flush(5)
    small = checkpoint(3, size=64)
    store.put(KEY, "h", small)
    assert store.flush(5)
    assert path.stat().st_size < large
    stored = store.get(KEY)  # none of the larger checkpoint's bytes are left after it
    assert stored is not None and stored.checkpoint.step == 3
    assert torch.equal(stored.checkpoint.tensors["latents"], small.tensors["latents"])


def test_a_removed_request_s_files_become_spares_and_close_deletes_them(store):
    write(store, f"{KEY}.0", 1)
    write(store, f"{KEY}.1", 1)
    kept = {inode(store.directory / f"{KEY}.{i}.safetensors") for i in range(2)}
    store.remove_request(KEY)
    assert store.flush(5)
    assert checkpoints(store.directory) == [] and store.get(f"{KEY}.0") is None
    assert {inode(store.directory / name) for name in spares(store.directory)} == kept
    other = "O" * 16
    write(store, other, 4)  # a new request's checkpoint goes into one of them
    assert inode(store.directory / f"{other}.safetensors") in kept
    store.close()
    assert spares(store.directory) == [] and checkpoints(store.directory) == [f"{other}.safetensors"]


def test_a_spare_that_another_name_shares_is_never_written_over(store, tmp_path):
    write(store, KEY, 1)
    write(store, KEY, 2)
    (spare,) = spares(store.directory)
    outside = tmp_path / "outside"  # a second name (another store's spare, a checkpoint): not ours alone
    os.link(store.directory / spare, outside)
    before = outside.read_bytes()
    write(store, KEY, 3)
    assert outside.read_bytes() == before
    assert inode(store.directory / f"{KEY}.safetensors") != inode(outside)
    stored = store.get(KEY)
    assert stored is not None and stored.checkpoint.step == 3


def test_spares_are_bounded_by_a_quarter_of_the_store_s_bytes(tmp_path):
    size = len(checkpoint_store.serialise(KEY, "h", checkpoint(1), 0.0))
    small = CheckpointStore(tmp_path / "small", 4 * size - 1, 3600.0)  # room for less than one spare
    try:
        write(small, KEY, 1)
        write(small, KEY, 2)
        small.remove_request(KEY)
        assert small.flush(5)
        assert spares(small.directory) == [] and files(small.directory) == []
    finally:
        small.close()
    many = CheckpointStore(tmp_path / "many", 1 << 30, 3600.0)
    try:
        for i in range(checkpoint_files.SPARES_MOST + 5):
            write(many, f"{KEY}.{i}", 1)
        many.remove_request(KEY)
        assert many.flush(5)
        assert len(spares(many.directory)) == checkpoint_files.SPARES_MOST
    finally:
        many.close()


def test_a_rename_that_fails_keeps_the_old_checkpoint_and_makes_no_spare_of_it(store, monkeypatch):
    write(store, KEY, 1)
    real = os.rename

    def rename(source, target):
        if Path(target).name == f"{KEY}.safetensors":
            raise OSError(5, "Input/output error")
        return real(source, target)

    monkeypatch.setattr(checkpoint_files.os, "rename", rename)
    write(store, KEY, 2)
    monkeypatch.setattr(checkpoint_files.os, "rename", real)
    assert "the write failed" in (store.not_kept(KEY) or "")
    assert spares(store.directory) == [] and files(store.directory) == [f"{KEY}.safetensors"]
    write(store, "O" * 16, 3)  # a write goes on; step 1's file is the key's still
    stored = store.get(KEY)
    assert stored is not None and stored.checkpoint.step == 1


def test_a_read_that_a_write_raced_reads_the_key_s_new_file(store, monkeypatch):
    """The file read was replaced while it was read (and may have been written over as a spare since):
    not damage. The key's file now is read instead, and nothing is deleted."""
    write(store, KEY, 1)
    path = store.directory / f"{KEY}.safetensors"
    real = checkpoint_store.read_regular
    calls = []

    def read_regular(target, limit):
        data, identity = real(target, limit)
        if not calls:  # the first read: its file is replaced, and what it read is torn
            calls.append(identity)
            replacement = store.directory / "replacement"
            replacement.write_bytes(checkpoint_store.serialise(KEY, "h", checkpoint(2), 0.0))
            os.utime(replacement, (path.stat().st_mtime,) * 2)
            os.replace(replacement, path)
            return data[: len(data) // 2], identity
        return data, identity

    monkeypatch.setattr(checkpoint_store, "read_regular", read_regular)
    stored = store.get(KEY)
    assert stored is not None and stored.checkpoint.step == 2
    assert checkpoints(store.directory) == [f"{KEY}.safetensors"]


def test_a_read_that_two_writes_raced_is_not_damage_though_the_key_names_its_inode_again(store, monkeypatch):
    """Two writes during one read: the key is renamed back onto the inode read (a spare), written over. The
    file's identity (its change time) tells it is another file: the key's file is read again."""
    write(store, KEY, 1)
    path = store.directory / f"{KEY}.safetensors"
    first = inode(path)
    real = checkpoint_store.read_regular
    raced = []

    def read_regular(target, limit):
        data, identity = real(target, limit)
        if not raced:
            raced.append(1)
            write(store, KEY, 2)  # step 1's file becomes a spare
            write(store, KEY, 3)  # written into it, renamed back onto the key
            assert inode(path) == first
            return data[: len(data) // 2], identity  # what a read torn by the rewrite would hold
        return data, identity

    monkeypatch.setattr(checkpoint_store, "read_regular", read_regular)
    stored = store.get(KEY)
    assert stored is not None and stored.checkpoint.step == 3
    assert checkpoints(store.directory) == [f"{KEY}.safetensors"]


def test_a_dead_store_s_spares_are_swept_once_old_and_the_store_s_own_never(tmp_path):
    clock = [1_000_000.0]
    store = CheckpointStore(tmp_path / "c", 1 << 20, 3600.0, lambda: clock[0])
    try:
        write(store, KEY, 1)
        write(store, KEY, 2)  # step 1's file: a spare of this store, its time step 1's
        (own,) = spares(store.directory)
        dead = store.directory / f"{checkpoint_files.SPARE}0123456789abcdef{checkpoint_files.TEMPORARY}"
        dead.write_bytes(b"a dead store's spare")
        os.utime(dead, (clock[0], clock[0]))
        store.sweep()
        assert spares(store.directory) == sorted([own, dead.name])  # young: it may be a live replica's
        clock[0] += LEFTOVER_S + 1
        store.sweep()
        assert spares(store.directory) == [own]  # its own, however old, stays
        dead.write_bytes(b"a dead store's spare")
        future = clock[0] + LEFTOVER_S + 1  # its time set ahead (a clock set back since): as old
        os.utime(dead, (future, future))
        store.sweep()
        assert spares(store.directory) == [own]
    finally:
        store.close()


def test_a_link_planted_at_a_key_never_becomes_a_spare(store, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not a checkpoint")
    (store.directory / f"{KEY}.safetensors").symlink_to(target)
    write(store, KEY, 1)  # the rename replaces the link itself, which is not kept
    assert spares(store.directory) == []
    assert target.read_bytes() == b"not a checkpoint"
    stored = store.get(KEY)
    assert stored is not None and stored.checkpoint.step == 1


def test_a_damaged_file_is_deleted_only_while_no_write_renames_onto_its_key(store, monkeypatch):
    """A read finds the key's file damaged; a write of the key, handed over during the read, has its file
    written and is about to rename it onto the key while the read checks that the key still names the
    damaged file. The rename waits for the check and the deletion (one lock), so the deletion never takes
    the new checkpoint."""
    path = store.directory / f"{KEY}.safetensors"
    path.write_bytes(b"damaged")
    written, go, renamed = threading.Event(), threading.Event(), threading.Event()
    real_utime, real_rename = os.utime, os.rename
    real_read, real_names_other = checkpoint_store.read_regular, checkpoint_store.names_other

    def utime(target, times):  # the writer's last step before its rename
        real_utime(target, times)
        written.set()
        assert go.wait(10)

    def rename(source, target):
        real_rename(source, target)
        if Path(target) == path:
            renamed.set()

    def read_regular(target, limit):
        found = real_read(target, limit)
        store.put(KEY, "h", checkpoint(2))
        assert written.wait(10)
        return found

    def names_other(target, seen):
        other = real_names_other(target, seen)
        go.set()
        renamed.wait(2.0)  # without the lock, the rename lands here
        return other

    monkeypatch.setattr(checkpoint_files.os, "utime", utime)
    monkeypatch.setattr(checkpoint_files.os, "rename", rename)
    monkeypatch.setattr(checkpoint_store, "read_regular", read_regular)
    monkeypatch.setattr(checkpoint_store, "names_other", names_other)
    with pytest.raises(CorruptCheckpoint):
        store.get(KEY)
    monkeypatch.undo()
    assert store.flush(5)
    stored = store.get(KEY)
    assert stored is not None and stored.checkpoint.step == 2


def test_eviction_counts_a_file_gone_since_the_listing_and_evicts_no_other_for_it(tmp_path, monkeypatch):
    size = len(checkpoint_store.serialise(KEY, "h", checkpoint(1), 0.0))
    store = CheckpointStore(tmp_path / "c", int(size * 2.5), 3600.0)
    try:
        write(store, f"{KEY}.0", 1)
        real = CheckpointStore._checkpoint_files
        ghost = store.directory / f"{'G' * 16}.safetensors"  # listed, then deleted by another replica

        def listing(self):
            found = real(self)
            entry = found[0][1]
            return [(ghost, os.stat_result((entry.st_mode, 0, 0, 1, 0, 0, size, 0, 0, 0))), *found]

        monkeypatch.setattr(CheckpointStore, "_checkpoint_files", listing)
        write(store, f"{KEY}.1", 1)  # the ghost's bytes and two files' pass the bound: the ghost goes
        assert checkpoints(store.directory) == [f"{KEY}.0.safetensors", f"{KEY}.1.safetensors"]
    finally:
        store.close()


def test_a_file_s_identity_tells_apart_a_rewrite_the_change_time_may_not():
    """The change time may tick coarsely (older kernels, some NFS): the modification time, set to each
    checkpoint's own ``created`` to the nanosecond, tells two rewrites within one tick apart."""
    fields = [0o100644, 7, 1, 1, 0, 0, 100, 0, 0, 0]

    def entry(mtime_ns: int) -> os.stat_result:
        return os.stat_result(fields, {"st_mtime_ns": mtime_ns, "st_ctime_ns": 5_000_000})

    assert checkpoint_files.identity(entry(1)) == checkpoint_files.identity(entry(1))
    assert checkpoint_files.identity(entry(2)) != checkpoint_files.identity(entry(1))  # one tick of ctime


def test_the_folder_is_fsynced_after_a_batch_that_wrote_a_new_file_only(store, monkeypatch):
    synced: list[Path] = []
    monkeypatch.setattr(checkpoint_store, "fsync_directory", synced.append)
    for step in (1, 2, 3):
        store.put(KEY, "h", checkpoint(step))
        assert store.flush(5)
    # Steps 1 and 2 into new files (no spare yet); step 3 into step 1's file, a spare since step 2.
    assert synced == [store.directory] * 2
    stored = store.get(KEY)
    assert stored is not None and stored.checkpoint.step == 3

"""The checkpoint store (recovery/checkpoint_store.py): checkpoints written atomically by a writer thread,
the latest of a key winning, damaged files detected and deleted, expiry, the byte bound and keys that
cannot name a path elsewhere."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from triton_diffusion.recovery import checkpoint_files, checkpoint_store
from triton_diffusion.recovery.checkpoint_files import SPARE
from triton_diffusion.recovery.checkpoint_format import JobCheckpoint
from triton_diffusion.recovery.checkpoint_store import CheckpointStore, CorruptCheckpoint, valid_key

KEY = "0123456789abcdef-request"


def checkpoint(step: int, size: int = 64) -> JobCheckpoint:
    """A checkpoint of every kind of tensor a job's has: float, half, 0-d, integer, bytes."""
    generator = torch.Generator().manual_seed(step)
    tensors = {
        "latents": torch.randn(1, 4, size // 8, size // 8, generator=generator),
        "scheduler.sigmas": torch.linspace(14.6, 0.0, 7),
        "scheduler.model_outputs.1": torch.randn(1, 4, 2, 2, generator=generator).to(torch.bfloat16),
        "scheduler.final": torch.tensor(0.5),
        "scheduler.timesteps": torch.arange(7, dtype=torch.int64),
        "generator.0": torch.Generator().manual_seed(step).get_state(),
    }
    return JobCheckpoint(
        step, tensors, {"scheduler": {"_step_index": {"value": step}}, "x": [1.5, None, "s"]}
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class HeldWrites:
    """``os.rename`` in the store held until released: a write under way, seen from outside."""

    def __init__(self, monkeypatch) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()
        self.replaced: list[str] = []
        real = os.rename

        def rename(source, target) -> None:
            self.reached.set()
            assert self.go.wait(10), "the test never released the write"
            self.replaced.append(Path(target).name)
            real(source, target)

        monkeypatch.setattr(checkpoint_files.os, "rename", rename)


def files(directory: Path) -> list[str]:
    """What the folder holds but the store's spares (hidden files it writes into: checkpoint_files.py)."""
    return sorted(path.name for path in directory.iterdir() if not path.name.startswith(SPARE))


def spares(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.name.startswith(SPARE))


def checkpoints(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.glob("*.safetensors"))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path, clock):
    store = CheckpointStore(tmp_path / "checkpoints", 1 << 20, 3600.0, clock)
    yield store
    store.close()


def test_a_checkpoint_reads_back_as_it_was_written(store):
    written = checkpoint(3)
    store.put(KEY + ".0", "fields-hash", written)
    stored = store.get(KEY + ".0")  # waits for the pending write
    assert stored is not None and stored.fields_hash == "fields-hash"
    assert stored.checkpoint.step == 3 and stored.checkpoint.meta == written.meta
    assert set(stored.checkpoint.tensors) == set(written.tensors)
    for name, tensor in written.tensors.items():
        read = stored.checkpoint.tensors[name]
        assert read.dtype == tensor.dtype and torch.equal(read, tensor), name
    assert store.bytes_used == (store.directory / f"{KEY}.0.safetensors").stat().st_size
    assert store.get(KEY + ".1") is None


def test_a_get_waits_for_the_pending_write_of_its_key(store, monkeypatch):
    held = HeldWrites(monkeypatch)
    store.put(KEY, "h", checkpoint(2))
    assert held.reached.wait(5)
    threading.Timer(0.3, held.go.set).start()  # released while get waits
    stored = store.get(KEY)
    assert stored is not None and stored.checkpoint.step == 2


def test_a_write_is_atomic_no_partial_file_is_ever_a_checkpoint(store, monkeypatch, tmp_path):
    store.put(KEY, "h", checkpoint(1))
    assert store.flush(5)
    held = HeldWrites(monkeypatch)
    store.put(KEY, "h", checkpoint(2))
    assert held.reached.wait(5), "the write did not go through a rename"
    # Written in full under a hidden name, not yet renamed: the old checkpoint is the key's, and it has a
    # spare name too (checkpoint_files.py: the rename then replaces a name, and the file becomes a spare).
    (temporary,) = [name for name in files(store.directory) if not name.endswith(".safetensors")]
    assert temporary.startswith(".") and not valid_key(temporary.split(".safetensors")[0])
    assert checkpoint_store.parse((store.directory / temporary).read_bytes(), KEY).checkpoint.step == 2
    assert checkpoints(store.directory) == [f"{KEY}.safetensors"]
    assert (
        checkpoint_store.parse((store.directory / f"{KEY}.safetensors").read_bytes(), KEY).checkpoint.step
        == 1
    )
    (spare,) = spares(store.directory)
    assert os.path.samefile(store.directory / spare, store.directory / f"{KEY}.safetensors")
    assert store.flush(0.1) is False  # the write is under way
    held.go.set()
    assert store.flush(5)
    assert files(store.directory) == [f"{KEY}.safetensors"]
    stored = store.get(KEY)
    assert stored is not None and stored.checkpoint.step == 2
    # A temporary file a crash left behind is never a checkpoint, and is removed at a later start once it
    # is old (a fresh one may be another replica's write under way, in a folder replicas share).
    leftover = store.directory / f".{KEY}.0a1b2c.tmp"
    leftover.write_bytes(b"half a checkpoint")
    os.utime(leftover, (store.clock() - 60, store.clock() - 60))
    kept = CheckpointStore(store.directory, 1 << 20, 3600.0, store.clock)
    assert sorted(files(kept.directory)) == sorted([leftover.name, f"{KEY}.safetensors"])
    kept.close()
    os.utime(leftover, (store.clock() - 601, store.clock() - 601))
    again = CheckpointStore(store.directory, 1 << 20, 3600.0, store.clock)
    assert files(again.directory) == [f"{KEY}.safetensors"]
    again.close()


def test_the_latest_pending_checkpoint_of_a_key_wins(store, monkeypatch):
    held = HeldWrites(monkeypatch)
    store.put(KEY, "h", checkpoint(1))
    assert held.reached.wait(5)  # step 1 is being written; 2 and 3 wait, 3 replaces 2
    store.put(KEY, "h", checkpoint(2))
    store.put(KEY, "h", checkpoint(3))
    held.go.set()
    assert store.flush(5)
    assert held.replaced == [f"{KEY}.safetensors"] * 2  # steps 1 and 3: step 2 was never written
    stored = store.get(KEY)
    assert stored is not None and stored.checkpoint.step == 3


def damage(path: Path, how: str) -> None:
    """Damage the file in place, keeping its time (the store's clock, not the host's)."""
    data = bytearray(path.read_bytes())
    written = path.stat().st_mtime
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) - 10]))
    else:  # one bit of the payload (the last tensor's last byte)
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    os.utime(path, (written, written))


@pytest.mark.parametrize("how", ["truncated", "flipped"])
def test_a_damaged_checkpoint_is_corrupt_and_deleted(store, how):
    store.put(KEY, "h", checkpoint(4))
    assert store.flush(5)
    path = store.directory / f"{KEY}.safetensors"
    damage(path, how)
    with pytest.raises(CorruptCheckpoint):
        store.get(KEY)
    assert not path.exists() and store.bytes_used == 0
    assert store.get(KEY) is None


def test_checkpoints_expire_after_the_ttl(store, clock, tmp_path):
    store.put(KEY + ".0", "h", checkpoint(1))
    assert store.flush(5)
    clock.now += 3599.0
    assert store.get(KEY + ".0") is not None
    clock.now += 2.0
    assert store.get(KEY + ".0") is None
    assert checkpoints(store.directory) == []
    # The sweep at construction, and before each write.
    store.put(KEY + ".1", "h", checkpoint(1))
    assert store.flush(5)
    clock.now += 3601.0
    again = CheckpointStore(store.directory, 1 << 20, 3600.0, clock)
    assert checkpoints(again.directory) == [] and again.bytes_used == 0
    again.close()


def read_in_a_thread(store: CheckpointStore, key: str) -> BaseException | object:
    """``store.get(key)`` from a thread, bounded: a read that blocks fails the test instead of hanging it."""
    outcome: list[BaseException | object] = []

    def read() -> None:
        try:
            outcome.append(store.get(key))
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the read blocked"
    return outcome[0]


@pytest.mark.parametrize("how", ["fifo", "link to a fifo", "empty directory", "directory with a file"])
def test_an_entry_that_is_not_a_regular_file_is_corrupt_never_opened_and_never_fails_the_store(
    store, clock, tmp_path, how, monkeypatch
):
    def never(path: Path, limit: int) -> bytes:
        raise AssertionError(f"{path.name} was opened")

    monkeypatch.setattr(checkpoint_store, "read_regular", never)
    path = store.directory / f"{KEY}.0.safetensors"
    if how == "fifo":
        os.mkfifo(path)
    elif how == "link to a fifo":
        os.mkfifo(tmp_path / "elsewhere")
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.mkdir()
        if how == "directory with a file":
            (path / "inside").write_text("x")
    outcome = read_in_a_thread(store, f"{KEY}.0")
    assert isinstance(outcome, CorruptCheckpoint) and "not a regular file" in str(outcome), outcome
    assert path.exists() == (how == "directory with a file")  # removed where it safely can be
    assert (tmp_path / "elsewhere").exists() == (how == "link to a fifo")  # a link's target is not touched
    assert store.bytes_used == 0
    # Past the TTL, a new store (the model loading again) sweeps around it and writes beside it, and counts
    # the checkpoint alone.
    monkeypatch.undo()
    if how == "directory with a file":
        (path / "inside.safetensors").write_text("not counted either")
    clock.now += 7200.0
    again = CheckpointStore(store.directory, 1 << 20, 3600.0, clock)
    again.put(KEY + ".1", "h", checkpoint(1))
    assert again.flush(5) and again.get(KEY + ".1") is not None
    assert again.bytes_used == (store.directory / f"{KEY}.1.safetensors").stat().st_size
    again.close()


def test_what_could_not_be_written_is_said_once_and_kept_until_written_or_removed(tmp_path, clock, caplog):
    store = CheckpointStore(tmp_path / "small", 1000, 3600.0, clock)  # below one checkpoint
    try:
        for _ in range(3):
            store.put(KEY + ".0", "h", checkpoint(1))
            assert store.flush(5)
        assert "above checkpoint_max_mb" in (store.not_kept(KEY) or "")
        assert store.not_kept("another-key-0123456789") is None
        assert caplog.text.count("not kept") == 1  # said once per key, not once per checkpoint
        store.max_bytes = 1 << 20
        store.put(KEY + ".0", "h", checkpoint(2))
        assert store.flush(5) and store.not_kept(KEY) is None  # written since
        store.max_bytes = 1000
        store.put(KEY + ".1", "h", checkpoint(2))
        assert store.flush(5) and store.not_kept(KEY) is not None
        store.remove_request(KEY)
        assert store.not_kept(KEY) is None
    finally:
        store.close()


def test_a_checkpoint_from_the_future_expires(store, clock):
    store.put(KEY + ".0", "h", checkpoint(1))
    assert store.flush(5)
    path = store.directory / f"{KEY}.0.safetensors"
    os.utime(path, (clock.now + 2 * 3600.0, clock.now + 2 * 3600.0))  # touched, or a clock set back
    assert store.get(KEY + ".0") is None and not path.exists()


def test_a_file_larger_than_the_bound_is_corrupt(store, clock):
    path = store.directory / f"{KEY}.0.safetensors"
    path.write_bytes(b"x" * ((1 << 20) + 1))
    os.utime(path, (clock.now, clock.now))
    with pytest.raises(CorruptCheckpoint, match="more than checkpoint_max_mb"):
        store.get(KEY + ".0")
    assert not path.exists()


def test_the_byte_bound_evicts_the_oldest_first(tmp_path, clock, caplog):
    size = len(checkpoint_store.serialise(KEY, "h", checkpoint(1), clock.now))
    store = CheckpointStore(tmp_path / "c", int(size * 2.5), 3600.0, clock)
    for i in range(3):
        store.put(f"{KEY}.{i}", "h", checkpoint(1))
        assert store.flush(5)
        clock.now += 1.0
    assert checkpoints(store.directory) == [f"{KEY}.1.safetensors", f"{KEY}.2.safetensors"]
    assert store.bytes_used <= store.max_bytes
    store.put(f"{KEY}.1", "h", checkpoint(2))  # rewritten: now the newest, .2 the oldest
    assert store.flush(5)
    store.put(f"{KEY}.3", "h", checkpoint(1))
    assert store.flush(5)
    assert checkpoints(store.directory) == [f"{KEY}.1.safetensors", f"{KEY}.3.safetensors"]
    # One larger than the bound alone is not kept (and evicts nothing).
    with caplog.at_level(logging.WARNING, logger="triton_diffusion"):
        store.put(f"{KEY}.4", "h", checkpoint(1, size=512))
        assert store.flush(5)
    assert "not kept" in caplog.text
    assert checkpoints(store.directory) == [f"{KEY}.1.safetensors", f"{KEY}.3.safetensors"]
    store.close()


@pytest.mark.parametrize(
    "key",
    [
        "../x",
        "a/b",
        "../../../../etc/passwd",
        "0123456789abcdef/../x",
        "short",
        "x" * 129,
        "0123456789abcdef.x",
        "0123456789abcdef..0",
        "0123456789abcdef.0.1",
        ".0123456789abcdef",
        "0123456789abcdef\x00",
        "",
    ],
)
def test_a_bad_key_is_refused(store, key):
    assert not valid_key(key)
    with pytest.raises(ValueError, match="invalid checkpoint key"):
        store.put(key, "h", checkpoint(1))
    for call in (store.get, store.remove, store.remove_request):
        with pytest.raises(ValueError, match="invalid checkpoint key"):
            call(key)
    assert checkpoints(store.directory) == []


def test_good_keys():
    assert valid_key("0123456789abcdef") and valid_key("A-z_" * 32) and valid_key(KEY + ".12")


def test_remove_request_removes_every_image_of_the_request_and_their_pending_writes(store, monkeypatch):
    other = "fedcba9876543210-other"
    for key in (f"{KEY}.0", f"{KEY}.1", KEY, f"{other}.0", f"{KEY}x.0"):
        store.put(key, "h", checkpoint(1))
    assert store.flush(5)
    held = HeldWrites(monkeypatch)
    store.put(f"{other}.1", "h", checkpoint(1))  # under way
    assert held.reached.wait(5)
    store.put(f"{KEY}.2", "h", checkpoint(2))  # pending
    threading.Timer(0.2, held.go.set).start()
    store.remove_request(KEY)
    assert store.flush(5)
    assert checkpoints(store.directory) == [
        f"{KEY}x.0.safetensors",
        f"{other}.0.safetensors",
        f"{other}.1.safetensors",
    ]


def test_remove_cancels_a_pending_write(store, monkeypatch):
    held = HeldWrites(monkeypatch)
    store.put(f"{KEY}.0", "h", checkpoint(1))
    assert held.reached.wait(5)
    store.put(f"{KEY}.1", "h", checkpoint(1))
    store.remove(f"{KEY}.1")
    held.go.set()
    assert store.flush(5)
    assert checkpoints(store.directory) == [f"{KEY}.0.safetensors"]
    store.remove(f"{KEY}.0")
    assert store.flush(5) and checkpoints(store.directory) == [] and store.bytes_used == 0


def test_a_removal_returns_at_once_and_the_writer_deletes_after_the_write_under_way(store, monkeypatch):
    """The thread that answers never waits for the folder or starts a thread: a removal of a key whose
    write is under way returns while the write is held, and the file goes once it is written."""
    held = HeldWrites(monkeypatch)
    store.put(f"{KEY}.0", "h", checkpoint(1))
    assert held.reached.wait(5)

    def no_thread(*args, **kwargs):
        raise AssertionError("a removal started a thread")

    monkeypatch.setattr(checkpoint_store.threading, "Thread", no_thread)
    started = time.monotonic()
    store.remove_request(KEY)
    store.remove(f"{KEY}.0")
    assert time.monotonic() - started < 1.0  # it did not wait for the write held
    held.go.set()
    assert store.flush(5) and checkpoints(store.directory) == [] and store.bytes_used == 0


def held_deletes(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The store's file deletions held until the first event is set; the second says one was reached."""
    release, entered = threading.Event(), threading.Event()
    real = CheckpointStore._delete

    def delete(self, path, retire=False):
        entered.set()
        assert release.wait(10), "the test never released the deletion"
        return real(self, path, retire)

    monkeypatch.setattr(CheckpointStore, "_delete", delete)
    return release, entered


@pytest.mark.parametrize("alone", ["removal", "put"])
def test_a_removal_or_a_put_alone_wakes_the_writer(store, alone):
    """Nothing else handed over, nobody flushing or reading: it is done within the writer's gathering (a
    put wakes the writer only when it waits for work)."""
    deadline = time.monotonic() + 5.0
    while not store._idle and time.monotonic() < deadline:  # it waits for work: the call must wake it
        time.sleep(0.01)
    assert store._idle
    store.put(f"{KEY}.0", "h", checkpoint(1))
    if alone == "removal":
        assert store.flush(5)
        while not store._idle and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store._idle
        store.remove_request(KEY)
    want = [] if alone == "removal" else [f"{KEY}.0.safetensors"]
    deadline = time.monotonic() + 5.0
    while checkpoints(store.directory) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    assert checkpoints(store.directory) == want


def test_puts_and_removals_while_the_writer_gathers_do_not_wake_it(store, monkeypatch):
    """Only the first call of a batch wakes the writer: a wakeup per put or removal costs the caller's
    thread (the engine's, the one that answers) a switch for nothing."""
    monkeypatch.setattr(checkpoint_store, "BATCH_S", 30.0)  # a gathering no call ends
    deadline = time.monotonic() + 5.0
    while not store._idle and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store._idle
    store.put(f"{KEY}.0", "h", checkpoint(1))
    while store._idle and time.monotonic() < deadline:  # woken: it gathers
        time.sleep(0.01)
    assert not store._idle
    woken = []
    real = store._changed.notify_all
    monkeypatch.setattr(store._changed, "notify_all", lambda: (woken.append(1), real())[1])
    for i in range(1, 6):
        store.put(f"{KEY}.{i}", "h", checkpoint(1))
    store.remove(f"{KEY}.5")
    store.remove_request("R" * 16)
    assert woken == []
    monkeypatch.undo()
    assert store.flush(5)
    assert len(checkpoints(store.directory)) == 5


def test_a_read_waits_for_the_removal_under_way_and_finds_nothing(store, monkeypatch):
    store.put(f"{KEY}.0", "h", checkpoint(1))
    assert store.flush(5)
    release, entered = held_deletes(monkeypatch)
    store.remove_request(KEY)
    assert entered.wait(5)  # the writer has taken the removal and is deleting the file
    got: list = []
    reader = threading.Thread(target=lambda: got.append(store.get(f"{KEY}.0")), daemon=True)
    reader.start()
    reader.join(0.3)
    assert reader.is_alive()  # it waits: the file is still there, being removed
    release.set()
    reader.join(5)
    assert got == [None]


def test_a_flush_waits_for_what_was_handed_over_before_it_only(store, monkeypatch):
    """A drain's flush is not held up by the removals of requests answered while it waits."""
    store.put("fedcba9876543210-other.0", "h", checkpoint(1))
    assert store.flush(5)
    held = HeldWrites(monkeypatch)
    store.put(f"{KEY}.0", "h", checkpoint(1))
    assert held.reached.wait(5)  # being written
    flushed: list[bool] = []
    flusher = threading.Thread(target=lambda: flushed.append(store.flush(10)), daemon=True)
    flusher.start()
    time.sleep(0.1)
    release, entered = held_deletes(monkeypatch)
    store.remove_request("fedcba9876543210-other")  # answered meanwhile: its removal is held
    held.go.set()
    assert entered.wait(5)
    flusher.join(2)
    assert flushed == [True]  # the write before it is done; the removal after it still under way
    release.set()
    assert store.flush(5)


def test_a_removal_that_fails_loses_no_write_of_its_batch(store, monkeypatch):
    store.put(f"{KEY}.0", "h", checkpoint(1))
    assert store.flush(5)

    def unlistable(self):
        raise OSError("the folder cannot be listed")

    monkeypatch.setattr(checkpoint_store, "BATCH_S", 1.0)  # the removal and the put in one batch
    monkeypatch.setattr(CheckpointStore, "_remove", lambda self, removals: unlistable(self))
    store.remove_request("fedcba9876543210-other")
    store.put(f"{KEY}.1", "h", checkpoint(2))
    assert store.flush(5)
    stored = store.get(f"{KEY}.1")
    assert stored is not None and stored.checkpoint.step == 2 and store.not_kept(KEY) is None


def test_a_queued_removal_hides_the_checkpoint_and_a_later_put_is_kept(store, monkeypatch):
    """Until the writer deletes it, a removed checkpoint is not read; a put of the same key after the
    removal is newer and is written after it."""
    store.put(f"{KEY}.0", "h", checkpoint(1))
    store.put(f"{KEY}.1", "h", checkpoint(1))
    assert store.flush(5)
    monkeypatch.setattr(checkpoint_store, "BATCH_S", 30.0)  # the writer gathers: the removal waits
    store.remove_request(KEY)
    assert store.get(f"{KEY}.0") is None  # the read waits for the removal (it ends the gathering)
    store.remove(f"{KEY}.1")
    store.put(f"{KEY}.1", "h", checkpoint(2))
    stored = store.get(f"{KEY}.1")
    assert stored is not None and stored.checkpoint.step == 2
    assert checkpoints(store.directory) == [f"{KEY}.1.safetensors"]


def test_flush_waits_for_the_writer(store, monkeypatch):
    held = HeldWrites(monkeypatch)
    store.put(KEY, "h", checkpoint(1))
    assert store.flush(0.2) is False
    held.go.set()
    assert store.flush(5) is True
    assert checkpoints(store.directory) == [f"{KEY}.safetensors"]
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.put(KEY, "h", checkpoint(2))


def evictions(monkeypatch) -> list[frozenset[Path]]:
    """The files each eviction kept (one eviction a batch, after its writes)."""
    kept: list[frozenset[Path]] = []
    real = checkpoint_store.CheckpointStore._evict

    def evict(self, keep):
        kept.append(keep)
        real(self, keep)

    monkeypatch.setattr(checkpoint_store.CheckpointStore, "_evict", evict)
    return kept


def test_checkpoints_pending_together_are_written_as_one_batch(store, monkeypatch):
    batches = evictions(monkeypatch)
    held = HeldWrites(monkeypatch)
    store.put(f"{KEY}.0", "h", checkpoint(1))
    assert held.reached.wait(5)  # .0 is being written; the next three wait for it together
    for i in (1, 2, 3):
        store.put(f"{KEY}.{i}", "h", checkpoint(i))
    held.go.set()
    assert store.flush(5)
    path = store._path
    assert batches == [{path(f"{KEY}.0")}, {path(f"{KEY}.{i}") for i in (1, 2, 3)}]  # .0, then the three
    assert checkpoints(store.directory) == [f"{KEY}.{i}.safetensors" for i in range(4)]
    assert store.bytes_used == sum(p.stat().st_size for p in store.directory.glob("*.safetensors"))


def test_expired_checkpoints_are_swept_before_a_batch_at_most_every_sweep_s(store, clock):
    store.put(f"{KEY}.0", "h", checkpoint(1))
    assert store.flush(5)
    clock.now += 3601.0  # .0 has expired, and a sweep is due
    store.put(f"{KEY}.1", "h", checkpoint(1))
    assert store.flush(5)
    assert checkpoints(store.directory) == [f"{KEY}.1.safetensors"]
    clock.now += 3600.0 - checkpoint_store.SWEEP_S / 3
    store.put(f"{KEY}.2", "h", checkpoint(1))  # a sweep, .1 not yet expired
    assert store.flush(5)
    clock.now += checkpoint_store.SWEEP_S / 2
    store.put(f"{KEY}.3", "h", checkpoint(1))  # .1 has expired, but the last sweep was too recent
    assert store.flush(5)
    assert checkpoints(store.directory) == [f"{KEY}.{i}.safetensors" for i in (1, 2, 3)]
    assert store.get(f"{KEY}.1") is None  # a read checks its own file's age


def test_the_writer_lives_on_when_what_it_gathers_is_removed(store, monkeypatch):
    monkeypatch.setattr(checkpoint_store, "BATCH_S", 1.0)
    store.put(f"{KEY}.0", "h", checkpoint(1))
    time.sleep(0.3)  # the writer is gathering
    store.remove_request(KEY)  # nothing is left to write
    time.sleep(1.0)  # the window ends with nothing pending
    assert store._thread.is_alive()
    store.put(f"{KEY}.1", "h", checkpoint(2))
    stored = store.get(f"{KEY}.1")
    assert stored is not None and stored.checkpoint.step == 2


def test_a_checkpoint_that_cannot_be_serialised_loses_only_itself(store, monkeypatch):
    real = checkpoint_store.serialise

    def serialise(key, *args):
        if key.endswith(".1"):
            raise TypeError("not a tensor")
        return real(key, *args)

    monkeypatch.setattr(checkpoint_store, "serialise", serialise)
    batches = evictions(monkeypatch)
    for i in range(3):
        store.put(f"{KEY}.{i}", "h", checkpoint(i))
    assert store.flush(5)
    assert checkpoints(store.directory) == [f"{KEY}.0.safetensors", f"{KEY}.2.safetensors"]
    assert batches == [{store._path(f"{KEY}.0"), store._path(f"{KEY}.2")}]


def hang(monkeypatch, owner, name: str) -> tuple[threading.Event, threading.Event]:
    """``owner.name`` blocks in the kernel (a hung volume) until the first event is set; the second says
    it was reached."""
    release, entered = threading.Event(), threading.Event()
    call = getattr(owner, name)

    def hung(*args):
        entered.set()
        release.wait(60)
        return call(*args)

    monkeypatch.setattr(owner, name, hung)
    return release, entered


def test_a_folder_that_does_not_answer_stalls_no_read_or_removal(store, monkeypatch):
    """A hung network volume: the read blocks in the kernel. The request's read gives up after FOLDER_S
    (none found: the request starts over), later calls skip the folder at once while it is stuck, and it
    is used again once it answers."""
    key = "K" * 16 + ".0"
    store.put(key, "h", checkpoint(3))
    assert store.flush(10)
    monkeypatch.setattr(checkpoint_store, "FOLDER_S", 0.2)
    release, entered = hang(monkeypatch, checkpoint_store, "read_regular")
    done = threading.Event()
    results = []

    def reader() -> None:
        results.append(store.get(key))  # not found: the folder did not answer
        results.append(store.get(key))  # skipped at once: the first call is still stuck
        store.remove_request("L" * 16)  # another request's removal: queued for the writer, never waited for
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    try:
        assert entered.wait(30), "the read never reached the folder"
        assert done.wait(30), "a read of a hung folder stalled its caller"
        assert results == [None, None]
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while store._hung is not None and store._hung.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    monkeypatch.setattr(checkpoint_store, "FOLDER_S", 30.0)  # a healthy read on a busy machine
    stored = store.get(key)  # the folder answers again: the checkpoint is there
    assert stored is not None and stored.checkpoint.step == 3


def test_a_write_that_hangs_marks_the_folder_hung_until_it_returns(store, monkeypatch):
    """A write stuck in the kernel (a hung volume) for longer than FOLDER_S: reads then skip the folder at
    once (the request starts over) instead of waiting on it; once the write returns they read again."""
    other = "O" * 16 + ".0"
    store.put(other, "h", checkpoint(2))
    assert store.flush(10)
    monkeypatch.setattr(checkpoint_store, "FOLDER_S", 0.2)
    release, entered = hang(monkeypatch, store, "_write_one")
    store.put("W" * 16 + ".0", "h", checkpoint(5))
    try:
        assert entered.wait(30), "the write never reached the folder"
        deadline = time.monotonic() + 30
        while not store._folder_hung("probe") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.get(other) is None  # skipped: the folder is busy with a write that does not return
    finally:
        release.set()
    assert store.flush(30)
    monkeypatch.setattr(checkpoint_store, "FOLDER_S", 30.0)
    stored = store.get(other)  # the write returned: the folder is read again
    assert stored is not None and stored.checkpoint.step == 2

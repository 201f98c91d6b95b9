"""The checkpoint-cost benchmark's round (scripts/benchmarks/checkpoint_cost.py): the intervals alternate in
blocks on one engine, each interval gets its engine steps, checkpoints are taken only in its blocks, and an
answered request's checkpoints are removed only where checkpoints are on; what the store has left of a
block's work is done before the block's time ends; the summary and ``--against`` read each round against
its own."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the benchmarks' package

from benchmarks import checkpoint_cost  # noqa: E402

from tests.unit.recording import tracked  # noqa: E402
from tests.unit.test_step_engine import FakeAdapter, Spec  # noqa: E402
from triton_diffusion.engine.jobs import Job  # noqa: E402
from triton_diffusion.recovery.checkpoint_format import JobCheckpoint  # noqa: E402
from triton_diffusion.recovery.checkpoint_store import CheckpointStore  # noqa: E402


class CheckpointingAdapter(FakeAdapter):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def checkpoint(self, jobs):
        self.events.extend("checkpoint" for _ in jobs)
        return [JobCheckpoint(job.run.steps_done, {"latents": torch.zeros(4)}, {}) for job in jobs]


class FakeBench:
    device = "cpu"

    def __init__(self, events: list[str]) -> None:
        self.adapter = CheckpointingAdapter(events)
        self.steps: list[int] = []  # each job's, in the order made

    def request(self, index: int, steps: int, guidance: float) -> int:
        self.steps.append(steps)
        return steps

    def job(self, index: int, steps: int, engine: str) -> Job:
        return Job(tracked(f"job{index:06d}"), Spec(steps=steps), shape="64x64", tokens=1)


def test_a_round_alternates_the_intervals_in_blocks_each_timing_its_own_work(tmp_path, monkeypatch):
    """Intervals 0, 1 and 3, 14 engine steps each in blocks of 4 after a warm-up of 6, on a clock each
    engine step advances by 1 + the interval then set: every block is timed from before its first step to
    after the store has done what its steps left (the flush), at one interval throughout, so each
    interval's mean step is exactly its own; checkpoints are taken, and answered requests' checkpoints
    removed, only where the interval is not 0 (those answered with it 0 at the next such block's start);
    the blocks in balanced orders (the fourth reversed, where rotated orders start over)."""
    events: list[str] = []  # what happened, in order: step@<interval>, checkpoint, remove@<interval>, ...
    bench = FakeBench(events)
    clock = [0.0]
    engines: list = []
    real_engine, store_class = checkpoint_cost.StepEngine, checkpoint_cost.CheckpointStore
    real_remove, real_flush = store_class.remove_request, store_class.flush

    def engine(*args, **kwargs):
        made = real_engine(*args, **kwargs)
        real_step = made.step

        def step():
            events.append(f"step@{made.checkpoint_every}")
            clock[0] += 1 + made.checkpoint_every
            return real_step()

        made.step = step
        engines.append(made)
        return made

    def remove_request(store, key):
        events.append(f"remove@{engines[-1].checkpoint_every}")
        real_remove(store, key)

    def flush(store, timeout_s):
        done = real_flush(store, timeout_s)
        events.append("flushed" if done and not store._pending and not store._removals else "not flushed")
        return done

    def perf_counter() -> float:
        events.append("time")
        return clock[0]

    monkeypatch.setattr(checkpoint_cost, "StepEngine", engine)
    monkeypatch.setattr(store_class, "remove_request", remove_request)
    monkeypatch.setattr(store_class, "flush", flush)
    monkeypatch.setattr(checkpoint_cost, "time", SimpleNamespace(perf_counter=perf_counter))
    args = Namespace(running=4, steps=6, engine_steps=14, block=4)
    runs = checkpoint_cost.one_round(bench, [0, 1, 3], args, tmp_path / "round")

    assert [(run["interval"], run["engine_steps"]) for run in runs] == [(0, 14), (1, 14), (3, 14)]
    assert [run["step_s_mean"] for run in runs] == [1.0, 2.0, 4.0]  # each block's time its own steps'
    assert runs[0]["checkpoints"] == 0 and runs[1]["checkpoints"] > runs[2]["checkpoints"] > 0
    assert runs[1]["bytes_per_checkpoint"] == 16  # four float32 latents
    # The first jobs' steps spread (their successors' finishes too), every later one of --steps.
    assert bench.steps[:4] == [2, 3, 5, 6] and set(bench.steps[4:]) == {6}
    # The blocks, after the warm-up's steps (at the last interval) and its flush: balanced orders.
    timed = events[events.index("flushed") + 1 :]
    blocks = []
    while "time" in timed:
        start = timed.index("time")
        end = timed.index("time", start + 1)
        blocks.append(timed[start + 1 : end])
        timed = timed[end + 1 :]
    steps = [[e for e in block if e.startswith("step@")] for block in blocks]
    assert [block[0] for block in steps] == [f"step@{i}" for i in (0, 1, 3, 1, 3, 0, 3, 0, 1, 3, 1, 0)]
    assert [len(block) for block in steps] == [4] * 9 + [2] * 3  # 14 steps each: the last blocks short
    assert all(block == block[:1] * len(block) for block in steps)
    assert all(block[-1] == "flushed" for block in blocks)  # the store's work is done inside the block
    for block, stepped in zip(blocks, steps, strict=True):  # checkpoints, removals: only with them on
        if stepped[0] == "step@0":
            assert not any(e == "checkpoint" or e.startswith("remove") for e in block)
        if stepped[0] == "step@1":
            assert "checkpoint" in block
    assert "remove@0" not in events and any(e.startswith("remove@") for e in events)
    # Requests answered with checkpoints off: removed at the start of the next block with them on.
    assert any(block[0].startswith("remove@") for block in blocks)


def test_against_reads_each_round_s_ratio_to_off_with_one_store_over_the_other():
    """``--against REV``: per round, this store's step at the interval over off, over REV's the same: one
    off a round (store None), or, in an artefact of a run per store, each store's own."""
    shared = [
        {"round": r, "store": store, "interval": interval, "step_s_mean": step * factor}
        for r, factor in ((0, 1.0), (1, 2.0))  # round 1 on a host twice as slow: the ratios do not change
        for store, interval, step in ((None, 0, 1.0), ("this", 5, 1.01), ("b1db203", 5, 1.04))
    ]
    ratios = checkpoint_cost.against_rounds(shared, 5, "b1db203")
    assert len(ratios) == 2 and all(abs(r - 1.01 / 1.04) < 1e-12 for r in ratios)
    assert checkpoint_cost.against_rounds(shared, 1, "b1db203") == []  # an interval not run: no rounds
    each = [
        {"round": 0, "store": store, "interval": interval, "step_s_mean": step}
        for store, steps in (("this", {0: 1.0, 5: 1.01}), ("b1db203", {0: 2.0, 5: 2.08}))
        for interval, step in steps.items()
    ]
    (ratio,) = checkpoint_cost.against_rounds(each, 5, "b1db203")
    assert abs(ratio - 1.01 / 1.04) < 1e-12


def test_a_round_one_store_lacks_is_no_against_round():
    runs = [
        {"round": r, "store": store, "interval": interval, "step_s_mean": step}
        for r in (0, 1)
        for store, interval, step in ((None, 0, 1.0), ("this", 5, 1.01), ("b1db203", 5, 1.04))
        if not (r == 1 and store == "b1db203")  # cut short before REV's block in round 1
    ]
    assert checkpoint_cost.against_rounds(runs, 5, "b1db203") == [pytest.approx(1.01 / 1.04)]


def test_the_summary_reads_each_round_s_step_over_its_own_off_and_its_median_step():
    """Round 1 on a host twice as slow: its ratio is its own (1.02), not its step over round 0's off."""
    runs = [
        {
            "round": r,
            "store": store,
            "interval": interval,
            "step_s_mean": step * slow,
            "bytes_per_checkpoint": b,
        }
        for r, slow in ((0, 1.0), (1, 2.0), (2, 1.0))
        for store, interval, step, b in ((None, 0, 0.010, 0.0), ("this", 5, 0.0101 + 0.0001 * r, 6080.0))
    ]
    off, every5 = checkpoint_cost.summarise(runs, [0, 5])
    assert off["ratio_to_off"]["rounds"] == [1.0, 1.0, 1.0]
    assert every5["ratio_to_off"]["rounds"] == pytest.approx([1.01, 1.02, 1.03])
    assert every5["ratio_to_off"]["median"] == pytest.approx(1.02)
    assert every5["step_ms_median"] == pytest.approx(10.3)  # the median of 10.1, 20.4 and 10.3 ms
    assert every5["bytes_per_checkpoint"] == 6080.0 and "against" not in every5


def test_two_stores_alternate_block_by_block_with_off_each_taking_its_own_checkpoints(tmp_path, monkeypatch):
    """With a second store: off, every 2 with this store and every 2 with the other alternate in blocks in
    a balanced order on one engine; a block's checkpoints go to its own store, which it waits for; every
    answered request's checkpoints are removed from each store (at its next block, where another was on),
    once; each store has its own folder."""
    events: list[str] = []
    bench = FakeBench(events)
    real_engine = checkpoint_cost.StepEngine
    removed: dict[str, list[str]] = {"this": [], "other": []}
    folders: dict[str, Path] = {}

    def engine(*args, **kwargs):
        made = real_engine(*args, **kwargs)
        real_step = made.step

        def step():
            events.append(f"step@{made.checkpoint_every}")
            report = real_step()
            events.extend(f"answered:{f.job.spec.checkpoint_key.removesuffix('.0')}" for f in report.finished)
            return report

        made.step = step
        return made

    def recording(name: str) -> type[CheckpointStore]:
        class Recording(CheckpointStore):
            def __init__(self, directory, *args) -> None:
                folders[name] = directory
                super().__init__(directory, *args)

            def put(self, key, fields_hash, checkpoint) -> None:
                events.append(f"put:{name}")
                super().put(key, fields_hash, checkpoint)

            def remove_request(self, resume_key) -> None:
                events.append(f"remove:{name}")
                removed[name].append(resume_key)
                super().remove_request(resume_key)

            def flush(self, timeout_s) -> bool:
                events.append(f"flush:{name}")
                return super().flush(timeout_s)

        return Recording

    monkeypatch.setattr(checkpoint_cost, "StepEngine", engine)
    monkeypatch.setattr(
        checkpoint_cost, "time", SimpleNamespace(perf_counter=lambda: events.append("time") or 0.0)
    )
    args = Namespace(running=4, steps=6, engine_steps=8, block=4)
    stores = {"this": recording("this"), "other": recording("other")}
    runs = checkpoint_cost.one_round(bench, [0, 2], args, tmp_path / "round", stores)

    assert [(r["interval"], r["store"], r["engine_steps"]) for r in runs] == [
        (0, None, 8),
        (2, "this", 8),
        (2, "other", 8),
    ]
    assert runs[0]["checkpoints"] == 0 and runs[1]["checkpoints"] > 0 and runs[2]["checkpoints"] > 0
    assert folders["this"] != folders["other"]
    times = [i for i, e in enumerate(events) if e == "time"]  # each block's start and end, after the warm-ups
    starts, blocks = times[::2], [events[a + 1 : b] for a, b in zip(times[::2], times[1::2], strict=True)]
    between = [events[b + 1 : a] for a, b in zip(starts[1:], times[1::2], strict=False)]
    assert not any(e.startswith("remove:") for gap in between for e in gap)  # removals timed in blocks
    ran = []
    for block in blocks:
        (interval,) = {e for e in block if e.startswith("step@")}
        puts = {e.removeprefix("put:") for e in block if e.startswith("put:")}
        removes = {e.removeprefix("remove:") for e in block if e.startswith("remove:")}
        (flushed,) = [e.removeprefix("flush:") for e in block if e.startswith("flush:")]
        assert block[-1].startswith("flush:")  # its store's work done inside the block
        if interval == "step@0":
            assert not puts and not removes
            ran.append(None)
        else:
            assert puts == {flushed} and removes <= {flushed}  # its own store's work only
            ran.append(flushed)
    assert ran == [None, "this", "other", "this", "other", None]  # balanced_orders' first two
    for name in ("this", "other"):  # what was answered before its last block: removed from it, once
        last = starts[len(ran) - 1 - ran[::-1].index(name)]
        answered = {e.removeprefix("answered:") for e in events[:last] if e.startswith("answered:")}
        assert answered and answered <= set(removed[name])
        assert len(set(removed[name])) == len(removed[name])


def test_the_store_of_a_commit_is_loaded_from_git_and_runs_beside_this_one(tmp_path, monkeypatch):
    asked = []

    def git_show(command, **_):  # the working tree's modules stand in for the commit's
        asked.append(command)
        path = command[-1].split(":", 1)[1]
        return SimpleNamespace(stdout=(checkpoint_cost.REPO_ROOT / path).read_text(), returncode=0)

    monkeypatch.setattr(checkpoint_cost.subprocess, "run", git_show)
    real = {name: sys.modules[f"triton_diffusion.recovery.{name}"] for name in checkpoint_cost.STORE_MODULES}
    loaded = checkpoint_cost.store_at("b1db203")
    paths = [f"{checkpoint_cost.RECOVERY}/{name}.py" for name in checkpoint_cost.STORE_MODULES]
    assert asked == [["git", "-C", str(checkpoint_cost.REPO_ROOT), "show", f"b1db203:{p}"] for p in paths]
    assert loaded is not CheckpointStore and loaded.__module__ == "checkpoint_store_at_b1db203"
    # The commit's store writes with the commit's format and file work, not this tree's.
    module = sys.modules[loaded.__module__]
    assert module.serialise.__module__ == "checkpoint_format_at_b1db203"
    assert module.FileWriter.__module__ == "checkpoint_files_at_b1db203"
    assert {name: sys.modules[f"triton_diffusion.recovery.{name}"] for name in real} == real  # put back

    store = loaded(tmp_path / "c", 1 << 20, 3600.0)
    try:
        store.put("0123456789abcdef", "h", JobCheckpoint(1, {"latents": torch.ones(2)}, {}))
        stored = store.get("0123456789abcdef")
        assert stored is not None and stored.checkpoint.step == 1
    finally:
        store.close()


def test_a_commit_s_store_that_loads_a_module_not_loaded_yet_is_refused(monkeypatch):
    """Such a module would import the commit's format in place of this tree's for good."""
    unloaded = "triton_diffusion.codecs.video"
    monkeypatch.delitem(sys.modules, unloaded, raising=False)

    def git_show(command, **_):
        path = command[-1].split(":", 1)[1]
        source = (checkpoint_cost.REPO_ROOT / path).read_text()
        if path.endswith("checkpoint_store.py"):
            source += f"\nimport {unloaded}\n"
        return SimpleNamespace(stdout=source, returncode=0)

    monkeypatch.setattr(checkpoint_cost.subprocess, "run", git_show)
    real = sys.modules["triton_diffusion.recovery.checkpoint_format"]
    with pytest.raises(SystemExit, match=unloaded):
        checkpoint_cost.store_at("b1db203")
    assert sys.modules["triton_diffusion.recovery.checkpoint_format"] is real

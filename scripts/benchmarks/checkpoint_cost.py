"""What checkpoints cost the step engine: engine steps with ``checkpoint_every_steps`` off and at each
interval asked, side by side, in one process (no Triton), on the tiny SD at 64x64 (CPU fp32; on a GPU,
``--arch sd15 --size 512`` in bfloat16: each engine step ends with a device sync, as a step's snapshots do).

A full running set (--running jobs, each of --steps denoising steps, a finished one replaced at once by a
new one, so every engine step runs a full forward; the first ones of fewer steps, so that finishes and
starts spread evenly over the engine steps) is stepped, after a warm-up of a job's lifetime, for
--engine-steps engine steps at each interval a round. Each job carries a checkpoint key; every
``interval`` of its steps the engine asks the adapter for a snapshot (CPU copies) and the host's part is
done as the served host does it: each checkpoint handed to a real :class:`CheckpointStore` in a temporary
folder, whose writer thread gathers them for up to ``checkpoint_store.BATCH_S`` and writes them as a batch
(safetensors, rename), and an answered request's checkpoints removed (the writer deletes
them; a request answered in a block with checkpoints off has its removal asked at the start of the next
block with them on, so the folder holds what it would served).

The intervals alternate in blocks of --block engine steps (off, every 1, every 5, then rotated: every 1,
every 5, off, ...) on the same engine and jobs, so a drift of the host's speed between runs (other tenants
on a shared machine) falls on every interval alike. A block's time holds its steps, with the snapshots and
the hand-over, and then the wait for whatever the writer has left of its work. So what the writer does
while the engine steps is counted as it competes with the steps for the cores, and what is left at the
block's end is counted whole, disk waits included, as if the engine waited for it: in a block shorter than
``BATCH_S`` that is every write. What a block leaves behind for the system (the kernel's writeback of the
files, memory freed) may fall on the next block. Each round is a fresh engine, and every round is kept, so
each ratio to ``off`` comes with its spread. Also recorded: bytes per checkpoint and checkpoints written.

    .venv/bin/python scripts/bench.py checkpoint-cost --out docs/cpu
    .venv/bin/python scripts/bench.py checkpoint-cost --device-profile sd15-h100 --size 512 \
        --out docs/profiles/sd15-h100      # at an H100's cost ratios (adapters/device_profiles.py)

``--against REV`` also runs every round with the checkpoint store as commit REV had it (its module read
from git and run beside this one's, on the same engine code), the two stores alternated round by round in
rotated order: the artefact ``checkpoint_cost_against.json`` holds each store's runs and, per interval and
round, this store's ratio to off over REV's, so a change of the store is measured side by side.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import replace
from pathlib import Path

import artefacts
import torch
from verdicts import rotated_orders

from benchmarks.common import REPO_ROOT
from benchmarks.inprocess import Bench, device_and_dtype, sync
from triton_diffusion.adapters.device_profiles import PROFILES, load_costs
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.recovery.checkpoint_store import BATCH_S, CheckpointStore

DEFAULT_INTERVALS = "0,1,5"
WRITE_WAIT_S = 60.0  # the longest a block waits for the store's writes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="tiny-sd")
    p.add_argument("--size", type=int, default=64)
    p.add_argument(
        "--device-profile",
        default=None,
        help="time the denoiser and decode as this GPU was measured to (sd15-h100: use --size 512; "
        "adapters/device_profiles.py)",
    )
    p.add_argument("--device", default="auto", help="auto: cuda where there is one")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on cuda, float32 on a CPU")
    p.add_argument("--running", type=int, default=8, help="jobs in the running set")
    p.add_argument("--steps", type=int, default=20, help="denoising steps of each job")
    p.add_argument(
        "--engine-steps", type=int, default=200, help="engine steps at each interval a round (after warm-up)"
    )
    p.add_argument("--block", type=int, default=10, help="engine steps a block (the intervals alternate)")
    p.add_argument("--intervals", default=DEFAULT_INTERVALS, help="checkpoint_every_steps values; 0: off")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds")
    p.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: 2 on a CPU, torch's on a GPU; the GPU smoke takes 1: two threads "
        "spinning on a CPU shared with other work made its steps many times slower)",
    )
    p.add_argument(
        "--against",
        metavar="REV",
        help="also run each round with the checkpoint store of commit REV, alternated (module docstring)",
    )
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results")
    return p


RECOVERY = "src/triton_diffusion/recovery"
# The store's modules, each importing those before it: its file's format, its file work, the store.
STORE_MODULES = ("checkpoint_format", "checkpoint_files", "checkpoint_store")


def store_at(rev: str) -> type[CheckpointStore]:
    """The checkpoint store class as commit ``rev`` had it: the store's modules (those ``rev`` has) from
    git, each run as a module of its own, importing ``rev``'s modules before it and this tree's others
    (which must still have what it uses)."""
    saved: dict[str, types.ModuleType | None] = {}
    try:
        for name in STORE_MODULES:
            path = f"{RECOVERY}/{name}.py"
            show = ["git", "-C", str(REPO_ROOT), "show", f"{rev}:{path}"]
            shown = subprocess.run(show, check=False, capture_output=True, text=True)
            if shown.returncode != 0 and name != "checkpoint_store":  # not a module yet at ``rev``
                continue
            if shown.returncode != 0:
                raise SystemExit(f"{rev}: no {path} ({shown.stderr.strip()})")
            module = types.ModuleType(f"{name}_at_{rev}")
            sys.modules[module.__name__] = module  # its dataclasses look their module up
            exec(compile(shown.stdout, f"{rev}:{path}", "exec"), module.__dict__)
            real = f"triton_diffusion.recovery.{name}"
            saved.setdefault(real, sys.modules.get(real))
            sys.modules[real] = module  # what ``rev``'s modules after it import
    finally:  # this tree's modules back for everyone else
        for real, original in saved.items():
            if original is None:
                sys.modules.pop(real, None)
            else:
                sys.modules[real] = original
    return module.CheckpointStore


def against_rounds(runs: list[dict], interval: int, rev: str) -> list[float]:
    """Each round's ratio to off at ``interval`` with this store over the same round's with ``rev``'s
    (below 1: this store costs an engine step less)."""

    def ratio(store: str, round_: int) -> float | None:
        by = {r["interval"]: r["step_s_mean"] for r in runs if r["round"] == round_ and r["store"] == store}
        return by[interval] / by[0] if interval in by and 0 in by else None

    ratios = []
    for round_ in sorted({r["round"] for r in runs}):
        this, that = ratio("this", round_), ratio(rev, round_)
        if this is not None and that is not None:
            ratios.append(this / that)
    return ratios


def one_round(
    bench: Bench,
    intervals: list[int],
    args: argparse.Namespace,
    folder: Path,
    store_class: type[CheckpointStore] = CheckpointStore,
) -> list[dict]:
    """One running set stepped ``args.engine_steps`` engine steps at each interval (after a warm-up of a
    job's lifetime), in blocks of ``args.block`` steps, the intervals alternated block by block in rotated
    order; each block ends waiting for the store's writes of its checkpoints, counted in its time. A
    result per interval: its steps' mean time and checkpoints."""
    limits = EngineLimits(args.running, args.running)
    engine = StepEngine(bench.adapter, limits, checkpoint_every=intervals[-1])
    store = store_class(folder, 2**34, 3600.0)
    made = iter(range(10**9))
    answered_off: list[str] = []  # the resume keys of requests answered in a block with checkpoints off

    def add(steps: int = args.steps) -> None:
        index = next(made)
        values = bench.request(index, steps, 7.5)
        job = bench.job(index, values, "step")
        job.spec = replace(job.spec, checkpoint_key=f"bench-checkpoint-key-{index:06d}.0")
        engine.add(job)

    def step() -> tuple[int, list[int]]:
        """One engine step, its checkpoints handed to the store: their count and sizes."""
        report = engine.step()
        sizes = []
        for job, checkpoint in report.checkpoints:
            store.put(job.spec.checkpoint_key, "hash", checkpoint)
            sizes.append(sum(t.numel() * t.element_size() for t in checkpoint.tensors.values()))
        sync(bench.device)
        for finished in report.finished:  # answered: its checkpoints removed (recovery/resumes.py)
            key = (finished.job.spec.checkpoint_key or "").removesuffix(".0")
            if engine.checkpoint_every:
                store.remove_request(key)
            else:  # checkpoints off: no store serves it; removed in the next block with them on
                answered_off.append(key)
            add()
        for _ in report.left:
            if _.reason != "finished":
                add()
        return len(sizes), sizes

    # The first jobs' steps spread over 1..--steps, so that their successors (of --steps each) start and
    # finish spread out evenly over the engine steps, not all in one (a finish's decode and a start's text
    # encoding then fall on every block alike); the warm-up is the longest's lifetime.
    for i in range(args.running):
        add(math.ceil(args.steps * (i + 1) / args.running))
    for _ in range(args.steps):
        step()
    store.flush(WRITE_WAIT_S)
    block = min(args.block, args.engine_steps)
    seconds = dict.fromkeys(intervals, 0.0)
    steps = dict.fromkeys(intervals, 0)
    sizes: dict[int, list[int]] = {interval: [] for interval in intervals}
    for order in rotated_orders(intervals, math.ceil(args.engine_steps / block)):
        for interval in order:
            engine.checkpoint_every = interval  # the engine reads it each step
            count = min(block, args.engine_steps - steps[interval])
            started = time.perf_counter()
            if interval:  # what a served store would have removed (else the folder, listed each batch, grows)
                for key in answered_off:
                    store.remove_request(key)
                answered_off.clear()
            for _ in range(count):
                sizes[interval].extend(step()[1])
            # What the writer has left of this block's checkpoints and removals is this block's.
            store.flush(WRITE_WAIT_S)
            seconds[interval] += time.perf_counter() - started
            steps[interval] += count
    store.close()
    return [
        {
            "interval": interval,
            "engine_steps": steps[interval],
            "step_s_mean": seconds[interval] / steps[interval],
            "checkpoints": len(sizes[interval]),
            "bytes_per_checkpoint": statistics.fmean(sizes[interval]) if sizes[interval] else 0.0,
        }
        for interval in intervals
    ]


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    profile = None
    if args.device_profile:  # its times hold at the size it was measured at only
        costs = load_costs(PROFILES[args.device_profile])
        if costs.size != (args.size, args.size):
            parser().error(f"--device-profile {args.device_profile} was measured at {costs.size}: --size")
        profile = {"what": PROFILES[args.device_profile].what, **costs.record()}
    intervals = [int(v) for v in args.intervals.split(",")]
    device, dtype = device_and_dtype(args.device, args.dtype)
    if args.threads or device == "cpu":
        torch.set_num_threads(args.threads or 2)
    bench = Bench(
        args.arch, args.size, args.size, args.running, device, dtype, device_profile=args.device_profile
    )
    stores = {"this": CheckpointStore}
    if args.against:
        stores[args.against] = store_at(args.against)
    names = list(stores)
    runs: list[dict] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                folder = Path(tmp) / f"r{round_}-{len(runs)}"
                for run in one_round(bench, intervals, args, folder, stores[name]):
                    runs.append({"round": round_, "store": name, **run})
                    print(
                        f"round {round_} store {name} every {run['interval'] or 'off'}: "
                        f"{run['step_s_mean'] * 1000:.2f} ms an engine step, "
                        f"{run['checkpoints']} checkpoints",
                        flush=True,
                    )
    summary = []
    for interval in intervals:
        against = bool(args.against and interval)
        mine = [r for r in runs if r["interval"] == interval and r["store"] == "this"]
        ratios = [
            r["step_s_mean"]
            / next(
                o["step_s_mean"]
                for o in runs
                if o["interval"] == 0 and o["round"] == r["round"] and o["store"] == "this"
            )
            for r in mine
        ]
        summary.append(
            {
                "interval": interval,
                "step_ms_median": statistics.median(r["step_s_mean"] for r in mine) * 1000,
                "ratio_to_off": {
                    "median": statistics.median(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                    "rounds": ratios,
                },
                "bytes_per_checkpoint": statistics.fmean(r["bytes_per_checkpoint"] for r in mine),
                **({"against": against_rounds(runs, interval, args.against)} if against else {}),
            }
        )
    artefact = {
        "benchmark": "checkpoint-cost",
        "device": device,
        "device_profile": args.device_profile,
        "device_profile_table": profile,  # the times its stand-ins waited, and where they came from
        "dtype": str(dtype).removeprefix("torch."),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "store_batch_s": BATCH_S,  # how long the store's writer gathers a batch
        "runs": runs,
        "summary": summary,
        "wall_s": time.perf_counter() - started,
        "complete": True,
    }
    name = "checkpoint_cost_against.json" if args.against else "checkpoint_cost.json"
    path = artefacts.write(args.out / name, artefact)
    print(f"wrote {path}")

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

The intervals alternate in blocks of --block engine steps on the same engine and jobs (off, every 1, every 5,
then every 1, every 5, off, ...: verdicts.balanced_orders: within the orders of each whole cycle, each
interval after each other equally often), so a drift of the host's speed between runs (other tenants on a
shared machine) falls on every interval alike, and so, but for the joins between orders, does what a block
leaves to the next. A block's time holds its steps, with the snapshots and the hand-over, and then the wait
for whatever the writer has left of its work. So what the writer does while the engine steps is counted as it
competes with the steps for the cores, and what is left at the block's end is counted whole, disk waits
included, as if the engine waited for it: in a block shorter than ``BATCH_S`` that is every write. What a
block leaves behind for the system (the kernel's writeback of the files, memory freed) may fall on the next
block: on each interval alike within the orders, by their balance. Each round is a fresh engine, and every
round is kept, so each ratio to ``off`` comes with its spread. Also recorded: bytes per checkpoint and
checkpoints written.

    .venv/bin/python scripts/bench.py checkpoint-cost --out docs/cpu
    .venv/bin/python scripts/bench.py checkpoint-cost --device-profile sd15-h100 --size 512 \
        --out docs/profiles/sd15-h100      # at an H100's cost ratios (adapters/device_profiles.py)

``--against REV`` also runs every interval with the checkpoint store as commit REV had it (its modules read
from git and run beside this one's, on the same engine code): a round's variants are then checkpoints off
and each interval with each store, alternated block by block in balanced orders on one engine (each store
in a folder of its own, warmed up in turn, the order of the warm-ups rotated by round), so the two stores
meet the same drift of the host within a round. The artefact ``checkpoint_cost_against.json`` holds every
variant's runs and, per interval and round, this store's ratio to off over REV's, so a change of the
store is measured side by side.
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
from tables.checkpoint_cost import step_ratios
from verdicts import balanced_orders

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
    (which must still have what it uses, and be loaded already: one loaded while ``rev``'s modules stand
    in for this tree's would keep them)."""
    saved: dict[str, types.ModuleType | None] = {}
    loaded = set(sys.modules)
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
            new = sorted(m for m in set(sys.modules) - loaded if m.startswith("triton_diffusion."))
            if new:
                raise SystemExit(f"{rev}:{path} loads {', '.join(new)}, not loaded before: import it first")
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
    this, that = step_ratios(runs, interval, "this"), step_ratios(runs, interval, rev)
    return [this[round_] / that[round_] for round_ in sorted(this) if round_ in that]


def summarise(runs: list[dict], intervals: list[int], against: str | None = None) -> list[dict]:
    """Per interval (0: off): its median engine step and bytes a checkpoint over rounds, each round's
    ratio to the same round's off (this store's), and, with ``against``, each round's ratio over that
    commit's store's."""
    summary = []
    for interval in intervals:
        mine = [r for r in runs if r["interval"] == interval and r["store"] == ("this" if interval else None)]
        ratios = list(step_ratios(runs, interval).values())
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
                **({"against": against_rounds(runs, interval, against)} if against and interval else {}),
            }
        )
    return summary


def one_round(
    bench: Bench,
    intervals: list[int],
    args: argparse.Namespace,
    folder: Path,
    stores: dict[str, type[CheckpointStore]] | None = None,
) -> list[dict]:
    """One running set stepped ``args.engine_steps`` engine steps at each variant (checkpoints off; each
    interval with each store, by default this tree's only), after a warm-up of a job's lifetime with each
    store, in blocks of ``args.block`` steps, the variants alternated block by block in a balanced order;
    each block ends waiting for its store's writes, counted in its time. A result per variant: its steps'
    mean time and checkpoints (off's store: None)."""
    stores = stores or {"this": CheckpointStore}
    names = list(stores)
    variants: list[tuple[int, str | None]] = [(0, None)]
    variants += [(interval, name) for interval in intervals if interval for name in names]
    limits = EngineLimits(args.running, args.running)
    engine = StepEngine(bench.adapter, limits, checkpoint_every=intervals[-1])
    opened = {name: stores[name](folder / f"store{i}", 2**34, 3600.0) for i, name in enumerate(names)}
    store = opened[names[0]]  # the store of the block under way (off: the last one's, which gets no work)
    made = iter(range(10**9))
    # The resume keys of requests answered while a store was not on: removed at its next block (else its
    # folder, listed each batch, grows; so it holds what it would served).
    answered: dict[str, list[str]] = {name: [] for name in names}

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
            for name, each in opened.items():
                if engine.checkpoint_every and each is store:
                    each.remove_request(key)
                else:
                    answered[name].append(key)
            add()
        for _ in report.left:
            if _.reason != "finished":
                add()
        return len(sizes), sizes

    def removals(name: str) -> None:
        for key in answered[name]:
            opened[name].remove_request(key)
        answered[name].clear()

    # The first jobs' steps spread over 1..--steps, so that their successors (of --steps each) start and
    # finish spread out evenly over the engine steps, not all in one (a finish's decode and a start's text
    # encoding then fall on every block alike); the warm-up is the longest's lifetime, with each store.
    for i in range(args.running):
        add(math.ceil(args.steps * (i + 1) / args.running))
    for name in names:
        store = opened[name]
        removals(name)
        for _ in range(args.steps):
            step()
        store.flush(WRITE_WAIT_S)
    block = min(args.block, args.engine_steps)
    seconds = dict.fromkeys(variants, 0.0)
    steps = dict.fromkeys(variants, 0)
    sizes: dict[tuple[int, str | None], list[int]] = {variant: [] for variant in variants}
    for order in balanced_orders(variants, math.ceil(args.engine_steps / block)):
        for variant in order:
            interval, name = variant
            engine.checkpoint_every = interval  # the engine reads it each step
            count = min(block, args.engine_steps - steps[variant])
            started = time.perf_counter()
            if name is not None:
                store = opened[name]
                removals(name)
            for _ in range(count):
                sizes[variant].extend(step()[1])
            # What the writer has left of this block's checkpoints and removals is this block's.
            store.flush(WRITE_WAIT_S)
            seconds[variant] += time.perf_counter() - started
            steps[variant] += count
    for each in opened.values():
        each.close()
    return [
        {
            "interval": variant[0],
            "store": variant[1],
            "engine_steps": steps[variant],
            "step_s_mean": seconds[variant] / steps[variant],
            "checkpoints": len(sizes[variant]),
            "bytes_per_checkpoint": statistics.fmean(sizes[variant]) if sizes[variant] else 0.0,
        }
        for variant in variants
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
        for round_ in range(args.rounds):  # the stores' warm-ups in rotated order too
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            folder = Path(tmp) / f"r{round_}"
            for run in one_round(bench, intervals, args, folder, {name: stores[name] for name in order}):
                runs.append({"round": round_, **run})
                print(
                    f"round {round_} store {run['store']} every {run['interval'] or 'off'}: "
                    f"{run['step_s_mean'] * 1000:.2f} ms an engine step, {run['checkpoints']} checkpoints",
                    flush=True,
                )
    summary = summarise(runs, intervals, args.against)
    artefact = {
        "benchmark": "checkpoint-cost",
        "device": device,
        "device_profile": args.device_profile,
        "device_profile_table": profile,  # the times its stand-ins waited, and where they came from
        "dtype": str(dtype).removeprefix("torch."),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "store_batch_s": BATCH_S,  # how long the store's writer gathers a batch
        "block_order": "balanced",  # verdicts.balanced_orders (before: rotated orders)
        "runs": runs,
        "summary": summary,
        "wall_s": time.perf_counter() - started,
        "complete": True,
    }
    name = "checkpoint_cost_against.json" if args.against else "checkpoint_cost.json"
    path = artefacts.write(args.out / name, artefact)
    print(f"wrote {path}")

"""What checkpoints cost the step engine: engine steps with ``checkpoint_every_steps`` off and at each
interval asked, side by side, in one process (no Triton), on the tiny SD at 64x64 (CPU fp32; on a GPU,
``--arch sd15 --size 512`` in bfloat16: each engine step ends with a device sync, as a step's snapshots do).

A full running set (--running jobs, each of --steps denoising steps, a finished one replaced at once by a
new one, so every engine step runs a full forward) runs for --engine-steps engine steps per run. Each job
carries a checkpoint key; every ``interval`` of its steps the engine asks the adapter for a snapshot (CPU
copies) and the host's part is done as the served host does it: each checkpoint handed to a real
:class:`CheckpointStore` in a temporary folder, whose writer thread writes it (safetensors, rename,
one folder fsync per batch) while the engine steps on, and a finished job's checkpoint removed (its
request answered). The time of an engine step includes the snapshots and the hand-over; the writer's
work competes for the same cores, as it would served. Variants alternate within each round (off, every 1,
every 5, off, ...) and every round is kept, so each ratio to ``off`` comes with its spread. Also
recorded: bytes per checkpoint and checkpoints written.

    .venv/bin/python scripts/bench.py checkpoint-cost --out docs/cpu
    .venv/bin/python scripts/bench.py checkpoint-cost --device-profile sd15-h100 --size 512 \
        --out docs/profiles/sd15-h100      # at an H100's cost ratios (adapters/device_profiles.py)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
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
from triton_diffusion.recovery.checkpoint_store import CheckpointStore

DEFAULT_INTERVALS = "0,1,5"


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
    p.add_argument("--engine-steps", type=int, default=200, help="engine steps per run (after warm-up)")
    p.add_argument("--intervals", default=DEFAULT_INTERVALS, help="checkpoint_every_steps values; 0: off")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds")
    p.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: 2 on a CPU, torch's on a GPU; the GPU smoke takes 1: two threads "
        "spinning on a CPU shared with other work made its steps many times slower)",
    )
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results")
    return p


def one_run(bench: Bench, interval: int, args: argparse.Namespace, folder: Path) -> dict:
    """A full running set for ``args.engine_steps`` engine steps, checkpoints every ``interval`` steps."""
    engine = StepEngine(bench.adapter, EngineLimits(args.running, args.running), checkpoint_every=interval)
    store = CheckpointStore(folder, 2**34, 3600.0)
    made = iter(range(10**9))

    def add() -> None:
        index = next(made)
        values = bench.request(index, args.steps, 7.5)
        job = bench.job(index, values, "step")
        job.spec = replace(job.spec, checkpoint_key=f"bench-checkpoint-key-{index:06d}.0")
        engine.add(job)

    for _ in range(args.running):
        add()
    step_s: list[float] = []
    written = 0
    sizes: list[int] = []
    warm_up = args.steps  # the first jobs' lifetime: starts and finishes spread out by then
    for step in range(warm_up + args.engine_steps):
        started = time.perf_counter()
        report = engine.step()
        for job, checkpoint in report.checkpoints:
            store.put(job.spec.checkpoint_key, "hash", checkpoint)
            written += 1
            sizes.append(sum(t.numel() * t.element_size() for t in checkpoint.tensors.values()))
        sync(bench.device)
        if step >= warm_up:
            step_s.append(time.perf_counter() - started)
        for finished in report.finished:  # answered: the host removes its checkpoints (recovery/resumes.py)
            store.remove(finished.job.spec.checkpoint_key)
            add()
        for _ in report.left:
            if _.reason != "finished":
                add()
    store.close()
    return {
        "interval": interval,
        "engine_steps": len(step_s),
        "step_s_mean": statistics.fmean(step_s),
        "step_s_median": statistics.median(step_s),
        "checkpoints": written,
        "bytes_per_checkpoint": statistics.fmean(sizes) if sizes else 0.0,
    }


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
    runs: list[dict] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        one_run(bench, intervals[-1], args, Path(tmp) / "warm-up")  # the process's first steps: not kept
        for round_, order in enumerate(rotated_orders(intervals, args.rounds)):
            for interval in order:
                folder = Path(tmp) / f"r{round_}-i{interval}"
                run = {"round": round_, **one_run(bench, interval, args, folder)}
                runs.append(run)
                print(
                    f"round {round_} every {interval or 'off'}: {run['step_s_mean'] * 1000:.2f} ms an engine "
                    f"step, {run['checkpoints']} checkpoints",
                    flush=True,
                )
    summary = []
    for interval in intervals:
        mine = [r for r in runs if r["interval"] == interval]
        ratios = [
            r["step_s_mean"]
            / next(o["step_s_mean"] for o in runs if o["interval"] == 0 and o["round"] == r["round"])
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
            }
        )
    artefact = {
        "benchmark": "checkpoint-cost",
        "device": device,
        "device_profile": args.device_profile,
        "device_profile_table": profile,  # the times its stand-ins waited, and where they came from
        "dtype": str(dtype).removeprefix("torch."),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": runs,
        "summary": summary,
        "wall_s": time.perf_counter() - started,
        "complete": True,
    }
    path = artefacts.write(args.out / "checkpoint_cost.json", artefact)
    print(f"wrote {path}")

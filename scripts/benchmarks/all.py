"""Re-take every CPU figure: each CPU benchmark in turn, each with its time limit (seconds on the
project's 2-core host; their sum is the default budget, which --budget-s scales), then
``scripts/figures.py`` renders every block.

    .venv/bin/python scripts/bench.py all --out docs                 # every CPU benchmark, then figures
    .venv/bin/python scripts/bench.py all --out docs --only engines,mixed_sizes
    .venv/bin/python scripts/bench.py all --out docs --dry-run       # the plan, its limits, nothing run

Each benchmark runs as its own process group (a fresh torch, its own servers) with its time limit; at
the limit the whole group is ended (servers included). Most benchmarks write their artefact as they
measure, so one cut short keeps what it measured and says so (``complete: false``);
checkpoint-cost and dllm write theirs at the end, so a cut one keeps its previous artefact. The run's own
record (``<out>/cpu/all.json``: each benchmark's command, exit status and seconds) is written after each.
Each command below is the one its artefact records (``provenance.command``). Where a benchmark has rounds,
it runs 5 (the fewest from which scripts/verdicts.py reads a verdict), except where its limit cannot hold
them (graphs: 3 repeats of a timing, no ratio read); the
engines benchmark's Poisson and mixed runs are one run each (no verdict), its closed loop 5 rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import REPO_ROOT
from triton_diffusion.engine.overload import WINDOW

# Each take's time limit, in seconds on the project's 2-core host (a --budget-s scales them all).
# The goodput benchmark on this CPU, in steady state (278 requests a run, the first 128 the warm-up, 3
# variants, 5 loads): 1196 s measured at 5 rounds (3e13ef4); 9 rounds (each its own arrivals: the 90%
# interval then leaves out the lowest and the highest round, scripts/verdicts.py; a multiple of the 3
# variants, each first and last alike) about 1.8 x that.
GOODPUT_S = 2900
# The crash soak: 5 rounds of 2 runs of 150-step jobs, 2 crashes a run 35 s apart (a restart more than 30 s
# after the one before: no anti-spin wait); 13 minutes measured for 60 s runs (--mid-job 75).
CRASH_SOAK_S = 1400
# The mixed-sizes benchmark at the flux1-h100 profile: 2 traffic kinds x 8 rounds (two whole cycles of
# balanced orders for 4 variants) x 4 variants of 16 requests of 8 steps at 512 to 1024 pixels a side, each
# forward as long as on an H100 (about 40 to 170 ms a row): 8 rounds took 764 s on the AMD host (9189eb9).
MIXED_SIZES_FLUX1_S = 1500
# The crash soak with the server busy, on the tiny SD and at an H100's cost ratios, each take this limit
# (3 x one request at a time: more than the engine serves, so each run ends with a queue and a recomputed
# step delays every answer after it; at 2 x with crashes this far apart the server caught up between them,
# a try stopped after one run): 16 runs of
# 140 s of arrivals and the queue they leave, each round's arrivals a draw of their own, a crash at 45, 90
# and 135 s. Kills at least 45 s apart (the crasher moves one held back): a restart then comes more than
# 30 s after the one before, so the supervisor's anti-spin wait (serving/supervisor.py) adds to none. 10
# resends, more than a run's 3 crashes (the client's default is 3: a request queued through every crash
# would be given up). Measured on the AMD host: 2757 s at the profile (2d43313), 2675 s on the tiny SD
# (9b276b0).
CRASH_SOAK_BUSY_S = 4600
BUSY = (  # the busy soak's settings, on the tiny SD and at the sd15-h100 profile
    "--rounds 8 --steps 150 --mid-job 75 --duration 140 --crash-every 45 --arrivals-per-round --load 3"
    " --checkpoint-every 5 --timeout 300 --retries 10"
)
# The goodput benchmark's room at the door (tiny SD, 2 variants, 4 loads), on traffic with deadlines and on
# mixed traffic at the default room and at 3 x: about 7 minutes each with the client that leaked threads;
# with it fixed, 34 and 38 of the 40 runs of the mixed takes in 424 s (9066962).
GOODPUT_MIXED_S = 600
# The goodput benchmark's step cache for the steps left (tiny FLUX.1 at 256x256, 4 variants, 3 loads):
# 14.7 minutes measured at the in-step capacity; at the out-of-phase one (lower: longer runs) 1068 s
# (cae73aa).
GOODPUT_CACHE_S = 1320
# The tier's pause by its deadline's need against by tier (tiny SD, 3 variants, 5 loads): 845 s measured on
# the AMD host (9774fab), whose capacity is lower than the Intel one's (longer runs).
GOODPUT_TIER_PAUSE_S = 1020
# The goodput benchmark at an H100's cost ratios, 5 variants: about 17 minutes (a GPU's forwards: 0.7 s a
# request).
GOODPUT_SD15_S = 1306
# The same in the steady state of its load (278 requests a run, the load's window first): fifo, tiers-room
# and degrade-room at 0.8x and 1.5x, about 30 minutes.
GOODPUT_SD15_STEADY_S = 2400


@dataclass(frozen=True)
class Take:
    """One benchmark of the plan: its name (bench.py NAME), its arguments (``{out}`` is the --out folder)
    and its time limit (seconds at the default budget)."""

    name: str
    args: tuple[str, ...]
    limit_s: int  # at the default budget (the plan's sum)
    script: str = ""  # a script of its own instead of scripts/bench.py NAME
    benchmark: str = ""  # bench.py's NAME where it is not ``name`` (one benchmark taken twice)


def _door(name: str, traffic: tuple[str, ...], out: str) -> Take:
    """A take of the door with deadline_room against without (tiers against tiers-room) on tiny SD:
    ``traffic``'s arguments (the room, a share without a deadline) between the variants and the rest."""
    return Take(
        name,
        (
            "--variants",
            "tiers,tiers-room",
            *traffic,
            "--requests",
            "150",
            "--loads",
            "0.5,0.8,1.5,2.0",
            "--rounds",
            "5",
            "--out",
            f"{{out}}/cpu/{out}",
        ),
        GOODPUT_MIXED_S,
        benchmark="goodput",
    )


PLAN = (
    # The headline: both engines in one process, closed loop and Poisson at 50/80/95% of the request-level
    # engine's capacity, on the true arrival clock; 8 rounds of each traffic, each Poisson round its own
    # arrivals (docs/cpu/all.json has the seconds each take ran).
    Take(
        "engines",
        tuple(
            "--concurrency 1,4,8 --requests 48 --rounds 8 --poisson-requests 150 --no-image-mix "
            "--out {out}/cpu".split()
        ),
        600,
    ),
    # The same engines through the real server and the project's gRPC client, 8 rounds of each traffic
    # (each Poisson round its own arrivals); and the OpenAI front's overhead against gRPC direct (its
    # runs pooled: figures, no verdict).
    Take(
        "server",
        tuple(
            "--concurrency 1,4,8 --requests 48 --max-batch-size 8 --mixed --poisson --poisson-requests 120 "
            "--rounds 8 --progress --openai --out {out}".split()
        ),
        600,
    ),
    # 16 requests a run. Three takes on the AMD host on 2026-12-05 (16, 64 and 256 requests a run; e1ef6c1,
    # d2d3a9b, bc4d6cd; not kept) read 90% intervals of 0.71-1.11 (64) and 0.82-1.15 (256) for two variants
    # that run the same engine on one size: longer runs no narrower, that host's noise. More rounds instead:
    # 15 (5 took 24 s on the Intel host; docs/cpu/all.json has each take's seconds). Then 18, three whole
    # cycles of the balanced orders of three variants: with rotated orders packed ran right after the
    # request-level engine in two rounds of three, and a take (at a183190, not kept) read tiny FLUX.1's
    # homogeneous packed / by-shape, the same code on one size, as a loss (0.961, 0.899-0.995).
    Take(
        "mixed_sizes",
        ("--rounds", "18", "--requests", "16", "--loads", "", "--out", "{out}/cpu"),
        200,
    ),
    # The same at an H100's cost ratios for FLUX.1-dev, at its sizes: the packing gate where a padded token
    # costs what it would there, and packing without the gate beside it. Both traffic kinds, closed loop,
    # 8 rounds.
    Take(
        "mixed_sizes_flux1",
        (
            "--arch",
            "tiny-flux",
            "--device-profile",
            "flux1-h100",
            "--sizes",
            "512x512,768x768,1024x1024",
            "--variants",
            "packed,by-shape,request,packed-ungated",
            "--rounds",
            "8",
            "--requests",
            "16",
            "--loads",
            "",
            "--out",
            "{out}/profiles/flux1-h100",
        ),
        MIXED_SIZES_FLUX1_S,
        benchmark="mixed_sizes",
    ),
    # Engine steps at each interval a round, in alternated blocks (the writer's work counted in the block
    # that made it): 40 rounds of 620 engine steps (15 rounds took 152 s; their every-5 interval held 1.02).
    Take("checkpoint_cost", ("--rounds", "40", "--engine-steps", "200", "--out", "{out}/cpu"), 600),
    # The same at an H100's cost ratios: SD 1.5's forward and decode timed as measured on one.
    Take(
        "checkpoint_cost_sd15",
        (
            *"--device-profile sd15-h100 --size 512 --rounds 7 --engine-steps 60 --out".split(),
            "{out}/profiles/sd15-h100",
        ),
        240,
        benchmark="checkpoint_cost",
    ),
    # And at FLUX.1-dev's (flux1-h100: an engine step of 8 jobs at 1024x1024 is seconds long): blocks of 5.
    Take(
        "checkpoint_cost_flux1",
        tuple(
            (
                "--arch tiny-flux --device-profile flux1-h100 --size 1024 --rounds 5 --engine-steps 30 "
                "--block 5 --out {out}/profiles/flux1-h100"
            ).split()
        ),
        1100,
        benchmark="checkpoint_cost",
    ),
    # This store beside 7153e66's (the serialiser of the safetensors library, an fsync a batch), alternated.
    Take(
        "checkpoint_cost_against",
        tuple("--against 7153e66 --rounds 20 --out {out}/cpu".split()),
        600,
        benchmark="checkpoint_cost",
    ),
    Take("caches", ("--requests", "16", "--rounds", "5", "--threads", "1", "--out", "{out}/cpu/caches"), 442),
    Take("lora", ("--repeats", "5", "--out", "{out}/cpu/lora"), 39),
    Take(
        "slo",
        ("--requests", "48", "--loads", "0.9,1.1", "--rounds", "5", "--out", "{out}/cpu/slo"),
        257,
    ),
    # The GPU SLO part's traffic (scripts/gpu/parts.py SLO) at an H100's cost ratios: the real scheduler
    # where a step is as long against its jitter as on a GPU, beside the H200's own runs (docs/gpu/): 281 s
    # measured with two variants (473d43a). tiers-narrow (config narrow_forwards on): the block counts what it
    # narrowed where a forward's fixed part dominates.
    Take(
        "slo_sd15",
        tuple(
            (
                "--device-profile sd15-h100 --height 512 --width 512 --cap 8 --requests 40 --loads 0.7,1.1 "
                "--rounds 5 --variants tiers,oldest,tiers-narrow --interactive-steps 4 --background-steps "
                "16-30 --out {out}/profiles/sd15-h100/slo"
            ).split()
        ),
        600,
        benchmark="slo",
    ),
    # The same traffic at FLUX.1-dev's 1024x1024 cost ratios (the flux1-h100 profile's estimate): a step of
    # 8 rows there is 8 times one of 1, so an interactive job's deadline depends on whom it steps with. 30
    # requests a run: 1659 s measured with two variants (7c44444). tiers-narrow first: its verdicts read
    # narrowed forwards against the tiers without them, and against first come, first served.
    Take(
        "slo_flux1",
        tuple(
            (
                "--arch tiny-flux --device-profile flux1-h100 --height 1024 --width 1024 --cap 8 --requests "
                "30 --loads 0.7,1.1 --rounds 5 --variants tiers-narrow,tiers,oldest --interactive-steps 4 "
                "--background-steps 16-30 --out {out}/profiles/flux1-h100/slo"
            ).split()
        ),
        3600,
        benchmark="slo",
    ),
    Take(
        "slo_server",
        ("--requests", "40", "--loads", "1.1", "--rounds", "5", "--out", "{out}/cpu/slo"),
        118,
    ),
    # Degrading rows against refusing them, through the real server at loads below and above capacity, at
    # the default room (the -room variants), against first come, first served.
    Take(
        "goodput",
        (
            "--variants",
            "fifo,tiers-room,degrade-room",
            "--room",
            "1",
            "--requests",
            "278",
            "--warm-up",
            str(WINDOW),  # the load's window (engine/overload.py) filled with the run's load first
            "--loads",
            "0.5,0.8,1.2,1.5,2.0",
            "--rounds",
            "9",
            "--out",
            "{out}/cpu",
        ),
        GOODPUT_S,
    ),
    # Degrading near capacity, where the headroom bound (engine/overload.py) lets the deadline rule act less
    # often than the point estimate did: tiers-room against degrade-room at 1.0x and 1.1x, on the goodput
    # take's traffic (340 s measured, 6f628b6).
    Take(
        "goodput_near",
        (
            "--variants",
            "tiers-room,degrade-room",
            "--room",
            "1",
            "--requests",
            "278",
            "--warm-up",
            str(WINDOW),
            "--loads",
            "1.0,1.1",
            "--rounds",
            "5",
            "--out",
            "{out}/cpu/goodput_near",
        ),
        600,
        benchmark="goodput",
    ),
    # A higher tier pausing a lower one by its tier (tier_pause tier, the default) against only where its
    # deadline needs it (deadline), at the default room, against first come, first served.
    Take(
        "goodput_tier_pause",
        (
            "--variants",
            "fifo,tiers-room,tiers-need",
            "--room",
            "1",
            "--requests",
            "150",
            "--loads",
            "0.5,0.8,1.2,1.5,2.0",
            "--rounds",
            "5",
            "--out",
            "{out}/cpu/goodput_tier_pause",
        ),
        GOODPUT_TIER_PAUSE_S,
        benchmark="goodput",
    ),
    # The door with deadline_room (the default's, 1 x the capacity) against without, on traffic with
    # deadlines and on mixed traffic (a share of requests without one); and a room of 3 x on the mixed.
    _door("goodput_room", ("--room", "1"), "goodput_room1"),
    _door("goodput_mixed", ("--room", "1", "--no-deadline-share", "0.3"), "goodput_mixed_room1"),
    _door("goodput_mixed_room3", ("--no-deadline-share", "0.3"), "goodput_mixed"),
    # Narrowed forwards (config narrow_forwards) on that traffic: tiers-room against the same with it on.
    Take(
        "goodput_narrow",
        (
            "--variants",
            "tiers-room,narrow-room",
            "--room",
            "1",
            "--requests",
            "150",
            "--loads",
            "0.5,0.8,1.5,2.0",
            "--rounds",
            "5",
            "--out",
            "{out}/cpu/goodput_narrow",
        ),
        GOODPUT_MIXED_S,
        benchmark="goodput",
    ),
    # A step cache for the steps left against tiers without it (tiny FLUX.1: a DiT), on both doors.
    Take(
        "goodput_cache",
        (
            "--arch",
            "tiny-flux",
            "--size",
            "256",
            "--variants",
            "tiers,cache,tiers-room,cache-room",
            "--requests",
            "150",
            "--loads",
            "0.8,1.5,2.0",
            "--rounds",
            "5",
            "--out",
            "{out}/cpu/goodput_cache",
        ),
        GOODPUT_CACHE_S,
        benchmark="goodput",
    ),
    # The same at an H100's cost ratios (SD 1.5 at 512x512).
    Take(
        "goodput_sd15",
        (
            "--device-profile",
            "sd15-h100",
            "--requests",
            "36",
            "--loads",
            "0.5,0.8,1.5,2.0",
            "--rounds",
            "5",
            "--out",
            "{out}/profiles/sd15-h100",
        ),
        GOODPUT_SD15_S,
        benchmark="goodput",
    ),
    # At those cost ratios, in the steady state of the load: runs long enough for the load's rule
    # (engine/overload.py) to see the load, as the CPU take above.
    Take(
        "goodput_sd15_steady",
        (
            "--device-profile",
            "sd15-h100",
            "--variants",
            "fifo,tiers-room,degrade-room",
            "--room",
            "1",
            "--requests",
            "278",
            "--warm-up",
            str(WINDOW),
            "--loads",
            "0.8,1.5",
            "--rounds",
            "5",
            "--out",
            "{out}/profiles/sd15-h100/steady",
        ),
        GOODPUT_SD15_STEADY_S,
        benchmark="goodput",
    ),
    Take("graphs", ("--repeats", "3", "--out", "{out}/cpu"), 20),
    Take("dllm", ("--concurrency", "1,4", "--requests-per-client", "3", "--out", "{out}"), 39),
    Take(
        "crash_soak",
        tuple(
            "--rounds 5 --steps 150 --mid-job 75 --duration 75 --crash-every 35 --load 0.8 --timeout 300"
            " --out {out}/cpu".split()
        ),
        CRASH_SOAK_S,
    ),
    # The same at an H100's cost ratios: a crash's recomputed steps cost what SD 1.5's would there (the
    # restart is this machine's), checkpoints at the cadence checkpoint_cost measures. Kills 35 s apart, as
    # in the CPU take: 30 s apart would fall inside the anti-spin window. 1032 s measured for 90 s runs
    # (a87904f).
    Take(
        "crash_soak_sd15",
        tuple(
            "--device-profile sd15-h100 --rounds 5 --steps 150 --mid-job 75 --duration 105 --crash-every 35"
            " --load 0.8 --checkpoint-every 5 --timeout 300 --out {out}/profiles/sd15-h100".split()
        ),
        2400,
        benchmark="crash_soak",
    ),
    # The crash soak with the server busy (arrivals above what it serves, so every run ends with a queue): a
    # crash's recomputed steps then delay every answer after them, where goodput can show what they cost;
    # 8 rounds, so that the 90% interval leaves out the lowest and the highest round (scripts/verdicts.py).
    # On the tiny SD (its forwards this CPU's) and at the sd15-h100 profile; checkpoints every 5 steps, the
    # cadence checkpoint_cost measures.
    Take(
        "crash_soak_busy",
        tuple(f"{BUSY} --out {{out}}/cpu/busy".split()),
        CRASH_SOAK_BUSY_S,
        benchmark="crash_soak",
    ),
    Take(
        "crash_soak_sd15_busy",
        tuple(f"--device-profile sd15-h100 {BUSY} --out {{out}}/profiles/sd15-h100/busy".split()),
        CRASH_SOAK_BUSY_S,
        benchmark="crash_soak",
    ),
    # Not benchmarks, but CPU figures too: one request's walk through the package, and whether Triton can
    # reload one model whose stub died.
    Take("request_walk", ("--out", "{out}/design/request_walk.json"), 22, "scripts/request_walk.py"),
    # The headroom and overload rules read on simulated arrivals (no model: the rule's statistics).
    Take("headroom_rule", ("--out", "{out}/design/headroom_rule.json"), 60, "scripts/headroom_rule.py"),
    # The shipped repository's start, crash restart and idle stop, against the commit before the launcher
    # let Triton load every model at once and before a model's config stub read it without torch (365dc1a).
    Take(
        "restart_times",
        ("--before", "365dc1a", "--rounds", "5", "--out", "{out}/cpu/restart_times.json"),
        1200,  # 12 starts (2 unrecorded), 10 crash restarts and stops: past 653 s on a day starts took 30 s
        "scripts/restart_times.py",
    ),
    Take("model_reload", ("--out", "{out}/cpu/model_reload.json"), 178, "scripts/model_reload_check.py"),
)


# The default budget: every take's limit.
BUDGET_S = sum(take.limit_s for take in PLAN)


def command(take: Take, out: Path) -> list[str]:
    args = [a.replace("{out}", str(out)) for a in take.args]
    # Relative to the repository (where it runs): the artefacts record this command line.
    if take.script:
        return [sys.executable, take.script, *args]
    return [sys.executable, "scripts/bench.py", (take.benchmark or take.name).replace("_", "-"), *args]


def run_group(argv: list[str], limit_s: float) -> int | str:
    """Run ``argv`` as a process group; at ``limit_s`` end the whole group (its servers and their stubs)."""
    process = subprocess.Popen(argv, cwd=REPO_ROOT, start_new_session=True)
    try:
        return process.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, None)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        return "cut at its limit"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.py all", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("docs"), help="the docs folder (relative: to the repo)"
    )
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for all of them")
    parser.add_argument("--only", default="", help="these benchmarks of the plan (comma-separated)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and its limits; run nothing")
    args = parser.parse_args(argv)
    only = {n.replace("-", "_") for n in args.only.split(",") if n}
    unknown = only - {t.name for t in PLAN}
    if unknown:
        parser.error(f"--only: {sorted(unknown)} not in the plan ({', '.join(t.name for t in PLAN)})")
    plan = [t for t in PLAN if not only or t.name in only]
    folder = REPO_ROOT / args.out / "cpu"
    kept = []  # a run of some (--only) keeps the record of the others
    if only and (folder / "all.json").is_file():
        earlier = json.loads((folder / "all.json").read_text())["benchmarks"]
        kept = [e for e in earlier if e["name"] not in only and e["name"] in {t.name for t in PLAN}]
    record: dict = {"budget_s": args.budget_s, "benchmarks": kept}
    started = time.monotonic()
    for take in plan:
        limit = take.limit_s * args.budget_s / BUDGET_S
        argv_ = command(take, args.out)
        print(f"[all] {take.name}: at most {limit:.0f} s: {' '.join(argv_[1:])}", flush=True)
        if args.dry_run:
            continue
        began = time.monotonic()
        status = run_group(argv_, limit)
        entry = {
            "name": take.name,
            "command": argv_[1:],
            "status": status,
            "seconds": time.monotonic() - began,
        }
        order = [t.name for t in PLAN]
        record["benchmarks"] = sorted([*record["benchmarks"], entry], key=lambda e: order.index(e["name"]))
        print(f"[all] {take.name}: {status} after {entry['seconds']:.0f} s", flush=True)
        record["seconds"] = sum(e["seconds"] for e in record["benchmarks"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "all.json").write_text(json.dumps(record, indent=1) + "\n")
    if args.dry_run:
        return
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "figures.py")], cwd=REPO_ROOT, check=True)
    print(f"[all] done in {time.monotonic() - started:.0f} s (budget {args.budget_s:.0f} s)")

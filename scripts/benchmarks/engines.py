"""The two image engines side by side in one process, on one pipeline, without Triton or client threads.

  request  the request-level engine: requests that arrived while the model was busy form the next batch
           (Triton's dynamic batcher, window --window), grouped by compatibility key, one diffusers
           ``pipeline(...)`` call per group of at most --cap rows (planner.plan_groups)
  step     the step engine: requests join a running denoising loop at the next step, one forward per
           step for the running set (--cap rows), each row with its own steps, guidance and scheduler
  raw      the pipeline alone: batch 1 and batch --cap calls back to back (the ceiling)

Traffic (a single-threaded event loop, so nothing but the engines competes for the machine):
  homogeneous  closed loop at each --concurrency (a client sends its next request when answered)
  mixed        closed loop at the top concurrency, steps from {4, 8, 16} x guidance from {1, 5, 7.5}
  poisson      open loop at 50/80/95% of the request-level engine's saturated throughput, --poisson-requests
               (500) per run, both engines on the same arrival times (--arrival-seed), the first 10% by
               arrival left out (an empty system filling up is not steady state): mean and p95 latency,
               time to the first denoising step, offered against delivered images/s

--rounds N runs each traffic N times (homogeneous at the top concurrency only, with the raw batch --cap
call in each round), the engines alternated, each Poisson round on arrivals of its own (seeds
--arrival-seed, +1, ...), and the profile N times: each ratio is read round by round
(benchmarks/engine_ratios.py).

The clock is the clients', not the loop's (arrivals.Traffic): the loop looks for arrivals only when it
is free (the request-level engine between whole pipeline calls, the step engine between steps), but a
Poisson request's latency runs from its scheduled arrival and a closed-loop client's next request from
its previous answer, so the wait behind a running call is counted for both engines.

Also a profile of the step engine at full occupancy: model forward, text encoding, decode, and the
engine's own work (scheduling, per-row scheduler steps, guidance, bookkeeping) per step.

Works on CPU (the tiny models) and on a GPU (``--arch sd15 --height 512 --width 512``, bf16).

    .venv/bin/python scripts/bench.py engines --concurrency 1,2,4,8,16 --requests 64
    .venv/bin/python scripts/bench_engines.py --concurrency 1,2,4,8,16 --requests 64   # the same
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import random
import time
from pathlib import Path

import artefacts
import torch
from verdicts import balanced_orders

from benchmarks.arrivals import poisson_arrivals
from benchmarks.common import (
    MIXED_GUIDANCE,
    MIXED_STEPS,
    POISSON_LOADS,
    REPO_ROOT,
    WARM_UP_FRACTION,
    benchmark_parser,
    poisson_label,
    pooled_throughput,
)
from benchmarks.engine_ratios import ratios
from benchmarks.engine_runs import (
    IMAGE_STRENGTH,
    STEP_COHORTS,
    Outcome,
    StageClock,
    raw_loop_profile,
    run_closed,
    run_image_mix,
    run_poisson,
    timeline_line,
)
from benchmarks.inprocess import Bench, sync, timed_median
from benchmarks.reports import load_cell, number_cell, ratio_table
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.stopwatch import Stopwatch
from triton_diffusion.tiny_models import ARCHITECTURES


def profile_step_engine(bench: Bench, steps: int, forwards: int) -> dict:
    """Full occupancy: ``cap`` jobs running all the time (a newcomer joins whenever one leaves). Splits
    each engine step into text encoding + noise (admission), the model forward, the row math around it
    (guidance, scheduler steps), VAE decode + postprocess, and the engine's own work."""
    engine = bench.step_engine(cohort=1)
    counter = 0
    for _ in range(3):  # warm-up
        engine.add(bench.job(counter, bench.request(counter, steps, 7.5), "step"))
        counter += 1
    while engine.active:
        engine.step()
    clock = StageClock(bench.device)
    with clock.timing(bench.adapter):
        for _ in range(forwards):
            while engine.active < bench.cap:
                engine.add(bench.job(counter, bench.request(counter, steps, 7.5), "step"))
                counter += 1
            sync(bench.device)
            started = time.perf_counter()
            engine.step()
            sync(bench.device)
            clock.end_step(time.perf_counter() - started, len(engine.scheduler.waiting))
    return {"forwards": forwards, "rows_per_forward": bench.cap, **clock.summary()}


def started_jobs(bench: Bench, k: int, steps: int) -> list[Job]:
    """k jobs of the bench's request, started by its adapter (text encoded, noise drawn)."""
    jobs = [bench.job(i, bench.request(i, steps, 7.5), "step") for i in range(k)]
    for job, start in zip(jobs, bench.adapter.prepare(jobs), strict=True):
        job.begin(start)
    return jobs


def stage_costs(
    bench: Bench, steps: int, sizes: tuple[int, ...] = (1, 2, 4, 8)
) -> dict[str, dict[int, float]]:
    """Median seconds of text encoding + noise, one forward and one decode for k images (the engine's
    own adapter, CFG on): the costs ``engine_sim.py`` models the engines from."""
    costs: dict[str, dict[int, float]] = {"encode": {}, "forward": {}, "decode": {}}
    adapter = bench.adapter
    for k in sizes:
        jobs = started_jobs(bench, k, steps)
        costs["encode"][k] = timed_median(lambda k=k: started_jobs(bench, k, steps), bench.device)
        costs["forward"][k] = timed_median(lambda jobs=jobs: adapter.step(jobs), bench.device)
        costs["decode"][k] = timed_median(lambda jobs=jobs: adapter.finish(jobs), bench.device)
    return costs


def stopwatch_median(work, stopwatch: Stopwatch, device: str, repeats: int = 7) -> float:
    """Median seconds of ``work`` as the engine's stopwatch reads them (engine/stopwatch.py): run back to
    back with no sync between, as the engine runs its forwards, then every span settled at the end.
    Beside :func:`timed_median` (the host's clock around a synced call) it checks that what the cost
    model learns is what the device spends."""
    work()
    sync(device)
    recorded: list[float] = []
    for _ in range(repeats):
        mark = stopwatch.start()
        work()
        stopwatch.stop(mark, recorded.append)
    sync(device)
    stopwatch.settle(wait=True)
    return sorted(recorded)[len(recorded) // 2]


def stopwatch_check(bench: Bench, steps: int, sizes: tuple[int, ...] = (1, 8)) -> dict[str, dict[str, float]]:
    """A forward of k images timed both ways: the host's clock around a synced call, and the engine's
    stopwatch (on a GPU its CUDA events; on a CPU the host's clock: the same clock, in runs of their own)."""
    adapter, out = bench.adapter, {}
    for k in sizes:
        jobs = started_jobs(bench, k, steps)
        synced = timed_median(lambda jobs=jobs: adapter.step(jobs), bench.device)
        watched = stopwatch_median(
            lambda jobs=jobs: adapter.step(jobs), Stopwatch.on(bench.device), bench.device
        )
        out[str(k)] = {"synced_host_s": synced, "stopwatch_s": watched, "ratio": watched / synced}
    return out


def sim_arguments(costs: dict[str, dict[int, float]]) -> str:
    return " ".join(
        f"--{stage} " + ",".join(f"{k}:{seconds:.5f}" for k, seconds in by_k.items())
        for stage, by_k in costs.items()
    )


def raw_ceiling(bench: Bench, steps: int, images: int) -> dict:
    out = {}
    for batch in (1, bench.cap):
        out[f"batch{batch}_images_per_s"] = raw_images_per_s(bench, steps, images, batch)
        print(f"  raw batch {batch}: {out[f'batch{batch}_images_per_s']:.2f} images/s", flush=True)
    return out


def raw_images_per_s(bench: Bench, steps: int, images: int, batch: int) -> float:
    """diffusers' own pipeline called with ``batch`` equal requests back to back (after one warm-up call
    and a garbage collection), about ``images`` images in all: images per second."""
    requests = [bench.request(i, steps, 7.5) for i in range(batch)]
    bench.raw_pipeline_call(requests)  # warm-up
    gc.collect()
    calls = max(1, images // batch)
    started = time.perf_counter()
    for _ in range(calls):
        bench.raw_pipeline_call(requests)
    return calls * batch / (time.perf_counter() - started)


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__, "engines")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="tiny-sd")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=64, help="requests per closed-loop run")
    parser.add_argument(
        "--poisson-requests",
        type=int,
        default=500,
        help="requests per Poisson run (long enough for steady state; the first 10%% are left out)",
    )
    parser.add_argument("--arrival-seed", type=int, default=1, help="the Poisson arrival times' seed")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cap", type=int, default=8, help="rows per forward / per fused call")
    parser.add_argument(
        "--window", type=int, default=32, help="Triton's max_batch_size for the request engine"
    )
    parser.add_argument("--max-running", type=int, help="the step engine's running set (default: --cap)")
    parser.add_argument("--policy", default="oldest", help="the step engine's scheduling policy")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each traffic (homogeneous at the top concurrency with the raw batch call beside it, "
        "mixed, each Poisson load: its own arrivals a round) and of the profile, the engines alternated "
        "(this machine's speed drifts by 10%% and more between runs: each ratio is taken round by round, "
        "its median and verdict read from the rounds)",
    )
    parser.add_argument("--no-mixed", action="store_true")
    parser.add_argument(
        "--no-image-mix",
        action="store_true",
        help="no text-only + img2img traffic (one model on the step engine vs two request-level models)",
    )
    parser.add_argument("--no-closed", action="store_true", help="no closed-loop runs (give --saturated)")
    parser.add_argument("--no-raw", action="store_true")
    parser.add_argument(
        "--timeline", action="store_true", help="on a GPU too: per-stage times of each step (synchronising)"
    )
    parser.add_argument(
        "--loads",
        default=",".join(str(load) for load in POISSON_LOADS),
        help="Poisson loads, fractions of the request-level engine's saturated throughput ('' for none)",
    )
    parser.add_argument(
        "--saturated", type=float, help="that throughput (images/s); default: the closed loop's best"
    )
    parser.add_argument(
        "--sim",
        type=Path,
        default=REPO_ROOT.parent / "shared" / "tools" / "engine_sim.py",
        help="engine_sim.py, to set its prediction beside the measurement (skipped if absent)",
    )
    parser.add_argument("--profile-forwards", type=int, default=40)
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="the model loaded with cuda_graphs (GPU: forwards replay captured graphs; ignored on a CPU)",
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results")
    parser.add_argument(
        "--step-cache",
        metavar="VARIANTS",
        help="instead: step caches per request, these step_cache values side by side (benchmarks/caches.py; "
        "'default' for none,fbc:0.05,fbc:0.12,taylorseer:4:2), on --arch (default there: flux-bench)",
    )
    parser.add_argument(
        "--slo",
        action="store_true",
        help="instead: service tiers and deadlines under mixed interactive and background traffic "
        "(benchmarks/slo.py; its own options follow --slo-args)",
    )
    parser.add_argument("--slo-args", default="", help="options for benchmarks/slo.py, as one string")
    return parser


def instead(argv: list[str]) -> tuple[str, list[str]] | None:
    """The benchmark ``--step-cache`` or ``--slo`` runs in this one's place, and its arguments (the
    dispatcher, ``benchmarks.main``, runs it): ``caches`` on --arch, or ``slo`` with --slo-args."""
    args, _ = build_parser().parse_known_args(argv)
    if args.step_cache:
        variants = [] if args.step_cache == "default" else ["--variants", args.step_cache]
        arch = [] if args.arch == "tiny-sd" else ["--arch", args.arch]
        return "caches", [*variants, *arch, "--out", str(args.out), "--dtype", args.dtype]
    if args.slo:
        return "slo", [*args.slo_args.split(), "--out", str(args.out)]
    return None


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.step_cache or args.slo:
        parser.error("--step-cache and --slo run another benchmark: run them through scripts/bench.py")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        args.dtype, torch.bfloat16 if device == "cuda" else torch.float32
    )
    bench = Bench(args.arch, args.height, args.width, args.cap, device, dtype, args.cuda_graphs)
    bench.max_running, bench.policy = args.max_running or args.cap, args.policy
    bench.timeline = args.timeline
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.no_closed and args.loads and not args.saturated:
        parser.error(
            "--no-closed needs --saturated (the request-level engine's throughput) for Poisson loads"
        )
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    top = max(concurrencies)
    report: dict = {
        **bench.report_header(args.steps),
        "cuda_graphs": bench.adapter is not None and bench.adapter.captured is not None,
        "cap": args.cap,
        "window": args.window,
        "requests": args.requests,
        "poisson_requests": args.poisson_requests,
        "warm_up_fraction": WARM_UP_FRACTION,
        "arrival_seed": args.arrival_seed,
        "runs": [],
        "raw_rounds": [],  # diffusers' own batch --cap images/s, a round at the top concurrency
        "profile_rounds": [],  # the step engine at full occupancy, a round
        "raw_profile_rounds": [],  # diffusers' own call at batch --cap, timed in place, a round
        "complete": False,  # until the last figure: a run cut short keeps what it measured
        "provenance": artefacts.provenance(),
    }
    path = args.out / "bench_engines.json"

    def save() -> None:
        """The report so far, rewritten after every measured run."""
        artefacts.write(path, {**report, "runs": [r.__dict__ for r in report["runs"]]})

    def measured(run: Outcome, round_: int = 0) -> None:
        run.round = round_
        report["runs"].append(run)
        save()

    homogeneous = [bench.request(i, args.steps, 7.5) for i in range(args.requests)]
    print("[warm-up]", flush=True)
    for engine in ("request", "step"):
        run_closed(bench, engine, homogeneous[: args.cap], args.cap, "warm-up", args.window)

    if not args.no_closed:
        print("[homogeneous closed loop]", flush=True)
        for concurrency in concurrencies:
            # Each engine goes first in every other round: a machine slowing down (or warming up) through
            # the run, or what one run leaves to the next, does not always favour one. At the top
            # concurrency diffusers' own pipeline runs after them in each round (batch --cap calls: the
            # ceiling), after each engine in turn.
            raw = ("raw",) if concurrency == top and not args.no_raw else ()
            rounds = args.rounds if concurrency == top else 1
            for round_ in range(rounds):
                engines = ("request", "step") if round_ % 2 == 0 else ("step", "request")
                for engine in (*engines, *raw):
                    if engine == "raw":
                        each = raw_images_per_s(bench, args.steps, args.requests, args.cap)
                        report["raw_rounds"].append(each)
                        print(f"  raw batch {args.cap}, round {round_}: {each:.2f} images/s", flush=True)
                        continue
                    run = run_closed(bench, engine, homogeneous, concurrency, "homogeneous", args.window)
                    measured(run, round_)
    if not args.no_closed and not args.no_mixed:
        print("[mixed closed loop]", flush=True)
        rng = random.Random(5)
        mixed = [
            bench.request(i, rng.choice(MIXED_STEPS), rng.choice(MIXED_GUIDANCE))
            for i in range(args.requests)
        ]
        for round_ in range(args.rounds):
            for engine in ("request", "step") if round_ % 2 == 0 else ("step", "request"):
                measured(run_closed(bench, engine, mixed, top, "mixed", args.window), round_)
    # The family's step adapter starts from images (its starter's starts; the adapter's own in a tree before
    # adapters/starts.py was composed).
    starter = getattr(bench.adapter, "starter", bench.adapter)
    img2img = "image" in getattr(starter, "starts", ())
    if not args.no_closed and not args.no_image_mix and img2img:
        print("[text-only and img2img requests: one model (step) vs two models (request)]", flush=True)
        image_runs, report["image_mix_weights"] = run_image_mix(bench, args, top)
        report["runs"] += image_runs
        save()
    loads = [float(load) for load in args.loads.split(",")] if args.loads else []
    if loads:
        request_runs = [r for r in report["runs"] if r.engine == "request" and r.traffic == "homogeneous"]
        saturated = args.saturated or max(  # the best concurrency's, its rounds pooled
            pooled_throughput([r for r in request_runs if r.concurrency == c]) for c in concurrencies
        )
        report["request_saturated_images_per_s"] = saturated
        print(
            f"[poisson, {args.poisson_requests} requests per run, request-level saturation "
            f"{saturated:.2f} images/s]",
            flush=True,
        )
        poisson = [bench.request(i, args.steps, 7.5) for i in range(args.poisson_requests)]
        for load in loads:
            # Each round its own arrivals (seeds from --arrival-seed on), the same for every engine, the
            # engines in orders balanced for what one run leaves to the next (verdicts.balanced_orders).
            for round_, order in enumerate(balanced_orders(("request", *STEP_COHORTS), args.rounds)):
                for engine in order:
                    run = run_poisson(
                        bench,
                        engine,
                        poisson,
                        load * saturated,
                        args.arrival_seed + round_,
                        poisson_label(load),
                        args.window,
                        WARM_UP_FRACTION,
                    )
                    measured(run, round_)
        print("[stage costs, and what engine_sim.py predicts from them]", flush=True)
        costs = stage_costs(bench, steps=50)
        report["stage_costs"] = {stage: {str(k): v for k, v in by_k.items()} for stage, by_k in costs.items()}
        print("  engine_sim.py " + sim_arguments(costs) + f" --steps {args.steps} --cap {args.cap}")
        report["model"] = model_prediction(args.sim, costs, args, saturated, loads)
        report["stopwatch_check"] = stopwatch_check(bench, steps=50)
        print(
            "  stopwatch / synced host clock, a forward: "
            + ", ".join(f"{k} img {v['ratio']:.3f}" for k, v in report["stopwatch_check"].items()),
            flush=True,
        )
        save()
    if args.profile_forwards:
        print("[profile of the step engine at full occupancy]", flush=True)
        calls = max(1, args.profile_forwards // args.steps)  # about as many forwards as the engine's
        for round_ in range(args.rounds):
            # The step engine and diffusers' own call, in turn (each first in every other round).
            beside = () if args.no_raw else ("raw",)  # --no-raw: no call of diffusers' own either
            for which in ("engine", *beside) if round_ % 2 == 0 else (*beside, "engine"):
                if which == "engine":
                    profile = profile_step_engine(bench, args.steps, args.profile_forwards)
                    report["profile_rounds"].append(profile)
                    print(f"  round {round_}: " + timeline_line(profile), flush=True)
                else:
                    raw = raw_loop_profile(bench, args.steps, calls)
                    report["raw_profile_rounds"].append(raw)
                    print(
                        f"  round {round_}, diffusers' own call: {raw['step_ms']:.1f} ms a step, its loop's "
                        f"own work {raw['loop_ms']:.2f} ms",
                        flush=True,
                    )
        # The round at the median of the engine's own share (of two middle rounds, the higher).
        by_share = sorted(report["profile_rounds"], key=lambda profile: profile["own_share_of_step"])
        report["profile"] = by_share[len(by_share) // 2]
        save()
    if not args.no_raw:
        print("[raw pipeline]", flush=True)
        report["raw"] = raw_ceiling(bench, args.steps, max(args.requests // 2, args.cap * 2))
    report["ratios"], report["ratio_rounds"] = ratios(report)
    report["runs"] = [r.__dict__ for r in report["runs"]]
    report["complete"] = True
    artefacts.write(path, report)
    (args.out / "bench_engines.md").write_text(markdown(report))
    print(markdown(report))


def model_prediction(sim: Path, costs: dict, args, saturated: float, loads: list[float]) -> dict | None:
    """engine_sim.py's prediction for the measured stage costs and the same arrivals: the request-level
    engine, the step engine with every stage on its thread (admitting every newcomer at once), and the
    bound with encoding and decoding free. None where the model is not there (a clean clone)."""
    if not sim.is_file():
        print(f"  ({sim} not found: no model prediction)")
        return None
    spec = importlib.util.spec_from_file_location("engine_sim", sim)
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    c = {
        stage: model.piecewise(",".join(f"{k}:{v}" for k, v in by_k.items())) for stage, by_k in costs.items()
    }
    c["row"] = 0.0  # the measured forward includes the row math
    out: dict = {}
    for load in loads:
        arrivals = poisson_arrivals(args.poisson_requests, load * saturated, args.arrival_seed)
        runs = {
            "request": model.run_request(arrivals, c, args.steps, args.cap, args.window),
            "step-eager": model.run_step(arrivals, c, args.steps, args.cap, "serial", 1.0),
            "step-free": model.run_step(arrivals, c, args.steps, args.cap, "free", 1.0),
        }
        out[poisson_label(load)] = runs
        for name, r in runs.items():
            print(
                f"  model {poisson_label(load)} {name:10s}: mean {r['mean']:.3f} s, p95 {r['p95']:.3f} s, "
                f"first step {r['ttfs']:.3f} s, mean / request {r['mean'] / runs['request']['mean']:.2f}"
            )
    return out


def markdown(report: dict) -> str:
    lines = [
        f"{report['machine']}; {report['arch']} {report['dtype']}"
        f"{', captured forwards (cuda_graphs)' if report.get('cuda_graphs') else ''}, {report['size']}, "
        f"{report['steps']} steps "
        f"(mixed: 4/8/16 steps x guidance 1/5/7.5), {report['cap']} rows per forward or call, "
        f"request window {report['window']}, {report['requests']} requests per closed-loop run, "
        f"{report['poisson_requests']} per Poisson run (the same arrivals for both engines, the first "
        f"{100 * report['warm_up_fraction']:.0f}% left out). Latency runs from when a request was sent "
        "(its Poisson arrival, or its client's previous answer), not from when the engine took it.",
        "",
        "| engine | traffic | concurrency / rate | offered images/s | images/s | mean (s) | p95 (s) "
        "| first step mean (s) | first step p95 (s) | rows per forward / call | measured requests |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        rows = f"{r['rows_per_forward']:.2f}" if r["rows_per_forward"] else "-"
        lines.append(
            f"| {r['engine']} | {r['traffic']} | {load_cell(r['concurrency'], r['rate'])} "
            f"| {number_cell(r['offered_images_per_s'], 2)} | {r['images_per_s']:.2f} "
            f"| {r['latency_mean_s']:.3f} | {r['latency_p95_s']:.3f} | {r['first_step_mean_s']:.3f} "
            f"| {r['first_step_p95_s']:.3f} | {rows} | {r['measured_requests']} of {r['requests']} |"
        )
    if "image_mix_weights" in report:
        weights = report["image_mix_weights"]
        lines += [
            "",
            "text+image: half text-only, half img2img requests (strength "
            f"{IMAGE_STRENGTH}) of one size; request = a text_to_image and an image_to_image model on the "
            "request-level engine taking turns (two copies of the weights), step = one text_to_image model "
            "on the step engine running both kinds in the same forwards. Resident weights for serving both "
            f"kinds: {weights['one_model_mib']:.1f} MiB with one model, {weights['two_models_mib']:.1f} MiB "
            "with two.",
        ]
    if "raw" in report:
        raw = report["raw"]
        lines += ["", "Raw pipeline: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in raw.items())]
    timelines = [r for r in report["runs"] if "timeline" in r["extra"]]
    if timelines:
        lines += ["", "Where a step engine's time went under Poisson load (per engine step):", ""]
        lines += [
            f"- {r['engine']} {r['traffic']}: {timeline_line(r['extra']['timeline'])}" for r in timelines
        ]
    if report.get("model"):
        lines += [
            "",
            "engine_sim.py's prediction from the stage costs measured in this run (same arrivals):",
            "",
        ]
        lines += [
            "| load | engine | mean (s) | p95 (s) | first step (s) | mean / request |",
            "|---|---|---|---|---|---|",
        ]
        for label, by_engine in report["model"].items():
            base = by_engine["request"]["mean"]
            lines += [
                f"| {label} | {name} | {m['mean']:.3f} | {m['p95']:.3f} | {m['ttfs']:.3f} "
                f"| {m['mean'] / base:.2f} |"
                for name, m in by_engine.items()
            ]
    if "profile" in report:
        lines += [
            "",
            f"Step engine at full occupancy ({report['profile']['rows_per_forward']} rows): "
            + timeline_line(report["profile"])
            + ".",
        ]
    lines += [""]
    lines += ratio_table(report["ratios"])
    return "\n".join(lines) + "\n"

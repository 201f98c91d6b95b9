"""Goodput under overload: degrading rows (fewer steps where a deadline needs it) against refusing them,
through the real server (``bench.py goodput``).

One tritonserver holds a tiny-SD model per variant on the step engine (``deadline_policy`` refuse), so
that no variant's run starts from the state another's traffic left (the load's window, the estimates).
Every request asks --steps steps and has a deadline, --deadline-scale x the latency of one such request
alone through the server; its tier is drawn (--tiers shares of priority, default, flex). The variants
of a round run on the same Poisson arrivals (each round a sequence of its own: --seed + round - 1), in
rotated order, at --loads of the step engine's capacity on this traffic (closed loop at --cap concurrent
requests through the server, out of phase: the workers' first requests spread over about one request's
time, so that jobs start and finish spread out, as on Poisson arrivals, rather than together; on every
variant's model in turn: the median; the same loop in step, whose starts and decodes are batched, is
kept beside it):

  fifo      no tier, no deadline sent: first come, first served (the client still counts its deadline)
  tiers     each request's tier and deadline sent: refused at once where the estimate says it cannot be
            in time, ended where its deadline passes
  degrade   the same, plus ``min_inference_steps`` = --least-share x its steps: the scheduler runs it with
            the most steps that meet its deadline where what it asked would not (engine/degradation.py)
  tiers-room    tiers on a model the same but for ``deadline_room`` --room x its capacity (3): where
                the model is full, a request with a deadline goes in for the scheduler to refuse or
                order it instead of waiting for room in execute() (holding up the requests behind it,
                higher tiers among them)
  degrade-room  degrade on such a model
  tiers-need, degrade-need  tiers-room and degrade-room on models the same but for ``tier_pause``
                deadline: a higher tier pauses a running job, or skips the admission cohort, only where its
                deadline needs it or the load is shown above capacity (engine/scheduler.py)
  narrow-room   tiers-room on a model the same but for ``narrow_forwards``: a forward holds fewer jobs
                where a deadline needs it and the cost line prices it within 5% a token (engine/
                forward_choice.py); each run counts the forwards narrowed (the server's metric)
  cache, cache-room  (--variants; a DiT family, e.g. --arch tiny-flux) tiers and tiers-room, plus
                ``degrade_step_cache`` = --degrade-cache: a started request late for its deadline at full
                compute is given that step cache for its steps left (engine/degradation.py)

The first three run on models with ``deadline_room`` 0 (a request with a deadline waits for room in
execute(), as every request did before the room was on by default); the two -room variants read what the
door that lets requests with a deadline in (engine_worker.py) does, each against its own variant. The first
--warm-up arrivals of each run are not counted: the load's rule (engine/overload.py) reads its newest
``WINDOW``, so a warm-up of as many measures each variant in the steady state of its load.

Reported per run (every offered request after the warm-up counted; refused, expired and late requests
are misses): goodput (requests that met their deadline per second of the arrival window: the same window
for every variant, so a ratio of goodputs is a ratio of requests in time), attainment per tier, the share
degraded and the steps they ran (BATCH ``degraded``), and the quality cost: each degraded image's PSNR
against the same request's full-steps image from the fifo run of the same round (which answers every
request, at full steps; without a fifo run, from its tiers run, where that answered it). And where
nothing should be degraded (loads below 1), how many of the degrade run's images equal the tiers run's
(within one uint8 level). The artefact (``<out>/goodput.json``,
written after every run) keeps every run; ``scripts/tables/goodput.py`` renders it, reading the goodput
ratio degrade / tiers over rounds by the one verdict rule (scripts/verdicts.py).

    .venv/bin/python scripts/bench.py goodput --requests 40 --loads 0.8,1.5,2.0 --rounds 5 --out docs/cpu
    .venv/bin/python scripts/bench.py goodput --device-profile sd15-h100 --out docs/profiles/sd15-h100
"""

from __future__ import annotations

import argparse
import io
import random
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from artefacts import provenance, write
from PIL import Image
from tables.goodput import RULE_WORDS
from triton_diffusion_client import GenerateResult, generate_one
from verdicts import rotated_orders

from benchmarks.arrivals import poisson_arrivals
from benchmarks.common import REPO_ROOT, benchmark_parser, metric_delta
from triton_diffusion.adapters.device_profiles import PROFILES, load_costs, profiles_for
from triton_diffusion.engine.overload import WINDOW
from triton_diffusion.serving.server_process import RunningServer, copy_model, read_metrics, start_server
from triton_diffusion.tiny_models import build_missing

VARIANTS = ("fifo", "tiers", "degrade", "tiers-room", "degrade-room")
NARROWED = "triton_diffusion_forwards_narrowed_total"  # the host's count of forwards narrowed
KNOWN = (*VARIANTS, "cache", "cache-room", "tiers-need", "degrade-need", "narrow-room")
TIERS = ("priority", "default", "flex")
WARM_UP_FRACTION = 0.1  # of --requests, where --warm-up does not say how many
NO_DEADLINE = "_no_deadline"  # a request of the traffic that sends no deadline (--no-deadline-share)


def models(cap: int, room: float = 3.0, variants: tuple[str, ...] = ()) -> dict[str, dict[str, str]]:
    """A model per variant (its engine's state, the load's window and the learned estimates among it, is
    its own: no variant's run starts from another's traffic), each with its config's edits beside the
    shared ones: ``deadline_room`` 0 (a request with a deadline waits for room); for a -room variant, room
    for requests with a deadline of ``room`` x the capacity (running set and waiting room: --cap each);
    for a -need variant, that and ``tier_pause`` deadline; for narrow-room, that and ``narrow_forwards``."""
    room_edits = {"deadline_room": str(round(room * 2 * cap))}

    def edits(variant: str) -> dict[str, str]:
        if variant.endswith("-need"):
            return {**room_edits, "tier_pause": "deadline"}
        if variant == "narrow-room":
            return {**room_edits, "narrow_forwards": "true"}
        return room_edits if variant.endswith("-room") else {"deadline_room": "0"}

    return {model_of(variant): edits(variant) for variant in variants}


def model_of(variant: str) -> str:
    return "goodput_" + variant.replace("-", "_")


def traffic(
    count: int, steps: int, shares: tuple[float, ...], seed: int, size: int = 64, no_deadline: float = 0.0
) -> list[dict]:
    """The requests: a prompt and seed each, ``steps`` steps at ``size`` square, a tier drawn by
    ``shares``; a ``no_deadline`` share of them (drawn) sends no deadline (the client still counts one)."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        tier = rng.choices(TIERS, shares)[0]
        request = {
            "prompt": f"a lighthouse at dusk {i}",
            "seed": i,
            "height": size,
            "width": size,
            "num_inference_steps": steps,
            "service_tier": tier,
        }
        if no_deadline and rng.random() < no_deadline:
            request[NO_DEADLINE] = True
        requests.append(request)
    return requests


def sent(request: dict, variant: str, deadline_s: float, least: int, cache: str = "") -> dict:
    """What the client sends in a variant."""
    if variant == "fifo":
        return {k: v for k, v in request.items() if k not in ("service_tier", NO_DEADLINE)}
    if request.get(NO_DEADLINE):  # its tier, and nothing that needs a deadline
        return {k: v for k, v in request.items() if k != NO_DEADLINE}
    out = {**request, "timeout": int(deadline_s * 1e6)}
    if variant.startswith("degrade"):
        out["min_inference_steps"] = least
    if variant.startswith("cache"):
        out["degrade_step_cache"] = cache
    return out


def run(
    url: str,
    requests: list[dict],
    arrivals: list[float],
    variant: str,
    deadline_s: float,
    least: int,
    cache: str = "",
):
    """Every request at its arrival, a thread each; each one's result and its latency from its scheduled
    arrival (the client's lateness in sending it charged to it)."""
    results: list[GenerateResult | None] = [None] * len(requests)
    latency = [0.0] * len(requests)
    started = time.perf_counter()

    def send(index: int) -> None:
        time.sleep(max(0.0, started + arrivals[index] - time.perf_counter()))
        late = time.perf_counter() - (started + arrivals[index])
        body = sent(requests[index], variant, deadline_s, least, cache)
        results[index] = generate_one(body, f"{variant}-{index}", url, model_of(variant), 600.0)
        latency[index] = results[index].latency_s + late

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, latency


def pixels(result: GenerateResult) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(result.images[0])).convert("RGB"), dtype=np.float64)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def figures(requests, results, latency, measured, window_s, deadline_s) -> dict:
    """One run's figures over the measured requests (every one offered counts)."""
    met = [i for i in measured if results[i].ok and latency[i] <= deadline_s]
    degraded = [i for i in measured if results[i].ok and "degraded" in (results[i].batch or {})]
    by_tier = {}
    for tier in TIERS:
        mine = [i for i in measured if requests[i]["service_tier"] == tier]
        if mine:
            by_tier[tier] = {
                "offered": len(mine),
                "met": sum(i in met for i in mine),
                "degraded": sum(i in degraded for i in mine),
            }
    errors = [results[i].error or "" for i in measured if not results[i].ok]
    plain = [i for i in measured if requests[i].get(NO_DEADLINE)]
    thirds = [measured[k * len(measured) // 3 : (k + 1) * len(measured) // 3] for k in range(3)]
    return {
        # The median latency of the answered requests among each third of the counted arrivals (None: none
        # answered): a latency that grows from the first third to the last is a queue that grew, more
        # arriving than was served.
        "latency_thirds": [
            statistics.median(done) if (done := [latency[i] for i in third if results[i].ok]) else None
            for third in thirds
        ],
        # Those that sent no deadline (--no-deadline-share), counted against the same deadline.
        "no_deadline": {"offered": len(plain), "met": sum(i in met for i in plain)},
        "offered": len(measured),
        "met": len(met),
        # Which were not in time (refused, expired, failed or late): whether a degraded request was among
        # those its round's run without degradation missed (scripts/tables/goodput.py).
        "missed_requests": sorted(set(measured) - set(met)),
        "goodput": len(met) / window_s,
        "attainment": len(met) / len(measured),
        "by_tier": by_tier,
        "answered": sum(results[i].ok for i in measured),
        "refused": sum("cannot finish within" in e for e in errors),
        "expired": sum("passed after step" in e for e in errors),
        "failed": sum(not ("cannot finish within" in e or "passed after step" in e) for e in errors),
        # Expired after some steps ran (running or paused), not while waiting: no cut could reach them.
        "expired_started": sum(bool(re.search(r"passed after step [1-9]", e)) for e in errors),
        "degraded": len(degraded),
        "degraded_requests": degraded,
        # By the rules that degraded them, as their BATCH names them (engine/degradation.py and
        # engine/overload.py).
        "degraded_why": why_degraded([results[i].batch["degraded"] for i in degraded]),
        "steps_run": [
            results[i].batch["degraded"]["steps_run"]
            for i in degraded
            if "steps_run" in results[i].batch["degraded"]
        ],
        # Given a step cache for their steps left (degrade_step_cache), and the step they were given it at.
        "cached_from": [
            results[i].batch["degraded"]["cached_from_step"]
            for i in degraded
            if "cached_from_step" in results[i].batch["degraded"]
        ],
    }


def why_degraded(reports: list[dict]) -> dict[str, int]:
    """How many requests each rule degraded, by the rules their BATCH ``degraded`` names (``rules``),
    counted under the words their reasons begin with (as the artefacts from before the field count)."""
    counts: dict[str, int] = {}
    for report in reports:
        for rule in report["rules"]:
            counts[RULE_WORDS[rule]] = counts.get(RULE_WORDS[rule], 0) + 1
    return counts


def capacity(url: str, model: str, requests: list[dict], concurrency: int, spacing_s: float) -> float:
    """Requests per second the step engine serves of this traffic in its steady state (fifo: full steps),
    closed loop at ``concurrency`` out of phase: the workers' first requests ``spacing_s`` apart (one
    answer's time in step, so they spread over about one request's time at that concurrency), so that
    jobs start and finish spread out, each start and decode mostly its own call, and a new one joins a
    running loop, as on Poisson arrivals (which also cluster: a start or decode batched there is served
    a little faster); 12 x ``concurrency`` requests (the traffic's, in turn), counted from the
    ``concurrency``-th answer to the ``concurrency``-th from last (every worker busy)."""
    pending = [(i, requests[i % len(requests)]) for i in range(12 * concurrency)]
    lock = threading.Lock()
    answered: list[float] = []

    def worker(k: int) -> None:
        time.sleep(k * spacing_s)
        while True:
            with lock:
                if not pending:
                    return
                index, request = pending.pop()
            generate_one(sent(request, "fifo", 0, 0), f"cap-{index}", url, model, 600.0)
            with lock:
                answered.append(time.perf_counter())

    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return steady_rate(answered, concurrency, started + (concurrency - 1) * spacing_s)


# The most the models' capacity reads (repeats of one measurement: the same model, the same traffic) may
# differ, largest over smallest: beyond it the machine is not steady enough for loads set from their
# median (a take whose reads disagreed by more missed many deadlines at 0.5x; it was not kept).
MOST_CAPACITY_SPREAD = 1.3


def steady_machine(rates: list[float]) -> None:
    """Stop before any run where the capacity reads disagree by more than ``MOST_CAPACITY_SPREAD``."""
    if len(rates) > 1 and max(rates) > MOST_CAPACITY_SPREAD * min(rates):
        reads = ", ".join(f"{rate:.1f}" for rate in rates)
        raise SystemExit(
            f"capacity reads {reads} req/s differ by more than {MOST_CAPACITY_SPREAD}x: the machine is not "
            "steady enough to set loads from them; nothing written (take it again on a quiet machine)"
        )


def steady_rate(answered: list[float], concurrency: int, all_busy: float = float("-inf")) -> float:
    """Answers a second between the ``concurrency``-th answer (or the first after ``all_busy``, when the
    last worker started) and the ``concurrency``-th from last: while every one of a closed loop's
    workers was busy, no start-up or drain counted."""
    stamps = sorted(answered)
    if len(stamps) < 2 * concurrency + 1:
        raise ValueError(f"{len(stamps)} answers: at least {2 * concurrency + 1} needed to count any")
    start = max(concurrency - 1, next((k for k, t in enumerate(stamps) if t >= all_busy), len(stamps)))
    end = len(stamps) - concurrency
    if end <= start:
        raise ValueError(f"no answer counted: the last worker started after the {end + 1}-th answer")
    return (end - start) / (stamps[end] - stamps[start])


def in_step_capacity(url: str, model: str, requests: list[dict], concurrency: int) -> float:
    """The same closed loop in step, as the artefacts before out-of-phase measured it: the workers start
    together, so their jobs start, run and finish together (starts and decodes batched) over 4 x
    ``concurrency`` requests (kept beside the capacity read; its answers' spacing spreads that loop)."""
    pending = list(enumerate(requests[: 4 * concurrency]))
    count = len(pending)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                index, request = pending.pop()
            generate_one(sent(request, "fifo", 0, 0), f"cap-{index}", url, model, 600.0)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return count / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> dict:
    parser = benchmark_parser(__doc__, "goodput")
    parser.add_argument("--arch", default="tiny-sd")
    parser.add_argument("--cap", type=int, default=8, help="max_running and max_rows_per_call")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--least-share", type=float, default=0.5, help="min_inference_steps / steps")
    parser.add_argument("--tiers", default="0.2,0.4,0.4", help="shares of priority, default, flex")
    parser.add_argument("--loads", default="0.5,0.8,1.2,1.5,2.0")
    parser.add_argument("--deadline-scale", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=5, help="runs per variant and load, order rotated")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--room",
        type=float,
        default=3.0,
        help="the -room variants' deadline_room, in multiples of the capacity (running set and waiting "
        "room: 2 x --cap)",
    )
    parser.add_argument(
        "--warm-up",
        type=int,
        help="the first arrivals of each run not counted (default: a tenth of --requests); the engine's "
        f"load is read over its newest {WINDOW} arrivals (engine/overload.py): a warm-up of as many runs "
        "each variant in the steady state of its load",
    )
    parser.add_argument("--size", type=int, default=64, help="image height and width (a profile: its own)")
    parser.add_argument(
        "--no-deadline-share",
        type=float,
        default=0.0,
        help="the share of requests (drawn) that send no deadline in any variant: mixed traffic (each is "
        "still counted against the same deadline)",
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(KNOWN)}"
    )
    parser.add_argument(
        "--degrade-cache",
        default="taylorseer:2",
        help="the cache and cache-room variants' degrade_step_cache (on random weights FBC at a usable "
        "threshold skips nothing: benchmarks/caches.py)",
    )
    parser.add_argument(
        "--device-profile",
        choices=profiles_for("StableDiffusionPipeline"),
        help="the model at a GPU's forward and decode times at the profile's size "
        "(adapters/device_profiles.py): goodput at that GPU's cost ratios; it computes no image, so no PSNR "
        "or equality is read",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "goodput")
    args = parser.parse_args(argv)
    args.variants = tuple(v for v in args.variants.split(",") if v)
    unknown = sorted(set(args.variants) - set(KNOWN))
    if unknown or "tiers" not in args.variants and "tiers-room" not in args.variants:
        parser.error(
            f"--variants: {unknown or 'none'} unknown (of {', '.join(KNOWN)}); tiers or tiers-room needed"
        )
    weights = REPO_ROOT / "weights"
    build_missing(weights, only=[args.arch])
    config = {
        "model": str(weights / args.arch),
        "engine": "step",
        "max_running": str(args.cap),
        "max_rows_per_call": str(args.cap),
        "deadline_policy": "refuse",
    }
    if args.device_profile:
        height, width = load_costs(PROFILES[args.device_profile]).size  # where its times hold
        if height != width:
            parser.error(
                f"--device-profile {args.device_profile} was measured at {height}x{width}, not square"
            )
        args.size = height
        config["device_profile"] = args.device_profile
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        served = models(args.cap, args.room, args.variants)
        for name, edits in served.items():
            copy_model("text_to_image", repo, name, {**config, **edits})
        server = start_server(repo, Path(tmp) / "tritonserver.log", list(served))
        try:
            return measure(server.grpc_url, args, config, args.out / "goodput.json", server)
        finally:
            server.stop()


def measure(
    url: str, args: argparse.Namespace, config: dict, path: Path, server: RunningServer | None = None
) -> dict:
    shares = tuple(float(x) for x in args.tiers.split(","))
    requests = traffic(args.requests, args.steps, shares, args.seed, args.size, args.no_deadline_share)
    least = max(1, round(args.steps * args.least_share))
    warm_up = int(args.requests * WARM_UP_FRACTION) if args.warm_up is None else args.warm_up
    if not 0 <= warm_up < args.requests:
        raise SystemExit(f"--warm-up {warm_up}: 0 up to --requests ({args.requests}) less one")
    for i in range(3):  # warm: the engine's estimates start from measured forwards
        for name in models(args.cap, args.room, args.variants):
            generate_one(sent(requests[i], "fifo", 0, 0), "warm", url, name)
    # Alone and the capacity on every variant's model, in turn (each model then starts from the same
    # work measured), their medians read: without a deadline or tier sent, every model runs them alike
    # (their edits act on requests with a deadline), so the models are repeats of one measurement.
    served = list(models(args.cap, args.room, args.variants))
    alones = [
        statistics.median(
            generate_one(sent(requests[i], "fifo", 0, 0), f"alone-{i}", url, name).latency_s for i in range(5)
        )
        for name in served
    ]
    alone = statistics.median(alones)
    # Each model in step first: its answers' spacing spreads the out-of-phase loop's first requests.
    in_step, rates = [], []
    for name in served:
        in_step.append(in_step_capacity(url, name, requests, args.cap))
        rates.append(capacity(url, name, requests, args.cap, 1.0 / in_step[-1]))
    rate = statistics.median(rates)
    steady_machine(rates)
    deadline_s = args.deadline_scale * alone
    print(f"alone {alone:.3f} s, deadline {deadline_s:.3f} s, capacity {rate:.2f} req/s", flush=True)
    report: dict = {
        "benchmark": "goodput",
        "config": {
            "arch": args.arch,
            "size": f"{args.size}x{args.size}",
            "device_profile": args.device_profile,
            "cap": args.cap,
            "requests": args.requests,
            "steps": args.steps,
            "min_inference_steps": least,
            "tier_shares": dict(zip(TIERS, shares, strict=True)),
            "deadline_scale": args.deadline_scale,
            "no_deadline_share": args.no_deadline_share,
            "sent_no_deadline": sum(bool(r.get(NO_DEADLINE)) for r in requests),
            "rounds": args.rounds,
            "variants": list(args.variants),
            "degrade_step_cache": args.degrade_cache
            if any(v.startswith("cache") for v in args.variants)
            else None,
            "warm_up": warm_up,
            "arrival_seeds": "--seed + round - 1",
            "model_config": {k: v for k, v in config.items() if k != "model"},
            "model_of": {v: model_of(v) for v in args.variants},
            "model_edits": models(args.cap, args.room, args.variants),
            "through": "tritonserver, gRPC, the project's client (one thread per request)",
        },
        "alone_s": alone,
        "deadline_s": deadline_s,
        "capacity": rate,
        # Each model's, in the order of "model_of" (the medians above are the figures read).
        "alone_by_model": alones,
        "capacity_by_model": rates,
        "capacity_rule": "out of phase",
        "capacity_in_step_by_model": in_step,
        "loads": [float(x) for x in args.loads.split(",")],
        "runs": [],
        "complete": False,
        "provenance": provenance(),
    }
    measured = list(range(warm_up, args.requests))
    for load in report["loads"]:
        for round_index, order in enumerate(rotated_orders(args.variants, args.rounds)):
            # A sequence of arrivals of its own each round (the variants of a round share it): the rounds
            # sample the arrival times (the requests, tiers and deadlines are the same), not only the
            # server's noise on one sequence.
            arrivals = poisson_arrivals(args.requests, load * rate, args.seed + round_index)
            window_s = arrivals[-1] - arrivals[measured[0]] if len(measured) > 1 else arrivals[-1]
            images: dict[str, dict[int, np.ndarray]] = {}
            for variant in order:
                before = read_metrics(server) if server is not None else {}
                results, latency = run(
                    url, requests, arrivals, variant, deadline_s, least, args.degrade_cache
                )
                entry = {"load": load, "round": round_index + 1, "variant": variant, "order": order}
                if server is not None:  # the whole run's, its warm-up arrivals included
                    after = read_metrics(server)
                    entry["forwards_narrowed"] = metric_delta(before, after, NARROWED, model_of(variant))
                entry.update(figures(requests, results, latency, measured, window_s, deadline_s))
                images[variant] = {i: pixels(results[i]) for i in measured if results[i].ok}
                report["runs"].append(entry)
                write(path, report)
                print(f"  {load} round {round_index + 1} {variant}: met {entry['met']}/{entry['offered']}, "
                      f"degraded {entry['degraded']}", flush=True)  # fmt: skip
            if not args.device_profile:  # a profile's stand-ins compute nothing: no image to compare
                compare(report["runs"][-len(args.variants) :], images, measured)
            write(path, report)
    report["complete"] = True  # every planned run measured
    write(path, report)
    return report


# Each variant that degrades, with the variant it is read against (the same door, without degradation).
DEGRADED_AGAINST = (
    ("degrade", "tiers"),
    ("degrade-room", "tiers-room"),
    ("cache", "tiers"),
    ("cache-room", "tiers-room"),
    ("degrade-need", "tiers-need"),
)


def compare(runs: list[dict], images: dict[str, dict[int, np.ndarray]], measured: list[int]) -> None:
    """Into the round's degrade runs (each with its tiers run: degrade with tiers, degrade-room with
    tiers-room):
    the PSNR of each degraded image against the full-steps image of the same request (the fifo run's, else
    its tiers run's where that answered it), and how many of its undegraded images equal its tiers run's."""
    for ours_name, tiers_name in DEGRADED_AGAINST:
        degrade = next((r for r in runs if r["variant"] == ours_name), None)
        if degrade is None:
            continue
        tiers, ours = images.get(tiers_name, {}), images.get(ours_name, {})
        # The full-steps images: fifo's (it answers every request in full), else its tiers run's (each it
        # answered is the request's full image: nothing is degraded there).
        full = images.get("fifo") or tiers
        degrade["psnr_against"] = "fifo" if "fifo" in images else tiers_name
        degraded = [i for i in degrade["degraded_requests"] if i in full]
        degrade["psnr_degraded"] = [min(psnr(ours[i], full[i]), 99.0) for i in degraded]
        undegraded = set(measured) - set(degrade["degraded_requests"])
        both = [i for i in sorted(undegraded) if i in ours and i in tiers]
        degrade["same_as_tiers"] = {
            "compared": len(both),
            "equal": sum(float(np.abs(ours[i] - tiers[i]).max()) <= 1 for i in both),
        }

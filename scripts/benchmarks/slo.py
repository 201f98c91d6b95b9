"""Service tiers and deadlines under mixed traffic, in one process (``bench_engines.py --slo`` runs this).

Two classes on one model, Poisson arrivals at --loads of the request-level engine's capacity for the mix:
  interactive  service_tier ``priority``, --interactive-steps steps, deadline = --deadline-scale x its
               latency alone (what a person waiting for a preview tolerates)
  background   the default tier, --background-steps (a range) steps, no deadline

Variants on the same arrivals, alternating within the run (--rounds rounds per load, the order rotated
from round to round):
  tiers             the step engine with tiers and deadlines: the scheduler of engine/scheduler.py
  tiers-narrow      (only when named in --variants) tiers with forwards narrowed where a deadline needs it
                    (config narrow_forwards, off by default: engine/forward_choice.py)
  oldest            the step engine, first come first served (every request the same tier, no deadline)
  fewest_remaining  the step engine, shortest remaining work first (no tiers)
  request           the request-level engine (one fused call per compatible group, in arrival order)

Every offered request counts (after the first 10% by arrival, which fill an empty system). Per class:
attainment (the share of offered interactive requests answered within the deadline, and within 1.5, 2
and 3 x alone), goodput (requests per second of the run's window that met the deadline), the p95 latency
over every offered request (a refused, expired or failed request counted as infinitely late: ``inf``,
shown "missed", as soon as more than 5% missed) beside the p95 over the answered requests only, counts of
refusals and expiries, how long a refusal took, background throughput, preemptions, and a steady-state
check (median latency and share unanswered over the first and second half of the arrivals). The artefact
keeps every round; ``summary`` gives median, min and max over rounds, and ``verdicts`` the first variant's
attainment against each other variant's, read against the rounds' spread. It is rewritten after every
measured run (``<out>/bench_slo.json``, ``scripts/artefacts.py``); ``scripts/tables/slo.py`` renders it.
``--trace FILE`` replays a trace instead (vLLM-Omni's format: one JSON object per line or a JSON list,
with ``width``, ``height``, ``num_inference_steps`` or ``steps``, ``slo_ms`` and optionally ``arrival_s``
or ``timestamp``; a request with ``slo_ms`` is interactive).

    .venv/bin/python scripts/bench.py slo --requests 120 --loads 0.9,1.1,3.0 --rounds 2 --out docs/cpu/slo
    .venv/bin/python scripts/bench_slo.py --requests 120 --loads 0.9,1.1,3.0 --rounds 2 --out docs/cpu/slo
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from artefacts import provenance, write

from benchmarks.arrivals import Traffic, poisson_arrivals
from benchmarks.common import REPO_ROOT, benchmark_parser
from benchmarks.inprocess import Bench, sync
from benchmarks.slo_figures import NOTES, Item, class_report, progress, summarize_rounds
from triton_diffusion.adapters.device_profiles import PROFILES, load_costs
from triton_diffusion.engine.jobs import Job, StepReport
from triton_diffusion.engine.ordering import AdmissionPacing, Service, make_policy
from triton_diffusion.engine.planner import RowCaps
from triton_diffusion.engine.request_engine import RequestEngine
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.tiny_models import ARCHITECTURES

VARIANTS = ("tiers", "oldest", "fewest_remaining", "request")  # the default; also "tiers-narrow"
TIERED = ("tiers", "tiers-narrow")
PRIORITY, DEFAULT = 0, 1
REASONS_KEPT = 5


@dataclass
class Outcomes:
    """What happened to each request of a run, by its index."""

    left: dict[int, str] = field(default_factory=dict)  # refused / expired / failed
    answered_at: dict[int, float] = field(default_factory=dict)
    preemptions: int = 0
    forwards: int = 0
    narrowed: int = 0  # forwards narrowed for a deadline (config narrow_forwards)
    # The first few refusals' and expiries' messages (the estimate a refusal rested on): what a GPU run
    # brings back to read a refusal by.
    reasons: list[str] = field(default_factory=list)


class SloRecorder:
    def __init__(self, traffic: Traffic, outcomes: Outcomes) -> None:
        self.traffic, self.outcomes = traffic, outcomes

    def render(self, report: StepReport) -> None:
        for stepped in report.stepped:
            self.traffic.first_step(stepped.job.record)
        for finished in report.finished:
            self.traffic.done(finished.job.record)
        for left in report.left:
            if left.reason not in ("finished", "ended") and left.job.record not in self.outcomes.left:
                self.outcomes.left[left.job.record] = left.reason
                if left.error is not None and len(self.outcomes.reasons) < REASONS_KEPT:
                    self.outcomes.reasons.append(f"{left.reason}: {left.error.message}")
                self.outcomes.answered_at[left.job.record] = time.perf_counter()
                self.traffic.done(left.job.record)
        self.outcomes.preemptions += len(report.paused)
        self.outcomes.forwards += len(report.forwards)
        self.outcomes.narrowed += sum(forward.narrowed > 0 for forward in report.forwards)


def job(bench: Bench, index: int, item: Item, variant: str, submitted: float, step_engine: bool) -> Job:
    if not step_engine:
        return bench.job(index, item.values, "request")
    made = bench.job(index, item.values, "step")
    made.spec = replace(made.spec, planned_steps=item.values["num_inference_steps"])
    made.request.entered = submitted
    if variant in TIERED:
        made.spec = replace(made.spec, tier=PRIORITY if item.interactive else DEFAULT)
        if item.slo_s is not None:
            made.spec = replace(made.spec, deadline=submitted + item.slo_s)
    else:
        made.spec = replace(made.spec, tier=DEFAULT)
    return made


def engine_for(bench: Bench, variant: str, max_running: int):
    if variant == "request":
        return RequestEngine(bench.model.run_call, RowCaps(bench.cap), lambda report: None)
    limits = EngineLimits(
        max_running, bench.cap, max_paused=max_running, narrow_forwards=variant == "tiers-narrow"
    )
    policy = make_policy("fewest_remaining" if variant == "fewest_remaining" else "oldest")
    pacing = AdmissionPacing(max(1, bench.cap // 2))
    return StepEngine(bench.adapter, limits, policy, pacing, Service(refuse_late=variant in TIERED))


def run(
    bench: Bench,
    variant: str,
    items: list[Item],
    arrivals: list[float],
    window: int,
    times,
    deadline_scale: float,
    alone: float,
) -> dict:
    traffic = Traffic(items, arrivals=arrivals, warm_up_fraction=0.1)
    outcomes = Outcomes()
    recorder = SloRecorder(traffic, outcomes)
    step_engine = variant != "request"
    engine = engine_for(bench, variant, bench.max_running)
    if step_engine and times is not None:
        for tokens, seconds in times.by_tokens.items():  # what a warm server has measured
            engine.times.forward_ran(1, tokens, seconds)
        engine.times.start_s, engine.times.finish_s = times.start_s, times.finish_s
    if not step_engine:
        engine.on_progress = recorder.render
    waiting: list[tuple[int, Item]] = []
    while not traffic.finished:
        arrived = traffic.arrived()
        for index, item in arrived:
            submitted = traffic.timings[index].submitted
            if step_engine:
                engine.add(job(bench, index, item, variant, submitted, True))
            else:
                waiting.append((index, item))
        if step_engine and engine.active:
            recorder.render(engine.step())
        elif not step_engine and waiting:
            batch, waiting = waiting[:window], waiting[window:]
            for index, item in batch:
                engine.add(job(bench, index, item, variant, 0.0, False))
            recorder.render(engine.step())
            sync(bench.device)
        else:
            traffic.wait_for_arrival()
    report = summarize(variant, items, traffic, outcomes, deadline_scale, alone)
    if step_engine:  # the cost model the run ended with, as MODEL_INFO gives it (engine/estimates.py)
        engine.stopwatch.settle(wait=True)
        report["cost_model"] = engine.times.describe()
    return report


def summarize(
    variant: str, items: list[Item], traffic: Traffic, outcomes: Outcomes, deadline_scale: float, alone: float
) -> dict:
    timings = traffic.timings
    measured = [i for i in sorted(timings) if i >= traffic.warm_up]
    spans = {i: (timings[i].submitted, timings[i].done) for i in measured if i not in outcomes.left}
    refused = [i for i in measured if outcomes.left.get(i) == "refused"]
    refusals = {i: outcomes.answered_at[i] - timings[i].submitted for i in refused}
    window = max(timings[i].done for i in measured) - min(timings[i].submitted for i in measured)
    report = class_report(
        variant, items, measured, spans, outcomes.left, refusals, deadline_scale, window, alone
    )
    return report | {
        "preemptions": outcomes.preemptions,
        "forwards": outcomes.forwards,
        "forwards_narrowed": outcomes.narrowed,
        "reasons": outcomes.reasons,
    }


def alone_latency(bench: Bench, steps: int, repeats: int = 7) -> float:
    """One request alone through the step engine, median seconds."""
    times = []
    for i in range(repeats):
        engine = engine_for(bench, "oldest", bench.max_running)
        engine.add(bench.job(10_000 + i, bench.request(10_000 + i, steps, 7.5), "step"))
        started = time.perf_counter()
        while engine.active:
            engine.step()
        sync(bench.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def mix(
    bench: Bench, count: int, share: float, steps: int, background: tuple[int, int], slo_s: float, seed: int
):
    rng = random.Random(seed)
    items = []
    for i in range(count):
        if rng.random() < share:
            items.append(Item(True, bench.request(i, steps, 7.5), slo_s))
        else:
            items.append(Item(False, bench.request(i, rng.randint(*background), 7.5)))
    return items


def from_trace(bench: Bench, path: Path) -> tuple[list[Item], list[float] | None]:
    """vLLM-Omni's trace format: width, height, steps (or num_inference_steps), slo_ms, an arrival time."""
    text = path.read_text().strip()
    records = json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines()]
    items, arrivals = [], []
    for i, record in enumerate(records):
        steps = int(record.get("num_inference_steps") or record.get("steps") or 4)
        raw = bench.raw_request(i, steps, 7.5)
        raw.update(
            width=int(record.get("width", bench.width)), height=int(record.get("height", bench.height))
        )
        slo = record.get("slo_ms")
        items.append(Item(slo is not None, bench.model.fields.parse(raw), slo / 1000 if slo else None))
        at = record.get("arrival_s", record.get("timestamp"))
        arrivals.append(float(at) if at is not None else None)
    if any(a is None for a in arrivals):
        return items, None
    start = min(arrivals)
    return items, [a - start for a in arrivals]


def capacity(bench: Bench, items: list[Item], window: int) -> float:
    """The request-level engine's throughput on the mix, closed loop at its cap (requests/s)."""
    sample = items[: max(2 * bench.cap, 16)]
    traffic = Traffic(sample, concurrency=bench.cap)
    engine = RequestEngine(bench.model.run_call, RowCaps(bench.cap), lambda report: None)
    outcomes = Outcomes()
    recorder = SloRecorder(traffic, outcomes)
    while not traffic.finished:
        arrived = traffic.arrived()
        if not arrived:
            traffic.wait_for_arrival()
            continue
        for index, item in arrived[:window]:
            engine.add(job(bench, index, item, "request", 0.0, False))
        recorder.render(engine.step())
    return traffic.measure().delivered_per_s


def main(argv: list[str] | None = None) -> dict:
    parser = benchmark_parser(__doc__, "slo")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="tiny-sd")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument(
        "--device-profile",
        help="time the denoiser and decode as this GPU was measured to (sd15-h100: --height 512 --width "
        "512; adapters/device_profiles.py): the real scheduler at that GPU's cost ratios, on a CPU",
    )
    parser.add_argument("--cap", type=int, default=8)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--loads", default="0.7,0.9,1.1")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--interactive-share", type=float, default=0.5)
    parser.add_argument("--interactive-steps", type=int, default=4)
    parser.add_argument("--background-steps", default="16-30")
    parser.add_argument("--deadline-scale", type=float, default=2.0)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="runs per variant and load, order rotated")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--trace", type=Path, help="replay this trace (vLLM-Omni's format) instead")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "slo")
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - {*VARIANTS, *TIERED}
    if unknown:
        parser.error(f"--variants: {', '.join(sorted(unknown))} unknown; choose from {VARIANTS + TIERED[1:]}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.device_profile:  # its times hold at the size it was measured at only
        size = load_costs(PROFILES[args.device_profile]).size
        if size != (args.height, args.width):
            parser.error(f"--device-profile {args.device_profile} was measured at {size}: --height, --width")
    bench = Bench(
        args.arch, args.height, args.width, args.cap, device, dtype, device_profile=args.device_profile
    )
    background = tuple(int(x) for x in args.background_steps.split("-"))
    # What a warm step engine has measured before the run, at every forward size up to the cap (a server
    # learns these in its first seconds; its deadline estimates start from them).
    warm = engine_for(bench, "oldest", bench.max_running)
    for size in range(1, bench.cap + 1):
        for i in range(size):
            warm.add(bench.job(20_000 + i, bench.request(20_000 + i, 4, 7.5), "step"))
        while warm.active:
            warm.step()
    warm.stopwatch.settle(wait=True)  # on a GPU, the last forwards and decodes too
    alone = alone_latency(bench, args.interactive_steps)
    slo_s = args.deadline_scale * alone
    if args.trace:
        items, trace_arrivals = from_trace(bench, args.trace)
    else:
        share = args.interactive_share
        items = mix(bench, args.requests, share, args.interactive_steps, background, slo_s, args.seed)
        trace_arrivals = None
    cap_rate = capacity(bench, items, args.window)
    variants = args.variants.split(",")
    report: dict = {
        "benchmark": "bench_slo",
        "config": {
            "arch": args.arch,
            "device_profile": args.device_profile,
            "size": f"{args.width}x{args.height}",
            "cap": args.cap,
            "requests": len(items),
            "interactive_steps": args.interactive_steps,
            "background_steps": args.background_steps,
            "interactive_share": args.interactive_share,
            "deadline_scale": args.deadline_scale,
            "rounds": args.rounds,
            "variants": variants,
            "warm_up_fraction": 0.1,
            "device": device,
            "torch_threads": torch.get_num_threads(),
            "trace": str(args.trace) if args.trace else None,
        },
        "interactive_alone_s": alone,
        "deadline_s": slo_s,
        "capacity": cap_rate,
        "loads": [float(x) for x in args.loads.split(",")] if trace_arrivals is None else ["trace"],
        "notes": NOTES,
        "rounds": [],
        "complete": False,
        "provenance": provenance(),
    }
    path = args.out / "bench_slo.json"
    print(f"alone {alone:.3f} s, capacity {cap_rate:.2f} req/s", flush=True)
    for load in report["loads"]:
        arrivals = trace_arrivals or poisson_arrivals(len(items), load * cap_rate, args.seed)
        for round_index in range(args.rounds):  # the order rotated each round: drift hits all alike
            shift = round_index % len(variants)
            entry = {"load": load, "round": round_index + 1, "order": variants[shift:] + variants[:shift]}
            entry["runs"] = {}
            report["rounds"].append(entry)
            for variant in entry["order"]:
                result = run(
                    bench, variant, items, arrivals, args.window, warm.times, args.deadline_scale, alone
                )
                entry["runs"][variant] = result
                summarize_rounds(report)
                write(path, report)
                print(f"  {load} round {round_index + 1} {variant}: {progress(result)}", flush=True)
    report["complete"] = True  # every planned run measured (gpu_checks reads a cut one's rows as kept)
    write(path, report)
    for label, text in report.get("verdicts", {}).items():
        print(f"{label}: {text}")
    return report


if __name__ == "__main__":
    main()

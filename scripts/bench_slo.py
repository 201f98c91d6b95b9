"""Service tiers and deadlines under mixed traffic, in one process (``bench_engines.py --slo`` runs this).

Two classes on one model, Poisson arrivals at --loads of the request-level engine's capacity for the mix:
  interactive  service_tier ``priority``, --interactive-steps steps, deadline = --deadline-scale x its
               latency alone (what a person waiting for a preview tolerates)
  background   the default tier, --background-steps (a range) steps, no deadline

Variants on the same arrivals, alternating within the run (--rounds rounds per load, the order rotated
from round to round):
  tiers             the step engine with tiers and deadlines: the scheduler of engine/scheduler.py
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
keeps every round; ``summary`` gives median, min and max over rounds, and ``verdicts`` tiers' attainment
against each other variant, read against the rounds' spread. It is rewritten after every measured run
(``<out>/bench_slo.json``, ``scripts/artefacts.py``); ``scripts/tables/slo.py`` renders it.
``--trace FILE`` replays a trace instead (vLLM-Omni's format: one JSON object per line or a JSON list,
with ``width``, ``height``, ``num_inference_steps`` or ``steps``, ``slo_ms`` and optionally ``arrival_s``
or ``timestamp``; a request with ``slo_ms`` is interactive).

    .venv/bin/python scripts/bench_slo.py --requests 120 --loads 0.9,1.1,3.0 --rounds 2 --out docs/cpu/slo
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from artefacts import provenance, write  # noqa: E402
from bench_common import REPO_ROOT, Traffic, mean, percentile, poisson_arrivals  # noqa: E402
from bench_engines import Bench, sync  # noqa: E402

from triton_diffusion.engine.jobs import Job, StepReport  # noqa: E402
from triton_diffusion.engine.ordering import AdmissionPacing, Service, make_policy  # noqa: E402
from triton_diffusion.engine.planner import RowCaps  # noqa: E402
from triton_diffusion.engine.request_engine import RequestEngine  # noqa: E402
from triton_diffusion.engine.scheduler import EngineLimits  # noqa: E402
from triton_diffusion.engine.step_engine import StepEngine  # noqa: E402
from triton_diffusion.tiny_models import ARCHITECTURES  # noqa: E402

VARIANTS = ("tiers", "oldest", "fewest_remaining", "request")
SLO_SCALES = (1.5, 2.0, 3.0)
PRIORITY, DEFAULT = 0, 1

NOTES = [
    "Every offered request counts (after the first 10% by arrival): a request refused at the door, ended at "
    "its deadline or failed is a miss in attainment and goodput, and infinitely late in the p95 over "
    "offered requests (stored as Infinity, shown 'missed': it is infinite as soon as more than 5% missed).",
    "latency_p95_answered_s and p95_answered_over_alone are over the answered requests only: a variant that "
    "refuses the requests it would answer late looks better there than it is.",
    "attainment: the share of offered interactive requests answered within the deadline (deadline_scale x "
    "alone); attainment_Kx_alone: within K x alone. goodput_per_s: those that met the deadline per second "
    "of the run's window (first measured arrival to last answer or refusal); for background (no deadline) "
    "the answered requests per second of that window.",
    "steady_state: median answered latency and share unanswered over the first and second half of a "
    "class's requests by arrival; p50_ratio well above 1 means the queue kept growing (no steady state).",
    "summary: median, min and max over rounds; verdicts read tiers against each other variant in "
    "attainment, within noise when the per-round differences straddle 0 or lie within either variant's "
    "own round-to-round half-range.",
]


@dataclass
class Item:
    """One request of the traffic: its class, its fields, and its deadline (seconds from its arrival)."""

    interactive: bool
    values: dict
    slo_s: float | None = None


@dataclass
class Outcomes:
    """What happened to each request of a run, by its index."""

    left: dict[int, str] = field(default_factory=dict)  # refused / expired / failed
    answered_at: dict[int, float] = field(default_factory=dict)
    preemptions: int = 0


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
                self.outcomes.answered_at[left.job.record] = time.perf_counter()
                self.traffic.done(left.job.record)
        self.outcomes.preemptions += len(report.paused)


def job(bench: Bench, index: int, item: Item, variant: str, submitted: float, step_engine: bool) -> Job:
    if not step_engine:
        return bench.job(index, item.values, "request")
    made = bench.job(index, item.values, "step")
    made.planned_steps = item.values["num_inference_steps"]
    made.request.entered = submitted
    if variant == "tiers":
        made.tier = PRIORITY if item.interactive else DEFAULT
        if item.slo_s is not None:
            made.deadline = submitted + item.slo_s
    else:
        made.tier = DEFAULT
    return made


def engine_for(bench: Bench, variant: str, max_running: int):
    if variant == "request":
        return RequestEngine(bench.model.run_call, RowCaps(bench.cap), lambda report: None)
    limits = EngineLimits(max_running, bench.cap, max_paused=max_running)
    policy = make_policy("fewest_remaining" if variant == "fewest_remaining" else "oldest")
    pacing = AdmissionPacing(max(1, bench.cap // 2))
    return StepEngine(bench.adapter, limits, policy, pacing, Service(refuse_late=variant == "tiers"))


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
        engine.times.forward_s.update(times.forward_s)  # what a warm server has measured
        engine.times.by_group.update({group: dict(table) for group, table in times.by_group.items()})
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
    return summarize(variant, items, traffic, outcomes, deadline_scale, alone)


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
    return report | {"preemptions": outcomes.preemptions}


def offered_percentile(latencies: list[float], q: float) -> float | None:
    """A percentile over every offered request, those never answered in time given as ``inf``: ``inf``
    as soon as the rank it falls on (or the one it interpolates towards) is a miss."""
    ordered = sorted(latencies)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    if math.isinf(ordered[low]) or (position > low and math.isinf(ordered[high])):
        return math.inf
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def halves(indices: list[int], latency: dict[int, float]) -> dict:
    """Steady state: the median answered latency and the share never answered, over the first and the
    second half of the class's requests by arrival (a queue that keeps growing shows as a second half
    much slower, or missing more, than the first)."""
    middle = len(indices) // 2
    out = {}
    for name, part in (("first_half", indices[:middle]), ("second_half", indices[middle:])):
        answered = [latency[i] for i in part if i in latency]
        out[f"{name}_p50_s"] = statistics.median(answered) if answered else None
        out[f"{name}_unanswered"] = (len(part) - len(answered)) / len(part) if part else None
    first, second = out["first_half_p50_s"], out["second_half_p50_s"]
    out["p50_ratio"] = second / first if first and second else None
    return out


def class_report(
    variant: str,
    items: list[Item],
    measured: list[int],
    spans: dict[int, tuple[float, float]],
    left: dict[int, str],
    refusals: dict[int, float],
    deadline_scale: float,
    window_s: float,
    alone: float,
) -> dict:
    """Per class, over every offered (``measured``) request: ``spans`` (arrival, answer) of the answered
    ones, why the others ``left`` (refused, expired, failed), how long each refusal took (seconds),
    ``window_s`` the run's measured span (first arrival to last answer or refusal), ``alone`` the
    interactive latency alone. A request not answered is a miss everywhere: in attainment, in goodput and
    in the p95 over offered (as infinitely late); the p95 over answered requests only is given beside it."""
    result: dict = {"variant": variant, "window_s": window_s}
    for name, interactive in (("interactive", True), ("background", False)):
        indices = [i for i in measured if items[i].interactive == interactive]
        answered = [i for i in indices if i in spans]
        latency = {i: spans[i][1] - spans[i][0] for i in answered}
        offered_latency = [latency.get(i, math.inf) for i in indices]
        stats: dict = {
            "offered": len(indices),
            "answered": len(answered),
            "refused": sum(left.get(i) == "refused" for i in indices),
            "expired": sum(left.get(i) == "expired" for i in indices),
            "failed": sum(left.get(i) not in (None, "refused", "expired") for i in indices),
            "latency_p95_offered_s": offered_percentile(offered_latency, 0.95),
            "latency_p95_answered_s": percentile(list(latency.values()), 0.95) if latency else None,
            "latency_mean_answered_s": mean(list(latency.values())) if latency else None,
            "steady_state": halves(indices, latency),
        }
        if interactive:
            # The deadline is deadline_scale x alone, so scale x alone is slo x scale / deadline_scale.
            for scale in SLO_SCALES:
                met = sum(latency[i] <= items[i].slo_s * scale / deadline_scale for i in answered)
                stats[f"attainment_{scale:g}x_alone"] = met / len(indices) if indices else None
            met = sum(latency[i] <= items[i].slo_s for i in answered)
            stats["met_deadline"] = met
            stats["attainment"] = met / len(indices) if indices else None
            stats["goodput_per_s"] = met / window_s if window_s > 0 else None
            p95 = stats["latency_p95_offered_s"]
            stats["p95_offered_over_alone"] = None if p95 is None else p95 / alone
            p95 = stats["latency_p95_answered_s"]
            stats["p95_answered_over_alone"] = None if p95 is None else p95 / alone
            refused = [refusals[i] for i in indices if i in refusals]
            stats["refusal_max_s"] = max(refused) if refused else None
        else:
            span = max(spans[i][1] for i in answered) - min(spans[i][0] for i in answered) if answered else 0
            stats["images_per_s"] = len(answered) / span if span > 0 else None
            stats["goodput_per_s"] = len(answered) / window_s if window_s > 0 else None  # no deadline
        result[name] = stats
    return result


# ---- rounds into a summary and verdicts (also bench_slo_server.py's) ----------------------------------

SUMMARY_FIGURES = {
    "interactive": ("attainment", "attainment_1.5x_alone", "attainment_3x_alone", "goodput_per_s",
                    "latency_p95_offered_s", "latency_p95_answered_s", "p95_offered_over_alone",
                    "p95_answered_over_alone", "refused", "expired", "failed", "refusal_max_s"),
    "background": ("images_per_s", "goodput_per_s", "latency_p95_answered_s", "failed"),
}  # fmt: skip


def spread(values: list) -> dict | None:
    """Median, min and max over rounds (``inf`` sorts last: a median of misses is a miss)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {"median": statistics.median(sorted(present)), "min": min(present), "max": max(present),
            "rounds": values}  # fmt: skip


def attainment_verdict(ours: dict | None, theirs: dict | None, rounds: list[float]) -> str:
    """Attainment of one variant against another, in points: within noise when the per-round
    differences (both variants on the same arrivals in the same round) straddle 0; one round has no
    spread."""
    if ours is None or theirs is None or not rounds:
        return "not measured"
    difference = statistics.median(rounds)
    text = f"{ours['median']:.0%} vs {theirs['median']:.0%} (median round difference "
    text += f"{100 * difference:+.0f} points"
    if len(rounds) < 2:
        return text + "; one round: no spread measured, not a finding)"
    text += f", rounds {100 * min(rounds):+.0f} to {100 * max(rounds):+.0f}"
    if min(rounds) <= 0 <= max(rounds):
        return text + ": within noise)"
    return text + (": better)" if difference > 0 else ": worse)")


def summarize_rounds(report: dict) -> None:
    """``summary`` (per load and variant: each figure's median, min and max over the rounds so far) and
    ``verdicts`` (tiers against each other variant: attainment within the deadline, counting every
    offered request)."""
    summary: dict = {}
    verdicts: dict = {}
    for load in report["loads"]:
        entries = [r for r in report["rounds"] if r["load"] == load]
        runs_by_variant: dict[str, list[dict]] = {}
        for entry in entries:
            for variant, run_report in entry["runs"].items():
                runs_by_variant.setdefault(variant, []).append(run_report)
        summary[str(load)] = {
            variant: {
                cls: {key: spread([r[cls].get(key) for r in runs]) for key in keys}
                for cls, keys in SUMMARY_FIGURES.items()
            }
            | {"preemptions": spread([r.get("preemptions") for r in runs]), "rounds": len(runs)}
            for variant, runs in runs_by_variant.items()
        }
        if "tiers" not in runs_by_variant:
            continue
        for other in runs_by_variant:
            if other == "tiers":
                continue
            pairs = [
                (
                    e["runs"]["tiers"]["interactive"]["attainment"],
                    e["runs"][other]["interactive"]["attainment"],
                )
                for e in entries
                if "tiers" in e["runs"] and other in e["runs"]
            ]
            differences = [ours - theirs for ours, theirs in pairs if ours is not None and theirs is not None]
            label = f"{_load_label(load)}: tiers vs {other}, interactive attainment within the deadline"
            verdicts[label] = attainment_verdict(
                summary[str(load)]["tiers"]["interactive"]["attainment"],
                summary[str(load)][other]["interactive"]["attainment"],
                differences,
            )
    report["summary"] = summary
    report["verdicts"] = verdicts


def progress(result: dict) -> str:
    """One line of a run for the log."""
    i = result["interactive"]
    attainment = "-" if i.get("attainment") is None else f"{i['attainment']:.0%}"
    return (f"interactive attainment {attainment}, p95 offered {i['latency_p95_offered_s']}, refused "
            f"{i['refused']}, expired {i['expired']}, failed {i['failed']}")  # fmt: skip


def _load_label(load) -> str:
    return load if isinstance(load, str) else f"{load:.0%} load"


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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="tiny-sd")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
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
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    bench = Bench(args.arch, args.height, args.width, args.cap, device, dtype)
    background = tuple(int(x) for x in args.background_steps.split("-"))
    # What a warm step engine has measured before the run, at every forward size up to the cap (a server
    # learns these in its first seconds; its deadline estimates start from them).
    warm = engine_for(bench, "oldest", bench.max_running)
    for size in range(1, bench.cap + 1):
        for i in range(size):
            warm.add(bench.job(20_000 + i, bench.request(20_000 + i, 4, 7.5), "step"))
        while warm.active:
            warm.step()
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

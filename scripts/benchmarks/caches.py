"""Step caches per request on the step engine, in one process: the same traffic with no cache, First Block
Cache at two thresholds and TaylorSeer, alternating within one run (``bench_engines.py --step-cache`` runs
this).

Each of --rounds rounds runs every variant on the same requests (each with that ``step_cache``), the order
rotated from round to round so that a drift of the machine hits every variant alike:
  closed    a closed loop at --concurrency: throughput, mean and p95 latency, the share of denoiser
            row-steps served from the caches, and every forward's time by (jobs, rows, rows reused)
  poisson   an open loop at --load of round 1's uncached closed throughput (the same arrival times for
            every variant and round): mean and p95 latency
  probe     (closed, not a variant) ``fbc:1.0``, whose forwards mostly reuse every row: what a forward of
            k jobs costs when every row skips the blocks after the first

The FBC overhead of a round is measured against that round's own forwards only. The ideal of a cached
forward of k jobs is ``head(k) + (full(k) - head(k)) x rows computed / rows``, with ``full(k)`` the median
uncached forward of k jobs of the round's ``none`` run and ``head(k)`` the median of the probe's forwards of
k jobs that reused every row; so a forward that reuses nothing has for its ideal exactly what the same
round's uncached forwards took. The overhead is the cached run's forwards (the median of each (jobs, rows,
reused) group, weighted by its count) over their ideal; forwards of a job count that the round's ``none``
or probe run never ran are left out (and counted). The artefact keeps every round; its ``summary`` gives
the median over rounds and the spread (min-max), and ``verdicts`` read each figure by the one verdict rule
(scripts/verdicts.py): the median's 90% sign-test interval against the neutral value; fewer than 5 rounds
give no verdict.

Random weights say nothing about quality, and little about how often a real model reuses: the reuse
fractions here are the tiny model's. Works on CPU (``flux-bench`` at 128x128) and on a GPU (bf16). The
artefact (``<out>/bench_caches.json``, ``scripts/artefacts.py``) is rewritten after every measured run, so a
run cut short keeps what it measured; ``scripts/tables/caches.py`` renders it.

    .venv/bin/python scripts/bench.py caches --requests 32 --rounds 5 --out docs/cpu/caches
    .venv/bin/python scripts/bench_caches.py --requests 32 --rounds 5 --out docs/cpu/caches   # the same
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

import torch
from artefacts import provenance, read, write
from verdicts import verdict as one_rule

from benchmarks.arrivals import Traffic, poisson_arrivals
from benchmarks.common import REPO_ROOT, benchmark_parser, mean, percentile
from benchmarks.inprocess import Bench, Recorder, full_size_flux1
from triton_diffusion.engine.jobs import StepReport
from triton_diffusion.tiny_models import ARCHITECTURES

# Random weights change their features far more from step to step than a trained model's: on flux-bench
# FBC starts to reuse at about 0.7 (a trained FLUX.1 at 0.05-0.12), so these thresholds are the random
# model's, chosen to reuse some and most steps.
VARIANTS = ("none", "fbc:0.7", "fbc:0.9", "taylorseer:4:2")
PROBE = "fbc:1.0"  # the highest threshold: from its second step a job reuses whenever its residual allows

NOTES = [
    "Every round runs every variant (closed loop, then Poisson) in an order rotated from round to round; "
    "summary figures are the median over rounds with min and max.",
    "FBC overhead: the cached run's forwards over their ideal, head(k) + (full(k) - head(k)) x computed "
    "rows / rows, with full(k) the same round's median uncached forward of k jobs (the none run) and "
    "head(k) the same round's median forward of k jobs that reused every row (the fbc:1.0 probe); medians "
    "per (jobs, rows, reused) group, weighted by count. A forward that reuses nothing has exactly the "
    "round's uncached forward for its ideal, so the ideal is never below what an uncached forward took.",
    "Verdicts: the one rule (scripts/verdicts.py): a figure's median over rounds with its 90% sign-test "
    "interval against its neutral value (0 for an overhead, 1 for a ratio); fewer than 5 rounds give none.",
    "The ideal charges the computing rows their proportional share of an uncached forward; where a "
    "forward of fewer rows costs more per row (a CPU's fixed per-layer cost), that share is a lower bound, "
    "so the overhead holds that as well as the per-row machinery (gathering, the per-branch decision).",
    "Random weights: the reuse fractions are the tiny model's and say nothing about a trained model's, or "
    "about quality.",
]


class CacheRecorder(Recorder):
    """The engines' reports into the traffic's clock, and each forward's jobs, rows and device seconds
    (the stopwatch's: on a GPU they come a step or more after the forward's report)."""

    def __init__(self, traffic: Traffic) -> None:
        super().__init__(traffic)
        self.ran: dict[int, tuple[int, int, int]] = {}  # by span: (jobs, rows, rows reused)
        self.timed: dict[int, float] = {}  # by span: device seconds

    def render(self, report: StepReport) -> None:
        super().render(report)
        self.ran.update((f.span, (f.images, f.rows, f.rows_reused)) for f in report.forwards)
        self.timed.update(report.timed)

    @property
    def forwards(self) -> list[tuple[int, int, int, float]]:
        """(jobs, rows, rows reused, seconds) of each forward run and timed, in order."""
        return [(*self.ran[span], self.timed[span]) for span in sorted(self.ran) if span in self.timed]


def run(bench: Bench, variant: str, requests: list[dict], traffic: Traffic) -> dict:
    recorder = CacheRecorder(traffic)
    engine = bench.step_engine(bench.cohort)
    while not traffic.finished:
        for index, values in traffic.arrived():
            engine.add(bench.job(index, {**values, "step_cache": variant}, "step"))
        if engine.active:
            recorder.render(engine.step())
        else:
            traffic.wait_for_arrival()
    recorder.render(engine.settle())  # the last forwards' device seconds
    measured = traffic.measure()
    forwards = recorder.forwards
    rows = sum(f[1] for f in forwards)
    return {
        "variant": variant,
        "images_per_s": measured.delivered_per_s,
        "offered_per_s": measured.offered_per_s,
        "latency_mean_s": mean(measured.latencies),
        "latency_p95_s": percentile(measured.latencies, 0.95),
        "reused_fraction": sum(f[2] for f in forwards) / rows if rows else 0.0,
        "forwards": forwards,
    }


# ---- the same round's forwards: groups, the baseline and the overhead ---------------------------------


def forward_groups(forwards: list[tuple[int, int, int, float]]) -> list[dict]:
    """A run's forwards by (jobs, rows, rows reused): count and median, min and max milliseconds."""
    groups: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    for jobs, rows, reused, seconds in forwards:
        groups[jobs, rows, reused].append(seconds * 1000)
    return [
        {"jobs": jobs, "rows": rows, "reused": reused, "count": len(times),
         "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}
        for (jobs, rows, reused), times in sorted(groups.items())
    ]  # fmt: skip


def pooled_median(groups: list[dict], jobs: int, keep) -> tuple[float | None, int]:
    """The median forward time (ms) of ``jobs`` jobs over the groups ``keep`` accepts, each group's median
    weighted by its count (a weighted median of the group medians), and how many forwards that is."""
    points = sorted((g["median_ms"], g["count"]) for g in groups if g["jobs"] == jobs and keep(g))
    total = sum(count for _, count in points)
    if not total:
        return None, 0
    seen = 0
    for value, count in points:
        seen += count
        if seen * 2 >= total:
            return value, total
    return points[-1][0], total


def baseline(none_groups: list[dict], probe_groups: list[dict]) -> dict[str, dict]:
    """Per job count: ``full_ms``, the median uncached forward (the none run); ``head_ms``, the median
    forward whose rows all reused (the probe); and their counts."""
    out: dict[str, dict] = {}
    for jobs in sorted({g["jobs"] for g in none_groups}):
        full, full_n = pooled_median(none_groups, jobs, lambda g: g["reused"] == 0)
        head, head_n = pooled_median(probe_groups, jobs, lambda g: g["reused"] == g["rows"])
        if full is not None:
            out[str(jobs)] = {"full_ms": full, "full_n": full_n, "head_ms": head, "head_n": head_n}
    return out


def overhead(groups: list[dict], base: dict[str, dict]) -> dict:
    """The cached run's forwards over their ideal (see the module's docstring), with the forwards covered
    and those left out for want of a baseline of their job count."""
    actual = ideal = 0.0
    covered = left_out = 0
    for g in groups:
        cost = base.get(str(g["jobs"]))
        if cost is None or cost["head_ms"] is None:
            left_out += g["count"]
            continue
        full, head = cost["full_ms"], cost["head_ms"]
        ideal += g["count"] * (head + (full - head) * (g["rows"] - g["reused"]) / g["rows"])
        actual += g["count"] * g["median_ms"]
        covered += g["count"]
    value = actual / ideal - 1 if ideal else None
    return {"overhead": value, "forwards": covered, "forwards_without_baseline": left_out}


# ---- rounds into a summary and verdicts ---------------------------------------------------------------


def spread(values: list[float | None]) -> dict | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present),
            "rounds": values}  # fmt: skip


def relative_half_range(summary: dict | None) -> float | None:
    """Half the min-max range relative to the median: how far one round of a figure moves; None for one
    round."""
    if not summary or len(summary["rounds"]) < 2 or not summary["median"]:
        return None
    return (summary["max"] - summary["min"]) / 2 / abs(summary["median"])


def verdict(summary: dict | None, neutral: float, kind: str, words=("", "")) -> str:
    """How a figure over rounds reads, by the one verdict rule (scripts/verdicts.py): ``kind`` "overhead"
    (neutral 0, shown as a percentage) or "ratio" (neutral 1, shown as a factor; ``words`` name a ratio
    above and below 1). Each round's figure compares variants measured in that round."""
    if summary is None:
        return "not measured"

    def show(value: float) -> str:
        return f"{value + 0.0:+.0%}".replace("-0%", "+0%") if kind == "overhead" else f"{value:.2f}x"

    rounds = [v for v in summary["rounds"] if v is not None]
    found = one_rule(rounds, higher_is_better=None, neutral=neutral)
    if found.low is None:
        return f"{show(found.median)} ({found.interval}: not a finding)"
    span = f"90% interval {show(found.low)} to {show(found.high)}"
    if found.word == "no gain or loss shown":
        return f"{show(found.median)} ({span}: neither above nor below {show(neutral)})"
    above = found.word.startswith("above")
    if kind == "overhead":
        if not above:
            return f"{show(found.median)} ({span}: below its ideal: the ideal is not a floor, check it)"
        return f"{show(found.median)} ({span}: above its ideal)"
    return f"{show(found.median)} ({span}: {words[0] if above else words[1]})"


def summarize(report: dict) -> None:
    """``summary`` and ``verdicts`` from the rounds so far (called after every measured run)."""
    variants = report["config"]["variants"]
    rounds = report["rounds"]
    closed: dict[str, dict] = {}
    for variant in variants:
        done = [r["closed"][variant] for r in rounds if variant in r["closed"]]
        ratios = [
            r["closed"][variant]["images_per_s"] / r["closed"]["none"]["images_per_s"]
            for r in rounds
            if variant in r["closed"] and "none" in r["closed"]
        ]
        closed[variant] = {
            key: spread([d[key] for d in done])
            for key in ("images_per_s", "latency_mean_s", "latency_p95_s", "reused_fraction")
        } | {"vs_none": spread(ratios)}
        overheads = [r["overhead"][variant]["overhead"] for r in rounds if variant in r.get("overhead", {})]
        closed[variant]["overhead"] = spread(overheads) if overheads else None
    poisson: dict[str, dict] = {}
    for variant in variants:
        done = [r["poisson"][variant] for r in rounds if variant in r["poisson"]]
        p95_ratio = [
            r["poisson"][variant]["latency_p95_s"] / r["poisson"]["none"]["latency_p95_s"]
            for r in rounds
            if variant in r["poisson"] and "none" in r["poisson"]
        ]
        poisson[variant] = {
            key: spread([d[key] for d in done]) for key in ("latency_mean_s", "latency_p95_s")
        }
        poisson[variant]["p95_vs_none"] = spread(p95_ratio)
    # The uncached baseline's own noise: its median forward at the most common job count, and its
    # closed-loop throughput, from round to round.
    top = max((int(k) for r in rounds for k in r.get("baseline", {})), default=None)
    full = spread([r["baseline"][str(top)]["full_ms"] for r in rounds if str(top) in r.get("baseline", {})])
    noise = {
        "uncached_forward": relative_half_range(full),
        "uncached_images_per_s": relative_half_range(closed.get("none", {}).get("images_per_s")),
        "uncached_poisson_p95": relative_half_range(poisson.get("none", {}).get("latency_p95_s")),
        "uncached_forward_jobs": top,
    }
    verdicts = {}
    for variant in variants[1:]:
        if closed[variant]["overhead"] is not None:
            verdicts[f"{variant} overhead over its same-round ideal"] = verdict(
                closed[variant]["overhead"], 0.0, "overhead"
            )
        verdicts[f"{variant} closed-loop images/s vs none"] = verdict(
            closed[variant]["vs_none"], 1.0, "ratio", ("faster", "slower")
        )
        verdicts[f"{variant} Poisson p95 vs none"] = verdict(
            poisson[variant]["p95_vs_none"],
            1.0,
            "ratio",
            ("higher p95: worse", "lower p95: better"),
        )
    report["summary"] = {"closed": closed, "poisson": poisson, "noise": noise}
    report["verdicts"] = verdicts


# ---- the run ------------------------------------------------------------------------------------------


def rotated(items: list[str], round_index: int) -> list[str]:
    shift = round_index % len(items)
    return items[shift:] + items[:shift]


def main(argv: list[str] | None = None) -> dict:
    parser = benchmark_parser(__doc__, "caches")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="flux-bench")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="step_cache values ('none' is added)")
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cap", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every variant, order rotated")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument(
        "--flux1-size",
        action="store_true",
        help="FLUX.1's transformer at full size (19 + 38 blocks, 3072 wide, random weights, built on the "
        "device) in place of the loaded one, over its text encoders and VAE (a GPU's step-cache figures)",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "caches")
    parser.add_argument(
        "--summarize-only",
        action="store_true",
        help="measure nothing: recompute <out>/bench_caches.json's summary and verdicts from its rounds",
    )
    args = parser.parse_args(argv)
    path = args.out / "bench_caches.json"
    if args.summarize_only:
        report = read(path)
        summarize(report)
        report["summary_recomputed"] = provenance()["date"]
        write(path, report)
        return report
    variants = ["none", *(v for v in args.variants.split(",") if v and v != "none")]
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        args.dtype, torch.bfloat16 if device == "cuda" else torch.float32
    )
    bench = Bench(args.arch, args.height, args.width, args.cap, device, dtype)
    if args.flux1_size:
        full_size_flux1(bench, device, dtype)
    requests = [bench.request(i, args.steps, 3.5) for i in range(args.requests)]
    print("warm-up", flush=True)
    warm = requests[: max(1, args.concurrency)]
    for variant in ("none", PROBE):
        run(bench, variant, warm, Traffic(warm, concurrency=args.concurrency))
    report: dict = {
        "benchmark": "bench_caches",
        "config": {
            "arch": args.arch + (" (FLUX.1 transformer at full size)" if args.flux1_size else ""),
            "size": f"{args.width}x{args.height}",
            "steps": args.steps,
            "requests": args.requests,
            "cap": args.cap,
            "concurrency": args.concurrency,
            "load": args.load,
            "rounds": args.rounds,
            "variants": variants,
            "probe": PROBE,
            "device": device,
            "dtype": str(dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
        },
        "notes": NOTES,
        "poisson_rate": None,
        "rounds": [],
        "complete": False,
        "provenance": provenance(),
    }

    def save() -> None:
        summarize(report)
        write(path, report)

    closed_order = [*variants, PROBE]
    for round_index in range(args.rounds):
        entry: dict = {"round": round_index + 1, "closed_order": rotated(closed_order, round_index)}
        entry |= {"closed": {}, "probe": None, "baseline": {}, "overhead": {}, "poisson": {}}
        report["rounds"].append(entry)
        groups: dict[str, list[dict]] = {}
        for variant in entry["closed_order"]:
            result = run(bench, variant, requests, Traffic(requests, concurrency=args.concurrency))
            groups[variant] = forward_groups(result.pop("forwards"))
            result["forward_groups"] = groups[variant]
            if variant == PROBE:
                entry["probe"] = result
            else:
                entry["closed"][variant] = result
            print(f"  round {round_index + 1} closed {variant}: {result['images_per_s']:.2f} images/s, "
                  f"reused {result['reused_fraction']:.0%}", flush=True)  # fmt: skip
            if "none" in groups and PROBE in groups:
                entry["baseline"] = baseline(groups["none"], groups[PROBE])
                for name in variants:  # the ideal is FBC's (skipped blocks), not TaylorSeer's (attention)
                    if name.startswith("fbc") and name in groups:
                        entry["overhead"][name] = overhead(groups[name], entry["baseline"])
            save()
        if report["poisson_rate"] is None:
            report["poisson_rate"] = args.load * entry["closed"]["none"]["images_per_s"]
        arrivals = poisson_arrivals(len(requests), report["poisson_rate"], seed=1)
        entry["poisson_order"] = rotated(variants, round_index)
        for variant in entry["poisson_order"]:
            traffic = Traffic(requests, arrivals=arrivals, warm_up_fraction=0.1)
            result = run(bench, variant, requests, traffic)
            result.pop("forwards")
            entry["poisson"][variant] = result
            print(
                f"  round {round_index + 1} poisson {variant}: p95 {result['latency_p95_s']:.2f} s",
                flush=True,
            )
            save()
    report["complete"] = True  # every planned run measured (gpu_checks reads a cut one's rows as kept)
    save()
    for label, text in report["verdicts"].items():
        print(f"{label}: {text}")
    return report

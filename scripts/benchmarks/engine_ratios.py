"""The in-process engines benchmark's ratios (scripts/benchmarks/engines.py): the step engine over the
request-level engine for each traffic, and, where it ran rounds (``--rounds``), each round's ratio, from
the two engines' runs of that round (the same requests; under Poisson the same arrivals, a draw of the
round's own): what scripts/verdicts.py reads a verdict from. A pure function of the report's runs."""

from __future__ import annotations

from benchmarks.common import (
    DELIVERED_TARGET,
    POISSON_TARGETS,
    TARGETS,
    per_round,
    poisson_label,
    pooled_throughput,
    ratio_value,
)
from benchmarks.engine_runs import STEP_COHORTS


def ratios(report: dict) -> tuple[dict[str, tuple[float, str]], dict[str, list[float]]]:
    """``{label: (value, target)}`` and, for each ratio measured over more than one round, ``{label: its
    rounds}``."""
    runs = report["runs"]
    out: dict[str, tuple[float, str]] = {}
    rounds: dict[str, list[float]] = {}

    def add(label: str, each: list[float], target: str) -> None:
        if not each:
            return
        out[label] = (ratio_value(each), target)
        if len(each) > 1:
            rounds[label] = each

    closed = [r.concurrency for r in runs if r.traffic == "homogeneous"]
    if closed:
        top = max(closed)
        each = per_round(runs, ("step", "request"), "homogeneous", "images_per_s", top)
        add(f"homogeneous c={top}: step / request throughput", each, TARGETS["throughput"])
        top_runs = [r for r in runs if r.traffic == "homogeneous" and r.concurrency == top]
        steps = [r for r in top_runs if r.engine == "step"]
        label = f"homogeneous c={top}: step / raw batch-{report['cap']} throughput"
        if report.get("raw_rounds"):  # diffusers' own pipeline in each round, beside the engines
            raw_rounds = report["raw_rounds"]
            ran = sorted((r for r in steps if r.round < len(raw_rounds)), key=lambda r: r.round)
            add(label, [r.images_per_s / raw_rounds[r.round] for r in ran], TARGETS["raw throughput"])
        elif "raw" in report:  # an older take: one raw run after every other
            raw = report["raw"][f"batch{report['cap']}_images_per_s"]
            out[label] = (pooled_throughput(steps) / raw, TARGETS["raw throughput"])
    pair = ("step", "request")
    add(
        "mixed: step / request throughput",
        per_round(runs, pair, "mixed", "images_per_s"),
        TARGETS["mixed throughput"],
    )
    for traffic in ("text+image", "text+image poisson80"):
        label = f"{traffic}: one model (step) / two models (request)"
        add(f"{label} throughput", per_round(runs, pair, traffic, "images_per_s"), "-")
        add(f"{label} p95 latency", per_round(runs, pair, traffic, "latency_p95_s"), "-")
    if "image_mix_weights" in report:
        weights = report["image_mix_weights"]
        out["text+image: resident weights, one model / two models"] = (
            weights["one_model_mib"] / weights["two_models_mib"],
            "-",
        )
    for load, (latency, first) in POISSON_TARGETS.items():
        traffic, percent = poisson_label(load), f"Poisson {round(load * 100)}%"
        for engine in STEP_COHORTS:
            if not per_round(runs, (engine, "request"), traffic, "latency_mean_s"):
                continue
            served = engine == "step"  # the served step engine's targets; its eager cohort's none
            for figure, said, target in (
                ("latency_mean_s", "mean latency", f"<= {latency}"),
                ("latency_p95_s", "p95 latency", f"<= {latency}"),
                ("first_step_mean_s", "mean time to first step", f"<= {first}"),
            ):
                each = per_round(runs, (engine, "request"), traffic, figure)
                add(f"{percent}: {engine} / request {said}", each, target if served else "-")
            ran = sorted(
                (r for r in runs if r.engine == engine and r.traffic == traffic), key=lambda r: r.round
            )
            delivered = [
                run.images_per_s / run.offered_images_per_s for run in ran if run.offered_images_per_s
            ]
            add(
                f"{percent}: {engine} delivered / offered",
                delivered,
                DELIVERED_TARGET if served and load == 0.95 else "-",
            )
    label = "profile: engine's own work / step time"
    if report.get("profile_rounds"):  # a profile a round
        shares = [profile["own_share_of_step"] for profile in report["profile_rounds"]]
        add(label, shares, TARGETS["own work"])
        # The same work in diffusers' own loop, the same round: the engine's row math and bookkeeping a
        # step over the rest of diffusers' call a step (all but starting, the denoiser and decoding).
        # And starting jobs (text encoding, each job's scheduler, noise) against diffusers' own start (its
        # inputs checked, text encoding, timesteps and step arguments, starting latents), a step.
        pairs = list(zip(report["profile_rounds"], report.get("raw_profile_rounds") or [], strict=False))
        for name, ours, theirs in (
            ("engine's own work / diffusers' loop's own work", ("row_math_ms", "own_ms"), "loop_ms"),
            ("starting jobs / diffusers' start", ("admission_ms",), "start_ms"),
        ):
            each = [sum(e[k] for k in ours) / raw[theirs] for e, raw in pairs if raw[theirs] > 0]
            add(f"profile: {name}, a step", each, "-")
    elif "profile" in report:  # an older take: one profile
        out[label] = (report["profile"]["own_share_of_step"], TARGETS["own work"])
    return out, rounds

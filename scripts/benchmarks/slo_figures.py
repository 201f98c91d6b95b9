"""The figures of the service-tier benchmarks, in process (``slo``) and through the server
(``slo_server``): a request of the two classes (``Item``), every offered request's fate into per-class
figures (``class_report``: attainment within the deadline, goodput, the p95 over offered and over answered
requests, refusals, the steady-state check), and the rounds into a ``summary`` and ``verdicts``
(``summarize_rounds``).

Nothing here imports torch or the package.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from verdicts import verdict

from benchmarks.common import mean, percentile

SLO_SCALES = (1.5, 2.0, 3.0)

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
    "summary: median, min and max over rounds; verdicts read the first variant against each other in "
    "attainment by the one verdict rule (scripts/verdicts.py): the per-round differences' median with its "
    "90% sign-test interval against 0; fewer than 5 rounds give no verdict.",
]


@dataclass
class Item:
    """One request of the traffic: its class, its fields, and its deadline (seconds from its arrival)."""

    interactive: bool
    values: dict
    slo_s: float | None = None


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


# ---- rounds into a summary and verdicts -------------------------------------------------------------

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
    """Attainment of one variant against another, in points, by the one verdict rule
    (scripts/verdicts.py): the per-round differences (both variants on the same arrivals in the same
    round), their median's 90% interval against 0."""
    if ours is None or theirs is None or not rounds:
        return "not measured"
    found = verdict(rounds, neutral=0.0)
    word = {"gain": "better", "loss": "worse"}.get(found.word, found.word)
    interval = (
        found.interval
        if found.low is None
        else (f"90% interval {100 * found.low:+.0f} to {100 * found.high:+.0f} points")
    )
    return (
        f"{ours['median']:.0%} vs {theirs['median']:.0%} (median round difference "
        f"{100 * found.median:+.0f} points, {interval}: {word})"
    )


def summarize_rounds(report: dict) -> None:
    """``summary`` (per load and variant: each figure's median, min and max over the rounds so far) and
    ``verdicts`` (the first variant of the config against each other: attainment within the deadline,
    counting every offered request)."""
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
        lead = report["config"]["variants"][0]
        if lead not in runs_by_variant:
            continue
        for other in runs_by_variant:
            if other == lead:
                continue
            pairs = [
                (
                    e["runs"][lead]["interactive"]["attainment"],
                    e["runs"][other]["interactive"]["attainment"],
                )
                for e in entries
                if lead in e["runs"] and other in e["runs"]
            ]
            differences = [ours - theirs for ours, theirs in pairs if ours is not None and theirs is not None]
            label = f"{_load_label(load)}: {lead} vs {other}, interactive attainment within the deadline"
            verdicts[label] = attainment_verdict(
                summary[str(load)][lead]["interactive"]["attainment"],
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

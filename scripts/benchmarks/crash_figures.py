"""The crash soak's pure part (scripts/benchmarks/crash_soak.py): a run's figures from its per-request
records, each variant's summary over rounds, and the paired verdicts of checkpoints against none."""

from __future__ import annotations

import statistics
from typing import Any

from tables.crash_soak import FIGURES
from verdicts import verdict

from benchmarks.common import mean, percentile


def attempt_starts(record: dict[str, Any]) -> list[int | None]:
    """The step each attempt started from: 0 for the first; the final one's ``resumed_from_step`` (0 where
    absent) when it completed; another's first progress step minus one (None where it reported none)."""
    attempts = record["attempts"]
    starts: list[int | None] = [a["start"] for a in attempts]
    if starts:
        starts[0] = 0
    if record["ok"] and len(attempts) > 1:
        starts[-1] = record.get("resumed_from_step") or 0
    return starts


def steps_recomputed(record: dict[str, Any]) -> int:
    """Steps a request computed again after its failures: for each failed attempt, the step it had reached
    (its start where it reported no progress) minus the start of the next attempt whose start is known."""
    starts = attempt_starts(record)
    failed = len(starts) - (1 if record["ok"] else 0)  # attempts that ended in a failure
    total = 0
    for i in range(min(failed, len(starts) - 1)):
        reached = record["attempts"][i]["reached"]
        reached = starts[i] if reached is None else reached
        following = [s for s in starts[i + 1 :] if s is not None]
        if reached is not None and following:
            total += max(0, reached - following[0])
    return total


def run_figures(records: list[dict[str, Any]], crashes: int, duration_s: float, hung: int = 0) -> dict:
    """One run's figures from its requests (``records``), the crashes it saw and its traffic's length;
    ``hung``: requests whose thread never ended (lost, without a record)."""
    done = [r for r in records if r["ok"]]
    latencies = [r["latency_s"] for r in done]
    end = max([duration_s, *(r["arrival_s"] + r["latency_s"] for r in done)])
    images = sum(r["images"] for r in done)
    recomputed = sum(steps_recomputed(r) for r in records)
    offered = len(records) + hung
    return {
        "offered": offered,
        "completed": len(done),
        "lost": offered - len(done),
        "images": images,
        "goodput_images_per_s": images / end if end > 0 else 0.0,
        "span_s": end,
        "crashes": crashes,
        "latency_mean_s": mean(latencies) if latencies else None,
        "latency_p95_s": percentile(latencies, 0.95) if latencies else None,
        "retried": sum(len(r["attempts"]) > 1 for r in records),
        "resumed": sum(bool(r.get("resumed_from_step")) for r in done),
        "resume_keys_sent": sum(bool(r.get("resume_key")) for r in records),
        "steps_recomputed": recomputed,
        "steps_recomputed_per_crash": recomputed / crashes if crashes else None,
        "hung": hung,
    }


# What each variant's summary gives a median and spread of: the figures its table shows.
SUMMARY_FIGURES = FIGURES


def paired_verdicts(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per round, checkpoints against none (scripts/verdicts.py's rule over the rounds that ran both): the
    goodput ratio (a gain above 1), the mean latency ratio (a gain below 1: where every request completes in
    both, the time a crash costs the requests it hit shows here, not in the goodput: rounds where either
    lost a request count nothing) and the steps
    recomputed per crash that checkpoints saved (none's minus checkpoints', a gain above 0; a round where
    either saw no crash counts nothing)."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["variant"]] = run
    pairs = [(r["checkpoints"], r["none"]) for r in by_round.values() if {"checkpoints", "none"} <= r.keys()]
    goodput = [
        c["goodput_images_per_s"] / n["goodput_images_per_s"] for c, n in pairs if n["goodput_images_per_s"]
    ]
    saved = [
        n["steps_recomputed_per_crash"] - c["steps_recomputed_per_crash"]
        for c, n in pairs
        if c["steps_recomputed_per_crash"] is not None and n["steps_recomputed_per_crash"] is not None
    ]
    # Only where both answered every request: a variant that lost its slowest would look faster.
    latency = [
        c["latency_mean_s"] / n["latency_mean_s"]
        for c, n in pairs
        if c["latency_mean_s"] and n["latency_mean_s"] and c["lost"] == n["lost"] == 0
    ]
    found: dict[str, Any] = {}
    for name, values, neutral, higher in (
        ("goodput_ratio", goodput, 1.0, True),
        ("latency_mean_ratio", latency, 1.0, False),
        ("steps_saved_per_crash", saved, 0.0, True),
    ):
        if values:
            found[name] = {
                **verdict(values, higher_is_better=higher, neutral=neutral).as_dict(),
                "values": values,
            }
    return found


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant that ran: each figure's median over rounds with min, max and each round's."""
    rows = []
    for variant in dict.fromkeys(run["variant"] for run in runs):
        mine = [run for run in runs if run["variant"] == variant]
        row: dict[str, Any] = {"variant": variant, "rounds": len(mine)}
        for name in SUMMARY_FIGURES:
            values = [run[name] for run in mine if run.get(name) is not None]
            row[name] = (
                {
                    "median": statistics.median(values),
                    "min": min(values),
                    "max": max(values),
                    "rounds": values,
                }
                if values
                else None
            )
        rows.append(row)
    return rows

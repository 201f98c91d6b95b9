"""The performance index's headline: what to expect of the engine today, one row a feature, each with its
figure, its reading by the one verdict rule (scripts/verdicts.py) and its date; CPU and GPU apart. Pure
functions of the artefacts; nothing here imports torch."""

from __future__ import annotations

import math
from statistics import median
from typing import Any

from verdicts import verdict

from tables import mixed_sizes
from tables.checkpoint_cost import step_ratios
from tables.engines import ratio_rounds
from tables.goodput import ROOM, ROOM_DEGRADE, TARGET_AT_1_5, at_load, goodput_ratios
from tables.markdown import number, table


def _measured(artefact: dict[str, Any], on: str = "cpu") -> str:
    """Its date and the machine it was measured on: its ``on``, "cpu" in the CPU table (a CPU take on a
    host with a GPU names its CPU), "gpu" in the GPU one; the rows of one table come from artefacts taken
    on different hosts. And "stale" when a block that shows it says so (figures.py sets ``_stale``)."""
    provenance = artefact.get("provenance") or {}
    date = str(provenance.get("date", "?"))[:10]
    where = (provenance.get("machine") or {}).get(on)
    measured = f"{date}, {where}" if where else date
    return f"{measured}, **stale**" if artefact.get("_stale") else measured


def _run(artefact: dict[str, Any], engine: str, traffic: str, concurrency: int | None = None) -> dict | None:
    for run in artefact.get("runs", []):
        if run.get("engine") == engine and run.get("traffic") == traffic:
            if concurrency is None or run.get("concurrency") == concurrency:
                return run
    return None


def engine_rows(artefact: dict[str, Any], where: str, on: str = "cpu") -> list[list[str]]:
    """Step engine against request-level batching from one engines artefact: each row read from its
    rounds where the benchmark ran them (``ratio_rounds``, under the row's label in ``ratios``); a row of
    one run has no verdict."""
    rows = []  # what, compared, one run's value, its label in ratios, whether higher is a gain
    closed = [r["concurrency"] for r in artefact.get("runs", []) if r.get("traffic") == "homogeneous"]
    if closed:
        top = max(c for c in closed if c is not None)
        step, request = (
            _run(artefact, "step", "homogeneous", top),
            _run(artefact, "request", "homogeneous", top),
        )
        if step and request:
            value = step["images_per_s"] / request["images_per_s"]
            label = f"homogeneous c={top}: step / request throughput"
            rows.append(
                (
                    f"{where}: same requests, closed loop c={top}",
                    "step / request images/s",
                    value,
                    label,
                    True,
                )
            )
    step, request = _run(artefact, "step", "mixed"), _run(artefact, "request", "mixed")
    if step and request:
        value = step["images_per_s"] / request["images_per_s"]
        label = "mixed: step / request throughput"
        rows.append(
            (f"{where}: mixed step counts and guidance", "step / request images/s", value, label, True)
        )
    for load in (50, 80, 95):
        step, request = _run(artefact, "step", f"poisson{load}"), _run(artefact, "request", f"poisson{load}")
        if step and request:
            value = step["latency_mean_s"] / request["latency_mean_s"]
            label = f"Poisson {load}%: step / request mean latency"
            rows.append(
                (f"{where}: Poisson at {load}% load", "step / request mean latency", value, label, False)
            )
    ratios, rounds = artefact.get("ratios", {}), artefact.get("ratio_rounds") or {}
    out = []
    for what, compared, value, label, higher in rows:
        if label in rounds:
            target = ratios[label][1]
            target = "" if target == "-" else target
            out.append(_rounds_row(what, compared, rounds[label], target, _measured(artefact, on), higher))
        else:
            out.append(
                [what, compared, f"**{number(value)}**", "-", "one run: no verdict", _measured(artefact, on)]
            )
    return out


def _rounds_row(
    what: str, compared: str, rounds: list[float], target: str, date: str, higher_is_better: bool | None
) -> list[str]:
    rounds = [r for r in rounds if r is not None]
    found = verdict(rounds, target or None, higher_is_better)
    middle = median(rounds)
    # A ratio over nothing, not a missed time; else the median as the interval prints its bounds.
    shown = "inf" if math.isinf(middle) else found.shown_median
    return [what, compared, f"**{shown}**", target or "-", str(found), date]


def render(
    engines: dict[str, Any],
    mixed: dict[str, Any],
    checkpoints: dict[str, Any],
    lora: dict[str, Any],
    caches: dict[str, Any],
    gpu_engines: dict[str, Any],
    goodput: dict[str, Any],
) -> str:
    headers = ("what", "compared", "median", "target", "reading", "measured")
    cpu = engine_rows(engines, f"{engines.get('arch', '?')} {engines.get('size', '?')}")
    for row in mixed.get("summary", []):
        ratio = row.get("throughput_vs_by_shape")
        if row.get("variant") == "packed" and row.get("load") == "closed" and ratio:
            cpu.append(
                _rounds_row(
                    f"mixed sizes, {row['family']} {row['traffic']} traffic",
                    "packed / one shape a forward images/s",
                    ratio["rounds"],
                    mixed_sizes.target(mixed, row["family"], row["traffic"]),
                    _measured(mixed),
                    True,
                )
            )
    vs_none = (caches.get("summary") or {}).get("closed", {})
    for variant, entry in vs_none.items():
        if variant != "none" and entry.get("vs_none"):
            cpu.append(
                _rounds_row(
                    f"step cache {variant}",
                    "cached / uncached images/s",
                    entry["vs_none"]["rounds"],
                    "",
                    _measured(caches),
                    True,
                )
            )
    label = "mixed-4 / split-4"
    if label in lora.get("ratios", {}) and label in ratio_rounds(lora):
        target = lora["ratios"][label][1]
        cpu.append(
            _rounds_row(
                "LoRA: 4 adapters in one forward",
                "mixed / one adapter a forward images/s",
                ratio_rounds(lora)[label],
                target if target != "-" else "",
                _measured(lora),
                True,
            )
        )
    for interval, rounds in checkpoint_rounds(checkpoints).items():
        cpu.append(
            _rounds_row(
                f"checkpoints every {interval} step{'s' * (interval != 1)}",
                "engine step / without",
                rounds,
                "<= 1.02",
                _measured(checkpoints),
                False,
            )
        )
    rounds = at_load(goodput, 1.5)
    if goodput_ratios(rounds, ROOM_DEGRADE, ROOM):
        cpu.append(
            _rounds_row(
                f"degrading rows at 1.5x capacity, {goodput['config']['arch']} (degrade-room / tiers-room)",
                "goodput degrade / tiers without it",
                goodput_ratios(rounds, ROOM_DEGRADE, ROOM),
                TARGET_AT_1_5,
                _measured(goodput),
                True,
            )
        )
    gpu = engine_rows(gpu_engines, f"{gpu_engines.get('arch', '?')} {gpu_engines.get('size', '?')}", "gpu")
    return "\n".join(
        ["**CPU** (the tiny models)", "", table(headers, cpu), "", "**GPU**", "", table(headers, gpu)]
    )


def checkpoint_rounds(artefact: dict[str, Any]) -> dict[int, list[float]]:
    """Each checkpoint interval's per-round engine step over the same round's with checkpoints off (a
    round without its "off" run, cut short, left out)."""
    runs = artefact.get("runs", [])
    intervals = sorted({r["interval"] for r in runs if r["interval"]})
    return {interval: list(step_ratios(runs, interval).values()) for interval in intervals}

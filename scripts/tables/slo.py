"""Figure blocks of bench_slo.py (in process) and bench_slo_server.py (through the server): per load and
variant, every offered interactive request counted (attainment, goodput, p95 over offered with misses as
infinitely late) beside the p95 over answered requests only, each cell the median over rounds with its
min-max, and the verdicts the artefact computed. Pure functions of the JSON."""

from __future__ import annotations

import math
from typing import Any

from tables.markdown import number, table

NARROW = "tiers-narrow"  # the variant with narrowed forwards (scripts/benchmarks/slo.py)
HEADERS = (
    "load",
    "variant",
    "attainment (within deadline, of offered)",
    "within 3x alone",
    "goodput req/s",
    "p95 / alone, all offered",
    "p95 / alone, answered only",
    "refused + expired / offered",
    "background images/s",
    "preemptions",
    "p50 2nd / 1st half",
)


def _show(value: float | None, kind: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "missed"
    if kind == "percent":
        return f"{value:.0%}"
    if kind == "ratio":
        return f"{value:.2f}x"
    if kind == "count":
        return f"{value:g}"
    return number(value)


def _cell(summary: dict[str, Any] | None, kind: str = "number") -> str:
    """``median (min to max)``; the median alone for one round or no spread."""
    if summary is None:
        return "-"
    median, low, high = (_show(summary[key], kind) for key in ("median", "min", "max"))
    if len(summary.get("rounds", [])) < 2 or low == high:
        return median
    return f"{median} ({low} to {high})"


def _load(load: Any) -> str:
    return str(load) if isinstance(load, str) else f"{load:.0%}"


def _steady(artefact: dict[str, Any], load: Any, variant: str) -> str:
    """The interactive class's median latency over the second half of arrivals against the first, per
    round (well above 1: the queue kept growing), and the share unanswered in the second half."""
    cells = []
    for entry in artefact["rounds"]:
        run = entry["runs"].get(variant) if entry["load"] == load else None
        if run is None:
            continue
        steady = run["interactive"].get("steady_state") or {}
        ratio = steady.get("p50_ratio")
        text = "-" if ratio is None else f"{ratio:.2f}"
        unanswered = steady.get("second_half_unanswered")
        if unanswered:
            text += f" ({unanswered:.0%} unanswered)"
        cells.append(text)
    return ", ".join(cells) or "-"


def _table(artefact: dict[str, Any]) -> str:
    rows = []
    for load in artefact["loads"]:
        by_variant = (artefact.get("summary") or {}).get(str(load), {})
        for variant in artefact["config"]["variants"]:
            figures = by_variant.get(variant)
            if figures is None:
                continue
            i, b = figures["interactive"], figures["background"]
            misses = _misses(artefact, load, variant)
            rows.append(
                [
                    _load(load),
                    variant,
                    _cell(i.get("attainment"), "percent"),
                    _cell(i.get("attainment_3x_alone"), "percent"),
                    _cell(i.get("goodput_per_s")),
                    _cell(i.get("p95_offered_over_alone"), "ratio"),
                    _cell(i.get("p95_answered_over_alone"), "ratio"),
                    misses,
                    _cell(b.get("images_per_s")),
                    _cell(figures.get("preemptions"), "count"),
                    _steady(artefact, load, variant),
                ]
            )
    return table(HEADERS, rows)


def _misses(artefact: dict[str, Any], load: Any, variant: str) -> str:
    """Refused + expired of offered interactive requests, summed over the rounds."""
    refused = expired = offered = 0
    for entry in artefact["rounds"]:
        run = entry["runs"].get(variant) if entry["load"] == load else None
        if run is not None:
            i = run["interactive"]
            refused, expired, offered = refused + i["refused"], expired + i["expired"], offered + i["offered"]
    return f"{refused} + {expired} / {offered}" if offered else "-"


def _head(artefact: dict[str, Any], where: str) -> str:
    config = artefact["config"]
    rounds = config.get("rounds", 1)
    return (
        f"{where}: {config['arch']} {config['size']}, `max_running` {config['cap']}; interactive "
        f"{config['interactive_share']:.0%} of {config['requests']} requests per run, "
        f"{config['interactive_steps']} steps, alone {number(artefact['interactive_alone_s'])} s, deadline "
        f"{config['deadline_scale']:g}x that ({number(artefact['deadline_s'])} s); background "
        f"{config['background_steps']} steps; load is a share of the request-level capacity on the mix "
        f"({number(artefact['capacity'])} req/s); {rounds} round(s) per load, variants alternating (order "
        f"rotated each round); the first {config.get('warm_up_fraction', 0.1):.0%} of arrivals left out. "
        "Each cell: the median over rounds (min to max). Every offered interactive request counts: refused "
        "and expired requests are misses in attainment and goodput and infinitely late in the p95 over all "
        "offered ('missed' once more than about 5% missed); the p95 over answered requests only is beside "
        "it. Last column: the interactive median latency over the second half of arrivals against the "
        "first, per round (well above 1: no steady state)."
    )


def _verdicts(artefact: dict[str, Any]) -> str:
    verdicts = artefact.get("verdicts") or {}
    return "\n".join(f"- {label}: **{text}**" for label, text in verdicts.items())


def _narrowed(artefact: dict[str, Any]) -> str:
    """The tiers-narrow variant's forwards narrowed for a deadline (config narrow_forwards), over its rounds
    at each load."""
    parts = []
    for load in artefact["loads"]:
        runs = [e["runs"][NARROW] for e in artefact["rounds"] if e["load"] == load and NARROW in e["runs"]]
        if runs and all("forwards_narrowed" in run for run in runs):
            narrowed, forwards = sum(r["forwards_narrowed"] for r in runs), sum(r["forwards"] for r in runs)
            parts.append(f"{_load(load)} load: {narrowed} of {forwards}")
    if not parts:
        return ""
    return (
        f"`{NARROW}` is `tiers` with config `narrow_forwards` on (a forward narrowed to fewer jobs where a "
        "deadline needs it); its forwards narrowed, over its rounds (whole runs, warm-up included): "
        + "; ".join(parts)
        + "."
    )


def render(artefact: dict[str, Any]) -> str:
    """bench_slo.py, in process."""
    parts = [_head(artefact, "In process"), _table(artefact), _narrowed(artefact), _verdicts(artefact)]
    return "\n\n".join(p for p in parts if p) + "\n"


def render_server(artefact: dict[str, Any]) -> str:
    """bench_slo_server.py, through tritonserver over gRPC."""
    parts = [_head(artefact, "Through the server (gRPC)"), _table(artefact), _verdicts(artefact)]
    return "\n\n".join(p for p in parts if p) + "\n"

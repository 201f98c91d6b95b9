"""Figure block of bench_caches.py (step caches per request): the variants over rounds, each cell the
median over rounds with its min-max, and the verdicts the artefact computed. A pure function of the JSON."""

from __future__ import annotations

from typing import Any

from tables.markdown import number, table


def _cell(summary: dict[str, Any] | None, kind: str = "number") -> str:
    """``median (min-max)`` of a summary; the median alone for one round or no spread."""
    if summary is None:
        return "-"

    def show(value: float | None) -> str:
        if value is None:
            return "-"
        if kind == "percent":
            return f"{value:.0%}"
        if kind == "signed":
            return f"{value:+.0%}".replace("-0%", "+0%")
        if kind == "ratio":
            return f"{value:.2f}x"
        return number(value)

    median, low, high = summary["median"], summary["min"], summary["max"]
    if len(summary.get("rounds", [])) < 2 or show(low) == show(high):
        return show(median)
    return f"{show(median)} ({show(low)} to {show(high)})"


def render(artefact: dict[str, Any]) -> str:
    config = artefact["config"]
    summary = artefact.get("summary") or {}
    closed, poisson = summary.get("closed", {}), summary.get("poisson", {})
    rounds = len(artefact.get("rounds", []))
    rate = artefact.get("poisson_rate")
    # What the arrivals offered, measured over the run (a short Poisson draw can come faster than planned).
    offered = [
        run["offered_per_s"]
        for entry in artefact.get("rounds", [])
        for run in entry.get("poisson", {}).values()
        if run.get("offered_per_s")
    ]
    measured = f", measured {number(min(offered))} to {number(max(offered))} req/s offered" if offered else ""
    head = (
        f"{config['arch']} {config['size']}, {config['steps']} steps, {config['requests']} requests per "
        f"run, `max_rows_per_call` {config['cap']}, closed loop at concurrency {config['concurrency']}, "
        f"Poisson planned at {config['load']:.0%} of round 1's uncached throughput ({number(rate)} req/s"
        f"{measured}); "
        f"{rounds} round(s), variants alternating (order rotated each round), "
        f"{config['torch_threads']} torch thread(s), {config['device']} {config['dtype']}. Each cell: the "
        "median over rounds (min to max)."
    )
    rows = []
    for variant in config["variants"]:
        c, p = closed.get(variant, {}), poisson.get(variant, {})
        rows.append(
            [
                variant,
                _cell(c.get("images_per_s")),
                "1.00x" if variant == "none" else _cell(c.get("vs_none"), "ratio"),
                _cell(c.get("latency_p95_s")),
                _cell(p.get("latency_p95_s")),
                "1.00x" if variant == "none" else _cell(p.get("p95_vs_none"), "ratio"),
                _cell(c.get("reused_fraction"), "percent"),
                _cell(c.get("overhead"), "signed") if variant.startswith("fbc") else "-",
            ]
        )
    headers = (
        "step_cache",
        "closed images/s",
        "vs none",
        "closed p95 s",
        "Poisson p95 s",
        "Poisson p95 vs none",
        "row-steps reused",
        "FBC forwards over their same-round ideal",
    )
    parts = [head, table(headers, rows)]
    noise = summary.get("noise") or {}
    jobs = noise.get("uncached_forward_jobs")
    if jobs is not None:
        fulls = [r["baseline"][str(jobs)] for r in artefact["rounds"] if str(jobs) in r.get("baseline", {})]
        full = ", ".join(number(b["full_ms"]) for b in fulls)
        heads = ", ".join(number(b["head_ms"]) for b in fulls)
        spread = noise.get("uncached_forward")
        jitter = "" if spread is None else f"; round to round ±{spread:.0%}"
        probe = config.get("probe", "fbc:1.0")
        parts.append(
            f"The ideal's baseline, per round, at {jobs} jobs: the uncached forward {full} ms (the none "
            f"run's median{jitter}), a forward whose rows all reused {heads} ms (the `{probe}` probe)."
        )
    verdicts = artefact.get("verdicts") or {}
    if verdicts:
        parts.append("\n".join(f"- {label}: **{text}**" for label, text in verdicts.items()))
    return "\n\n".join(parts) + "\n"

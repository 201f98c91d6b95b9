"""The figure block of the crash soak (scripts/bench.py crash-soak): a model's process killed every N
seconds under Poisson traffic, with job checkpoints and without; what was lost and how much work each crash
cost. A pure function of the artefact's JSON (its ``summary``: medians over alternated rounds with min and
max, and its ``runs``); the benchmark prints the same text when it ends."""

from __future__ import annotations

from typing import Any

from verdicts import Verdict

from tables.markdown import number, table

HEADERS = (
    "variant",
    "offered",
    "completed",
    "lost",
    "goodput images/s",
    "crashes",
    "mean s",
    "p95 s",
    "steps recomputed per crash",
)
RUN_HEADERS = ("round", *HEADERS, "span s", "recovery s")
FIGURES = (
    "offered",
    "completed",
    "lost",
    "goodput_images_per_s",
    "crashes",
    "latency_mean_s",
    "latency_p95_s",
    "steps_recomputed_per_crash",
)
COUNTS = {"offered", "completed", "lost", "crashes"}


def _cell(summary: dict[str, Any] | None, name: str) -> str:
    """``median (min-max)``; the median alone for one round or no spread."""
    if summary is None:
        return "-"

    def show(value: float) -> str:
        return f"{value:g}" if name in COUNTS else number(value)

    median = show(summary["median"])
    if summary["min"] == summary["max"]:
        return median
    return f"{median} ({show(summary['min'])}-{show(summary['max'])})"


def _value(value: float | None, name: str) -> str:
    if value is None:
        return "-"
    return str(value) if name in COUNTS else number(value)


def _checkpoints(settings: dict[str, Any]) -> str:
    return (
        f"`checkpoints`: `checkpoint_every_steps` {settings['checkpoint_every']} and a temporary "
        "`checkpoint_dir`; `none`: no checkpoints"
    )


def _mid_job(settings: dict[str, Any]) -> str:
    step = settings.get("mid_job") or 0
    if not step:
        return ""
    wait = settings.get("mid_job_wait_s")
    within = f", or after {wait:g} s without one" if wait else ""
    return f" (each kill once a request in flight had computed {step} steps{within})"


def _arrivals(settings: dict[str, Any]) -> str:
    if settings.get("arrivals_per_round"):
        return "Each round's arrivals a draw of their own, the same for both its variants."
    return "Every run the same arrivals."


def render(artefact: dict[str, Any]) -> str:
    settings = artefact["settings"]
    rate = settings.get("rate_per_s")
    solo = settings.get("solo_latency_s")
    load = (
        f"{rate:.2f} requests/s ({settings['load']:.0%} of one request at a time: {solo:.2f} s alone)"
        if rate is not None and solo is not None
        else f"{number(rate)} requests/s"
    )
    size = settings["size"]
    parts = [
        f"One {settings['model']} behind the launcher's supervisor; Poisson arrivals at {load} for "
        f"{settings['duration']:g} s a run, {settings['steps']} steps at {size}x{size}, the model's stub "
        f"killed every {settings['crash_every']:g} s{_mid_job(settings)}. Every request through the project "
        "client with its "
        f"resume key, up to {settings['retries']} resends within {settings['timeout']:g} s. "
        f"{_arrivals(settings)} "
        f"{_checkpoints(settings)}. {settings['rounds']} alternated rounds: medians with min-max over "
        "rounds. "
        "Lost: no answer within the deadline. Goodput: completed images over the run's span (from the "
        f"start of its arrivals to its last answer, or their {settings['duration']:g} s where later). Steps "
        "recomputed: for each request sent again, the step it had reached minus the step it resumed from, "
        "per crash."
    ]
    skipped = {v: s["skipped"] for v, s in artefact.get("variants", {}).items() if s.get("skipped")}
    for variant, why in skipped.items():
        parts.append(f"**`{variant}` not run:** the server of this commit could not load it ({why}).")
    if not artefact.get("complete"):
        parts.append("**Incomplete:** the run was cut short; these are the runs it finished.")
    rows = [
        [f"`{row['variant']}`", *(_cell(row.get(name), name) for name in FIGURES)]
        for row in artefact["summary"]
    ]
    parts.append(table(HEADERS, rows))
    read = artefact.get("verdicts", {})
    said = {
        "goodput_ratio": "goodput, checkpoints / none",
        "latency_mean_ratio": "mean latency, checkpoints / none (below 1 a gain)",
        "steps_saved_per_crash": "steps recomputed per crash saved by checkpoints (none minus checkpoints)",
    }
    lines = [
        f"{said[name]}: **{number(found['median'])}**, {Verdict.of(found)}"
        for name, found in read.items()
        if name in said
    ]
    if lines:
        parts.append("Per round, the two variants of that round: " + "; ".join(lines) + ".")
    run_rows = []
    for run in artefact["runs"]:
        recoveries = [k["recovery_s"] for k in run.get("kills", []) if k.get("recovery_s") is not None]
        run_rows.append(
            [
                run["round"],
                f"`{run['variant']}`",
                *(_value(run.get(name), name) for name in FIGURES),
                _value(run.get("span_s"), "span_s"),
                ", ".join(f"{r:g}" for r in recoveries) or "-",
            ]
        )
    parts.append(table(RUN_HEADERS, run_rows))
    failures = [
        f"round {r['round']} `{r['variant']}`: {r['crash_failure']}"
        for r in artefact["runs"]
        if r.get("crash_failure")
    ]
    if failures:
        parts.append("**Crashes cut short:** " + "; ".join(failures) + ".")
    return "\n\n".join(parts) + "\n"

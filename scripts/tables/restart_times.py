"""The restart-times block (scripts/restart_times.py): the shipped repository's start, crash restart and
idle stop through the launcher, now and (where run) before, read over rounds by the one verdict rule."""

from __future__ import annotations

from typing import Any

from verdicts import verdict

TARGET = "< 15"  # seconds: an idle stop and a crash restart each
MEASURES = (
    ("stop_idle_s", "idle stop (SIGTERM to exit)", TARGET),
    ("crash_back_s", "crash restart (stub killed to ready)", TARGET),
    ("ready_s", "cold start (launch to ready)", None),
)


def _values(artefact: dict[str, Any], variant: str, key: str) -> list[float]:
    return [row[key] for row in artefact["rows"] if row["variant"] == variant]


def render(artefact: dict[str, Any]) -> str:
    setup = artefact["setup"]
    commits = setup.get("served_commits", {})
    variants = [v for v in ("before", "now") if _values(artefact, v, "ready_s")]
    named = "; ".join(f"{v}: commit `{commits.get(v)}`" for v in variants)
    incomplete = "" if artefact.get("complete", True) else "**Incomplete run** (cut short). "
    warmed = ", after one start of each not recorded" if setup.get("warm_up") else ""
    lines = [
        incomplete + "The shipped model repository (every model), started by `triton-diffusion-serve` (its "
        f"supervisor and drain) on this machine, rounds alternated ({named}){warmed}. Crash restart: "
        f"`kill -9` of the `{setup['victim']}` stub until the supervisor's `/readyz` answers again from a "
        "new server. "
        "Idle stop: SIGTERM to the launcher (the server that crash restart brought back) after each "
        "text-to-image model answered a request (the project's gRPC client, progress on) and 2 s idle. "
        "Seconds: the median over rounds; its reading by the one verdict rule against the target "
        f"({TARGET} s) where there is one."
        + (
            " now / before: each round's now over its before, their median read against 1 (below 1 a gain: "
            "less time)."
            if len(variants) == 2
            else ""
        ),
        "",
        "| | " + " | ".join(variants) + (" | now / before, per round |" if len(variants) == 2 else " |"),
        "|---|" + "---|" * (len(variants) + (len(variants) == 2)),
    ]
    for key, what, target in MEASURES:
        cells = []
        for variant in variants:
            found = verdict(_values(artefact, variant, key), target, higher_is_better=False, neutral=0)
            reading = f" ({found.word}, {found.interval})" if target else ""
            cells.append(f"{found.median:.1f}{reading}")
        ratios = _ratios(artefact, key)
        if len(variants) == 2:
            found = verdict(ratios, higher_is_better=False) if ratios else None
            cells.append(f"{found.median:.3g}: {found}" if found else "-")
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratios(artefact: dict[str, Any], key: str) -> list[float]:
    """Each round's now over before (rounds alternated; a round without both left out)."""
    by_round: dict[int, dict[str, float]] = {}
    for row in artefact["rows"]:
        by_round.setdefault(row["round"], {})[row["variant"]] = row[key]
    return [r["now"] / r["before"] for r in by_round.values() if "now" in r and "before" in r]

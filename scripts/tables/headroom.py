"""The headroom and overload rules read on simulated arrivals (scripts/headroom_rule.py)."""

from __future__ import annotations

from typing import Any

from tables.markdown import table


def _share(value: float) -> str:
    percent = value * 100
    return "0" if not value else f"{percent:.0f}%" if percent >= 10 else f"{percent:.2g}%"


def render(rule: dict[str, Any]) -> str:
    steady = rule["steady"]
    loads = sorted({row["load"] for row in steady})
    by = {(row["images"], row["load"]): row for row in steady}
    images = sorted({row["images"] for row in steady})
    headers = [
        "load offered",
        *(f"{n} image{'s' if n > 1 else ''} a request: no headroom / overload" for n in images),
    ]
    rows = [
        (
            f"{load:g}x",
            *(f"{_share(by[n, load]['no_headroom'])} / {_share(by[n, load]['overload'])}" for n in images),
        )
        for load in loads
    ]
    rises = ", ".join(
        f"to {r['to']:g}x at its arrival {r['arrival']}" if r["arrival"] else f"to {r['to']:g}x not at all"
        for r in rule["rise"]
    )
    config = rule["config"]
    return "\n".join(
        [
            f"Poisson requests at each load of what the engine serves ({config['arrivals']} jobs a load,"
            " every job alike), each read at an arrival's instant (the earliest an engine step can read it; a"
            f" step later reads a lower load), once the window of {config['window']} arrivals is full: the"
            " share of requests at whose arrival it reads no headroom (the deadline rule may degrade) and an"
            " overload shown (the load's cut acts). The rule's statistics on a simulated clock, not a"
            " measurement of serving.",
            "",
            table(headers, rows),
            "",
            f"After a full window at {rule['rise'][0]['from']:g}x, evenly spaced, a rise reads no headroom:"
            f" {rises}.",
        ]
    )

"""Old code against new, side by side (issue 40's engine-boundary change): the engine's own work per step
(scripts/engine_step_cost.py) and the in-process engine benchmark's ratios (scripts/compare_trees.py)."""

from __future__ import annotations

from statistics import median
from typing import Any

from verdicts import verdict

from tables.markdown import number, table


def _reads(values: list[float]) -> str:
    """New over old by the one verdict rule (scripts/verdicts.py): higher or lower where the rounds' 90%
    interval lies on one side of 1."""
    found = verdict(values, higher_is_better=None)
    word = {"above 1": "higher", "below 1": "lower"}.get(found.word, found.word)
    return f"{word} ({found.interval})"


def step_cost(artefact: dict[str, Any]) -> str:
    """Microseconds per engine step, each round's old and new run and their ratio."""
    rounds = artefact["rounds"]
    rows = [
        (i, " then ".join(r["order"]), number(r["old"]), number(r["new"]), f"{r['new_over_old']:.2f}")
        for i, r in enumerate(rounds)
    ]
    ratios = [r["new_over_old"] for r in rounds]
    config = artefact["config"]
    lines = [
        table(("round", "order", "old us/step", "new us/step", "new / old"), rows),
        "",
        f"Old = `{config.get('old_commit') or 'the tree before'}`; {config['jobs']} jobs held, "
        f"{config['per_forward']} per forward, {config['steps']} steps each, {config['engine_steps']} engine "
        f"steps a run. New over old, median of {len(ratios)} rounds: **{median(ratios):.2f}: "
        f"{_reads(ratios)}**.",
    ]
    return "\n".join(lines)


def engines(summary: dict[str, Any]) -> str:
    """Each ratio the engine benchmark reports, old tree's rounds beside the new tree's."""
    rows = []
    for label, entry in summary["ratios"].items():
        old, new = entry["old"], entry["new"]
        rows.append(
            (
                label,
                ", ".join(f"{v:.2f}" for v in old),
                ", ".join(f"{v:.2f}" for v in new),
                f"{entry['change']:+.2f}",
                _reads([n / o for n, o in zip(new, old, strict=False) if o]),
            )
        )
    config = summary["config"]
    orders = "; ".join(" then ".join(r) for r in config["rounds"])
    lines = [
        table(("ratio", "old rounds", "new rounds", "median change", "reads"), rows),
        "",
        f"Old = `{config.get('old_commit')}`, each tree's own benchmark script on its own `src/`, "
        f"{len(config['rounds'])} rounds alternated ({orders}); "
        f"arguments `{' '.join(config['bench_args'])}`. Read by the one verdict rule (new / old per "
        "round, the median's 90% sign-test interval against 1; fewer than 5 rounds give none).",
    ]
    return "\n".join(lines)

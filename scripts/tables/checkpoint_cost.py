"""The checkpoint-cost block (scripts/benchmarks/checkpoint_cost.py): an engine step's time at each
checkpoint interval against checkpoints off, with the spread over alternated rounds."""

from __future__ import annotations

from typing import Any

# The target: checkpoints cost at most 2% of an engine step at the interval suggested in the docs.
TARGET = 1.02


def render(artefact: dict[str, Any]) -> str:
    s = artefact["settings"]
    lines = [
        f"{s['arch']} at {s['size']}x{s['size']}, a full running set of {s['running']} jobs of {s['steps']} "
        f"steps (one finished is replaced at once), {s['engine_steps']} engine steps a run after a warm-up, "
        f"{s['rounds']} alternated rounds; the checkpoints written by a real checkpoint store on its own "
        "thread while the engine steps on. Ratio: the mean engine step against the same round's with "
        "checkpoints off (median, min-max over rounds).",
        "",
        "| checkpoint_every_steps | engine step ms | / off (min-max) | bytes a checkpoint | reading |",
        "|---|---|---|---|---|",
    ]
    for row in artefact["summary"]:
        ratio = row["ratio_to_off"]
        if row["interval"] == 0:
            lines.append(f"| off | {row['step_ms_median']:.2f} | 1 | - | |")
            continue
        noise = ratio["min"] <= 1.0 <= ratio["max"]
        reading = "within noise of off" if noise else ("<= 2%" if ratio["median"] <= TARGET else "over 2%")
        lines.append(
            f"| {row['interval']} | {row['step_ms_median']:.2f} | **{ratio['median']:.3f}** "
            f"({ratio['min']:.3f}-{ratio['max']:.3f}) | {row['bytes_per_checkpoint']:.0f} | {reading} |"
        )
    return "\n".join(lines)

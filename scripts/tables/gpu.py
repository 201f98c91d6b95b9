"""Figure blocks of the older GPU artefacts (family invariance, CUDA errors against the classifier)."""

from __future__ import annotations

from typing import Any

from tables.markdown import table


def family_invariance(artefact: dict[str, Any]) -> str:
    """Largest uint8 difference per family and dtype: one image fused among others vs alone, and the step
    engine vs ``pipeline(...)``."""
    rows = [
        [
            r["family"],
            r["dtype"],
            r["fused_vs_alone"],
            "-" if r.get("step_engine_vs_pipeline") is None else r["step_engine_vs_pipeline"],
        ]
        for r in artefact["rows"]
    ]
    return table(("pipeline", "dtype", "fused vs alone (uint8)", "step engine vs pipeline (uint8)"), rows)


def device_errors(artefact: dict[str, Any]) -> str:
    rows = [
        [
            c["case"],
            f"`{c['type']}`",
            "yes" if c["out_of_memory"] else "no",
            "yes" if c["device_lost"] else "no",
        ]
        for c in artefact["cases"]
    ]
    return f"Device: {artefact['device']}, torch {artefact['torch']}.\n\n" + table(
        ("case", "exception", "classified out of memory", "classified device lost"), rows
    )

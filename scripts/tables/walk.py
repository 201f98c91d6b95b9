"""The measured walk of one request through the package (scripts/request_walk.py)."""

from __future__ import annotations

from typing import Any

from tables.markdown import table

# Triton's and the model's thread names, as a reader knows them.
THREADS = {"MainThread": "execute()", "step-engine": "engine", "responses": "responses"}


def render(walk: dict[str, Any]) -> str:
    rows = [
        (THREADS.get(thread, thread), ", ".join(module.removesuffix(".py") for module in modules))
        for thread, modules in walk["threads"].items()
    ]
    layers = " > ".join(walk["layers"])
    upward = walk["upward"]
    crossings = "no call from a lower layer into a higher one" if not upward else f"calls back up: {upward}"
    contracts = ", ".join(f"`{call}`" for call in walk.get("through_contracts", [])) or "none"
    return "\n".join(
        [
            table(("thread", "modules, in order of first call"), rows),
            "",
            f"{walk['modules']} modules in all, and {crossings} outside its own contracts (layers in import"
            f" order: {layers}). Calls into a higher layer through a contract the lower one declares (a"
            f" Protocol, or its base class's hook): {contracts}.",
        ]
    )

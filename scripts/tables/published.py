"""The published quality block (scripts/published_quality.py): a published table's rows, as the source
writes them (no number here is read or rounded: each row is the source's line)."""

from __future__ import annotations

from typing import Any


def render(artefact: dict[str, Any]) -> str:
    source = artefact["source"]
    lines = [
        f"From [{source['repo']}: `{source['path']}`]({source['url']}) at `{source['commit'][:7]}` "
        f"({source['setup']}); each row as the source writes it.",
        "",
    ]
    for table in artefact["tables"]:
        columns = table["header"].count("|") - 1
        lines += [f"{table['caption']}:", "", table["header"], "|" + " --- |" * columns, *table["rows"], ""]
    return "\n".join(lines)

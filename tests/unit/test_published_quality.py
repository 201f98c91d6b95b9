"""The published quality block (scripts/published_quality.py, scripts/tables/published.py): rows are taken
from the source's table by their first cell, character for character, and rendered as they are."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import published_quality  # noqa: E402
from tables.published import render  # noqa: E402

SOURCE = """# Bench

## Section A

| Config | X |
| --- | --- |
| first table | 1 |

| Method | Score(↑) |
| --- | --- |
| [**M**]: 50 steps | 0.9898 |
| skipped | 0.5 |
| kept(N=4) |  0.9857  |

### Section B

| Config | PSNR |
| --- | --- |
| Baseline | - |
| F1 | 33.9639 |

## Section C
| Config | PSNR |
| --- | --- |
| F1 | 99 |
"""

TABLES = (
    {"heading": "## Section A", "index": 1, "caption": "a", "rows": ("[**M**]: 50 steps", "kept(N=4)")},
    {"heading": "### Section B", "index": 0, "caption": "b", "rows": ("Baseline", "F1")},
)


def test_rows_are_the_source_lines_of_the_table_named(monkeypatch):
    monkeypatch.setattr(published_quality, "TABLES", TABLES)
    first, second = published_quality.quote(SOURCE)
    assert first["header"] == "| Method | Score(↑) |"
    assert first["rows"] == ["| [**M**]: 50 steps | 0.9898 |", "| kept(N=4) |  0.9857  |"]  # as written
    assert second["rows"] == ["| Baseline | - |", "| F1 | 33.9639 |"]  # section B's, not section C's


def test_a_row_the_source_no_longer_has_stops_the_take(monkeypatch):
    monkeypatch.setattr(published_quality, "TABLES", ({**TABLES[1], "rows": ("F2",)},))
    with pytest.raises(SystemExit, match="F2"):
        published_quality.quote(SOURCE)


def test_the_block_shows_each_row_unchanged(monkeypatch):
    monkeypatch.setattr(published_quality, "TABLES", TABLES)
    artefact = {
        "source": {"repo": "o/r", "path": "p.md", "url": "u", "commit": "f" * 40, "setup": "s"},
        "tables": published_quality.quote(SOURCE),
    }
    lines = render(artefact).splitlines()
    assert "| kept(N=4) |  0.9857  |" in lines and "| F1 | 33.9639 |" in lines
    assert lines[lines.index("| Method | Score(↑) |") + 1] == "| --- | --- |"

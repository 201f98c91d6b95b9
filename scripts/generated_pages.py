"""The markdown pages that hold generated blocks (README.md and docs/), and rewriting them in place or
checking them (``--check``: a unified diff and the stale pages). scripts/figures.py writes its figures and
scripts/update_reference.py its reference tables through this."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = ("README.md", "docs")


def markdown_files(roots: Iterable[str] = MARKDOWN) -> list[Path]:
    files: list[Path] = []
    for root in roots:
        path = REPO_ROOT / root
        files.extend(sorted(path.rglob("*.md")) if path.is_dir() else [path])
    return files


def rewrite_pages(
    files: Iterable[Path], rewrite: Callable[[Path, str], str], check: bool, tool: str
) -> list[str]:
    """Each page's text through ``rewrite(path, text)``: written back, or with ``check`` only compared (the
    first lines of each difference printed). Returns the pages that differed."""
    stale = []
    for path in files:
        text = path.read_text()
        new = rewrite(path, text)
        if new == text:
            continue
        relative = path.relative_to(REPO_ROOT)
        if check:
            stale.append(str(relative))
            diff = difflib.unified_diff(text.splitlines(), new.splitlines(), str(relative), tool, n=1)
            sys.stdout.writelines(line + "\n" for line in list(diff)[:40])
        else:
            path.write_text(new)
            print(f"{tool}: rewrote {relative}")
    return stale

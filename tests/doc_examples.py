"""The runnable code examples of README.md and docs/: a fenced ``bash`` or ``python`` block right after a
``<!-- runnable -->`` comment on a line of its own. The comment may say what the example needs and does::

    <!-- runnable: needs out/0_7.png writes edited.png -->   # input files it reads; the files it writes
    <!-- runnable: streams -->                               # it prints server-sent events

tests/integration/test_doc_examples.py runs each against the tiny server; tests/unit/test_docs.py checks
that each parses. Examples address the server as ``localhost:8001`` (gRPC), ``localhost:8000`` (HTTP) and
``localhost:9000`` (the OpenAI front), which the test points at its own server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- runnable(?::(?P<spec>[^>]*?))? -->$", re.M)  # on a line of its own
FENCE = re.compile(r"```(?P<language>\w+)\n(?P<code>.*?)\n```", re.S)
ADDRESSES = {"localhost:8001": "grpc", "localhost:8000": "http", "localhost:9000": "openai"}
WORDS = ("needs", "writes", "streams")


@dataclass(frozen=True)
class Example:
    path: Path
    line: int
    language: str  # "bash" or "python"
    code: str
    needs: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    streams: bool = False

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"

    @property
    def addresses(self) -> set[str]:
        return {ADDRESSES[address] for address in ADDRESSES if address in self.code}


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parse_spec(spec: str) -> dict[str, object]:
    """``needs A B writes C streams`` -> {"needs": ("A", "B"), "writes": ("C",), "streams": True}."""
    found: dict[str, list[str]] = {}
    current = None
    for word in spec.split():
        if word in WORDS:
            current = word
            found.setdefault(word, [])
        elif current in ("needs", "writes"):
            found[current].append(word)
        else:
            raise ValueError(f"runnable: {word!r} is not one of {', '.join(WORDS)} or a file after one")
    return {
        "needs": tuple(found.get("needs", ())),
        "writes": tuple(found.get("writes", ())),
        "streams": "streams" in found,
    }


def examples(paths: list[Path] | None = None) -> list[Example]:
    """Every runnable example, in file order. A marker not followed by a bash or python fence is an error."""
    found = []
    for path in paths or markdown_files():
        text = path.read_text()
        for marker in MARKER.finditer(text):
            fence = FENCE.match(text, marker.end() + 1)
            line = text.count("\n", 0, marker.start()) + 1
            if fence is None or fence.group("language") not in ("bash", "python"):
                raise ValueError(f"{path}:{line}: a runnable marker must precede a bash or python block")
            spec = parse_spec(marker.group("spec") or "")
            found.append(Example(path, line, fence.group("language"), fence.group("code"), **spec))
    return found

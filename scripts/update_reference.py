"""Write the generated reference tables of docs/ from the declarations they describe.

A table lives between two markers in a markdown file under docs/ (or README.md)::

    <!-- NAME -->
    ...written by this script...
    <!-- /NAME -->

``NAME`` is one of :data:`TABLES`:

- ``fields:MODEL``: a model kind's request fields (fields.py declarations: type, default, limits, role);
- ``config``: the config.pbtxt parameters (settings.py: type, default or its derivation, aliases);
- ``metrics``: the metric families the models export (serving/metrics.py: name, type, meaning), their
  labels as the code records them, and the supervisor's (serving/supervisor.py);
- ``errors``: the error codes a request can be answered with (errors.py) and what the OpenAI front turns
  each into (openai_front/errors.py);
- ``layout``: every module of the package with its docstring's first sentence (docs/contributing.md).

    python scripts/update_reference.py           # rewrite every table in place
    python scripts/update_reference.py --check   # exit 1 when a table differs from what it would write

The unit tests run the check (tests/unit/test_docs.py): a declaration changed without regenerating, or a
table edited by hand, fails them.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from generated_pages import REPO_ROOT, markdown_files, rewrite_pages  # noqa: E402

PACKAGE = REPO_ROOT / "src" / "triton_diffusion"
MARKER = re.compile(r"(<!-- (?P<name>[\w:]+) -->\n)(?P<body>.*?)(<!-- /(?P=name) -->)", re.S)


def _escape(table: str, columns: int) -> str:
    """A generated table with every ``|`` inside a cell escaped (``largest |scale|``), so the row keeps its
    columns in any markdown renderer. Cells are separated by `` | ``."""
    lines = table.splitlines()
    out = lines[:2]
    for line in lines[2:]:
        cells = line.strip().removeprefix("| ").removesuffix(" |").split(" | ", columns - 1)
        out.append("| " + " | ".join(re.sub(r"(?<!\\)\|", r"\\|", cell) for cell in cells) + " |")
    return "\n".join(out)


def fields_table(model: str) -> Callable[[], str]:
    def render() -> str:
        from triton_diffusion.models.interfaces import INTERFACES

        # The reference names the LM's page by its model (diffusion_lm), MODEL_INFO by its kind.
        kind = "text_generation" if model == "diffusion_lm" else model
        return _escape(INTERFACES[kind].fields.markdown_table(), 6)

    return render


def config_table() -> str:
    from triton_diffusion.config_reference import parameters_markdown

    return _escape(parameters_markdown(), 5)


# ---- metrics ----------------------------------------------------------------------------------------


def recorded_labels() -> dict[str, set[str]]:
    """Metric name -> the labels the code records it with (besides ``model``), read from every
    ``metrics.increment/observe/set(NAME, ..., label=...)`` call in the package. ``NAME`` is a string or
    an attribute of the model kind's :class:`MetricNames` (``names.cancelled``), which stands for that
    attribute of every kind's names."""
    from triton_diffusion.serving.metrics import DIFFUSION_LM_METRICS, IMAGE_METRICS

    labels: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("increment", "observe", "set")
                and node.args
            ):
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names = [first.value]
            elif isinstance(first, ast.Attribute) and isinstance(first.value, (ast.Name, ast.Attribute)):
                owner = first.value.id if isinstance(first.value, ast.Name) else first.value.attr
                if owner != "names":
                    continue
                names = [getattr(kind, first.attr) for kind in (IMAGE_METRICS, DIFFUSION_LM_METRICS)]
                names = [name for name in names if name]
            else:
                continue
            for name in names:
                if name.startswith("triton_diffusion_"):
                    labels.setdefault(name, set()).update(k.arg for k in node.keywords if k.arg)
    return labels


def supervisor_families() -> list[tuple[str, str, list[str], str]]:
    """The supervisor's metrics (port 8003), as its ``metrics_text`` writes them: name, type, labels,
    meaning."""
    source = (PACKAGE / "serving" / "supervisor.py").read_text()
    families = []
    for name, text in re.findall(r'"# HELP (triton_diffusion_\w+) ([^"]*)"', source):
        kind = re.search(rf'"# TYPE {name} (\w+)"', source)
        labels = re.search(rf"{name}\{{\{{(.*?)\}}\}}", source)
        label_names = re.findall(r"(\w+)=", labels.group(1)) if labels else []
        meaning = re.sub(r"\s*\([^)]*\)$", "", text) if label_names else text
        families.append((name, kind.group(1) if kind else "?", label_names, meaning))
    return families


def metrics_table() -> str:
    from triton_diffusion.serving.metrics import DIFFUSION_LM_FAMILIES, FAMILIES

    labels = recorded_labels()
    rows = []
    for name in dict.fromkeys([*FAMILIES, *DIFFUSION_LM_FAMILIES]):
        kind, text = FAMILIES.get(name) or DIFFUSION_LM_FAMILIES[name]
        models = (
            "all"
            if name in FAMILIES and name in DIFFUSION_LM_FAMILIES
            else ("image and video" if name in FAMILIES else "diffusion_lm")
        )
        label_text = ", ".join(f"`{label}`" for label in ["model", *sorted(labels.get(name, ()))])
        rows.append(f"| `{name}` | {kind.lower()} | {label_text} | {models} | {text} |")
    for name, kind, label_names, text in supervisor_families():
        label_text = ", ".join(f"`{label}`" for label in label_names) or "-"
        rows.append(f"| `{name}` | {kind} | {label_text} | the supervisor (port 8003) | {text} |")
    head = ["| metric | type | labels | models | meaning |", "|---|---|---|---|---|"]
    return _escape("\n".join(head + rows), 5)


# ---- error codes ------------------------------------------------------------------------------------


def error_meanings() -> dict[str, str]:
    """Each code's meaning, from ErrorCode's docstring (``CODE: meaning`` lines)."""
    from triton_diffusion.errors import ErrorCode

    meanings: dict[str, str] = {}
    current = None
    for line in (ErrorCode.__doc__ or "").splitlines():
        found = re.match(r"\s*([A-Z_]+): (.*)", line)
        if found and found.group(1) in ErrorCode.__members__:
            current = found.group(1)
            meanings[current] = found.group(2).strip()
        elif current and line.strip():
            meanings[current] += " " + line.strip()
        else:
            current = None
    return meanings


def errors_table() -> str:
    from triton_diffusion.errors import ErrorCode
    from triton_diffusion.openai_front.errors import from_triton_message

    meanings = error_meanings()
    missing = [code.value for code in ErrorCode if code.value not in meanings]
    if missing:
        raise SystemExit(f"update_reference: ErrorCode's docstring says nothing of {', '.join(missing)}")
    rows = []
    for code in ErrorCode:
        answer = from_triton_message(f"width: an example [{code.value}]", {"width"})
        rows.append(
            f"| `{code.value}` | {meanings[code.value]} | {answer.status} `{answer.code}` "
            f'| `triton_diffusion_requests_failed_total{{code="{code.value}"}}` |'
        )
    head = [
        "| code | meaning | OpenAI front: HTTP status and `code` | counted in |",
        "|---|---|---|---|",
    ]
    return _escape("\n".join(head + rows), 4)


# A module's summary: its docstring's first sentence, cut at a word boundary past this many characters.
SUMMARY_CHARS = 180


def summary(docstring: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line (cut at ``SUMMARY_CHARS``)."""
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    sentence = re.match(r"(.+?\.)(\s|$)", paragraph)
    text = sentence.group(1) if sentence else paragraph
    if len(text) > SUMMARY_CHARS:
        text = text[:SUMMARY_CHARS].rsplit(" ", 1)[0] + " …"
    return text


def layout_table() -> str:
    """Every module of the package with its docstring's first sentence, folder by folder: the layout that
    cannot drift from the code (a module without a docstring stops the script)."""
    rows = ["| module | what it is |", "|---|---|"]
    for path in sorted(PACKAGE.rglob("*.py"), key=lambda p: (len(p.relative_to(PACKAGE).parts) > 1, p)):
        if path.name == "__init__.py":
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text()))
        if not docstring:
            raise SystemExit(f"update_reference: {path.relative_to(REPO_ROOT)} has no module docstring")
        rows.append(f"| `{path.relative_to(PACKAGE).as_posix()}` | {summary(docstring)} |")
    return _escape("\n".join(rows), 2)


MODELS = ("text_to_image", "image_to_image", "text_to_video", "diffusion_lm")
TABLES: dict[str, Callable[[], str]] = {
    **{f"fields:{model}": fields_table(model) for model in MODELS},
    "config": config_table,
    "metrics": metrics_table,
    "errors": errors_table,
    "layout": layout_table,
}


def rewrite(text: str, used: set[str]) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in TABLES:
            return match.group(0)  # another script's marker (figures) or a plain comment
        used.add(name)
        return f"{match.group(1)}{TABLES[name]()}\n{match.group(4)}"

    return MARKER.sub(replace, text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a table is not what it would write")
    args = parser.parse_args(argv)
    stale, used = [], set()
    stale += rewrite_pages(
        markdown_files(), lambda path, text: rewrite(text, used), args.check, "update_reference"
    )
    unused = sorted(set(TABLES) - used)
    if unused:
        print(f"update_reference: tables shown nowhere: {', '.join(unused)}", file=sys.stderr)
        return 1
    if stale:
        print(f"update_reference: stale tables in {', '.join(stale)}: run scripts/update_reference.py")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

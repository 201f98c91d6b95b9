"""README.md and the documentation site (docs/, mkdocs.yml): the generated reference tables are what the
declarations generate, the README is a front page whose every relative link and anchor resolves, the site
builds with ``mkdocs build --strict`` (every page in the navigation, every link and anchor resolving),
and every example marked runnable parses (tests/integration/test_doc_examples.py runs them)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_examples import examples, parse_spec

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SCRIPT = ROOT / "scripts" / "update_reference.py"


def reference_module():
    spec = importlib.util.spec_from_file_location("update_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def section(text: str, name: str) -> str:
    start = text.index(f"<!-- {name} -->") + len(f"<!-- {name} -->")
    return text[start : text.index(f"<!-- /{name} -->")].strip()


# ---- the generated reference ------------------------------------------------------------------------


def test_every_reference_table_is_the_generated_one():
    reference = reference_module()
    pages = {path: path.read_text() for path in reference.markdown_files()}
    for name, render in reference.TABLES.items():
        shown = [text for text in pages.values() if f"<!-- {name} -->" in text]
        assert len(shown) == 1, f"{name} is shown {len(shown)} times"
        assert section(shown[0], name) == render(), f"{name}: run scripts/update_reference.py"
    assert reference.main(["--check"]) == 0


def test_the_check_fails_when_a_declaration_changes_without_regenerating(monkeypatch):
    reference = reference_module()
    text = (DOCS / "reference" / "metrics.md").read_text()
    used: set[str] = set()
    assert reference.rewrite(text, used) == text
    table = reference.metrics_table()
    monkeypatch.setitem(reference.TABLES, "metrics", lambda: table.replace("histogram", "gauge", 1))
    assert reference.rewrite(text, used) != text


def test_the_reference_pages_say_where_they_come_from_and_cover_every_declaration():
    from triton_diffusion.errors import ErrorCode
    from triton_diffusion.serving.metrics import DIFFUSION_LM_FAMILIES, FAMILIES

    metrics = (DOCS / "reference" / "metrics.md").read_text()
    for name in [*FAMILIES, *DIFFUSION_LM_FAMILIES, "triton_diffusion_server_restarts_total"]:
        assert f"| `{name}` |" in metrics, name
    errors = (DOCS / "reference" / "errors.md").read_text()
    for code in ErrorCode:
        assert f"| `{code.value}` |" in errors, code
    for page in ("fields.md", "config.md", "metrics.md", "errors.md"):
        assert "scripts/update_reference.py" in (DOCS / "reference" / page).read_text(), page


def test_metric_labels_are_read_from_the_code_that_records_them():
    labels = reference_module().recorded_labels()
    assert labels["triton_diffusion_groups_cut_total"] == {"reason"}
    assert labels["triton_diffusion_requests_failed_total"] == {"code"}
    assert labels["triton_diffusion_cache_rows_total"] == {"method", "outcome"}  # through MetricNames
    assert labels["triton_diffusion_tier_latency_seconds"] == {"tier"}
    assert labels["triton_diffusion_forward_cost_seconds"] == {"fit", "part"}


def test_a_pipe_inside_a_cell_is_escaped_so_the_row_keeps_its_columns():
    escape = reference_module()._escape
    table = "| a | b |\n|---|---|\n| `x` | largest |scale| here |"
    assert escape(table, 2).splitlines()[2] == r"| `x` | largest \|scale\| here |"


# ---- README: a front page ---------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs' toc both write it for the headings used here."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return re.sub(r"\s", "-", text)


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def test_the_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    for needed in ("scripts/serve.sh", "scripts/test.sh", "tritonclient", "triton_diffusion_client"):
        assert needed in text, needed
    assert "from openai import OpenAI" in text
    assert "| `text_to_image` |" in text  # the shipped models
    assert "<!-- figures:" not in text and "<!-- fields:" not in text  # numbers and tables live in docs/


def test_every_relative_link_of_the_readme_resolves_with_its_anchor():
    links = LINK.findall(README.read_text())
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = (README.parent / target) if target else README
        assert path.exists(), link
        if anchor:
            assert anchor in anchors(path), link


# ---- the site -------------------------------------------------------------------------------------


def test_the_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.skip("mkdocs is not installed here (it is in the test extra: pip install -e .[test])")
    result = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site"), "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "metrics" / "index.html").is_file()


def test_every_page_is_in_the_navigation():
    yaml = pytest.importorskip("yaml")

    def pages(nav) -> set[str]:
        found = set()
        for item in nav:
            values = item.values() if isinstance(item, dict) else [item]
            for value in values:
                found |= pages(value) if isinstance(value, list) else {value}
        return found

    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.SafeLoader)
    listed = pages(config["nav"])
    written = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    reports = {p for p in written if re.search(r"(^|/)(bench[^/]*|dllm_bench|family[^/]*|summary)\.md$", p)}
    assert listed == written - reports


# ---- runnable examples ------------------------------------------------------------------------------


def test_every_runnable_example_parses_and_names_its_server():
    found = examples()
    pages = {README, DOCS / "usage" / "client.md", DOCS / "usage" / "openai-front.md"}
    assert {e.path for e in found} >= pages
    assert {e.language for e in found if e.path == README} == {"python"}
    for example in found:
        assert example.addresses, f"{example.name} talks to no server"
        assert not re.search(r"localhost:(?!800[01]\b|9000\b)\d+", example.code), example.name
        if example.language == "python":
            ast.parse(example.code, example.name)
        else:
            check = subprocess.run(["bash", "-n"], input=example.code, capture_output=True, text=True)
            assert check.returncode == 0, f"{example.name}: {check.stderr}"


def test_the_runnable_marker_says_what_an_example_needs_and_writes():
    assert parse_spec("") == {"needs": (), "writes": (), "streams": False}
    assert parse_spec("needs a.png writes b.png c.mp4 streams") == {
        "needs": ("a.png",),
        "writes": ("b.png", "c.mp4"),
        "streams": True,
    }
    with pytest.raises(ValueError):
        parse_spec("makes b.png")


def test_a_runnable_marker_without_its_block_is_an_error(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- runnable -->\n```\nplain\n```\n")
    with pytest.raises(ValueError):
        examples([page])


def test_the_layout_lists_every_module_by_its_docstrings_first_sentence(tmp_path, monkeypatch):
    reference = reference_module()
    assert reference.summary("One thing.\nMore of it. And more.\n\nLater.") == "One thing."
    assert reference.summary("No full stop\nat all") == "No full stop at all"
    long = "word " * 60 + "end."
    cut = reference.summary(long)
    assert cut.endswith(" …") and len(cut) <= reference.SUMMARY_CHARS + 2
    table = reference.layout_table()
    modules = [p for p in reference.PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    assert len(table.splitlines()) == 2 + len(modules)  # every module, once
    assert "| `engine/scheduler.py` | The step engine's scheduler:" in table
    (tmp_path / "bare.py").write_text("x = 1\n")
    monkeypatch.setattr(reference, "PACKAGE", tmp_path)
    monkeypatch.setattr(reference, "REPO_ROOT", tmp_path)
    with pytest.raises(SystemExit, match="bare.py has no module docstring"):
        reference.layout_table()

"""scripts/figures.py: every figure block of the docs is what the committed artefacts render to, every
artefact says where it came from, and the performance pages show the CPU's and the GPU's apart, each
block with its provenance and, when stale, why."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import figures  # noqa: E402
from tables.markdown import reading, target_met  # noqa: E402

# Figures shown on the page they illustrate rather than the performance pages.
PAGE_FIGURES = {
    "request-walk": "docs/design/engine.md",
    "headroom-rule": "docs/design/degradation.md",
    "model-reload": "docs/operations/reliability.md",
    "restart-times": "docs/operations/reliability.md",
    "checkpoint-cost-line": "docs/operations/crash-recovery.md",
    "headline": "docs/performance/index.md",
    "published-flux-quality": "docs/usage/degradation.md",
}


def test_every_block_in_readme_and_docs_is_what_its_artefacts_render_to():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "figures.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "blocks shown nowhere" not in result.stdout, result.stdout


def test_check_fails_when_a_block_was_edited_by_hand(tmp_path, monkeypatch):
    page = ROOT / "docs" / "performance" / "cpu.md"
    text = page.read_text()
    name = "server-engines"
    start = text.index(f"<!-- figures: {name} -->")
    edited = text[:start] + text[start:].replace("| **", "| **9", 1)
    assert edited != text
    used: set[str] = set()
    assert figures.rewrite(edited, page.parent, used) == figures.rewrite(text, page.parent, used) != edited


def test_the_cpu_and_the_gpu_figures_are_on_pages_of_their_own():
    shown = figures.shown_on(figures.markdown_files())
    for name, block in figures.BLOCKS.items():
        pages = {page.relative_to(ROOT).as_posix() for page in shown.get(name, [])}
        assert pages, f"{name} is shown nowhere"
        if block.gpu:
            assert pages == {"docs/performance/gpu.md"}, name
        elif name in PAGE_FIGURES:  # a design or operations figure, on the page it illustrates
            assert pages == {PAGE_FIGURES[name]}, name
        else:
            assert pages == {"docs/performance/cpu.md"}, name


def test_the_index_names_every_block_its_page_provenance_and_state():
    page = ROOT / "docs" / "performance" / "index.md"
    index = figures.render_index(page.parent, figures.shown_on(figures.markdown_files()))
    cpu, gpu = index.split("**GPU**")
    for name, block in figures.BLOCKS.items():
        row = next(
            line for line in (gpu if block.gpu else cpu).splitlines() if line.startswith(f"| `{name}` |")
        )
        artefact = json.loads((ROOT / block.artefacts[0]).read_text())
        date, commit, _ = figures.provenance(artefact)
        assert date in row and commit in row, name
        # Stale when the block says so, or when a stale block reads the same artefact (the headline's rows).
        shared = any(b.stale and block.artefacts[0] in b.artefacts for b in figures.BLOCKS.values())
        assert ("stale: " in row) == bool(block.stale or shared), name


def test_a_stale_block_says_so_first_and_links_its_artefact_from_its_page():
    page = ROOT / "docs" / "performance" / "gpu.md"
    body = figures.render_block("gpu-engines-sd15", page.parent)
    assert body.startswith("**Stale:** ")
    assert "[`docs/gpu/bench_engines_sd15.json`](../gpu/bench_engines_sd15.json)" in body
    assert (page.parent / "../gpu/bench_engines_sd15.json").resolve().is_file()


@pytest.mark.parametrize("name", list(figures.BLOCKS))
def test_every_artefact_records_command_commit_date_and_machine(name):
    for path in figures.BLOCKS[name].artefacts:
        source = json.loads((ROOT / path).read_text())["provenance"]
        assert source["command"] and source["commit"] and source["date"], path
        assert source["machine"], path
        if not source.get("backfilled"):  # written by scripts/artefacts.py
            assert {"cpu", "cores", "gpu"} <= set(source["machine"]), path
            assert "torch" in source["versions"], path


def test_a_block_names_its_artefact_commit_and_command():
    body = figures.render_block("graphs-cpu", ROOT)
    source = json.loads((ROOT / "docs/cpu/bench_graphs.json").read_text())["provenance"]
    assert source["commit"][:7] in body and source["command"] in body


def test_a_figure_reads_by_the_one_verdict_rule():
    # No rounds kept: no verdict, however close to or far from its target the one value lies.
    assert reading(1.08, ">= 1.0") == "one run: no verdict"
    assert reading(2.5, "-") == "-"
    # Rounds on both sides of the target: not shown, never met or missed.
    rounds = [0.67, 0.84, 1.05, 0.81, 0.9]
    assert reading(0.84, ">= 0.8", rounds) == "not shown (90% interval 0.67-1.05)"
    assert reading(0.84, ">= 0.6", rounds).startswith("met")
    assert reading(2.6, ">= 1.5", [2.3, 3.0, 2.6, 2.5, 2.7]).startswith("met")
    # Without a target, a ratio is compared with 1.
    assert reading(0.9, "-", rounds) == "no gain or loss shown (90% interval 0.67-1.05)"
    assert target_met(0.4, "<= 0.3") is False and target_met(1.0, "-") is None


def test_a_plot_that_lags_its_artefact_fails_the_check(tmp_path, monkeypatch):
    """Each plot's PNG carries the digest of the data it was drawn from: a changed artefact makes --check
    name the plot (the pixels are never compared: they differ between matplotlib versions)."""
    import plots

    assert plots.write_all(check=True) == []  # the committed plots are current
    name, (paths, build) = next(iter(plots.PLOTS.items()))
    changed = {"arch": "other", "size": 1, "runs": []}
    monkeypatch.setitem(plots.PLOTS, name, (paths, lambda *_: build(changed)))
    assert plots.write_all(check=True) == [f"docs/performance/plots/{name}.png"]


def test_an_engine_plot_draws_each_loads_rounds_as_their_median_and_range():
    import plots

    runs = [
        {"engine": "step", "traffic": "poisson80", "latency_mean_s": mean, "latency_p95_s": 2 * mean}
        for mean in (0.6, 0.1, 0.2)
    ]
    runs.append({"engine": "step", "traffic": "poisson50", "latency_mean_s": 0.05, "latency_p95_s": 0.1})
    runs.append({"engine": "step-eager", "traffic": "poisson50", "latency_mean_s": 9.0, "latency_p95_s": 9.0})
    series = plots.latency_vs_load({"runs": runs})["series"]
    assert set(series) == {"step mean", "step p95"}  # the served engines only
    assert series["step mean"] == {
        "x": [50, 80],
        "median": [0.05, 0.2],
        "low": [0.05, 0.1],
        "high": [0.05, 0.6],
    }
    assert series["step p95"]["median"] == [0.1, 0.4]  # the median round's, not their mean

"""scripts/benchmarks/ stays one small package without an import circle, and no module we ship grows past
600 lines.

What it catches, from the imports each module's source states (``ast``, nothing imported):
  - a benchmark module (one of ``BENCHMARKS``, run by ``scripts/bench.py NAME``) importing another
    benchmark module: the circle bench_engines.py / bench_caches.py / bench_slo.py once made, where each
    imported the others' parts (``from bench_engines import Bench``) and dispatched into them;
  - a shared module (any other module of the package) importing a benchmark module, and any cycle among
    the package's modules;
  - a Python file under scripts/, src/, client/src/ or model_repository/ over 600 lines;
  - a benchmark without its module and ``main``, or an old script that no longer runs its benchmark.

The checker itself is run on a made-up package with each fault, so a checker that finds nothing fails too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
PACKAGE = SCRIPTS / "benchmarks"
MAX_LINES = 600

sys.path.insert(0, str(SCRIPTS))

from benchmarks import BENCHMARKS, DEFAULT  # noqa: E402 (the package's __init__ imports no benchmark)


def package_imports(folder: Path) -> dict[str, set[str]]:
    """Each module of the package in ``folder`` -> the modules of the same package its source imports
    (``from benchmarks.x import``, ``import benchmarks.x``, ``from benchmarks import x``, relative forms),
    wherever the import statement is (a function's body counts as well)."""
    package = folder.name
    modules = {path.stem for path in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == package and len(parts) > 1:
                        found.add(parts[1])
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from .x import y, from . import x
                    base = (node.module or "").split(".")[0]
                elif node.module and node.module.split(".")[0] == package:
                    base = node.module.split(".")[1] if "." in node.module else ""
                else:
                    continue
                if base:
                    found.add(base)
                else:  # from benchmarks import x: x is a module where one of that name exists
                    found |= {alias.name for alias in node.names if alias.name in modules}
        found.discard(path.stem)
        graph[path.stem] = found & modules
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def faults(graph: dict[str, set[str]], benchmarks: set[str]) -> list[str]:
    """What breaks the package's shape: a benchmark importing a benchmark, a shared module importing a
    benchmark, a cycle."""
    out = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported & benchmarks):
            kind = "benchmark" if module in benchmarks else "shared module"
            out.append(f"{kind} {module} imports benchmark {other}")
    if found := cycle(graph):
        out.append("import cycle: " + " -> ".join(found))
    return out


def long_files(root: Path, limit: int = MAX_LINES) -> list[str]:
    return [
        f"{path.relative_to(root)}: {lines} lines"
        for path in sorted(root.rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > limit
    ]


def test_no_benchmark_imports_another_and_the_package_has_no_import_cycle():
    graph = package_imports(PACKAGE)
    assert set(BENCHMARKS) <= set(graph), "every benchmark has its module"
    assert faults(graph, set(BENCHMARKS)) == []
    shared = set(graph) - set(BENCHMARKS) - {"__init__"}
    assert {"common", "arrivals", "reports", "inprocess"} <= shared  # what the benchmarks share
    assert graph["__init__"] == set(), "the dispatcher loads benchmarks by name, never at import"


def test_no_python_file_we_ship_is_over_600_lines():
    # One module per concern, none over 600 lines (docs/contributing.md): the package, its scripts, the
    # client and the model repository's thin model.py files.
    root = SCRIPTS.parent
    for tree in (SCRIPTS, root / "src", root / "client" / "src", root / "model_repository"):
        assert any(tree.rglob("*.py")), tree  # a folder renamed away would pass unnoticed
        assert long_files(tree) == [], str(tree.relative_to(root))


def test_each_benchmark_has_a_main_and_each_old_script_runs_it():
    for benchmark in BENCHMARKS.values():
        tree = ast.parse((PACKAGE / f"{benchmark.name}.py").read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), benchmark.name
        if not benchmark.script:  # a benchmark newer than bench.py's NAME: no old script to keep
            continue
        shim = (SCRIPTS / benchmark.script).read_text()
        if benchmark.name == DEFAULT:  # bench.py: the entry point, which runs it without a NAME
            assert "from benchmarks import main" in shim
        else:
            assert f'main(["{benchmark.name}", *sys.argv[1:]])' in shim, benchmark.script
            assert len(shim.splitlines()) <= 15, f"{benchmark.script} is a shim, not a second copy"


def write_package(folder: Path, sources: dict[str, str]) -> Path:
    folder.mkdir()
    for name, source in sources.items():
        (folder / f"{name}.py").write_text(source)
    return folder


def test_the_checker_finds_a_benchmark_importing_another_a_cycle_and_a_long_file(tmp_path):
    bad = write_package(
        tmp_path / "benchmarks",
        {
            "__init__": "",
            "common": "import math\n",
            "helpers": "from benchmarks import engines\n",  # a shared module importing a benchmark
            "engines": "from benchmarks.common import x\n",
            "caches": "def main():\n    from benchmarks.engines import Bench\n",  # inside a function too
            "slo": "from .caches import run\n",  # relative
            "left": "import benchmarks.right\n",
            "right": "from benchmarks import left\n",  # left -> right -> left
        },
    )
    graph = package_imports(bad)
    assert graph["caches"] == {"engines"} and graph["slo"] == {"caches"} and graph["common"] == set()
    found = faults(graph, {"engines", "caches", "slo"})
    assert "benchmark caches imports benchmark engines" in found
    assert "benchmark slo imports benchmark caches" in found
    assert "shared module helpers imports benchmark engines" in found
    assert "import cycle: left -> right -> left" in found
    assert faults({"a": {"b"}, "b": {"c"}, "c": set()}, set()) == []
    (bad / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_files(tmp_path) == [f"benchmarks/long.py: {MAX_LINES + 1} lines"]


OLD_COMMANDS = [
    # (bench.py's argv, the benchmark it runs, that one's argv): the commands docs and artefacts record
    ([], "server", []),
    (
        ["--concurrency", "16", "--openai", "--out", "o"],
        "server",
        ["--concurrency", "16", "--openai", "--out", "o"],
    ),
    (
        ["--slo", "--slo-args", "--requests 200 --rounds 2", "--out", "docs/cpu/slo"],
        "slo_server",
        ["--requests", "200", "--rounds", "2", "--arch", "tiny-sd", "--out", "docs/cpu/slo"],
    ),
    (["server", "--requests", "4"], "server", ["--requests", "4"]),
    (["caches", "--rounds", "3"], "caches", ["--rounds", "3"]),
    (["mixed-sizes", "--rounds", "1"], "mixed_sizes", ["--rounds", "1"]),  # a hyphenated NAME
    # bench_engines.py's switches, as its shim passes them (``engines`` first)
    (["engines", "--loads", ""], "engines", ["--loads", ""]),
    (
        ["engines", "--step-cache", "fbc:0.1", "--arch", "sd15", "--out", "o"],
        "caches",
        ["--variants", "fbc:0.1", "--arch", "sd15", "--out", "o", "--dtype", "auto"],
    ),
    (["engines", "--slo", "--slo-args", "--rounds 3", "--out", "o"], "slo", ["--rounds", "3", "--out", "o"]),
]


@pytest.mark.parametrize(("argv", "name", "runs"), OLD_COMMANDS)
def test_bench_runs_what_the_old_commands_ran(argv, name, runs):
    """No NAME: the through-server benchmark, as bench.py always ran; ``--slo`` and ``--step-cache``: the
    benchmark the old scripts switched to, with the arguments they passed it."""
    from benchmarks import resolve

    assert resolve(argv) == (name, runs)

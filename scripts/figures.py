"""Write every figure of README and docs/ from the committed benchmark artefacts.

A figure lives between two markers in a markdown file::

    <!-- figures: NAME -->
    ...written by this script...
    <!-- /figures -->

``NAME`` is a block of :data:`BLOCKS`: the artefacts it reads (JSON under ``docs/``, each with the
``provenance`` that ``scripts/artefacts.py`` records) and the function that renders them. Every block
ends with the provenance of what it shows (date, commit, machine, command), so a reader sees where each
number came from and how old it is.

    python scripts/figures.py           # rewrite every block in place
    python scripts/figures.py --check   # exit 1 when a block differs from what it would write

The test suite runs ``--check`` (tests/unit/test_figures.py): an artefact changed without regenerating,
or a block edited by hand, fails it. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from artefacts import REPO_ROOT, read  # noqa: E402

MARKDOWN = ("README.md", "docs")
BLOCK = re.compile(r"(<!-- figures: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /figures -->)", re.S)


@dataclass(frozen=True)
class Block:
    """One rendered figure: the artefacts it reads (paths under the repository) and how."""

    artefacts: tuple[str, ...]
    renderer: str  # "module.function" under scripts/tables/
    doc: str = ""

    def render(self, *artefacts: dict[str, Any]) -> str:
        module, function = self.renderer.rsplit(".", 1)
        render: Callable[..., str] = getattr(importlib.import_module(f"tables.{module}"), function)
        return render(*artefacts)


BLOCKS: dict[str, Block] = {
    # the real server (scripts/bench.py)
    "server-engines": Block(("docs/bench.json",), "engines.server_ratios", "bench.py: served engines"),
    "openai-front": Block(
        ("docs/openai_front/bench.json", "docs/openai_front/repeat/bench.json"),
        "engines.openai_front",
        "bench.py --openai: the front against gRPC direct",
    ),
    # in process (scripts/bench_engines.py)
    "engines": Block(("docs/cpu/bench_engines.json",), "engines.in_process_ratios"),
    "request-walk": Block(("docs/design/request_walk.json",), "walk.render", "request_walk.py"),
    "engines-rounds": Block(("docs/cpu/rounds/bench_engines.json",), "engines.ratio_table"),
    "image-mix": Block(("docs/cpu/image_mix/bench_engines.json",), "engines.ratio_table"),
    "graphs-cpu": Block(("docs/cpu/bench_graphs.json",), "engines.graphs"),
    "lora": Block(("docs/cpu/lora/bench_lora.json",), "engines.ratio_table"),
    "dllm": Block(("docs/dllm_bench.json",), "engines.dllm"),
    # step caches, tiers and deadlines
    "caches": Block(("docs/cpu/caches/bench_caches.json",), "caches.render"),
    "slo": Block(("docs/cpu/slo/bench_slo.json",), "slo.render"),
    "slo-server": Block(("docs/cpu/slo/bench_slo_server.json",), "slo.render_server"),
    # GPU: scripts/gpu_checks.py on one H100 (docs/gpu/checks*/)
    "gpu-graphs": Block(("docs/gpu/checks/cuda_graphs/bench_graphs.json",), "engines.graphs"),
    "gpu-engines-graphs": Block(
        ("docs/gpu/checks/engines_graphs/bench_engines.json",), "engines.in_process_ratios"
    ),
    "gpu-engines-eager": Block(("docs/gpu/checks/engines_eager/bench_engines.json",), "engines.ratio_table"),
    "gpu-lora": Block(("docs/gpu/checks/lora/bench_lora.json",), "engines.ratio_table"),
    "gpu-family-now": Block(("docs/gpu/checks/family_invariance/family.json",), "gpu.family_invariance"),
    "gpu-caches": Block(("docs/gpu/checks_step_caches/step_caches/bench_caches.json",), "caches.render"),
    # GPU (older figures, kept with their dates)
    "gpu-engines-sd15": Block(("docs/gpu/bench_engines_sd15.json",), "engines.ratio_table"),
    "gpu-family-invariance": Block(("docs/gpu/family_invariance.json",), "gpu.family_invariance"),
    "gpu-device-errors": Block(("docs/gpu/device_errors.json",), "gpu.device_errors"),
}


def provenance_line(artefact: dict[str, Any], path: str) -> str:
    """Where a block's numbers came from, in one line."""
    source = artefact.get("provenance") or {}
    machine = source.get("machine") or {}
    if isinstance(machine, dict):
        gpu_name = machine.get("gpu")
        where = gpu_name or f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores"
    else:
        where = str(machine)
    commit = str(source.get("commit", "unknown"))
    commit = commit[:7] + ("+dirty" if commit.endswith("+dirty") else "")
    date = str(source.get("date", "unknown"))[:10]
    note = " (provenance from git history)" if source.get("backfilled") else ""
    command = source.get("command", "unknown")
    return f"<sub>[`{path}`]({path}): {date}, commit `{commit}`, {where}{note}: `{command}`</sub>"


def render_block(name: str, relative_to: Path) -> str:
    """The body of block ``name`` for a file in ``relative_to`` (links are relative to the file)."""
    block = BLOCKS[name]
    missing = [p for p in block.artefacts if not (REPO_ROOT / p).is_file()]
    if missing:
        raise SystemExit(f"figures: block {name!r} reads {missing}, which do not exist")
    artefacts = [read(REPO_ROOT / p) for p in block.artefacts]
    body = block.render(*artefacts).rstrip("\n")
    lines = [body, ""]
    for path, artefact in zip(block.artefacts, artefacts, strict=True):
        link = Path(_relative(REPO_ROOT / path, relative_to))
        lines.append(provenance_line(artefact, link.as_posix()))
        lines.append("")
    return "\n".join(lines)


def _relative(target: Path, start: Path) -> str:
    import os

    return os.path.relpath(target, start)


def markdown_files(roots: Sequence[str] = MARKDOWN) -> list[Path]:
    files: list[Path] = []
    for root in roots:
        path = REPO_ROOT / root
        files.extend(sorted(path.rglob("*.md")) if path.is_dir() else [path])
    return files


def rewrite(text: str, relative_to: Path, used: set[str]) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in BLOCKS:
            raise SystemExit(f"figures: unknown block {name!r} (known: {', '.join(BLOCKS)})")
        used.add(name)
        return f"{match.group(1)}{render_block(name, relative_to)}{match.group(4)}"

    return BLOCK.sub(replace, text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a block is not what it would write")
    parser.add_argument("--list", action="store_true", help="list the blocks and their artefacts")
    args = parser.parse_args(argv)
    if args.list:
        for name, block in BLOCKS.items():
            print(f"{name}: {', '.join(block.artefacts)}")
        return 0
    stale = []
    used: set[str] = set()
    for path in markdown_files():
        text = path.read_text()
        new = rewrite(text, path.parent, used)
        if new == text:
            continue
        relative = path.relative_to(REPO_ROOT)
        if args.check:
            stale.append(str(relative))
            diff = difflib.unified_diff(text.splitlines(), new.splitlines(), str(relative), "figures.py", n=1)
            sys.stdout.writelines(line + "\n" for line in list(diff)[:40])
        else:
            path.write_text(new)
            print(f"figures: rewrote {relative}")
    unused = sorted(set(BLOCKS) - used)
    if unused:
        print(f"figures: blocks shown nowhere: {', '.join(unused)}")
    if stale:
        print(f"figures: stale blocks in {', '.join(stale)}: run scripts/figures.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Write every figure of README and docs/ from the committed benchmark artefacts.

A figure lives between two markers in a markdown file::

    <!-- figures: NAME -->
    ...written by this script...
    <!-- /figures -->

``NAME`` is a block of :data:`BLOCKS`: the artefacts it reads (JSON under ``docs/``, each with the
``provenance`` that ``scripts/artefacts.py`` records) and the function that renders them. Every block
ends with the provenance of what it shows (date, commit, machine, command), so a reader sees where each
number came from and how old it is; a block whose figures no longer describe the code (declared with
``stale``) starts by saying so. The block ``index`` lists every block, where it is shown, its artefacts'
provenance and whether it is stale, CPU and GPU apart (docs/performance/index.md).

    python scripts/figures.py           # rewrite every block in place
    python scripts/figures.py --check   # exit 1 when a block differs from what it would write

The test suite runs ``--check`` (tests/unit/test_figures.py): an artefact changed without regenerating,
or a block edited by hand, fails it. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import plots  # noqa: E402
from artefacts import REPO_ROOT, read  # noqa: E402
from generated_pages import markdown_files, rewrite_pages  # noqa: E402
from tables.markdown import table  # noqa: E402

BLOCK = re.compile(r"(<!-- figures: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /figures -->)", re.S)


@dataclass(frozen=True)
class Figure:
    """One rendered figure: the artefacts it reads (paths under the repository) and how."""

    artefacts: tuple[str, ...]
    renderer: str  # "module.function" under scripts/tables/
    doc: str = ""
    stale: str = ""  # why these figures no longer describe the code, when they do not

    @property
    def gpu(self) -> bool:
        return all(path.startswith("docs/gpu/") for path in self.artefacts)

    def render(self, *artefacts: dict[str, Any]) -> str:
        module, function = self.renderer.rsplit(".", 1)
        render: Callable[..., str] = getattr(importlib.import_module(f"tables.{module}"), function)
        return render(*artefacts)


# Why a block's figures no longer describe the code (Figure.stale), for the reasons several blocks share.
BEFORE_ENGINE_CORE = "taken before the engine core was rewritten (commit 1586aec) and not taken again since"
BEFORE_BOUNDARY = (
    "taken before the engine boundary changed (commit 4229cc8: aborts handed in as data, the scheduler's"
    " update) and not taken again since"
)
BEFORE_HOOKS = (
    "taken before the per-row step caches moved to diffusers' HookRegistry (commit c35f2df) and not taken"
    " again since: its overhead column measures the machinery it replaced"
)

BEFORE_HEADROOM_BOUND = (
    "taken before degradation's headroom was read by a bound (commit 8c64a6c: before, a burst below"
    " capacity could let the deadline rule degrade) and not taken again since"
)

BEFORE_STOPWATCH = (
    "taken before the step engine timed a GPU's work by its device events (commit f9d0d4b,"
    " engine/stopwatch.py): its cost model timed forwards, starts and decodes with the host's clock, which"
    " would read a forward as its launch and a decode as every forward queued before it"
)

BLOCKS: dict[str, Figure] = {
    # the performance index's headline: one row a feature, from the newest artefact of each
    "headline": Figure(
        (
            "docs/cpu/bench_engines.json",
            "docs/cpu/mixed_sizes.json",
            "docs/cpu/checkpoint_cost.json",
            "docs/cpu/lora/bench_lora.json",
            "docs/cpu/caches/bench_caches.json",
            "docs/gpu/checks/engines_graphs/bench_engines.json",
            "docs/cpu/goodput.json",
        ),
        "headline.render",
    ),
    # the real server (scripts/bench.py)
    "server-engines": Figure(("docs/bench.json",), "engines.server_ratios", "bench.py: served engines"),
    "openai-front": Figure(
        ("docs/bench.json",),
        "engines.openai_front",
        "bench.py --openai: the front against gRPC direct",
    ),
    # in process (scripts/bench_engines.py)
    "engines": Figure(
        ("docs/cpu/bench_engines.json",),
        "engines.in_process_ratios",
    ),
    "request-walk": Figure(("docs/design/request_walk.json",), "walk.render", "request_walk.py"),
    "headroom-rule": Figure(("docs/design/headroom_rule.json",), "headroom.render", "headroom_rule.py"),
    # operations: reload one model after its stub died, or restart the server (docs/operations/reliability.md)
    "model-reload": Figure(("docs/cpu/model_reload.json",), "model_reload.render", "model_reload_check.py"),
    "restart-times": Figure(("docs/cpu/restart_times.json",), "restart_times.render", "restart_times.py"),
    "mixed-sizes": Figure(("docs/cpu/mixed_sizes.json",), "mixed_sizes.render", "bench.py mixed-sizes"),
    "mixed-sizes-flux1-h100": Figure(
        ("docs/profiles/flux1-h100/mixed_sizes.json",),
        "mixed_sizes.render",
        "bench.py mixed-sizes --device-profile flux1-h100",
    ),
    "crash-soak": Figure(("docs/cpu/crash_soak.json",), "crash_soak.render", "bench.py crash-soak"),
    "crash-soak-sd15-h100": Figure(
        ("docs/profiles/sd15-h100/crash_soak.json",),
        "crash_soak.render",
        "bench.py crash-soak --device-profile sd15-h100",
    ),
    "crash-soak-sd15-h100-busy": Figure(
        ("docs/profiles/sd15-h100/busy/crash_soak.json",),
        "crash_soak.render",
        "bench.py crash-soak --device-profile sd15-h100 --load 3",
    ),
    "crash-soak-busy": Figure(
        ("docs/cpu/busy/crash_soak.json",), "crash_soak.render", "bench.py crash-soak --load 3"
    ),
    "checkpoint-cost": Figure(
        ("docs/cpu/checkpoint_cost.json",), "checkpoint_cost.render", "bench.py checkpoint-cost"
    ),
    "checkpoint-cost-sd15-h100": Figure(
        ("docs/profiles/sd15-h100/checkpoint_cost.json",),
        "checkpoint_cost.render",
        "bench.py checkpoint-cost --device-profile sd15-h100",
    ),
    "checkpoint-cost-flux1-h100": Figure(
        ("docs/profiles/flux1-h100/checkpoint_cost.json",),
        "checkpoint_cost.render",
        "bench.py checkpoint-cost --device-profile flux1-h100",
    ),
    "checkpoint-store-against": Figure(
        ("docs/cpu/checkpoint_cost_against.json",),
        "checkpoint_cost.render_against",
        "bench.py checkpoint-cost --against 7153e66",
    ),
    "checkpoint-cost-line": Figure(
        (
            "docs/cpu/checkpoint_cost.json",
            "docs/profiles/sd15-h100/checkpoint_cost.json",
            "docs/profiles/flux1-h100/checkpoint_cost.json",
        ),
        "checkpoint_cost.sentence",
        "bench.py checkpoint-cost",
    ),
    "graphs-cpu": Figure(("docs/cpu/bench_graphs.json",), "engines.graphs"),
    "lora": Figure(("docs/cpu/lora/bench_lora.json",), "engines.ratio_table"),
    "dllm": Figure(("docs/dllm_bench.json",), "engines.dllm"),
    # step caches, tiers and deadlines
    "caches": Figure(("docs/cpu/caches/bench_caches.json",), "caches.render"),
    "slo": Figure(("docs/cpu/slo/bench_slo.json",), "slo.render"),
    "slo-server": Figure(("docs/cpu/slo/bench_slo_server.json",), "slo.render_server"),
    "slo-sd15-h100": Figure(
        ("docs/profiles/sd15-h100/slo/bench_slo.json",),
        "slo.render",
        "bench.py slo --device-profile sd15-h100",
    ),
    "slo-flux1-h100": Figure(
        ("docs/profiles/flux1-h100/slo/bench_slo.json",),
        "slo.render",
        "bench.py slo --device-profile flux1-h100",
    ),
    "goodput": Figure(("docs/cpu/goodput.json",), "goodput.render", "bench.py goodput"),
    "goodput-cache": Figure(
        ("docs/cpu/goodput_cache/goodput.json",),
        "goodput.render",
        "bench.py goodput --arch tiny-flux --size 256 --variants tiers,cache,tiers-room,cache-room",
    ),
    "goodput-room": Figure(
        ("docs/cpu/goodput_room1/goodput.json",),
        "goodput.render",
        "bench.py goodput --variants tiers,tiers-room --room 1",
    ),
    "goodput-narrow": Figure(
        ("docs/cpu/goodput_narrow/goodput.json",),
        "goodput.render",
        "bench.py goodput --variants tiers-room,narrow-room --room 1",
    ),
    "goodput-mixed-room3": Figure(
        ("docs/cpu/goodput_mixed/goodput.json",),
        "goodput.render",
        "bench.py goodput --variants tiers,tiers-room --no-deadline-share 0.3",
    ),
    "goodput-mixed": Figure(
        ("docs/cpu/goodput_mixed_room1/goodput.json",),
        "goodput.render",
        "bench.py goodput --variants tiers,tiers-room --no-deadline-share 0.3 --room 1",
    ),
    "goodput-near-capacity": Figure(
        ("docs/cpu/goodput_near/goodput.json",),
        "goodput.render",
        "bench.py goodput --variants tiers-room,degrade-room --room 1 --loads 1.0,1.1",
    ),
    "goodput-tier-pause": Figure(
        ("docs/cpu/goodput_tier_pause/goodput.json",),
        "goodput.render",
        "bench.py goodput --variants fifo,tiers-room,tiers-need --room 1",
    ),
    "goodput-sd15-h100": Figure(
        ("docs/profiles/sd15-h100/goodput.json",),
        "goodput.render",
        "bench.py goodput --device-profile sd15-h100",
    ),
    "goodput-sd15-h100-steady": Figure(
        ("docs/profiles/sd15-h100/steady/goodput.json",),
        "goodput.render",
        "bench.py goodput --device-profile sd15-h100 --variants fifo,tiers-room,degrade-room --room 1",
    ),
    # Published: rows of a published table (not measured here).
    "published-flux-quality": Figure(
        ("docs/published/flux_quality.json",), "published.render", "published_quality.py"
    ),
    # GPU: scripts/gpu_checks.py on one H100 (docs/gpu/checks*/)
    "gpu-graphs": Figure(
        ("docs/gpu/checks/cuda_graphs/bench_graphs.json",), "engines.graphs", stale=BEFORE_BOUNDARY
    ),
    "gpu-engines-graphs": Figure(
        ("docs/gpu/checks/engines_graphs/bench_engines.json",),
        "engines.in_process_ratios",
        stale=BEFORE_BOUNDARY,
    ),
    "gpu-engines-eager": Figure(
        ("docs/gpu/checks/engines_eager/bench_engines.json",), "engines.ratio_table", stale=BEFORE_BOUNDARY
    ),
    "gpu-lora": Figure(
        ("docs/gpu/checks/lora/bench_lora.json",), "engines.ratio_table", stale=BEFORE_BOUNDARY
    ),
    "gpu-family-now": Figure(("docs/gpu/checks/family_invariance/family.json",), "gpu.family_invariance"),
    "gpu-caches": Figure(
        ("docs/gpu/checks_step_caches/step_caches/bench_caches.json",), "caches.render", stale=BEFORE_HOOKS
    ),
    # GPU: scripts/gpu_checks.py on one H200 (docs/gpu/checks_h200*/)
    "gpu-h200-checkpoint-cost": Figure(
        ("docs/gpu/checks_h200/checkpoint_cost/checkpoint_cost.json",),
        "checkpoint_cost.render",
        stale="taken before the checkpoint store wrote into spare files and removed an answered request's on"
        " its own thread (commits 70a6238, 8f39c72), and before checkpoint-cost timed its intervals in"
        " alternated blocks; not taken again since (it needs a GPU)",
    ),
    "gpu-h200-mixed-sizes": Figure(
        ("docs/gpu/checks_h200/mixed_sizes/mixed_sizes.json",),
        "mixed_sizes.render",
        stale=BEFORE_STOPWATCH + "; and with the packing gate's fit seeded by a calibration of tiny-flux's"
        " own transformer, taken before the full-size one was swapped in (its calibration column)",
    ),
    "gpu-h200-slo": Figure(
        ("docs/gpu/checks_h200/slo/bench_slo.json",), "slo.render", stale=BEFORE_STOPWATCH
    ),
    "gpu-h200-slo-stopwatch": Figure(("docs/gpu/checks_h200_stopwatch/slo/bench_slo.json",), "slo.render"),
    # GPU (older figures, kept with their dates)
    "gpu-engines-sd15": Figure(
        ("docs/gpu/bench_engines_sd15.json",),
        "engines.ratio_table",
        stale=BEFORE_ENGINE_CORE + ", with bench_engines.py's earlier clock (a request stamped when the"
        " loop polled for it): its latency ratios are not comparable with the other tables'; its throughput"
        " ratios do not depend on the clock",
    ),
    "gpu-family-invariance": Figure(
        ("docs/gpu/family_invariance.json",),
        "gpu.family_invariance",
        stale="taken before Qwen-Image, Sana, PixArt-Sigma and Z-Image had step adapters, without"
        " PixArt-Alpha, the inpainting checkpoints or Wan, and with an earlier tiny Qwen-Image VAE;"
        " the block gpu-family-now takes it again",
    ),
    "gpu-device-errors": Figure(
        ("docs/gpu/device_errors.json",),
        "gpu.device_errors",
        stale="taken with the failure classifier of its commit, which engine/failures.py has changed since;"
        " not a part of gpu_checks.py (it provokes a sticky device-side assert)",
    ),
}
# Rendered from the other blocks, not from an artefact of its own.
INDEX = "index"
HEADLINE = "headline"


def provenance_line(artefact: dict[str, Any], path: str, href: str | None = None) -> str:
    """Where a block's numbers came from, in one line: the artefact's repository path, linked by ``href``
    (relative to the page that shows it)."""
    source = artefact.get("provenance") or {}
    date, commit, where = provenance(artefact)
    note = " (provenance from git history)" if source.get("backfilled") else ""
    command = source.get("command", "unknown")
    return f"<sub>[`{path}`]({href or path}): {date}, commit `{commit}`, {where}{note}: `{command}`</sub>"


def provenance(artefact: dict[str, Any]) -> tuple[str, str, str]:
    """An artefact's date, short commit and machine, as the provenance line gives them."""
    source = artefact.get("provenance") or {}
    machine = source.get("machine") or {}
    if isinstance(machine, dict):
        where = machine.get("gpu") or f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores"
    else:
        where = str(machine)
    commit = str(source.get("commit", "unknown"))
    commit = commit[:7] + ("+dirty" if commit.endswith("+dirty") else "")
    return str(source.get("date", "unknown"))[:10], commit, where


def render_block(name: str, relative_to: Path) -> str:
    """The body of block ``name`` for a file in ``relative_to`` (links are relative to the file)."""
    block = BLOCKS[name]
    missing = [p for p in block.artefacts if not (REPO_ROOT / p).is_file()]
    if missing:
        raise SystemExit(f"figures: block {name!r} reads {missing}, which do not exist")
    artefacts = [read(REPO_ROOT / p) for p in block.artefacts]
    if name == HEADLINE:  # its rows say which of their figures a block of their own marks stale
        stale = {path for other in BLOCKS.values() if other.stale for path in other.artefacts}
        artefacts = [{**a, "_stale": p in stale} for p, a in zip(block.artefacts, artefacts, strict=True)]
    body = block.render(*artefacts).rstrip("\n")
    lines = [f"**Stale:** {block.stale}.", "", body, ""] if block.stale else [body, ""]
    for path, artefact in zip(block.artefacts, artefacts, strict=True):
        link = Path(_relative(REPO_ROOT / path, relative_to))
        lines.append(provenance_line(artefact, path, link.as_posix()))
        lines.append("")
    return "\n".join(lines)


def render_index(relative_to: Path, shown: dict[str, list[Path]]) -> str:
    """Every block: where it is shown, its artefacts' date, commit and machine, and whether it is stale;
    the CPU's and the GPU's in two tables."""
    parts = []
    for title, gpu in (("CPU", False), ("GPU", True)):
        rows = []
        for name, block in BLOCKS.items():
            if block.gpu != gpu:
                continue
            pages = ", ".join(_link(page, relative_to) for page in shown.get(name, [])) or "nowhere"
            for path in block.artefacts:
                date, commit, where = provenance(read(REPO_ROOT / path))
                href = Path(_relative(REPO_ROOT / path, relative_to)).as_posix()
                reason = block.stale or next(  # a block reading another's stale artefact is as old
                    (
                        f"its artefact is stale ({other})"
                        for other, b in BLOCKS.items()
                        if b.stale and path in b.artefacts
                    ),
                    "",
                )
                state = f"stale: {reason}" if reason else "current"
                rows.append((f"`{name}`", pages, f"[`{path}`]({href})", date, f"`{commit}`", where, state))
        headers = ("block", "shown on", "artefact", "date", "commit", "machine", "state")
        parts += [f"**{title}**", "", table(headers, rows), ""]
    return "\n".join(parts)


def _link(page: Path, relative_to: Path) -> str:
    return f"[{page.relative_to(REPO_ROOT).as_posix()}]({Path(_relative(page, relative_to)).as_posix()})"


def _relative(target: Path, start: Path) -> str:
    import os

    return os.path.relpath(target, start)


def shown_on(files: Sequence[Path]) -> dict[str, list[Path]]:
    """Figure name -> the markdown files that show it."""
    shown: dict[str, list[Path]] = {}
    for path in files:
        for match in BLOCK.finditer(path.read_text()):
            shown.setdefault(match.group("name"), []).append(path)
    return shown


def rewrite(text: str, relative_to: Path, used: set[str], shown: dict[str, list[Path]] | None = None) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name == INDEX:
            body = render_index(relative_to, shown if shown is not None else shown_on(markdown_files()))
            return f"{match.group(1)}{body}{match.group(4)}"
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
    files = markdown_files()
    shown = shown_on(files)
    stale += rewrite_pages(
        files, lambda path, text: rewrite(text, path.parent, used, shown), args.check, "figures"
    )
    plotted = plots.write_all(args.check)
    if plotted and not args.check:
        print(f"figures: drew {', '.join(plotted)}")
    unused = sorted(set(BLOCKS) - used)
    if unused:
        print(f"figures: blocks shown nowhere: {', '.join(unused)}")
    if stale or (plotted and args.check):
        where = ", ".join(stale + (plotted if args.check else []))
        print(f"figures: stale blocks or plots in {where}: run scripts/figures.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

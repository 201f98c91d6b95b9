"""The in-process engine benchmark (``bench.py engines``) on two source trees, side by side: each round runs
the old tree's own benchmark script on its own ``src/`` and the new one's on its own, alternating which goes
first, and keeps both artefacts. The summary sets each ratio the benchmark reports (homogeneous, mixed,
Poisson) of the old tree beside the new one's, round by round: a change of a ratio is read against how
much the same tree's ratio moves between rounds (the noise).

    .venv/bin/python scripts/compare_trees.py --old /tmp/old --old-script scripts/bench_engines.py \\
        --rounds 2 --out bench_results/boundary -- --concurrency 16 --requests 32 --poisson-requests 150
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run(tree: Path, script: str, bench_args: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}:{tree}"}
    command = [sys.executable, str(tree / script), *bench_args, "--out", str(out)]
    subprocess.run(command, check=True, cwd=tree, env=env)
    return json.loads((out / "bench_engines.json").read_text())  # the script writes its folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, type=Path, help="the old tree (a git worktree)")
    parser.add_argument("--old-script", default="scripts/bench_engines.py")
    parser.add_argument("--old-commit", default="")
    parser.add_argument("--new", default=REPO_ROOT, type=Path)
    parser.add_argument("--new-script", default="scripts/bench_engines.py")
    parser.add_argument(
        "--rounds", type=int, default=5, help="at least 5 for a verdict (scripts/verdicts.py)"
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "boundary")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: the benchmark's arguments")
    args = parser.parse_args(argv)
    bench_args = [a for a in args.bench_args if a != "--"]
    args.out = args.out.resolve()  # each tree runs in its own folder
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    from artefacts import write
    from verdicts import rotated_orders, verdict

    ratios: dict[str, dict[str, list[float]]] = {}
    rounds = []
    for index, order in enumerate(rotated_orders(["old", "new"], args.rounds)):
        for name in order:
            tree, script = (args.old, args.old_script) if name == "old" else (args.new, args.new_script)
            artefact = run(tree, script, bench_args, args.out / f"{name}_{index}")
            for label, (value, _target) in artefact["ratios"].items():
                ratios.setdefault(label, {"old": [], "new": []})[name].append(value)
        rounds.append(list(order))
    summary = {}
    for label, values in ratios.items():
        old, new = values["old"], values["new"]
        if not old or not new:
            continue
        found = verdict([n / o for n, o in zip(new, old, strict=False) if o], higher_is_better=None)
        summary[label] = {
            "old": old,
            "new": new,
            "change": statistics.median(new) - statistics.median(old),
            "verdict": str(found),
        }
        print(f"{label}: old {old} new {new} -> {summary[label]['verdict']}")

    config = {"old_commit": args.old_commit, "bench_args": bench_args, "rounds": rounds}
    print(f"written: {write(args.out / 'summary.json', {'config': config, 'ratios': summary})}")


if __name__ == "__main__":
    main()

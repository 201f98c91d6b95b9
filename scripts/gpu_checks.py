"""Every pending GPU figure from one script, within a wall-clock budget: run this first whenever a GPU is
lent, in one call, and commit what it writes.

Each part is one of the bench scripts, run as a subprocess through its command line (so a change in the
engine's Python API breaks a script's run, which the summary names, not this one). Each part's budget is
computed from what it runs (its denoising forwards, at how many images each) and what a step costs on one
H100 (STEP_COSTS, each with its source), times MARGIN; the plan (parts, budgets, total) is printed at the
start, and parts that do not fit in ``--budget-s`` are left out, named, with the ``--parts`` for another
call (none fitting: it refuses to start). The parts run in the registry's order, the cheapest and most
important first, each with its own budget plus what earlier parts left unused; each writes its files under
``<out>/<part>/`` (the bench scripts rewrite their artefact after each measured row, so a part cut at its
budget keeps its rows), and ``<out>/summary.md`` and ``summary.json`` (command, commit, date, machine,
library versions; one line per part: done / cut short / failed, its key figures, its files) are
rewritten after every part and while a part's files change, so a run cut short keeps what it measured.

Before any part, one import probe (in the interpreter the parts use) imports what the planned parts
import; a missing package stops the run at once with its name and how to carry its wheel.

Weights are random: full-size architectures built from the diffusers configs in the package
(``triton_diffusion.tiny_models.ARCHITECTURES``: ``sd15``), and the tiny families for the invariance
table; nothing comes from a hub.

    python3 scripts/gpu_checks.py --wheels .whl          # a GPU: the planned parts into docs/gpu/ (or $OUT)
    python3 scripts/gpu_checks.py --parts lora           # one part again
    python3 scripts/gpu_checks.py --list                 # the registry, each part's budget and the plan
    .venv/bin/python scripts/gpu_checks.py --download-wheels .whl   # here: the wheels the device lacks
    .venv/bin/python scripts/gpu_checks.py --smoke --out /tmp/gpu_smoke   # CPU: tiny models, seconds

``--wheels DIR`` installs DIR's wheels (``--download-wheels`` fetched the ones scripts/gpu_wheels.txt
names, for the device's Python 3.12) with ``pip install --no-index --no-deps --no-compile --target`` into
a scratch folder put first on the parts' PYTHONPATH: the device machine's own torch stays.

Where the environment variable OUT is set (the device tool's folder, from which only 8 files come back)
and ``--out`` is not given, the parts write into a scratch folder and OUT receives ``summary.md`` and
``gpu_checks.tar.gz`` (every part's files and logs, refreshed after each part and while one writes):
unpack it with ``tar -xzf gpu_checks.tar.gz -C docs/gpu``.

The pieces live in ``scripts/gpu/``: ``budget.py`` (step costs with their sources, the estimate, the plan),
``parts.py`` (the registry PARTS: adding a part is one ``Part(...)`` entry there), ``environment.py``
(the wheels, the import probe, the machine) and ``runner.py`` (the parts' processes and the summary).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from gpu.budget import STEP_COSTS, Plan, make_plan
from gpu.environment import REPO_ROOT, download_wheels, install_wheels, machine, probe_imports
from gpu.parts import PARTS, PartOutcome, Run
from gpu.runner import Checks, Child, run_parts

# The device tool's longest command is 600 s; around the parts go installing the wheels, the import probe,
# the machine's description and the last bundle (about 30 s on an H100 machine): 540 s for the parts.
DEFAULT_BUDGET_S = 540.0


def list_parts(plan: Plan) -> None:
    for part in PARTS:
        state = f"not built yet: {part.missing()}" if part.missing() else part.measures
        print(f"{part.name:18} {part.budget():4.0f} s  {state}")
        for piece in part.work():
            print(f"{'':25}{piece.estimate():6.1f} s  {piece.what}")
    print("\nwhat a step costs on one H100 (bf16):")
    for model, points in STEP_COSTS.items():
        for point in points:
            print(f"  {model} x{point.images}: {1000 * point.seconds:.0f} ms ({point.source})")
    print()
    print("\n".join(plan.lines()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--budget-s", type=float, default=DEFAULT_BUDGET_S, help="wall clock for the parts (the plan's limit)"
    )
    parser.add_argument("--out", type=Path, help="default: $OUT if set (bundled, see above), else docs/gpu")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny models and a few steps: every part, on a CPU"
    )
    parser.add_argument(
        "--parts", help=f"comma-separated, in registry order (default: all of {[p.name for p in PARTS]})"
    )
    parser.add_argument("--list", action="store_true", help="print the registry, the budgets and the plan")
    parser.add_argument("--commit", help="the commit checked out, for a copy without git (the device tool's)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter the parts run with")
    parser.add_argument(
        "--wheels", type=Path, help="install this folder's wheels (--no-deps) first, into a scratch folder"
    )
    parser.add_argument(
        "--download-wheels",
        type=Path,
        metavar="DIR",
        help="here: download the wheels scripts/gpu_wheels.txt names, for the device's Python 3.12, and stop",
    )
    args = parser.parse_args(argv)
    if args.download_wheels:
        return download_wheels(args.download_wheels)
    names = [p.name for p in PARTS]
    chosen = args.parts.split(",") if args.parts else names
    if unknown := sorted(set(chosen) - set(names)):
        parser.error(f"unknown parts {unknown}; choose from {names}")
    plan = make_plan(PARTS, chosen, args.budget_s)
    if args.list:
        list_parts(plan)
        return 0
    if not args.smoke:
        print("[gpu_checks] " + "\n[gpu_checks] ".join(plan.lines()), flush=True)
        if not plan.budgets:
            print("[gpu_checks] nothing fits in --budget-s: not started", file=sys.stderr)
            return 2

    bundle = Path(os.environ["OUT"]) if args.out is None and os.environ.get("OUT") else None
    out = Path(tempfile.mkdtemp(prefix="gpu_checks_")) if bundle else (args.out or REPO_ROOT / "docs" / "gpu")
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out.resolve(), args.smoke, args.python)
    if args.wheels:
        install_wheels(args.wheels, run.python)
    if args.commit:  # for the bench scripts' artefacts, in a copy without git
        os.environ["ARTEFACTS_COMMIT"] = args.commit
    started = time.monotonic()
    info = machine(run.python, args.commit)
    print(f"[gpu_checks] {json.dumps(info)}", flush=True)
    checks = Checks(PARTS, run, bundle, info, plan, args.budget_s, started)
    probed = [p for p in PARTS if p.name in chosen and not p.missing()]
    scripts = [p.command(run)[0] for p in probed if args.smoke or p.name in plan.budgets]
    if problem := probe_imports(run.python, scripts, args.smoke):
        print(f"[gpu_checks] not started: {problem}", file=sys.stderr, flush=True)
        for part in PARTS:
            run.outcomes[part.name] = PartOutcome(
                part.name, "not started", "the import probe failed: see above"
            )
        info["probe"] = problem
        checks.publish()
        return 3
    if not args.smoke and info.get("device", "CPU") == "CPU":
        print("[gpu_checks] no CUDA device here (or no torch): use --smoke on a CPU", file=sys.stderr)
        checks.publish()
        return 2

    def stopped(signum, frame):  # the caller's own limit: keep what was measured
        Child.stop()
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        run_parts(checks, args, chosen)
    finally:
        signal.signal(signal.SIGTERM, previous)
    checks.publish()
    print(checks.summary())
    built = [o for o in run.outcomes.values() if o.status not in ("not built yet", "not selected")]
    return 0 if all(o.status == "done" for o in built) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The step engine's own work per engine step, two source trees side by side: a model-free adapter (its
prepare, step and finish do nothing but count), so what is timed is the engine (scheduling, applying each
job's results, reporting) and the host worker's abort check before each step.

Each round runs every tree once, in a subprocess of its own, alternating the order round by round; the
artefact keeps every round's microseconds per step, and the ratio of each round's pair (its spread is the
noise). Used for issue 40's "the engine's own work per step not higher":

    .venv/bin/python scripts/engine_step_cost.py --old /tmp/old/src --new src --rounds 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Runs inside the subprocess with the tree's src first on sys.path; works on both engine APIs (the older
# one polls cancellation inside step; the newer one takes aborts the worker hands in before each step).
PROBE = r"""
import json, sys, time
from triton_diffusion.engine.jobs import ForwardResult, Job, JobStart, JobStep
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepEngine
from triton_diffusion.serving.requests import TrackedRequest

JOBS, PER_FORWARD, STEPS, ENGINE_STEPS = {jobs}, {per_forward}, {steps}, {engine_steps}

class Channel:
    def send_partial(self, outputs): pass
    def send_final(self, outputs): pass
    def send_error(self, error): pass
    def is_cancelled(self): return False

class Adapter:
    def prepare(self, jobs):
        return [JobStart([0], "g", STEPS) for _ in jobs]
    def step(self, jobs, previews=None):
        steps = []
        for job in jobs:
            job.state[0] += 1
            steps.append(JobStep(job.state[0], job.state[0] == STEPS))
        return ForwardResult(steps, rows=len(jobs))
    def finish(self, jobs):
        return [None for _ in jobs]

try:
    from triton_diffusion.serving.cancellations import ClientAborts
    aborts = ClientAborts()
except ImportError:
    aborts = None  # the older engine polls cancellation itself, inside step()

engine = StepEngine(Adapter(), EngineLimits(JOBS, PER_FORWARD))
made = 0
def add():
    global made
    engine.add(Job(TrackedRequest(str(made), Channel()), None))
    made += 1
for _ in range(JOBS):
    add()

def one_step():
    if aborts is not None:
        held = engine.held_requests()
        if held:
            engine.abort(aborts.aborted(held))
    report = engine.step()
    for _ in report.finished:
        add()  # a steady state: a new request for each one done

for _ in range(200):  # warm-up
    one_step()
started = time.perf_counter()
for _ in range(ENGINE_STEPS):
    one_step()
elapsed = time.perf_counter() - started
print(json.dumps({{"us_per_step": elapsed / ENGINE_STEPS * 1e6, "requests": made}}))
"""


def run(src: Path, args: argparse.Namespace) -> float:
    code = PROBE.format(
        jobs=args.jobs, per_forward=args.per_forward, steps=args.steps, engine_steps=args.engine_steps
    )
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(src)!r})\n{code}"],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["us_per_step"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, type=Path, help="the src/ folder of the tree before")
    parser.add_argument("--new", default=REPO_ROOT / "src", type=Path)
    parser.add_argument("--old-commit", default="", help="what --old is (recorded)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--per-forward", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--engine-steps", type=int, default=3000)
    parser.add_argument("--out", default=str(REPO_ROOT / "bench_results" / "engine_step_cost.json"))
    args = parser.parse_args(argv)
    rounds = []
    for index in range(args.rounds):
        order = ("old", "new") if index % 2 == 0 else ("new", "old")
        timed = {name: run(args.old if name == "old" else args.new, args) for name in order}
        rounds.append({"order": list(order), **timed, "new_over_old": timed["new"] / timed["old"]})
        ratio = rounds[-1]["new_over_old"]
        print(f"round {index}: old {timed['old']:.1f} us, new {timed['new']:.1f} us, ratio {ratio:.3f}")
    ratios = [r["new_over_old"] for r in rounds]
    summary = {
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "old_median_us": statistics.median(r["old"] for r in rounds),
        "new_median_us": statistics.median(r["new"] for r in rounds),
    }
    print(json.dumps(summary))
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    from artefacts import write

    config = {
        k: getattr(args, k) for k in ("jobs", "per_forward", "steps", "engine_steps", "rounds", "old_commit")
    }
    print(f"written: {write(args.out, {'config': config, 'rounds': rounds, 'summary': summary})}")


if __name__ == "__main__":
    main()

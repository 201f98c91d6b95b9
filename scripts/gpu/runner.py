"""Running the parts: each a subprocess in its own process group with its budget as a timeout, and the
summary (``summary.md``, ``summary.json``; with a bundle folder, $OUT's ``summary.md`` and
``gpu_checks.tar.gz``) rewritten after every part and while a part's files change, so a run cut short
keeps what it measured. A part cut at its budget keeps the rows its bench script wrote so far (they
rewrite their JSON artefact after each measured row, with ``"complete": false`` until the last).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from gpu.budget import Plan
from gpu.environment import REPO_ROOT, SCRIPTS, child_environment
from gpu.parts import Part, PartOutcome, Run

MIN_START_S = 10.0  # a part is not started with less of the budget left
REFRESH_S = 15.0  # while a part runs, the summary and bundle are refreshed this often if its files changed


class Child:
    """The part's process, in its own process group so that a timeout or a stop ends all of it."""

    current: subprocess.Popen | None = None

    @classmethod
    def run(
        cls,
        args: list[str],
        log: Path,
        timeout: float,
        smoke: bool,
        tick: Callable[[], None] | None = None,
    ) -> int | None:
        """Its exit status, or None when it was stopped at ``timeout``; ``tick`` is called every REFRESH_S
        while it runs."""
        deadline = time.monotonic() + timeout
        with log.open("w") as out:
            cls.current = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env=child_environment(smoke),
                preexec_fn=os.setpgrp,  # noqa: PLW1509  (no threads here)
            )
            try:
                while True:
                    left = deadline - time.monotonic()
                    try:
                        return cls.current.wait(timeout=max(0.0, min(left, REFRESH_S)))
                    except subprocess.TimeoutExpired:
                        if left <= REFRESH_S:
                            cls.stop()
                            return None
                        if tick is not None:
                            tick()
            finally:
                cls.current = None

    @classmethod
    def stop(cls) -> None:
        proc = cls.current
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return


def last_error(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["no output"])[-1][:200]


def kept_rows(folder: Path, part: Part) -> str:
    """What a part that did not finish left: its JSON artefacts' rows (``rows``, else ``rounds``, ``runs``
    or bench_graphs.py's ``forward``: the bench scripts rewrite them after each measured row, with
    ``"complete": false`` until the last)."""
    kept = []
    for pattern in part.writes:
        for path in sorted(folder.glob(pattern)):
            if path.suffix != ".json":
                continue
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                kept.append(f"{path.name} unreadable")
                continue
            if not isinstance(data, dict):
                data = {"rows": data}
            keys = ("rows", "rounds", "runs", "forward")
            key = next((k for k in keys if isinstance(data.get(k), list | dict)), None)
            count = f"{len(data[key])} {'forward rows' if key == 'forward' else key}" if key else "no rows"
            unfinished = isinstance(data, dict) and data.get("complete") is False
            kept.append(f"{path.name}: {count}" + (", incomplete" if unfinished else ""))
    return "kept " + "; ".join(kept) if kept else "kept nothing"


@dataclass
class Checks:
    """One run's state for publishing: the registry, the parts' folder, the bundle folder, the machine, the
    plan."""

    parts: list[Part]
    run: Run
    bundle: Path | None
    info: dict
    plan: Plan
    budget: float
    started: float = field(default_factory=time.monotonic)

    def summary(self) -> str:
        elapsed = time.monotonic() - self.started
        return summary(self.parts, self.run, self.info, self.budget, elapsed, self.plan)

    def publish(self) -> None:
        publish(self.run, self.bundle, self.summary(), self.info)


def run_part(part: Part, checks: Checks, timeout: float) -> PartOutcome:
    run = checks.run
    folder = run.folder(part.name)
    if folder.exists():
        shutil.rmtree(folder)  # no figures from an earlier run pass for this one's
    folder.mkdir(parents=True)
    args = part.command(run)
    log = folder / "log.txt"
    (folder / "command.txt").write_text(
        " ".join(["python3", str(Path("scripts", args[0])), *args[1:]]) + "\n"
    )
    planned = checks.plan.budgets.get(part.name)
    budget = "" if planned is None or run.smoke else f" (its budget {planned:.0f} s)"
    print(f"[gpu_checks] {part.name}: started, {timeout:.0f} s for it{budget}", flush=True)
    started = time.monotonic()
    seen = {"newest": 0.0}

    def tick() -> None:  # a part's rows reach the bundle while it runs: an outer kill keeps them
        newest = max((p.stat().st_mtime for p in folder.iterdir() if p.name != "log.txt"), default=0.0)
        if newest > seen["newest"]:
            seen["newest"] = newest
            running = PartOutcome(part.name, "running", seconds=time.monotonic() - started)
            running.files = sorted(
                str(p.relative_to(run.out)) for pat in part.writes for p in folder.glob(pat)
            )
            running.detail = kept_rows(folder, part) + " so far"
            run.outcomes[part.name] = running
            checks.publish()

    code = Child.run([run.python, str(SCRIPTS / args[0]), *args[1:]], log, timeout, run.smoke, tick)
    outcome = PartOutcome(part.name, "done", seconds=time.monotonic() - started)
    if code is None:
        outcome.status = "cut short"
        outcome.detail = f"stopped at the budget, {timeout:.0f} s; {kept_rows(folder, part)}"
    elif code != 0:
        outcome.status, outcome.detail = (
            "failed",
            f"exit {code}: {last_error(log)}; {kept_rows(folder, part)}",
        )
    outcome.files = sorted(
        str(path.relative_to(run.out)) for pattern in part.writes for path in folder.glob(pattern)
    )
    absent = [pattern for pattern in part.writes if not any(folder.glob(pattern))]
    if outcome.status == "done" and absent:
        outcome.status, outcome.detail = "failed", f"wrote no {', '.join(absent)}"
    if outcome.files:
        try:
            outcome.figures = part.figures(folder, run)
        except Exception as exc:  # noqa: BLE001  (a figure we cannot read must not lose the others)
            outcome.figures = f"figures unreadable ({type(exc).__name__}: {exc})"[:200]
    print(
        f"[gpu_checks] {part.name}: {outcome.status} in {outcome.seconds:.0f} s {outcome.detail}", flush=True
    )
    return outcome


def summary(
    parts: list[Part], run: Run, info: dict, budget: float, elapsed: float, plan: Plan | None = None
) -> str:
    mode = "smoke (tiny models, CPU presets)" if run.smoke else f"GPU presets, budget {budget:.0f} s"
    provenance = info.get("provenance") or {}
    lines = [
        "# GPU checks (`scripts/gpu_checks.py`)",
        "",
        f"- taken: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {mode}, {elapsed:.0f} s in all",
        f"- command: `{provenance.get('command', 'scripts/gpu_checks.py ' + ' '.join(sys.argv[1:]))}`",
        f"- commit: {info.get('commit', 'unknown (no git here: see the command that ran it)')}",
        f"- device: {info.get('device', '?')}; driver: {info.get('driver', '?')}",
        f"- torch {info.get('torch', '?')} (CUDA {info.get('cuda', '-')}), "
        f"diffusers {info.get('diffusers', '?')}, transformers {info.get('transformers', '?')}, "
        f"peft {info.get('peft', '?')}, huggingface_hub {info.get('huggingface_hub', '?')}, "
        f"numpy {info.get('numpy', '?')}, "
        f"Python {info.get('python', (provenance.get('versions') or {}).get('python', '?'))}; "
        f"{info.get('host', '')}",
        *([f"- not started: {info['probe']}"] if info.get("probe") else []),
        "",
        "| part | status | seconds (budget on an H100) | key figures | files |",
        "|---|---|---|---|---|",
    ]
    for part in parts:
        outcome = run.outcomes.get(part.name, PartOutcome(part.name, "not reached"))
        status = outcome.status + (f" ({outcome.detail})" if outcome.detail else "")
        seconds = "-" if outcome.seconds is None else f"{outcome.seconds:.0f}"
        files = ", ".join(f"[{Path(f).name}]({f})" for f in outcome.files) or "-"
        planned = f"{seconds} ({part.budget():.0f})"
        lines.append(f"| {part.name} | {status} | {planned} | {outcome.figures or '-'} | {files} |")
    if plan is not None and not run.smoke:
        lines += ["", "```", *plan.lines(), "```"]
    lines += ["", "What each part measures (its command and log are in its folder):", ""]
    lines += [f"- `{part.name}`: {part.measures}" for part in parts]
    return "\n".join(lines) + "\n"


def atomic_write(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def publish(run: Run, bundle: Path | None, text: str, info: dict) -> None:
    """summary.md (and .json) where the parts are; with a bundle folder, there too, with a tarball of all;
    each written whole, then moved into place."""
    atomic_write(run.out / "summary.md", text)
    state = {
        "provenance": info.get("provenance"),
        "machine": {k: v for k, v in info.items() if k != "provenance"},
        "smoke": run.smoke,
        "parts": [o.__dict__ for o in run.outcomes.values()],
    }
    atomic_write(run.out / "summary.json", json.dumps(state, indent=2) + "\n")
    if bundle is None:
        return
    atomic_write(bundle / "summary.md", text)
    partial = bundle / "gpu_checks.tar.gz.partial"
    with tarfile.open(partial, "w:gz") as tar:
        for path in sorted(run.out.iterdir()):
            if not path.name.endswith(".partial"):
                tar.add(path, arcname=path.name)
    partial.replace(bundle / "gpu_checks.tar.gz")


def earlier_outcomes(out: Path) -> dict[str, PartOutcome]:
    """The outcomes an earlier run left in this folder (kept for the parts ``--parts`` leaves out)."""
    path = out / "summary.json"
    if not path.is_file():
        return {}
    outcomes = {}
    for saved in json.loads(path.read_text()).get("parts", []):
        if saved["status"] in ("done", "cut short", "failed") and (out / saved["part"]).is_dir():
            outcome = PartOutcome(**saved)
            if "an earlier run" not in outcome.detail:
                outcome.detail = "; ".join(x for x in (outcome.detail, "an earlier run") if x)
            outcomes[outcome.part] = outcome
    return outcomes


def run_parts(checks: Checks, args: argparse.Namespace, chosen: list[str]) -> None:
    """Each registered part in order, the summary published after each. On a GPU each planned part has
    what is left of the budget less the later planned parts' budgets (its own, and what earlier parts left
    unused); the smoke's parts have what is left. The budget counts from the first part on."""
    run, plan = checks.run, checks.plan
    earlier = earlier_outcomes(run.out)
    started = time.monotonic()
    for part in checks.parts:
        left = args.budget_s - (time.monotonic() - started)
        timeout = left if run.smoke else left - plan.later(part.name) if part.name in plan.budgets else 0
        if part.name not in chosen:
            run.outcomes[part.name] = earlier.get(part.name) or PartOutcome(
                part.name, "not selected", "--parts"
            )
        elif missing := part.missing():
            run.outcomes[part.name] = PartOutcome(part.name, "not built yet", missing)
        elif not run.smoke and part.name in plan.left_out:
            detail = f"{plan.left_out[part.name]}: another call, --parts {','.join(plan.left_out)}"
            run.outcomes[part.name] = PartOutcome(part.name, "not planned", detail)
        elif timeout < MIN_START_S:
            run.outcomes[part.name] = PartOutcome(
                part.name, "not reached", f"{max(timeout, 0):.0f} s of budget left"
            )
        else:
            try:
                run.outcomes[part.name] = run_part(part, checks, timeout)
            except (SystemExit, KeyboardInterrupt):
                Child.stop()
                run.outcomes[part.name] = PartOutcome(
                    part.name, "cut short", "the run was stopped from outside"
                )
                checks.publish()
                raise
        checks.publish()

"""Every command-line script answers ``--help`` (argparse formats help strings with ``%``: a bare ``%`` in
one crashes ``--help`` and nothing else, so nothing else would notice). The benchmarks' old scripts are
shims into scripts/benchmarks/ without argparse of their own: each runs its benchmark's ``--help``, and
``bench.py NAME --help`` runs the benchmarks without a shim of their own (server, mixed-sizes, crash-soak,
checkpoint-cost)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    path
    for path in (ROOT / "scripts").glob("*.py")
    if "argparse" in path.read_text() or "from benchmarks import main" in path.read_text()
)
COMMANDS = [[path] for path in SCRIPTS] + [
    [ROOT / "scripts" / "bench.py", name]
    for name in ("server", "mixed-sizes", "crash-soak", "checkpoint-cost")  # no shims of their own
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: " ".join([command[0].name, *command[1:]]))
def test_help(command):
    result = subprocess.run(
        [sys.executable, *map(str, command), "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.startswith("usage:"), result.stderr[-1500:]

"""Every command-line script answers ``--help`` (argparse formats help strings with ``%``: a bare ``%`` in
one crashes ``--help`` and nothing else, so nothing else would notice)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted(
    path
    for path in (Path(__file__).resolve().parents[2] / "scripts").glob("*.py")
    if "argparse" in path.read_text()
)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_help(script):
    result = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.startswith("usage:"), result.stderr[-1500:]

"""Every command-line script answers ``--help`` (argparse formats help strings with ``%``: a bare ``%`` in
one crashes ``--help`` and nothing else, so nothing else would notice). The benchmarks' old scripts are
shims into scripts/benchmarks/ without argparse of their own: each runs its benchmark's ``--help``, and
``bench.py NAME --help`` runs the benchmarks without a shim of their own (server, mixed-sizes, crash-soak,
checkpoint-cost).

Each script runs as ``__main__`` with ``--help`` (``runpy``), all of them in one child process: one
import of torch for the lot instead of one a script."""

from __future__ import annotations

import json
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
COMMANDS = [[str(path)] for path in SCRIPTS] + [
    [str(ROOT / "scripts" / "bench.py"), name]
    for name in ("server", "mixed-sizes", "crash-soak", "checkpoint-cost", "all")  # no shims of their own
]
DRIVER = r"""
import contextlib, io, json, runpy, sys
results = {}
base_path, base_modules = list(sys.path), set(sys.modules)
for command in json.loads(sys.argv[1]):
    # Each script as if alone: the path and the modules it found imported are this process's own, not
    # what an earlier script set up (heavy libraries stay loaded: they are not the script's to set up).
    sys.path[:] = [command[0].rsplit("/", 1)[0], *base_path]
    scripts = command[0].rsplit("/", 1)[0]
    for module in [
        name for name, module in list(sys.modules.items())
        if name not in base_modules and str(getattr(module, "__file__", "") or "").startswith(scripts)
    ]:
        del sys.modules[module]
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [*command, "--help"]
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(command[0], run_name="__main__")
        except SystemExit as exit:
            code = exit.code
        except BaseException as exc:
            code = repr(exc)
    results[" ".join(command)] = [code, out.getvalue()[:200], err.getvalue()[-1500:]]
print(json.dumps(results))
"""


def name(command: list[str]) -> str:
    return " ".join([Path(command[0]).name, *command[1:]])


@pytest.fixture(scope="module")
def helps() -> dict[str, list]:
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(COMMANDS)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("command", COMMANDS, ids=name)
def test_help(helps, command):
    code, stdout, stderr = helps[" ".join(command)]
    assert code in (0, None) and stdout.startswith("usage:"), (code, stderr)

#!/usr/bin/env bash
# Create .venv, install the package with its test extra, and build the tiny default weights if missing.
# Sourced by scripts/serve.sh and scripts/test.sh; safe to run again (it skips what is done).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO_ROOT/.venv"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.triton-diffusion-installed"
if [ ! -f "$STAMP" ] || [ "$REPO_ROOT/pyproject.toml" -nt "$STAMP" ]; then
  echo "[setup] installing triton-diffusion and its dependencies into $VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e "$REPO_ROOT[test]"
  touch "$STAMP"
fi
"$VENV/bin/triton-diffusion-build-tiny" --weights-dir "$REPO_ROOT/weights"

#!/usr/bin/env bash
# Create .venv, install the client (./client) and the package with its test extra, and build the tiny
# default weights if missing.
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
if [ ! -f "$STAMP" ] || [ "$REPO_ROOT/pyproject.toml" -nt "$STAMP" ] \
  || [ "$REPO_ROOT/client/pyproject.toml" -nt "$STAMP" ]; then
  echo "[setup] installing triton-diffusion-client, triton-diffusion and their dependencies into $VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # The client with the package: the package depends on it, and it is not on the package index.
  "$VENV/bin/python" -m pip install --quiet -e "$REPO_ROOT/client" -e "$REPO_ROOT[test]"
  if [ ! -x "$VENV/bin/triton-diffusion-generate" ]; then
    # A .venv from before the client was its own distribution: uninstalling the old package there
    # removed the client's commands, which it used to own.
    "$VENV/bin/python" -m pip install --quiet --no-deps --force-reinstall -e "$REPO_ROOT/client"
  fi
  touch "$STAMP"
fi
"$VENV/bin/triton-diffusion-build-tiny" --weights-dir "$REPO_ROOT/weights"

#!/usr/bin/env bash
# Set everything up (first run only) and run the whole test suite: unit tests, then integration tests
# against a real tritonserver on the tiny models, after ruff and the type checker. Extra arguments go to
# pytest.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO_ROOT/scripts/setup_env.sh"
cd "$REPO_ROOT"
"$REPO_ROOT/.venv/bin/ruff" check src client scripts tests model_repository
"$REPO_ROOT/.venv/bin/mypy"  # src/ (pyproject.toml [tool.mypy]): each Protocol where an implementation meets it
exec "$REPO_ROOT/.venv/bin/python" -m pytest -q "$@"

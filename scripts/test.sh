#!/usr/bin/env bash
# Set everything up (first run only) and run the whole test suite: ruff, the type checker, the
# documentation site's strict build (a broken link, a page missing from the navigation or a bad anchor
# fails it), then the unit tests and the integration tests against a real tritonserver on the tiny
# models. Extra arguments go to pytest.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO_ROOT/scripts/setup_env.sh"
cd "$REPO_ROOT"
"$REPO_ROOT/.venv/bin/ruff" check src client scripts tests model_repository
"$REPO_ROOT/.venv/bin/mypy"  # src/ (pyproject.toml [tool.mypy]): each Protocol where an implementation meets it
NO_MKDOCS_2_WARNING=1 "$REPO_ROOT/.venv/bin/mkdocs" build --strict --quiet --site-dir "$(mktemp -d)"
# --durations: every CI log shows where the time goes. Two workers (pytest-xdist): the session server's
# tests on one, the tests with servers of their own on the other, the unit tests on both
# (tests/integration/conftest.py); on 2 cores one worker left a core idle half the time.
exec "$REPO_ROOT/.venv/bin/python" -m pytest -q --durations=25 -n 2 --dist loadgroup "$@"

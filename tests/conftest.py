"""Settings for every test process, and how pytest-xdist shares the suite out (scripts/test.sh runs two
workers on two cores, ``--dist loadgroup``):

- each worker computes with one torch thread, so the two never ask for four threads on two cores (the
  servers the integration tests start keep their own threads);
- every integration test of the session server (and of the family matrix's own large server) runs on one
  worker, the integration tests with servers of their own (:data:`OWN_SERVERS`, a few models each) on the
  other, so no two large servers are up at once; the unit tests fill both. The grouping is a scheduler of
  our own: pytest-xdist 3.8's ``xdist_group`` mark renames node ids, which pytest 9 no longer reads.
"""

from __future__ import annotations

import os
from typing import Any

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Integration test files whose tests start servers of their own, or drive scripts that do.
OWN_SERVERS = {"test_drain", "test_resume", "test_self_healing", "test_gpu_machine_env", "test_openai_front"}


def worker_group(nodeid: str) -> str:
    """The unit of work a test goes to a worker in: one of the two integration groups, or itself."""
    path = nodeid.split("::", 1)[0]
    if not path.startswith("tests/integration/"):
        return nodeid
    return "own-servers" if path.rsplit("/", 1)[-1].removesuffix(".py") in OWN_SERVERS else "session-server"


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # without pytest-xdist the suite runs in one process
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:

    class _Grouped(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
        return _Grouped(config, log) if config.getvalue("dist") == "loadgroup" else None

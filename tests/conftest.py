"""Settings for every test process, and how pytest-xdist shares the suite out (scripts/test.sh runs two
workers on two cores, ``--dist loadgroup``):

- each xdist worker computes with one torch thread (a test that sets its own aside), and every process
  it starts (a server's stubs, a benchmark script, the GPU checks' smoke) gets ``OMP_NUM_THREADS=1``
  where the variable is not set, so nothing asks for more threads than the two cores have: torch's
  threads spin while they wait, and beside the other worker two of them made a step many times slower;
- every integration test of the session server (and of the family matrix's own large server) runs on one
  worker, the integration tests with servers of their own (:data:`OWN_SERVERS`, a few models each) on the
  other (with three benchmark smokes of :data:`OWN_PROCESSES`, which start servers or models of their
  own, and move work off the session server's worker), so no two large servers are up at once; the unit
  tests fill both. The grouping is a scheduler of
  our own: pytest-xdist 3.8's ``xdist_group`` mark renames node ids, which pytest 9 no longer reads.
"""

from __future__ import annotations

import os
from typing import Any

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # for the processes the tests start

# Integration test files whose tests start servers of their own, or drive scripts that do.
OWN_SERVERS = {"test_drain", "test_resume", "test_self_healing", "test_gpu_machine_env", "test_openai_front"}
# Integration tests, of files otherwise the session server's, that run a benchmark script of their own.
OWN_PROCESSES = {
    "tests/integration/test_benchmarks.py::test_bench_writes_its_report",
    "tests/integration/test_benchmarks.py::test_the_engine_benchmark_runs_both_engines_and_profiles_the_step_engine",
    "tests/integration/test_benchmarks.py::test_the_graphs_benchmark_times_forwards_and_counts_their_flops",
}


def worker_group(nodeid: str) -> str:
    """The unit of work a test goes to a worker in: one of the two integration groups, or itself."""
    path = nodeid.split("::", 1)[0]
    if not path.startswith("tests/integration/"):
        return nodeid
    own = path.rsplit("/", 1)[-1].removesuffix(".py") in OWN_SERVERS or nodeid in OWN_PROCESSES
    return "own-servers" if own else "session-server"


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

"""How pytest-xdist shares the suite out (tests/conftest.py): the session server's tests together on one
worker, the tests with servers of their own together on the other, each unit test on its own."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import OWN_PROCESSES, OWN_SERVERS, worker_group

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"


def test_integration_tests_go_in_two_groups_and_unit_tests_alone():
    assert worker_group("tests/integration/test_lora.py::test_x[sd_lora]") == "session-server"
    assert worker_group("tests/integration/test_drain.py::test_y") == "own-servers"
    assert worker_group("tests/integration/test_benchmarks.py::test_bench_writes_its_report") == "own-servers"
    assert worker_group("tests/integration/test_benchmarks.py::test_perf_analyzer_script_writes_a_csv") == (
        "session-server"
    )
    assert worker_group("tests/unit/test_jobs.py::test_z") == "tests/unit/test_jobs.py::test_z"


def test_the_own_server_files_exist_and_none_uses_the_session_server():
    """A test of the session server put in the other group would start a second session server there."""
    for name in OWN_SERVERS:
        text = (INTEGRATION / f"{name}.py").read_text()
        uses = re.findall(r"def (test_\w+)\([^)]*\bserver\b", text)
        assert not uses, (name, uses)


def test_the_own_process_tests_exist_and_none_uses_the_session_server():
    for nodeid in OWN_PROCESSES:
        path, name = nodeid.split("::")
        text = (INTEGRATION.parents[1] / path).read_text()
        signature = re.search(rf"def {name}\(([^)]*)\)", text)
        assert signature is not None, nodeid
        assert not re.search(r"\bserver\b", signature.group(1)), nodeid

"""How pytest-xdist shares the suite out (tests/conftest.py): the session server's tests together on one
worker, the tests with servers of their own together on the other, each unit test on its own."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import OWN_SERVERS, worker_group

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"


def test_integration_tests_go_in_two_groups_and_unit_tests_alone():
    assert worker_group("tests/integration/test_lora.py::test_x[sd_lora]") == "session-server"
    assert worker_group("tests/integration/test_drain.py::test_y") == "own-servers"
    assert worker_group("tests/unit/test_jobs.py::test_z") == "tests/unit/test_jobs.py::test_z"


def test_the_own_server_files_exist_and_none_uses_the_session_server():
    """A test of the session server put in the other group would start a second session server there."""
    for name in OWN_SERVERS:
        text = (INTEGRATION / f"{name}.py").read_text()
        uses = re.findall(r"def (test_\w+)\([^)]*\bserver\b", text)
        assert not uses, (name, uses)

"""The integration tests' server starter: distinct ports outside the ephemeral range, and a new start on new
ports when one was taken between its pick and the server's bind (a CI run once failed on that)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from triton_diffusion.serving import server_process
from triton_diffusion.serving.server_process import RunningServer, free_ports, port_conflict


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = server_process._ephemeral_low()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    if low - server_process._LOWEST_PORT > 1000:  # else the kernel's bind(0) picks
        assert all(server_process._LOWEST_PORT <= p < low for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))


def test_a_taken_port_is_passed_over(monkeypatch: pytest.MonkeyPatch):
    with socket.socket() as taken, socket.socket() as one, socket.socket() as two:
        for s in (taken, one, two):
            s.bind(("0.0.0.0", 0))
        taken.listen()
        busy, first, second = (s.getsockname()[1] for s in (taken, one, two))
        one.close()
        two.close()
        offered = iter([busy, busy, first, busy, second])

        class Scripted:
            def randrange(self, low: int, high: int) -> int:
                return next(offered)

        monkeypatch.setattr(server_process.random, "SystemRandom", Scripted)
        monkeypatch.setattr(server_process, "_ephemeral_low", lambda: 60000)
        assert free_ports(2) == [first, second]


@pytest.mark.parametrize(
    "line",
    [  # as tritonserver 2.51 and the launcher's health server print them
        'E1204 23:31:21.059644 28364 main.cc:257] "failed to start HTTP service: Unavailable - Socket '
        "'0.0.0.0:23456' already in use \"",
        'E1204 23:31:22.040462 28390 main.cc:245] "failed to start GRPC service: Unavailable - Socket '
        "'0.0.0.0:23457' already in use \"",
        "The server cannot listen to HTTP requests and metrics requests at the same address and port "
        "0.0.0.0:40789",
        "OSError: [Errno 98] Address already in use",
    ],
)
def test_a_port_conflict_is_read_from_the_log(line: str):
    assert port_conflict(f"I1204 started\n{line}\n")


def test_a_log_without_a_port_conflict_is_not_one():
    assert not port_conflict("I1204 model_lifecycle.cc:838] \"successfully loaded 'text_to_image'\"\n")


def test_a_start_that_lost_a_port_is_tried_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    ready = RunningServer(None, 1, 2, 3, 4, tmp_path / "log")  # type: ignore[arg-type]
    outcomes = iter(["a port was taken", "a port was taken", ready])
    calls = []

    def start_once(*args: object) -> RunningServer | str:
        calls.append(args)
        return next(outcomes)

    monkeypatch.setattr(server_process, "_start_once", start_once)
    assert server_process.start_server(tmp_path, tmp_path / "log", ["m"]) is ready
    assert len(calls) == 3

    monkeypatch.setattr(server_process, "_start_once", lambda *args: "a port was taken: log tail")
    with pytest.raises(RuntimeError, match="a port was taken: log tail"):
        server_process.start_server(tmp_path, tmp_path / "log", ["m"])

"""The integration tests' server starter: distinct ports outside the ephemeral range, and a new start on new
ports when one was taken between its pick and the server's bind (a CI run once failed on that)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from triton_diffusion.serving import server_process
from triton_diffusion.serving.server_process import RunningServer, free_ports, port_conflict


def scripted_picks(monkeypatch: pytest.MonkeyPatch, picks: list[int]) -> None:
    """free_ports draws ``picks`` in turn, from a range wide enough to draw from."""
    offered = iter(picks)

    class Scripted:
        def randrange(self, low: int, high: int) -> int:
            return next(offered)

    monkeypatch.setattr(server_process.random, "SystemRandom", Scripted)
    monkeypatch.setattr(server_process, "_ephemeral_low", lambda: 60000)


def unused_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("0.0.0.0", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = server_process._ephemeral_low()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    if low - server_process._LOWEST_PORT > 1000:  # else the kernel's bind(0) picks
        assert all(server_process._LOWEST_PORT <= p < low for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))


def test_a_taken_port_and_one_picked_twice_are_passed_over(monkeypatch: pytest.MonkeyPatch):
    first, second = unused_ports(2)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        scripted_picks(monkeypatch, [busy, first, first, busy, second])
        assert free_ports(2) == [first, second]


def test_ports_given_by_the_caller_are_not_picked(monkeypatch: pytest.MonkeyPatch):
    first, second = unused_ports(2)
    scripted_picks(monkeypatch, [first, first, second])
    assert free_ports(1, avoid={first}) == [second]


@pytest.mark.parametrize(
    "line",
    [  # as tritonserver 2.51, the launcher's health server and the OpenAI front (uvicorn) print them
        'E1204 23:31:21.059644 28364 main.cc:257] "failed to start HTTP service: Unavailable - Socket '
        "'0.0.0.0:23456' already in use \"",
        'E1204 23:31:22.040462 28390 main.cc:245] "failed to start GRPC service: Unavailable - Socket '
        "'0.0.0.0:23457' already in use \"",
        "The server cannot listen to HTTP requests and metrics requests at the same address and port "
        "0.0.0.0:40789",
        "OSError: [Errno 98] Address already in use",
        "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 9000): address "
        "already in use",
    ],
)
def test_a_port_conflict_is_read_from_the_log(line: str):
    assert port_conflict(f"I1204 started\n{line}\n")


def test_a_log_without_a_port_conflict_is_not_one():
    assert not port_conflict("I1204 model_lifecycle.cc:838] \"successfully loaded 'text_to_image'\"\n")
    assert not port_conflict("adapter 'ink' already in use by a running request: it stays loaded\n")


def test_a_start_that_lost_a_port_is_tried_again_at_most_three_times(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    ready = RunningServer(None, 1, 2, 3, 4, tmp_path / "log")  # type: ignore[arg-type]
    outcomes = iter(["a port was taken", "a port was taken", ready])
    calls = []

    def start_once(*args: object) -> RunningServer | str:
        calls.append(args)
        return next(outcomes)

    monkeypatch.setattr(server_process, "_start_once", start_once)
    assert server_process.start_server(tmp_path, tmp_path / "log", ["m"]) is ready
    assert len(calls) == 3

    calls.clear()

    def always_taken(*args: object) -> str:
        calls.append(args)
        return "a port was taken: log tail"

    monkeypatch.setattr(server_process, "_start_once", always_taken)
    with pytest.raises(RuntimeError, match="a port was taken: log tail"):
        server_process.start_server(tmp_path, tmp_path / "log", ["m"])
    assert len(calls) == 3


def test_a_port_the_caller_passes_to_the_launcher_is_not_picked_for_the_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    avoided = []

    class Picked(Exception):
        pass

    def record(count: int, avoid: object = ()) -> list[int]:
        avoided.append(avoid)
        raise Picked

    monkeypatch.setattr(server_process, "free_ports", record)
    with pytest.raises(Picked):
        server_process.start_server(
            tmp_path, tmp_path / "log", ["m"], extra_args=["--openai-port=23456", "--exit-timeout-secs=5"]
        )
    assert avoided == [{23456}]


FAKE_LAUNCHER = """#!{python}
# Stands in for triton-diffusion-serve: its first start finds its HTTP port taken and says so as
# tritonserver does; the next serves every GET with 200 on the HTTP port it was given.
import http.server, sys
from pathlib import Path
starts = Path({starts!r})
starts.write_text(starts.read_text() + "x" if starts.exists() else "x")
port = int(next(a for a in sys.argv if a.startswith("--http-port=")).split("=")[1])
if starts.read_text() == "x":
    print(f"failed to start HTTP service: Unavailable - Socket '0.0.0.0:{{port}}' already in use", flush=True)
    raise SystemExit(1)


class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()


http.server.HTTPServer(("127.0.0.1", port), Ready).serve_forever()
"""


def test_a_server_whose_log_says_a_port_was_taken_is_started_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launcher = bin_dir / "triton-diffusion-serve"  # start_server runs the one beside sys.executable
    launcher.write_text(FAKE_LAUNCHER.format(python=sys.executable, starts=str(tmp_path / "starts")))
    launcher.chmod(0o755)
    monkeypatch.setattr(server_process.sys, "executable", str(bin_dir / "python"))
    server = server_process.start_server(tmp_path, tmp_path / "server.log", ["m"], timeout_s=30)
    try:
        assert (tmp_path / "starts").read_text() == "xx"  # once on a taken port, then again
        assert not port_conflict(server.log())
    finally:
        server.stop()

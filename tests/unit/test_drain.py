"""Draining on SIGTERM (recovery/drain.py, supervisor.py, launcher.py): the files the launcher and the
models share, the supervisor's order (not ready, drain file, the models' marks or the drain time, then
SIGTERM to the server, no restart), and the whole launcher against a fake tritonserver whose fake model
drains as the contract says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from triton_diffusion.recovery import drain
from triton_diffusion.serving import launcher
from triton_diffusion.serving.supervisor import Stub, Supervisor

SRC = Path(__file__).resolve().parents[2] / "src"


def test_the_drain_file_travels_in_the_environment_and_a_stale_one_is_removed(
    tmp_path, tmp_path_factory, monkeypatch
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("tmp")))  # not the machine's
    assert drain.drain_file_from_env({}) is None and not drain.is_draining(None)
    path = drain.drain_path("8123", {drain.ENV: str(tmp_path / "d")})
    assert path == tmp_path / "d" == drain.drain_file_from_env({drain.ENV: str(path)})
    assert drain.drain_path("8123", {}).name == "triton-diffusion-8123.drain"  # one per server
    drain.request_drain(path)
    drain.mark_drained(path, "text_to_image")
    assert drain.is_draining(path) and (tmp_path / "d.text_to_image.done").is_file()
    # A launcher killed while draining left both: the next start clears them, or every request is refused.
    command = launcher.ServerCommand(["tritonserver"], {drain.ENV: str(path), "PATH": "/bin"})
    started, same = launcher.with_drain_file(command, ["--http-port=8123"])
    assert same == path and started.env[drain.ENV] == str(path) and started.env["PATH"] == "/bin"
    assert list(tmp_path.iterdir()) == []


def test_the_drain_file_is_in_a_folder_of_this_users_alone(tmp_path, monkeypatch, caplog):
    # In a shared temporary directory another user could otherwise drain this server (every request
    # refused) or leave a file it cannot remove; nor can what they plant there stop it from starting.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = drain.private_folder(tmp_path)
    assert folder.name == f"triton-diffusion-{os.getuid()}"
    assert folder.stat().st_mode & 0o777 == 0o700 and folder.stat().st_uid == os.getuid()
    assert drain.private_folder(tmp_path) == folder  # the same one next time
    assert drain.drain_path("8123", {}).parent == folder
    folder.chmod(0o777)  # open to others
    planted = ["open to other users"]
    assert drain.private_folder(tmp_path) != folder
    folder.rmdir()
    for kind in ("a link to a folder", "a dangling link", "a file"):
        if kind == "a file":
            folder.write_text("")
        else:
            folder.symlink_to(tmp_path if kind == "a link to a folder" else tmp_path / "nowhere")
        planted.append("a link or a file, not a folder")
        instead = drain.private_folder(tmp_path)
        assert instead != folder and instead.parent == tmp_path, kind
        assert instead.lstat().st_mode & 0o777 == 0o700 and instead.is_dir() and not instead.is_symlink()
        folder.unlink()
    warned = [r.getMessage() for r in caplog.records if "the drain file goes in" in r.getMessage()]
    assert [why for why in planted if any(why in w for w in warned)] == planted and len(warned) == 4


def test_the_drain_file_holds_the_drain_deadline(tmp_path):
    path = tmp_path / "d"
    drain.request_drain(path, 30.0, clock=lambda: 1000.0)
    assert drain.drain_deadline(path) == 1030.0 and not (tmp_path / "d.partial").exists()


def test_wait_drained_waits_for_every_model_or_the_time_or_a_reason_to_give_up(tmp_path):
    path = tmp_path / "d"
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds
        if clock[0] >= 1.0:
            drain.mark_drained(path, "a")  # "a" drains after a second; "b" never does

    waited = drain.wait_drained(path, ["a", "b", "a"], 3.0, sleep=sleep, clock=lambda: clock[0])
    assert waited == ["b"] and clock[0] == pytest.approx(3.0)  # the whole drain time, then gives up
    drain.mark_drained(path, "b")
    assert drain.wait_drained(path, ["a", "b"], 3.0, sleep=sleep, clock=lambda: clock[0]) == []
    assert drain.wait_drained(path, ["c"], 3.0, give_up=lambda: True) == ["c"]  # the server exited


class FakeServer:
    """A tritonserver process as the supervisor drives it: records the signals it gets, in order with
    the drain file's state at that moment."""

    pid = 1 << 30  # no such process: its stubs are listed by the fake list_stubs

    def __init__(self, drain_file: Path, events: list) -> None:
        self.drain_file, self.events = drain_file, events
        self.status: int | None = None

    def poll(self) -> int | None:
        return self.status

    def send_signal(self, signum: int) -> None:
        self.events.append(("signal", signum, sorted(p.name for p in self.drain_file.parent.iterdir())))
        self.status = -signum

    def wait(self, timeout: float | None = None) -> int:
        assert self.status is not None
        return self.status

    def kill(self) -> None:
        self.status = -9


def supervised(tmp_path, monkeypatch, drain_s: float = 5.0) -> tuple[Supervisor, list]:
    events: list = []
    drain_file = tmp_path / "drain" / "triton.drain"
    drain_file.parent.mkdir()
    # Pids no process has, and shared-memory regions in a folder of the test's: a stop ends what is left.
    stubs = [Stub((1 << 30) + i, m, f"{m}_{n}", f"shm-{m}{n}") for i, (m, n) in enumerate(["a0", "b0", "b1"])]
    monkeypatch.setattr("triton_diffusion.serving.supervisor.list_stubs", lambda pid: stubs)
    monkeypatch.setattr("triton_diffusion.serving.supervisor.SHM_DIR", tmp_path)

    def start() -> FakeServer:
        events.append(("start",))
        return FakeServer(drain_file, events)

    supervisor = Supervisor(start, "http://127.0.0.1:1", 0.02, drain_file=drain_file, drain_s=drain_s)
    monkeypatch.setattr(supervisor, "_server_ready", lambda: True)
    monkeypatch.setattr(supervisor, "_ready_models", lambda: ["a", "b"])
    monkeypatch.setattr(supervisor, "_python_models", lambda models: [m for m in models if m in ("a", "b")])
    return supervisor, events


def run_until_ready(supervisor: Supervisor) -> tuple[threading.Thread, list]:
    status: list = []
    thread = threading.Thread(target=lambda: status.append(supervisor.run()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while not supervisor.ready():
        assert time.monotonic() < deadline, "the fake server never became ready"
        time.sleep(0.01)
    return thread, status


def test_sigterm_drains_every_model_then_stops_the_server_without_a_restart(tmp_path, monkeypatch):
    supervisor, events = supervised(tmp_path, monkeypatch)
    drain_file = supervisor.drain_file
    thread, status = run_until_ready(supervisor)
    supervisor.stop(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not drain.is_draining(drain_file):  # the drain file comes first, with readiness gone
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not supervisor.ready() and thread.is_alive() and len(events) == 1  # no signal yet
    drain.mark_drained(drain_file, "a")
    time.sleep(0.3)
    assert thread.is_alive() and len(events) == 1  # "b" (two instances) is still draining
    drain.mark_drained(drain_file, "b")
    thread.join(5)
    assert not thread.is_alive() and status == [-signal.SIGTERM]
    marks = ["triton.drain", "triton.drain.a.done", "triton.drain.b.done"]
    assert events == [("start",), ("signal", signal.SIGTERM, marks)]  # one start: no restart


def test_sigterm_waits_for_every_instance_of_a_model_to_mark_itself(tmp_path, monkeypatch):
    supervisor, events = supervised(tmp_path, monkeypatch)
    drain_file = supervisor.drain_file
    thread, status = run_until_ready(supervisor)
    assert supervisor.watched_instances == {"a": ["a_0"], "b": ["b_0", "b_1"]}
    supervisor.stop(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not drain.is_draining(drain_file):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert drain.drain_deadline(drain_file) > time.time() + 3  # now + drain_s (5 s)
    drain.mark_drained(drain_file, "a", "a_0")
    drain.mark_drained(drain_file, "b", "b_0")
    time.sleep(0.8)  # more than a poll of the marks
    assert thread.is_alive() and len(events) == 1  # b_1 still holds jobs
    drain.mark_drained(drain_file, "b", "b_1")
    thread.join(5)
    assert not thread.is_alive() and status == [-signal.SIGTERM] and events[-1][1] == signal.SIGTERM


def test_a_model_that_never_drains_holds_the_stop_for_the_drain_time_only(tmp_path, monkeypatch):
    supervisor, events = supervised(tmp_path, monkeypatch, drain_s=0.4)
    thread, status = run_until_ready(supervisor)
    started = time.monotonic()
    supervisor.stop(signal.SIGTERM)
    thread.join(5)
    assert 0.4 <= time.monotonic() - started < 3 and status == [-signal.SIGTERM]
    assert events[-1] == ("signal", signal.SIGTERM, ["triton.drain"])


def test_a_second_signal_cuts_the_drain_short(tmp_path, monkeypatch):
    supervisor, events = supervised(tmp_path, monkeypatch, drain_s=30)
    thread, status = run_until_ready(supervisor)
    supervisor.stop(signal.SIGTERM)
    time.sleep(0.2)
    started = time.monotonic()
    supervisor.stop(signal.SIGINT)  # impatient: stop now (the first signal's kind is forwarded)
    thread.join(5)
    assert time.monotonic() - started < 2 and status == [-signal.SIGTERM]


def test_sigint_never_drains(tmp_path, monkeypatch):
    supervisor, events = supervised(tmp_path, monkeypatch, drain_s=30)
    thread, status = run_until_ready(supervisor)
    supervisor.stop(signal.SIGINT)
    thread.join(5)
    assert status == [-signal.SIGINT] and events[-1] == ("signal", signal.SIGINT, [])


@pytest.mark.parametrize("how", ["sigint", "no drain time"])
def test_a_stop_without_a_drain_is_not_ready_before_the_signal_goes(tmp_path, monkeypatch, how):
    # /readyz (and triton_diffusion_up) must not say 200 while the server is going away: a Service
    # would keep sending it traffic for the whole exit timeout.
    supervisor, events = supervised(tmp_path, monkeypatch, drain_s=0 if how == "no drain time" else 30)
    readiness: list[bool] = []
    monkeypatch.setattr(
        FakeServer, "poll", lambda server: readiness.append(supervisor.ready()) or server.status
    )
    thread, status = run_until_ready(supervisor)
    readiness.clear()
    supervisor.stop(signal.SIGINT if how == "sigint" else signal.SIGTERM)
    thread.join(5)
    assert status and readiness and not any(readiness[-2:]), readiness


class SlowServer(FakeServer):
    """A tritonserver that takes its time to exit after SIGTERM (Triton 2.51 waits for every stub process
    and looks for live models once a second): only a kill ends it."""

    def send_signal(self, signum: int) -> None:
        self.events.append(("signal", signum))

    def kill(self) -> None:
        self.events.append(("kill",))
        self.status = -9


def stop_in_thread(call) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    return thread, result


def test_a_restart_ends_the_server_once_every_live_instance_is_finalized(tmp_path):
    drain_file = tmp_path / "triton.drain"
    supervisor = Supervisor(lambda: None, "http://127.0.0.1:1", grace_s=30, drain_file=drain_file)
    supervisor.watched_instances = {"a": ["a_0"], "b": ["b_0", "b_1"]}
    supervisor.marks_cover = True  # every ready model is one of the watched stubs
    events: list = []
    server = SlowServer(drain_file, events)
    # a_0 died: it never finalizes, and the restart does not wait for it.
    thread, result = stop_in_thread(lambda: supervisor._stop_server(server, [], {"a_0"}))
    drain.mark_finalized(drain_file, "b", "b_0")
    deadline = time.monotonic() + 5
    while not events:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.5)  # several looks at the marks
    assert thread.is_alive() and events == [("signal", signal.SIGTERM)]  # b_1 still answers what it held
    drain.mark_finalized(drain_file, "b", "b_1")
    thread.join(5)
    assert result == [0] and events == [("signal", signal.SIGTERM), ("kill",)]


def test_a_restart_without_the_marks_kills_the_server_after_the_grace_time(tmp_path):
    drain_file = tmp_path / "triton.drain"
    supervisor = Supervisor(lambda: None, "http://127.0.0.1:1", grace_s=0.3, drain_file=drain_file)
    supervisor.watched_instances = {"a": ["a_0"]}
    supervisor.marks_cover = True
    events: list = []
    started = time.monotonic()
    status = supervisor._stop_server(SlowServer(drain_file, events), [], set())
    assert status == -9 and events == [("signal", signal.SIGTERM), ("kill",)]
    assert time.monotonic() - started >= 0.3


def test_a_restart_where_every_instance_died_ends_the_server_without_the_grace_time(tmp_path):
    # One model of one instance (the common deployment): its stub died, nothing of the server can answer.
    drain_file = tmp_path / "triton.drain"
    supervisor = Supervisor(lambda: None, "http://127.0.0.1:1", grace_s=30, drain_file=drain_file)
    supervisor.watched_instances = {"a": ["a_0"]}
    supervisor.marks_cover = True
    events: list = []
    started = time.monotonic()
    supervisor._stop_server(SlowServer(drain_file, events), [], {"a_0"})
    assert events == [("signal", signal.SIGTERM), ("kill",)]
    assert time.monotonic() - started < 10  # not the 30 s grace time
    # Where another backend's model may still answer, the grace time holds.
    supervisor.marks_cover, supervisor.grace_s, events[:] = False, 0.3, []
    started = time.monotonic()
    assert supervisor._stop_server(SlowServer(drain_file, events), [], {"a_0"}) == -9
    assert time.monotonic() - started >= 0.3


def test_a_stop_with_no_watched_instance_waits_for_tritons_own_exit(tmp_path):
    # No Python-backend model (or none ready yet): the marks cover nothing, so a SIGTERM's graceful exit
    # (other backends' requests in flight) is waited for, up to its time.
    drain_file = tmp_path / "triton.drain"
    supervisor = Supervisor(lambda: None, "http://127.0.0.1:1", grace_s=0.3, drain_file=drain_file)
    supervisor.watched_instances, supervisor.marks_cover = {}, True
    events: list = []
    started = time.monotonic()
    assert supervisor._end(SlowServer(drain_file, events), 0.3, supervisor.watched_instances) == -9
    assert time.monotonic() - started >= 0.3
    events.clear()
    assert supervisor._stop_server(SlowServer(drain_file, events), [], set()) == -9  # nothing died either
    assert time.monotonic() - started >= 0.6


def test_an_index_that_did_not_answer_covers_nothing(tmp_path, monkeypatch):
    supervisor, events = supervised(tmp_path, monkeypatch)
    monkeypatch.setattr(supervisor, "_ready_models", lambda: [])  # what it returns when the index fails
    thread, status = run_until_ready(supervisor)
    assert supervisor.watched_instances and not supervisor.marks_cover
    supervisor.stop(signal.SIGINT)
    thread.join(5)


def test_a_model_of_another_backend_keeps_the_wait_for_tritons_own_exit(tmp_path, monkeypatch):
    """An ONNX or ensemble model has no stub (no restart for it) and writes no mark: the Python models'
    marks must not end its requests."""
    supervisor, events = supervised(tmp_path, monkeypatch)
    monkeypatch.setattr(supervisor, "_ready_models", lambda: ["a", "b", "an_onnx_model"])
    supervisor.grace_s = 0.5
    thread, status = run_until_ready(supervisor)
    assert not supervisor.marks_cover and events == [("start",)]  # served, not restarted
    drain_file = supervisor.drain_file
    for model, instance in [("a", "a_0"), ("b", "b_0"), ("b", "b_1")]:
        drain.mark_finalized(drain_file, model, instance)
    status_of_stop = supervisor._stop_server(SlowServer(drain_file, events), [], set())
    assert status_of_stop == -9  # killed after the grace time, not ended by the marks
    supervisor.stop(signal.SIGINT)
    thread.join(5)


def test_a_stop_ends_the_server_once_every_model_drained_and_finalized(tmp_path, monkeypatch):
    supervisor, events = supervised(tmp_path, monkeypatch)
    drain_file = supervisor.drain_file
    slow = SlowServer(drain_file, events)
    supervisor.start = lambda: slow
    thread, status = run_until_ready(supervisor)
    supervisor.stop(signal.SIGTERM)
    for model, instance in [("a", "a_0"), ("b", "b_0"), ("b", "b_1")]:
        drain.mark_drained(drain_file, model, instance)
    deadline = time.monotonic() + 5
    while ("signal", signal.SIGTERM) not in events:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)
    assert thread.is_alive()  # signalled, not finalized: Triton's own exit is waited for
    for model, instance in [("a", "a_0"), ("b", "b_0"), ("b", "b_1")]:
        drain.mark_finalized(drain_file, model, instance)
    thread.join(5)
    assert status == [0] and events[-1] == ("kill",)


def test_each_start_clears_the_marks_of_the_server_before(tmp_path, monkeypatch):
    supervisor, events = supervised(tmp_path, monkeypatch)
    drain_file = supervisor.drain_file
    drain.mark_finalized(drain_file, "a", "a_0")
    drain.mark_drained(drain_file, "a", "a_0")
    assert drain.not_finalized(drain_file, {"a": ["a_0"], "b": ["b_0"]}) == ["b_0"]
    thread, status = run_until_ready(supervisor)
    assert list(drain_file.parent.iterdir()) == []  # a new server's models have finalized nothing
    supervisor.stop(signal.SIGINT)
    thread.join(5)


FAKE_TRITONSERVER = """#!{python}
# A tritonserver as the launcher sees it: ready on its HTTP port, one Python backend "stub" (a Python run
# through a link named like the stub, on a model.py), SIGTERM recorded and obeyed.
import http.server, os, pathlib, signal, subprocess, sys, threading
args = sys.argv[1:]
repo = pathlib.Path(args[args.index("--model-repository") + 1])
port = int(next(a for a in args if a.startswith("--http-port=")).split("=")[1])
events = repo / "events"
def event(text):
    with events.open("a") as f:
        f.write(text + "\\n")
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
server = http.server.HTTPServer(("127.0.0.1", port), Ready)
stub = subprocess.Popen([str(repo / "triton_python_backend_stub"), str(repo / "fake/1/model.py"), "shm-fake",
                         "x", "fake_0", "runtime"])
def stop(signum, frame):
    marks = pathlib.Path(os.environ["{env}"]).parent.glob("*.done")
    event("server got SIGTERM; marks: " + ",".join(sorted(p.name for p in marks)))
    stub.kill(); stub.wait()
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
event("server started")
server.serve_forever()
"""

FAKE_MODEL = """
# A model's engine host as the drain contract says: polls the drain file, drains, marks itself drained.
import pathlib, time
from triton_diffusion.recovery import drain
path = drain.drain_file_from_env()
events = pathlib.Path(__file__).parents[2] / "events"
while not drain.is_draining(path):
    time.sleep(0.05)
with events.open("a") as f:
    f.write("model drained\\n")
drain.mark_drained(path, "fake")
time.sleep(3600)
"""


def test_the_launcher_drains_a_fake_servers_model_before_stopping_it(tmp_path):
    repo = tmp_path / "repo"
    (repo / "fake" / "1").mkdir(parents=True)
    (repo / "fake" / "1" / "model.py").write_text(FAKE_MODEL)
    (repo / "triton_python_backend_stub").symlink_to(sys.executable)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    server = bin_dir / "tritonserver"
    server.write_text(FAKE_TRITONSERVER.replace("{python}", sys.executable).replace("{env}", drain.ENV))
    server.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(SRC)}
    env.pop(drain.ENV, None)  # the launcher picks the path (in its TMPDIR) and tells the server
    env["TMPDIR"] = str(tmp_path / "run")
    (tmp_path / "run").mkdir()
    port = launcher_port()
    command = [sys.executable, "-m", "triton_diffusion.serving.launcher", "--model-repository", str(repo)]
    command += ["--health-port=0", "--drain-s=10", f"--http-port={port}"]
    log_path = tmp_path / "launcher.log"
    with log_path.open("w") as log_file:
        process = subprocess.Popen(command, env=env, stderr=log_file, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while "watching stubs fake_0" not in log_path.read_text():  # the supervisor watches the model
            assert time.monotonic() < deadline and process.poll() is None, log_path.read_text()
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # whatever of the fake server is left
        except ProcessLookupError:
            pass
        process.wait()
    events, log = repo / "events", log_path.read_text()
    assert events.read_text().splitlines() == [
        "server started",
        "model drained",
        f"server got SIGTERM; marks: triton-diffusion-{port}.drain.fake.done",
    ], log
    assert "draining fake" in log and "every model drained" in log
    assert log.count("+ ") == 1  # started once: a stop is no crash, nothing restarts it
    (folder,) = (tmp_path / "run").iterdir()  # this user's own folder (drain.private_folder)
    assert list(folder.iterdir()) == []  # the drain file and its marks are gone


def test_the_drain_time_is_a_launcher_option(monkeypatch):
    taken: list = []
    monkeypatch.setattr(launcher, "server_command", lambda *a: launcher.ServerCommand(["t"], {}))
    monkeypatch.setattr(launcher, "supervise", lambda *args: taken.append(args) or 0)
    for argv, drain_s in (([], 30.0), (["--drain-s", "90"], 90.0), (["--drain-s=0"], 0.0)):
        with pytest.raises(SystemExit):
            launcher.main(["--log-verbose=1", *argv])
        threads = launcher.load_threads(launcher.DEFAULT_MODEL_REPOSITORY)
        assert taken[-1][4] == drain_s and taken[-1][1] == [
            "--exit-timeout-secs=5",
            f"--model-load-thread-count={threads}",
            "--log-verbose=1",
        ]
    with pytest.raises(SystemExit, match="2"):
        launcher.main(["--drain-s=-1"])


def launcher_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_supervisors_metrics_count_the_fronts_restarts_where_it_runs_one(tmp_path, monkeypatch):
    # A front that keeps exiting (a bad key file, a taken port) leaves the pod ready for gRPC: the count
    # is what an alert reads.
    restarts = [0]
    supervisor, _ = supervised(tmp_path, monkeypatch)
    assert "front_restarts" not in supervisor.metrics_text()  # no front: no such metric
    supervisor.front_restarts = lambda: restarts[0]
    restarts[0] = 3
    assert "\ntriton_diffusion_front_restarts_total 3\n" in supervisor.metrics_text()
    assert "# TYPE triton_diffusion_front_restarts_total counter" in supervisor.metrics_text()


def test_the_launcher_gives_the_supervisor_its_fronts_restart_count(tmp_path, monkeypatch):
    """launcher.supervise wires the front it keeps running into the supervisor's metrics."""
    from triton_diffusion.serving import companion, supervisor

    made: dict = {}

    class Front:
        restarts = 0

        def __init__(self, argv, name):
            made["front"] = self

        def start(self): ...

        def stopping(self): ...

        def stop(self): ...

    class Watch:
        def __init__(self, *args, **kwargs):
            made["supervisor"] = kwargs

        def stop(self, signum): ...

        def run(self):
            return 0

    monkeypatch.setattr(companion, "CompanionProcess", Front)
    monkeypatch.setattr(supervisor, "Supervisor", Watch)
    monkeypatch.setenv(drain.ENV, str(tmp_path / "triton.drain"))
    command = launcher.ServerCommand(["tritonserver"], {drain.ENV: str(tmp_path / "triton.drain")})
    try:
        assert launcher.supervise(command, [], 0, front_argv=["front"]) == 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    made["front"].restarts = 4
    assert made["supervisor"]["front_restarts"]() == 4

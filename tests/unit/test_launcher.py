import contextlib
from pathlib import Path

import pytest

from triton_diffusion.serving import launcher


def fake_server_root(tmp_path, versions):
    root = tmp_path / "tritonserver"
    (root / "backends" / "python").mkdir(parents=True)
    (root / "backends" / "python" / "libtriton_python.so").write_text("")
    (root / "backends" / "python" / "triton_python_backend_utils.py").write_text("")
    for version in versions:
        (root / "python_backend_stubs" / version).mkdir(parents=True)
        (root / "python_backend_stubs" / version / "triton_python_backend_stub").write_text("")
    return root


def test_backend_directory_links_the_stub_of_the_running_python(tmp_path):
    root = fake_server_root(tmp_path, [launcher.python_version_tag()])
    target = launcher.make_backend_directory(root, tmp_path / "backends")
    stub = target / "python" / "triton_python_backend_stub"
    assert stub.is_symlink() and launcher.python_version_tag() in str(stub.resolve())
    assert (target / "python" / "libtriton_python.so").is_symlink()
    launcher.make_backend_directory(root, tmp_path / "backends")  # idempotent


def test_servers_started_at_once_never_race_on_the_backend_links(tmp_path):
    # Two server roots, so each call replaces the links the other made: with an unlink then a symlink,
    # threads doing this at once raise FileExistsError or FileNotFoundError (as two test workers'
    # servers did); a race, so the old code fails here often, not always.
    import threading

    roots = [fake_server_root(tmp_path / str(i), [launcher.python_version_tag()]) for i in range(2)]
    errors: list[BaseException] = []

    def build(i: int) -> None:
        try:
            for n in range(40):
                launcher.make_backend_directory(roots[(i + n) % 2], tmp_path / "backends")
        except BaseException as error:  # noqa: BLE001 (collected for the assert)
            errors.append(error)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    python = tmp_path / "backends" / "python"
    assert sorted(p.name for p in python.iterdir()) == [
        "libtriton_python.so",
        "triton_python_backend_stub",
        "triton_python_backend_utils.py",
    ]  # no temporary link left behind
    sources = {str(p) for root in roots for p in root.rglob("*") if p.is_file()}
    assert all(str(p.resolve()) in sources for p in python.iterdir())  # each a whole link to a source


def test_missing_stub_is_a_clear_error(tmp_path):
    root = fake_server_root(tmp_path, ["2.7"])
    with pytest.raises(
        launcher.LauncherError, match=r"no Python backend stub for Python \S+ \(available: 2\.7\)"
    ):
        launcher.make_backend_directory(root, tmp_path / "backends")


def test_bundled_server_command_puts_this_python_first_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no tritonserver here
    command = launcher.server_command(tmp_path / "repo", ["--log-verbose=1"], tmp_path / "backends")
    assert command.argv[0].endswith("bin/tritonserver")
    assert command.argv[-1] == "--log-verbose=1"
    assert "--backend-directory" in command.argv and "--model-repository" in command.argv
    import sys
    from pathlib import Path

    assert command.env["PATH"].split(":")[0] == str(Path(sys.executable).parent)


def test_the_ready_line_names_every_model_and_the_ports_given():
    extra = ["--http-port", "18000", "--grpc-port=18001", "--metrics-port", "18002"]
    line = launcher.ready_line(extra, ["text_to_image", "diffusion_lm"], 18003, ("127.0.0.1", 19000))
    assert line.startswith("triton-diffusion: READY, 2 models (text_to_image, diffusion_lm)")
    for url in (
        "http://localhost:18000",
        "localhost:18001",
        "http://localhost:18002/metrics",
        "http://localhost:18003/readyz",
        "http://localhost:19000/v1",
    ):
        assert url in line, url
    plain = launcher.ready_line([], ["m"], 0, ("::1", 9000))
    assert "READY, 1 model (m)" in plain and "http://localhost:8000" in plain and "readyz" not in plain
    assert "http://[::1]:9000/v1" in plain


def test_the_last_of_a_repeated_option_wins_as_in_tritonserver():
    # scripts/serve.sh passes its port defaults first and the user's arguments after them.
    assert launcher._option(["--grpc-port", "8001", "--grpc-port=9001"], "grpc-port", "1") == "9001"
    assert launcher._option(["--grpc-port=8001", "--grpc-port", "9001"], "grpc-port", "1") == "9001"
    assert launcher._option([], "grpc-port", "8001") == "8001"


def test_the_supervised_server_gets_a_short_exit_timeout_unless_one_is_given(monkeypatch):
    taken: list = []
    monkeypatch.setattr(launcher, "server_command", lambda *a: launcher.ServerCommand(["t"], {}))
    monkeypatch.setattr(launcher, "supervise", lambda *args: taken.append(args) or 0)
    for argv, timeout in (([], "5"), (["--exit-timeout-secs=60"], "60")):
        with pytest.raises(SystemExit):
            launcher.main(argv)
        assert launcher._option(taken[-1][1], "exit-timeout-secs", "30") == timeout


def test_models_load_at_once_one_a_thread_unless_the_user_says(monkeypatch, tmp_path):
    for name in ("a", "b", "c", "d", "e"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text("")
    (tmp_path / "not_a_model").mkdir()
    assert launcher.load_threads(tmp_path) == 5  # Triton's default 4 would load the fifth after the others
    assert launcher.load_threads(tmp_path / "missing") == 4
    for name in range(20):
        (tmp_path / f"m{name}").mkdir()
        (tmp_path / f"m{name}" / "config.pbtxt").write_text("")
    assert launcher.load_threads(tmp_path) == 8
    # What tritonserver is started with, supervised and not (the user's own comes later and wins).
    given: list = []

    def command(repository, extra, cache):
        given.append(list(extra))
        return launcher.ServerCommand(["t"], {})

    monkeypatch.setattr(launcher, "server_command", command)
    monkeypatch.setattr(launcher, "supervise", lambda *args: 0)
    monkeypatch.setattr(launcher.os, "execvpe", lambda *args: None)
    for argv, threads in (
        ([], "8"),
        (["--model-load-thread-count=2"], "2"),
        (["--no-supervise"], "8"),
    ):
        with contextlib.suppress(SystemExit):
            launcher.main(["--model-repository", str(tmp_path), *argv])
        assert launcher._option(given[-1], "model-load-thread-count", "4") == threads


def test_an_unreadable_folder_does_not_lose_the_count(monkeypatch, tmp_path):
    for name in ("a", "b", "c", "d", "e", "f"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text("")
    is_file = Path.is_file

    def denied(path):
        if path.parent.name == "a":
            raise PermissionError(13, "Permission denied", str(path))
        return is_file(path)

    monkeypatch.setattr(Path, "is_file", denied)
    assert launcher.load_threads(tmp_path) == 5


def test_a_ready_model_without_a_stub_lost_it():
    """The supervisor's first listing: a model Triton calls ready whose stub is already gone (it died as the
    server became ready) is one to restart for; models with a stub each are not."""
    from triton_diffusion.serving.supervisor import Stub, stubless

    stubs = [Stub(10, "sd_plain", "sd_plain_0_0", "shm1"), Stub(11, "lm", "lm_0_0", "shm2")]
    assert stubless(["lm", "sd_plain"], stubs) == []
    assert stubless(["lm", "sd_plain", "sd_resuming"], stubs) == ["sd_resuming"]
    assert stubless([], stubs) == []  # an index that did not answer: nothing to say


def test_a_server_ended_by_a_signal_gives_the_shells_exit_code():
    assert launcher.exit_code(0) == 0 and launcher.exit_code(1) == 1
    assert launcher.exit_code(-9) == 137 and launcher.exit_code(-15) == 143  # SIGKILL, SIGTERM


@pytest.mark.parametrize("mode", ["explicit", "poll"])
def test_a_model_control_mode_that_unloads_models_needs_the_supervisor_off(monkeypatch, tmp_path, mode):
    # Triton 2.51 never says a stub died: the supervisor takes a stub gone for a crash, so an unload
    # through the model-control API would restart the whole server.
    monkeypatch.setattr(launcher, "server_command", lambda *args: launcher.ServerCommand(["t"], {}))

    def supervise(*args):
        raise SystemExit("supervised")

    monkeypatch.setattr(launcher, "supervise", supervise)
    ran: list = []

    def execvpe(*args):  # the process becomes tritonserver: nothing after it runs
        ran.append(args)
        raise SystemExit(0)

    monkeypatch.setattr(launcher.os, "execvpe", execvpe)
    for given in ([f"--model-control-mode={mode}"], ["--model-control", mode.upper()]):  # a prefix, any case
        with pytest.raises(SystemExit, match=f"--model-control-mode={mode} needs --no-supervise"):
            launcher.main(["--model-repository", str(tmp_path), *given])
    with pytest.raises(SystemExit, match="supervised"):  # "none" in any case: supervised as always
        launcher.main(["--model-repository", str(tmp_path), "--model-control-mode=NONE"])
    with pytest.raises(SystemExit):
        launcher.main(["--model-repository", str(tmp_path), "--model-control-mode", mode, "--no-supervise"])
    assert ran  # unsupervised, as asked

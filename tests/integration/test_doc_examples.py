"""Every code example of README.md and docs/ marked runnable (tests/doc_examples.py) runs against the tiny
server: the session's tritonserver, and an OpenAI front started here in front of it for the examples that
use one. Each runs from a scratch folder holding the files it needs (a 64x64 PNG each) and ``.venv`` (this
test's virtual environment), with ``localhost:8001``, ``localhost:8000`` and ``localhost:9000`` pointed at
the servers; it must exit 0 and write exactly the files its marker names, each a readable image or an MP4,
and an example that streams must print server-sent events, none of them an error."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from PIL import Image

from tests.doc_examples import Example, examples
from triton_diffusion.serving.server_process import free_port

pytestmark = pytest.mark.integration

EXAMPLES = examples()
VENV = Path(sys.prefix)


@pytest.fixture(scope="module")
def openai_front(server, tmp_path_factory):
    """The OpenAI front alone (``triton-diffusion-openai``), in front of the session's server."""
    port = free_port()
    log = (tmp_path_factory.mktemp("openai_front") / "front.log").open("w")
    command = [sys.executable, "-m", "triton_diffusion.openai_front", "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--triton-grpc", server.grpc_url], stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, "the OpenAI front did not start"
        time.sleep(0.2)
    yield f"127.0.0.1:{port}"
    process.terminate()
    process.wait(timeout=30)
    log.close()


def pointed(code: str, addresses: dict[str, str]) -> str:
    for written, actual in addresses.items():
        code = code.replace(written, actual)
    return code


def files_under(folder: Path) -> set[str]:
    """Every file under ``folder``, relative to it; symbolic links (``.venv``) are not followed."""
    return {
        (Path(directory) / name).relative_to(folder).as_posix()
        for directory, _, names in os.walk(folder)
        for name in names
        if not (Path(directory) / name).is_symlink()
    }


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda example: example.name)
def test_the_example_runs_against_the_tiny_server(example: Example, server, request, tmp_path):
    addresses = {
        "localhost:8001": server.grpc_url,
        "localhost:8000": server.http_url.removeprefix("http://"),
    }
    if "openai" in example.addresses:
        addresses["localhost:9000"] = request.getfixturevalue("openai_front")
    (tmp_path / ".venv").symlink_to(VENV, target_is_directory=True)
    for needed in example.needs:
        (tmp_path / needed).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (64, 64), "red").save(tmp_path / needed)
    before = files_under(tmp_path)

    code = pointed(example.code, addresses)
    if example.language == "python":
        command = [sys.executable, "-c", code]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", code]
    env = {**os.environ, "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{example.name}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"

    assert files_under(tmp_path) - before == set(example.writes), example.name
    for written in example.writes:
        path = tmp_path / written
        if path.suffix == ".mp4":
            assert path.read_bytes()[4:8] == b"ftyp", written  # an MP4 file's first box
        else:
            with Image.open(path) as image:
                image.load()
    if example.streams:
        events = [line for line in result.stdout.splitlines() if line.startswith("data:")]
        assert len(events) >= 2, result.stdout[-3000:]
        assert not [event for event in events if '"error"' in event], result.stdout[-3000:]

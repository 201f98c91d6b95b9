"""The client installs alone: ``pip install ./client`` into a fresh virtual environment (no torch, no
server package, no PyAV) generates an image and an MP4 from the tiny server through its installed CLI.

pip's cache is reused, so once warm this takes about 20 s; it needs the package index only as the
the docs' setup does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from triton_diffusion_client import generate_one

CLIENT = Path(__file__).resolve().parents[2] / "client"

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("client-venv")
    # Nothing of this test run's environment leaks into the fresh one.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PIP_NO_CACHE_DIR")}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile", str(CLIENT)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=venv,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    return venv


def run_in(venv: Path, *command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def test_the_installed_client_generates_without_torch_or_the_server(server, client_venv, tmp_path):
    python = str(client_venv / "bin" / "python")
    for module in ("torch", "triton_diffusion", "av"):  # not there: the client needs none of them
        assert run_in(client_venv, python, "-c", f"import {module}", cwd=tmp_path).returncode != 0, module

    cli = str(client_venv / "bin" / "triton-diffusion-generate")
    request = ["--url", server.grpc_url, "--seed", "5", "--steps", "2", "--height", "64", "--width", "96"]
    made = run_in(client_venv, cli, "a red cat", *request, "--out", str(tmp_path / "images"), cwd=tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    assert "[0] step 2/2\n" in made.stderr  # the progress, a line per step off a terminal
    (path,) = (tmp_path / "images").glob("*.png")
    assert path.name == "0_5.png" and Image.open(path).size == (96, 64)
    # The same bytes as this environment's client (the server package's dependency) gets.
    alone = generate_one(
        {"prompt": "a red cat", "seed": 5, "num_inference_steps": 2, "height": 64, "width": 96},
        "0",
        url=server.grpc_url,
    )
    assert alone.ok and alone.images == [path.read_bytes()], alone.error

    # A video comes as the MP4 the server encoded: no video library in the client.
    video = ["--url", server.grpc_url, "--model", "text_to_video", "--seed", "2", "--param", "num_frames=5"]
    made = run_in(client_venv, cli, "a boat", *video, "--out", str(tmp_path / "v"), cwd=tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    (mp4,) = (tmp_path / "v").glob("*.mp4")
    data = mp4.read_bytes()
    assert mp4.name == "0_2.mp4" and data[4:8] == b"ftyp"  # an MP4 file's first box

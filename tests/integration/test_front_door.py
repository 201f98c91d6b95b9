"""The shipped front door (docker/k8s/front-door: nginx + njs) in front of the real server: the two bodies
that crash Triton 2.51's HTTP front end are refused before Triton parses them, and ordinary generate /
generate_stream traffic passes unchanged.

Needs nginx with its njs module: Debian's ``nginx`` and ``libnginx-mod-http-js``, which ``.ci/run``
installs when it runs as root with apt-get; skipped, saying so, where they are absent.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from triton_diffusion.serving.launcher import REPO_ROOT
from triton_diffusion.serving.server_process import free_port

FRONT_DOOR = REPO_ROOT / "docker" / "k8s" / "front-door"
NJS_MODULE = Path("/usr/lib/nginx/modules/ngx_http_js_module.so")

pytestmark = pytest.mark.skipif(
    shutil.which("nginx") is None or not NJS_MODULE.is_file(),
    reason="needs nginx and its njs module: apt-get install nginx libnginx-mod-http-js (.ci/run does)",
)


@pytest.fixture(scope="module")
def front_door(server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("front-door")
    port = free_port()
    config = (FRONT_DOOR / "nginx.conf").read_text()
    config = config.replace("${TRITON_HTTP}", f"127.0.0.1:{server.http_port}")
    config = config.replace("/etc/nginx/json_guard.js", str(FRONT_DOOR / "json_guard.js"))
    config = config.replace("listen 8080", f"listen 127.0.0.1:{port}")
    config = config.replace("load_module modules/", f"load_module {NJS_MODULE.parent}/")
    config = config.replace("pid /tmp/nginx.pid", f"pid {folder}/nginx.pid")
    (folder / "nginx.conf").write_text(config)
    (folder / "logs").mkdir()
    process = subprocess.Popen(
        ["nginx", "-p", str(folder), "-c", str(folder / "nginx.conf"), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(50):
        try:
            urllib.request.urlopen(f"{url}/v2/health/ready", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    yield url
    process.terminate()
    process.wait(timeout=10)


def post(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def triton_up(server) -> bool:
    with urllib.request.urlopen(f"{server.http_url}/v2/health/live", timeout=5) as response:
        return response.status == 200


def test_bodies_that_crash_triton_are_refused_before_it_parses_them(server, front_door):
    generate = f"{front_door}/v2/models/text_to_image/generate"
    depth = 150_000  # crashes Triton 2.51 (SIGSEGV in its JSON parsing)
    status, body = post(generate, b'{"PROMPT":"x","parameters":{"a":' + b"[" * depth + b"]" * depth + b"}}")
    assert status == 400 and b"deeper than 32 levels" in body
    image = f"{front_door}/v2/models/image_to_image/generate"
    status, _ = post(image, b'{"PROMPT":"x","IMAGE":"' + b"A" * (4 << 20) + b'"}')  # a 4 MiB string does too
    assert status == 413
    assert triton_up(server)


def test_ordinary_traffic_passes_and_nothing_else_does(server, front_door):
    request = {"PROMPT": "a [bracketed] {prompt}", "parameters": {"seed": 3, "output_encoding": "base64"}}
    status, body = post(f"{front_door}/v2/models/text_to_image/generate", json.dumps(request).encode())
    assert status == 200 and json.loads(body)["SEED"] == 3
    request["parameters"]["progress"] = True
    status, body = post(f"{front_door}/v2/models/text_to_image/generate_stream", json.dumps(request).encode())
    assert status == 200 and body.count(b"data: ") > 1
    for path in ("/v2/repository/index", "/v2/models/text_to_image/config", "/v2/systemsharedmemory/status"):
        assert post(f"{front_door}{path}", b"{}")[0] == 404
    assert triton_up(server)

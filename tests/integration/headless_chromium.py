"""Headless Chromium for the playground test."""

from __future__ import annotations

import json
import os
import select
import shlex
import subprocess


class HeadlessChromium:
    """Debian's chromium, headless, driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
    JSON messages ending in NUL on fds 3 and 4), so no websocket library is needed."""

    def __init__(self, profile: str) -> None:
        to_chrome, self._write = os.pipe()
        self._read, from_chrome = os.pipe()
        command = (
            # Root needs --no-sandbox; the rest keep a test run from reaching the network (updates,
            # sync, first-run pages) or a GPU.
            "exec chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage "
            "--disable-background-networking --disable-component-update --disable-sync --no-first-run "
            f"--user-data-dir={shlex.quote(profile)} --remote-debugging-pipe about:blank "
            f"3<&{to_chrome} 4>&{from_chrome}"
        )
        self.process = subprocess.Popen(
            ["bash", "-c", command],
            pass_fds=(to_chrome, from_chrome),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome)
        os.close(from_chrome)
        self._buffer = b""
        self._next_id = 0
        self.session = None

    def call(self, method: str, **params):
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if self.session is not None:
            message["sessionId"] = self.session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        while True:  # events and other answers are skipped
            while b"\0" not in self._buffer:
                if not select.select([self._read], [], [], 30)[0]:  # never block a test run forever
                    raise TimeoutError(f"chromium did not answer {method} in 30 s")
                chunk = os.read(self._read, 1 << 16)
                if not chunk:
                    raise RuntimeError("chromium closed its DevTools pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer["result"]

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def close(self) -> None:
        self.process.kill()
        self.process.wait(10)
        os.close(self._read)
        os.close(self._write)

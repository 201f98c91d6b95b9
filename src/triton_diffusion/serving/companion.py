"""A process the launcher keeps running beside tritonserver (the OpenAI front).

Started once, started again when it exits without being asked to (after a pause, so one that cannot
start does not spin), and stopped with the server. It is independent of Triton's restarts: the front
reports not ready while Triton is down and serves again when it is back.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading

log = logging.getLogger("triton_diffusion.supervisor")


class CompanionProcess:
    def __init__(self, argv: list[str], name: str, restart_delay_s: float = 2.0) -> None:
        self.argv = argv
        self.name = name
        self.restart_delay_s = restart_delay_s
        self.restarts = 0
        self.process: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._keep_running, name=f"companion-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _keep_running(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                if self._stopping.is_set():
                    return
                print("+ " + " ".join(self.argv), file=sys.stderr, flush=True)
                self.process = subprocess.Popen(self.argv)
            status = self.process.wait()
            if self._stopping.is_set():
                return
            self.restarts += 1
            log.error(
                "%s exited with status %s; starting it again in %.0f s",
                self.name,
                status,
                self.restart_delay_s,
            )
            self._stopping.wait(self.restart_delay_s)

    def stopping(self) -> None:
        """From now on an exit is expected (the launcher is shutting down): never start it again."""
        self._stopping.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._stopping.set()
            process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._thread.join(timeout=timeout_s)

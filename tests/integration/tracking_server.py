"""A real ``mlflow server`` process for tests: 127.0.0.1, a free port, a SQLite store in a temp dir."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

MLFLOW = str(Path(sys.executable).with_name("mlflow"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``mlflow server`` on 127.0.0.1 with a SQLite backend in ``root`` (or the store ``backend``, e.g. the
    ``mlruns.db`` a job wrote: what ``mlflow ui`` shows a user); stop() kills it, start() brings it back on
    the same port and store. start() is launch() then wait(): a test can do other work while it boots."""

    def __init__(self, root: Path, backend: str | None = None):
        self.root, self.port = root, _free_port()
        self.backend = backend or f"sqlite:///{self.root / 'mlflow.db'}"
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self, timeout: float = 120.0) -> None:
        self.launch()
        self.wait(timeout)

    def launch(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(
            [MLFLOW, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", self.backend, "--artifacts-destination", str(self.root / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True)

    def wait(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise AssertionError("mlflow server did not start:\n" + (self.root / "server.log").read_text()[-3000:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its worker processes
            self.proc.wait(30)
        self.proc = None

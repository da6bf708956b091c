"""A real `mlflow server` on 127.0.0.1 (SQLite store and artifact folder under `base`) that a test can
kill and start again on the same port and store: the tracking server a team runs, going down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.net import free_port

BIN = Path(sys.executable).parent


class MlflowServer:
    def __init__(self, base: Path, port: int | None = None, nice: int = 0):
        self.base = Path(base)
        self.nice = nice  # a benchmark runs it at nice 19: its CPU work stands for another machine's
        self.base.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.starts = 0

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.uri}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self, timeout: float = 180) -> None:
        """Start it (again) on the same port and store, and wait until it answers."""
        assert self.proc is None or self.proc.poll() is not None, "the server is already running"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no job runner: one process less on a small box
        self.starts += 1
        # its own session: a kill of the group takes the uvicorn worker with it
        self._log = open(self.base / f"server-{self.starts}.log", "w")  # closed when it is stopped
        self.proc = subprocess.Popen(
            [
                *(["nice", "-n", str(self.nice)] if self.nice else []),
                str(BIN / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--backend-store-uri",
                f"sqlite:///{self.base / 'server.db'}",
                "--artifacts-destination",
                str(self.base / "artifacts"),
                "--workers",
                "1",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None:
                raise AssertionError(f"mlflow server exited {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"mlflow server did not answer in {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL, as a crashed or reclaimed machine: no goodbye to the clients."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, sig: int) -> None:
        if self._log is not None:
            self._log.close()
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass
        # the uvicorn worker is in the same group: wait until nothing of it is left
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.killpg(self.proc.pid, signal.SIGKILL)

    def log_tail(self, n: int = 30) -> str:
        logs = sorted(self.base.glob("server-*.log"))
        return "\n".join(logs[-1].read_text(errors="replace").splitlines()[-n:]) if logs else ""

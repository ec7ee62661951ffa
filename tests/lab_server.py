"""A JupyterLab server for the tests: started in its own process group on a free loopback port, waited
for with a bound, and always stopped, group and all (tests/test_lab.py, tests/browser/)."""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

STOP_TIMEOUT_S = 30
REQUEST_TIMEOUT_S = 20


def start_lab(command: list[str], cwd: Path, port: int, tmp: Path, env: dict | None = None) -> Lab:
    """Start command (a JupyterLab server on port) with a fresh random token, passed through JUPYTER_TOKEN
    (jupyter_server 2's IdentityProvider reads it) so it never shows on a command line. Its runtime
    files and workspaces go under tmp, not the user's home; its output goes to tmp/lab.log. env: more
    variables for it."""
    token = secrets.token_hex(24)
    env = dict(os.environ, JUPYTER_TOKEN=token, JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"), **(env or {}))
    env.pop("JUPYTER_TOKEN_FILE", None)
    log = tmp / "lab.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: stop make and jupyter together
    return Lab(proc, port, token, log)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    def __init__(self, proc: subprocess.Popen, port: int, token: str, log: Path) -> None:
        self.proc, self.port, self.token, self.log = proc, port, token, log

    def url(self, path: str, token: bool = True) -> str:
        sep = "&" if "?" in path else "?"
        return f"http://127.0.0.1:{self.port}{path}" + (f"{sep}token={self.token}" if token else "")

    def get(self, path: str, token: bool = True) -> tuple[int, str]:
        """(status, body) of a GET; HTTP errors are returned, not raised."""
        try:
            with urllib.request.urlopen(self.url(path, token), timeout=REQUEST_TIMEOUT_S) as r:
                return r.status, r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode("utf-8", "replace")

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a process we cannot signal still exists
            return True
        return True

    def stop(self) -> None:
        """SIGTERM the whole group (JupyterLab shuts down on it), then SIGKILL what is left."""
        for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 10)):
            if not self.group_alive():
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and self.group_alive():
                self.proc.poll()  # reap make so its group can empty
                time.sleep(0.2)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def wait_until_serving(lab: Lab, timeout_s: float, what: str = "`make lab`") -> None:
    """Return once /api/status answers 200; fail with the server's log if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if lab.proc.poll() is not None:
            pytest.fail(f"{what} exited with {lab.proc.returncode} before serving:\n{lab.log_tail()}")
        try:
            with socket.create_connection(("127.0.0.1", lab.port), timeout=2):
                pass
            status, _ = lab.get("/api/status")
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer on port {lab.port} within {timeout_s} s:\n{lab.log_tail()}")

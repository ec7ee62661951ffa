"""`make lab` really serves JupyterLab, safely: token required, loopback only, no nbgrader, clean stop.

The README promises `make lab`; this starts exactly that command headless on a free port, with the
token given through JUPYTER_TOKEN (jupyter_server 2's IdentityProvider reads it), so it never shows
up on a command line. Every wait is bounded, and the whole process group (make and the server it
started) is stopped at the end.
"""
from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest

from lab_server import Lab, free_port, start_lab, wait_until_serving

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 240  # make checks setup and the model first; a cold JupyterLab start takes ~10-30 s

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    port = free_port()
    server = start_lab(["make", "-s", "lab", f"LAB_PORT={port}"], ROOT, port, tmp_path_factory.mktemp("lab"))
    try:
        wait_until_serving(server, START_TIMEOUT_S)
        yield server
    finally:
        server.stop()


def test_lab_page_with_token_is_200(lab):
    status, body = lab.get("/lab")
    assert status == 200, f"GET /lab returned {status}:\n{lab.log_tail()}"
    assert "jupyter-config-data" in body


def test_api_refuses_requests_without_the_token(lab):
    status, _ = lab.get("/api/contents", token=False)
    assert status in (401, 403), f"/api/contents without a token returned {status}; authentication is off"
    wrong = Lab(lab.proc, lab.port, "not-the-token", lab.log)
    assert wrong.get("/api/contents")[0] in (401, 403)
    status, body = lab.get("/api/contents")
    assert status == 200, "with the token, the contents API should answer"
    names = {item["name"] for item in json.loads(body)["content"]}
    assert "Makefile" not in names and names <= set(os.listdir(ROOT / "notebooks")), (
        f"the server's root should be notebooks/, it lists {sorted(names)}"
    )


def _listening_addresses(port: int) -> list[str]:
    """Local addresses of LISTEN sockets on port, from /proc/net/tcp and tcp6 (hex, as the kernel writes
    them)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            addr, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A = TCP_LISTEN
                found.append(addr)
    return found


def test_listens_on_loopback_only(lab):
    if not Path("/proc/net/tcp").exists():
        pytest.skip("no /proc/net/tcp on this system")
    addresses = _listening_addresses(lab.port)
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1, little-endian words
    assert addresses, f"nothing listens on port {lab.port}"
    assert set(addresses) <= loopback, f"JupyterLab listens beyond loopback: {addresses}"


def test_learners_lab_has_no_nbgrader(lab):
    """nbgrader is for maintainers; its menus and server extension must not reach the learners' lab."""
    status, body = lab.get("/lab")
    match = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', body, re.S)
    assert status == 200 and match, "could not find JupyterLab's page config"
    config = json.loads(match.group(1))
    federated = [ext.get("name", "") for ext in config.get("federated_extensions", [])]
    assert not [n for n in federated if "nbgrader" in n], f"nbgrader lab extensions are served: {federated}"
    assert lab.get("/formgrader")[0] == 404, "nbgrader's formgrader server extension is loaded"


def test_stops_cleanly(lab):
    lab.stop()
    assert not lab.group_alive(), "processes of `make lab` are still running after SIGTERM and SIGKILL"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", lab.port), timeout=2).close()

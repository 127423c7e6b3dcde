"""Secure defaults of a launch: ``specserve serve`` with a config that sets nothing about the network
(only the models; the port is picked free so the test can run beside other servers) binds its HTTP
server to 127.0.0.1 only and starts no dashboard.

The launch runs in a subprocess with its own Ray cluster (the point is the launcher's own choices, not
the test session's); the listening sockets of that process tree are read with psutil.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_PORT = 8265
SERVE_GRPC_PORT = 9000  # Serve's default gRPC proxy port: off unless gRPC servicers are configured
WILDCARD = ("0.0.0.0", "::", "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> dict[int, str]:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            out[p.pid] = " ".join(p.cmdline())[:100] or p.name()
        except psutil.Error:
            continue
    return out


def _listeners(pids) -> list:
    return [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]


def _start(config: Path, log: Path) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update({"PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"})
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--config", str(config),
                                 "--port", str(port)], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, port


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)  # serve_forever drains and shuts its Ray cluster down
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own process group (start_new_session)
        proc.wait(10)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("launch")
    config = folder / "minimal.yaml"
    # Only the model is set (no draft keeps the launch to three replicas): every network setting is default.
    config.write_text("target:\n  path: builtin:tiny\n  max_model_len: 128\ndraft:\n  kind: none\n")
    for attempt in (1, 2):
        log = folder / f"serve-{attempt}.log"
        proc, port = _start(config, log)
        try:
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
            else:
                text = log.read_text(errors="replace")
                # A second Ray cluster on a loaded 2-core box can miss Ray's fixed 30 s raylet start window.
                if attempt == 1 and "timed out during startup" in text:
                    continue
                pytest.fail(f"specserve serve not healthy (exit {proc.returncode}):\n{text[-3000:]}")
            yield proc, port
            return
        finally:
            _stop(proc)


def test_default_launch_binds_loopback_only(launch):
    proc, port = launch
    procs = _tree(proc.pid)
    listeners = _listeners(procs)
    http = [c for c in listeners if c.laddr.port == port]
    assert http, f"nothing of the launch listens on the HTTP port {port}: {listeners}"
    assert {c.laddr.ip for c in http} == {"127.0.0.1"}, http
    # No other address on the machine answers on the HTTP port either.
    everywhere = [c for c in psutil.net_connections(kind="inet")
                  if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert {c.laddr.ip for c in everywhere} == {"127.0.0.1"}, everywhere

    ports = {c.laddr.port for c in listeners}
    assert DASHBOARD_PORT not in ports, "the Ray dashboard listens"
    assert SERVE_GRPC_PORT not in ports, "Serve's gRPC proxy listens"
    # Nothing serving the project's HTTP API (the proxy) listens on a wildcard address.
    proxies = {pid for pid, cmd in procs.items() if "ProxyActor" in cmd}
    assert proxies, procs
    assert not [c for c in listeners if c.pid in proxies and c.laddr.ip in WILDCARD and c.laddr.port == port]

    r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"]
    # Ray's own internal ports (GCS, raylet, workers' gRPC) are Ray's choice, not the launcher's: listed
    # for the record (run with -s to see them).
    ray_wildcard = sorted((c.laddr.ip, c.laddr.port, procs.get(c.pid, "?")[:80]) for c in listeners
                          if c.laddr.ip in WILDCARD)
    print(f"Ray-internal listeners on wildcard addresses: {ray_wildcard}")

"""Secure defaults of a launch: ``specserve serve`` with a config that sets nothing about the network or
Ray (only the models, and an API key in an environment variable; the port is picked free so the test
can run beside other servers), in an environment with no ``RAY_*`` settings and a fresh state directory.

- Every listening socket of the server's process tree (GCS, raylet, workers, replicas, agents, metrics,
  the HTTP proxy) is on loopback; no dashboard, no Serve gRPC proxy.
- Ray's token auth is on: the token file is generated 0600 in ``$XDG_STATE_HOME/specserve``. A job
  submitted to any listener without the token (the dashboard agent's job API among them) is refused and
  never runs; a driver attaching to GCS without the token, or with a wrong one, is refused, while the
  same attach with the token succeeds (so the refusals are the token's doing).
- The HTTP API key is in the environment of no Ray process, and the API requires it.
- Overload: the HTTP port is the ingress replica's own server (Serve's direct ingress, see
  deployments/loopback.py), so 640 simultaneous requests against a capacity of 160 (the default
  max_running 32 + max_queue 128) get only 200 or 503 (+ Retry-After, OpenAI body), rejections answer
  within 1 s at p99 (from the request on the wire: ``tools.loadgen.request`` leaves this process's
  own time to open 640 connections out, and prints it), and every accepted answer is token-identical to the reference. (This runs here, before
  the session's cluster starts, on the launcher's own path.)

The launch runs in a subprocess with its own Ray cluster (the point is the launcher's own choices, not
the test session's); the sockets and environments of that process tree are read with psutil.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.fixtures_tokenizer import prompts, reference, tiny_pair
from tools.loadgen import Target, burst, off_loopback, start_server, stop_server

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_PORT = 8265
SERVE_GRPC_PORT = 9000  # Serve's default gRPC proxy port: off unless gRPC servicers are configured
AGENT_PORT = 52365  # the dashboard agent's HTTP server (its job API runs even without the dashboard)
KEY_ENV = "SPECSERVE_TEST_API_KEY"
# The launch's only Ray-related setting from outside: Ray's usage report off (no traffic off this machine).
CLEAN_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}
MODEL = "tiny"
OVERLOAD, OVERLOAD_TOKENS, CAPACITY, REJECT_P99_S = 640, 8, 32 + 128, 1.0
ATTACH = "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); print('ATTACHED', flush=True)"


def _tree(pid: int) -> dict[int, psutil.Process]:
    try:
        root = psutil.Process(pid)
        return {p.pid: p for p in (root, *root.children(recursive=True))}
    except psutil.NoSuchProcess:
        return {}


def _name(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:90] or p.name()
    except psutil.Error:
        return "?"


def _sockets(pids) -> list:
    """Listening TCP sockets and bound UDP sockets of ``pids``."""
    out = []
    for c in psutil.net_connections(kind="inet"):
        if c.pid not in pids or not c.laddr:
            continue
        if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr):
            out.append(c)
    return out


def _log_dir(procs: dict[int, psutil.Process]) -> Path:
    for p in procs.values():
        for arg in p.cmdline() if "gcs_server" in _name(p) else ():
            if arg.startswith("--log_dir="):
                return Path(arg.split("=", 1)[1])
    raise AssertionError("no GCS process with --log_dir")


def _clean_env(state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(CLEAN_RAY_ENV)
    env.update({"XDG_STATE_HOME": str(state), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    return env


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("launch")
    state = folder / "state"
    config = folder / "minimal.yaml"
    # The models, the embedded default's router capacity and the key's variable: nothing about the network
    # or Ray, which is the launcher's to choose.
    pair = tiny_pair()
    config.write_text(f"target:\n  path: {pair.target}\n  max_model_len: 128\ndraft:\n  kind: model\n  path: {pair.draft}\n"
                      f"router:\n  stages: local\n  max_running: 32\n  max_queue: 128\n"
                      f"http:\n  api_key_env: {KEY_ENV}\n  model_name: {MODEL}\n")
    key = "sk-" + secrets.token_hex(16)
    proc, target = start_server(config, folder, {**_clean_env(state), KEY_ENV: key})
    try:
        yield {"proc": proc, "port": target.port, "key": key, "state": state, "folder": folder,
               "target": Target(target.host, target.port, api_key=key)}
    finally:
        stop_server(proc)


def test_every_socket_listens_on_loopback_only(launch):
    proc, port = launch["proc"], launch["port"]
    procs = _tree(proc.pid)
    sockets = _sockets(procs)
    table = sorted((c.laddr.ip, c.laddr.port, _name(procs[c.pid])) for c in sockets)
    print("\n".join(f"{ip:>18} {p:>5}  {name}" for ip, p, name in table))  # the record (run with -s)
    exposed = off_loopback(table)  # ::ffff:127.0.0.1 (a dual-stack socket bound to 127.0.0.1) is loopback
    assert not exposed, f"listening beyond loopback: {exposed}"
    # Ray itself, not only the launcher's own HTTP server: GCS, raylet, agents, replicas (Ray's own names).
    names = " ".join(name for _, _, name in table)
    for part in ("gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent", "ServeReplica", "ProxyActor"):
        assert part in names, (part, table)

    http = [c for c in sockets if c.laddr.port == port]
    assert {c.laddr.ip for c in http} == {"127.0.0.1"}, http
    # Served by the ingress replica itself, not Serve's proxy (deployments/loopback.direct_ingress_env).
    assert all("ServeReplica" in _name(procs[c.pid]) and "Ingress" in _name(procs[c.pid]) for c in http), http
    ports = {c.laddr.port for c in sockets}
    assert DASHBOARD_PORT not in ports, "the Ray dashboard listens"
    assert SERVE_GRPC_PORT not in ports, "Serve's gRPC proxy listens"


def test_token_file_is_private(launch):
    token = launch["state"] / "specserve" / "ray_token"
    mode = token.stat().st_mode
    assert stat.S_IMODE(mode) == 0o600, oct(mode)
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert len(token.read_text()) == 64


def test_job_submission_without_the_token_is_refused(launch):
    procs = _tree(launch["proc"].pid)
    marker = launch["folder"] / "job-ran"
    job = {"entrypoint": f"touch {marker}", "submission_id": "unauthenticated-probe"}
    answers = {}
    for c in _sockets(procs):
        if c.type != socket.SOCK_STREAM:
            continue
        try:
            r = httpx.post(f"http://127.0.0.1:{c.laddr.port}/api/job_agent/jobs/", json=job, timeout=5)
            answers[c.laddr.port] = (r.status_code, _name(procs[c.pid]))
        except httpx.HTTPError:  # gRPC servers: not HTTP/1.1
            continue
    assert not [a for a in answers.values() if 200 <= a[0] < 300], answers
    time.sleep(1.0)
    assert not marker.exists(), "an unauthenticated job ran"
    if AGENT_PORT not in answers:
        # Ray's agent port is fixed: while another Ray cluster on this machine holds it, this launch's agent
        # runs without its HTTP server (conftest runs this module before the session's cluster starts).
        log = _log_dir(procs) / "dashboard_agent.log"
        in_use = f"Failed to bind to port {AGENT_PORT}" in log.read_text(errors="replace")
        assert in_use, f"the dashboard agent's HTTP server is missing, and not for its port (see {log}): {answers}"
        pytest.skip(f"port {AGENT_PORT} was held by another Ray cluster: this launch's dashboard agent serves "
                    "no job API to try")
    code, name = answers[AGENT_PORT]
    assert code == 401 and "DashboardAgent" in name, answers
    # With the token the same server serves the job API: the 401 was the token's doing.
    token = (launch["state"] / "specserve" / "ray_token").read_text()
    r = httpx.get(f"http://127.0.0.1:{AGENT_PORT}/api/job_agent/jobs/unknown-job/logs",
                  headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert r.status_code not in (401, 403), r.text


def test_gcs_attach_needs_the_token(launch):
    procs = _tree(launch["proc"].pid)
    gcs = [c.laddr.port for c in _sockets(procs) if "gcs_server" in _name(procs[c.pid])]
    assert gcs, "no GCS listener found"
    token_path = str(launch["state"] / "specserve" / "ray_token")
    # The local-only variable, as a client of this cluster needs (deployments/loopback.py); few GCS retries
    # so that a refused client gives up in seconds.
    base = {**_clean_env(launch["state"] / "client"), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_NUM_REDIS_GET_RETRIES": "3", "HOME": str(launch["folder"])}  # no ~/.ray/auth_token
    clients = {
        "no auth": {"RAY_AUTH_MODE": "disabled"},
        "wrong token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
        "token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path},
    }
    running = {name: subprocess.Popen([sys.executable, "-c", ATTACH, f"127.0.0.1:{gcs[0]}"], env={**base, **extra},
                                      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name, extra in clients.items()}
    results = {}
    for name, p in running.items():
        try:
            out, err = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        results[name] = (p.returncode, out, err)
    assert "ATTACHED" in results["token"][1], results["token"][2][-2000:]
    for name in ("no auth", "wrong token"):
        code, out, err = results[name]
        assert "ATTACHED" not in out and code != 0, (name, out, err[-2000:])
        assert "token" in err.lower(), (name, err[-2000:])  # refused for the token, not for another reason


def test_api_key_reaches_only_the_ingress(launch):
    key, port = launch["key"], launch["port"]
    procs = _tree(launch["proc"].pid)
    holders = []
    for pid, p in procs.items():
        if pid == launch["proc"].pid:
            continue  # the launcher was started with the key in its environment, by the user
        try:
            env = p.environ()
            cmdline = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if key in cmdline or any(key in v for v in env.values()) or KEY_ENV in env:
            holders.append(_name(p))
    assert not holders, f"the API key is in the environment of: {holders}"
    base = f"http://127.0.0.1:{port}/v1/models"
    assert httpx.get(base, timeout=30).status_code == 401
    r = httpx.get(base, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"]


def test_overload_rejects_within_a_second_and_accepted_are_identical(launch):
    texts = prompts(4)
    for p in texts:
        reference(p, OVERLOAD_TOKENS)  # computed before the burst, not during it
    bodies = [{"model": MODEL, "prompt": texts[i % len(texts)], "max_tokens": OVERLOAD_TOKENS,
               "temperature": 0, "return_token_ids": True} for i in range(OVERLOAD)]
    t0 = time.perf_counter()
    results = asyncio.run(burst(launch["target"], bodies))
    wall = time.perf_counter() - t0
    assert {r.status for r in results} <= {200, 503, 429}, sorted({r.status for r in results}, key=str)
    rejected = sorted(r.latency_s for r in results if r.status != 200)
    accepted = [(i, r) for i, r in enumerate(results) if r.status == 200]
    p99 = rejected[min(len(rejected) - 1, int(0.99 * len(rejected)))]
    connects = sorted(r.connect_s for r in results if r.connect_s is not None)
    print(f"\n{OVERLOAD} concurrent: {len(accepted)} x 200, {len(rejected)} rejected in {wall:.1f} s; rejection "
          f"p50 {rejected[len(rejected) // 2] * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms, max {rejected[-1] * 1e3:.0f} ms "
          f"(from the request on the wire; opening the connections took up to {connects[-1] * 1e3:.0f} ms)")
    assert len(accepted) >= CAPACITY and len(rejected) >= 100, (len(accepted), len(rejected))
    for res in results:
        if res.status != 200:
            assert int(res.headers["retry-after"]) >= 1
            err = res.error_body
            assert err is not None and err["type"] == "server_overloaded" and err["code"] == "overloaded", res.body
    for i, res in accepted:
        ids, text, finish = reference(texts[i % len(texts)], OVERLOAD_TOKENS)
        assert (res.token_ids, res.text, res.finish_reason) == (list(ids), text, finish), res.body[:300]
    assert p99 <= REJECT_P99_S, p99

"""The host lab (``tools.hostlab``) on real namespaces: hosts that reach each other and nothing else, sshd on
each lab address only, netem delay and loss, a partition, a killed host, and teardown that leaves nothing,
also after a run that was killed. Each test puts back what it changes on the shared lab."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.lab.conftest import LIFECYCLE_NET, LIFECYCLE_PREFIX, leftovers
from tools.hostlab import NETEM_MISSING, HostLab, NetemUnavailable

REPO = Path(__file__).resolve().parents[2]


def ping(lab, src, dst, count=1, wait_s=1, interval_s=0.2) -> subprocess.CompletedProcess:
    return lab.exec(src, ["ping", "-n", "-q", "-c", str(count), "-i", str(interval_s), "-W", str(wait_s),
                          getattr(dst, "address", dst)])


def min_rtt_ms(lab, src, dst, count=5) -> float:
    out = ping(lab, src, dst, count=count)
    assert out.returncode == 0, out.stdout + out.stderr
    return float(re.search(r"= ([\d.]+)/", out.stdout).group(1))  # rtt min/avg/max/mdev = a/b/c/d ms


def connect(address, timeout_s=1.0) -> str:
    try:
        socket.create_connection((address, 22), timeout=timeout_s).close()
        return "open"
    except ConnectionRefusedError:
        return "refused"
    except OSError:  # timed out, unreachable
        return "silent"


def test_hosts_reach_each_other_and_this_machine(lab):
    for src in lab.hosts:
        for dst in lab.hosts:
            if dst != src:
                out = ping(lab, src, dst)
                assert out.returncode == 0, f"{src.name} -> {dst.name}: {out.stdout}{out.stderr}"
        assert connect(src.address) == "open"  # this machine reaches each host's sshd over the bridge


def test_ssh_lands_on_the_host_and_the_host_sees_only_the_lab(lab):
    for host in lab.hosts:
        out = lab.ssh(host, "ip -4 -o addr show; echo ---; ip -4 route show")
        assert out.returncode == 0, out.stderr
        addrs, routes = out.stdout.split("---\n")
        assert set(re.findall(r"inet (\S+)", addrs)) == {"127.0.0.1/8", f"{host.address}/24"}
        # The lab's /24 and a default route to the sink, an address no one holds: a host finds its own
        # address as a real one does, and nothing it sends can leave the lab.
        assert sorted(line.strip() for line in routes.splitlines()) == sorted([f"default via {lab.sink} dev eth0",
                                                       f"{lab.subnet} dev eth0 proto kernel scope link src {host.address}"])
        assert ping(lab, host, lab.sink).returncode != 0


def test_ssh_config_works_with_ssh_F(lab):
    host = lab.hosts[1]
    out = subprocess.run(["ssh", "-F", str(lab.config_file), host.name, "ip -4 -o addr show dev eth0"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and host.address in out.stdout, out.stderr


def test_sshd_listens_only_on_the_lab_address(lab):
    for host in lab.hosts:
        out = lab.exec(host, ["ss", "-ltnH"])
        assert [line.split()[3] for line in out.stdout.splitlines()] == [f"{host.address}:22"], out.stdout


def test_netem_adds_delay_and_loss(lab):
    if not lab.netem_available():
        pytest.skip(NETEM_MISSING)
    a, b = lab.hosts[0], lab.hosts[1]
    assert min_rtt_ms(lab, a, b) < 5
    try:
        lab.netem(b, delay_ms=40)
        # Delayed both ways on b's link: a round trip gains 2 x 40 ms.
        assert min_rtt_ms(lab, a, b) >= 2 * 40 * 0.95
        lab.netem(b, loss_pct=100)
        assert ping(lab, a, b, count=2).returncode != 0
    finally:
        lab.clear_netem(b)
    assert min_rtt_ms(lab, a, b) < 5


def test_netem_without_the_kernels_netem_says_so_and_changes_nothing(lab):
    if lab.netem_available():
        pytest.skip("this kernel has netem: test_netem_adds_delay_and_loss checks it")
    b = lab.hosts[1]
    with pytest.raises(NetemUnavailable, match="CONFIG_NET_SCH_NETEM"):
        lab.netem(b, delay_ms=40)
    for netns in ([], ["-n", b.name]):
        qdiscs = subprocess.run(["tc", *netns, "qdisc", "show", "dev", "eth0" if netns else b.name],
                                capture_output=True, text=True).stdout
        assert "netem" not in qdiscs
    assert min_rtt_ms(lab, lab.hosts[0], b) < 5


def test_link_down_partitions_the_host_and_link_up_restores_it(lab):
    a, c = lab.hosts[0], lab.hosts[2]
    try:
        lab.link_down(c)
        assert ping(lab, a, c).returncode != 0
        assert connect(c.address, timeout_s=0.5) == "silent"
        assert lab.exec(c, ["ip", "netns", "identify"]).returncode == 0  # the host itself lives on
    finally:
        lab.link_up(c)
    assert any(ping(lab, a, c, wait_s=2).returncode == 0 for _ in range(5))
    assert lab.ssh(c, "true").returncode == 0


def test_kill_host_kills_everything_in_it_and_sshd_restarts(lab):
    c = lab.hosts[2]
    pids = subprocess.run(["ip", "netns", "pids", c.name], capture_output=True, text=True).stdout.split()
    assert pids  # its sshd
    lab.kill_host(c)
    assert subprocess.run(["ip", "netns", "pids", c.name], capture_output=True, text=True).stdout.split() == []
    deadline = time.monotonic() + 5  # a killed process lingers as a zombie until its reaper (init) collects it
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert connect(c.address) == "refused"  # the host's kernel answers; nothing listens
    lab.restart_sshd(c)
    assert lab.ssh(c, "true").returncode == 0


def test_a_host_sees_only_its_own_processes(lab):
    """What a session starts on one host is invisible to another's, so a host's ``ray stop`` (which the shipped
    start commands run first) stops that host's Ray only."""
    a, b = lab.hosts[0], lab.hosts[1]
    sleeper = lab.ssh(a, "nohup sleep 300 >/dev/null 2>&1 & echo $!")
    assert sleeper.returncode == 0, sleeper.stderr
    try:
        assert "sleep 300" in lab.ssh(a, "ps -eo args").stdout
        assert "sleep 300" not in lab.ssh(b, "ps -eo args").stdout
        assert lab.ssh(b, "pkill -x sleep; true").returncode == 0  # -x: by name (-f would match this shell)
        assert "sleep 300" in lab.ssh(a, "ps -eo args").stdout  # b could not reach it
    finally:
        lab.ssh(a, "pkill -x sleep; true")


def test_two_hosts_form_one_ray_cluster_with_token_auth(lab, tmp_path):
    """The first step of ``ray up`` into the lab by hand: a Ray head on one host and a worker on another join
    over the lab network with token auth, the worker's role resource shows on the head, a client without the
    token is refused, and ``ray stop`` on the worker leaves the head running."""
    head, worker = lab.hosts[0], lab.hosts[1]
    token = tmp_path / "ray_token"
    token.write_text(os.urandom(32).hex())
    token.chmod(0o600)
    ray = str(Path(sys.executable).with_name("ray"))
    env = f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token} RAY_USAGE_STATS_ENABLED=0;"
    gcs = f"{head.address}:6379"
    try:
        started = lab.ssh(head, f"{env} {ray} start --head --port=6379 "
                                "--include-dashboard=false --num-cpus=1 --disable-usage-stats", timeout=120)
        assert started.returncode == 0, started.stdout + started.stderr
        joined = lab.ssh(worker, f"{env} {ray} start --address={gcs} "
                                 "--num-cpus=1 --resources='{\"specserve_draft\": 1}' --disable-usage-stats",
                         timeout=120)
        assert joined.returncode == 0, joined.stdout + joined.stderr
        deadline = time.monotonic() + 90  # the autoscaler's status lists a new node at its next update
        while True:
            status = lab.ssh(head, f"{env} {ray} status --address={gcs}", timeout=60)
            joined_both = len(re.findall(r"^ 1 node_", status.stdout, re.M)) == 2
            if joined_both or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert joined_both and "0.0/1.0 specserve_draft" in status.stdout, status.stdout + status.stderr
        other = token.with_name("other_token")
        other.write_text(os.urandom(32).hex())
        refused = lab.ssh(worker, f"export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={other}; "
                                  f"timeout 60 {ray} status --address={gcs}", timeout=90)
        assert refused.returncode != 0 and "specserve_draft" not in refused.stdout
        assert lab.ssh(worker, f"{ray} stop").returncode == 0
        assert "raylet" not in lab.ssh(worker, "ps -eo comm").stdout
        assert "raylet" in lab.ssh(head, "ps -eo comm").stdout
    finally:
        for host in (worker, head):
            lab.ssh(host, f"{ray} stop --force", timeout=60)


def test_close_leaves_nothing(make_lab):
    prefix = LIFECYCLE_PREFIX
    lab = make_lab(2).start()
    assert lab.ssh(lab.hosts[0], "true").returncode == 0
    assert len(leftovers(prefix)) >= 2 + 3 + 2 + 1  # namespaces, links, sshds, the lab dir
    lab.close()
    assert leftovers(prefix) == []
    lab.close()  # twice is fine


def names_any(item: str, *names: str) -> bool:
    """Whether ``item`` names one of ``names`` whole: a lab dir /tmp/spec-t2-x1b2c3 does not name spec-t2-x."""
    return any(re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", item) for name in names)


def test_the_next_lab_cleans_up_after_a_killed_one(make_lab):
    prefix = LIFECYCLE_PREFIX
    # A real killed run: the CLI brings a lab up and is SIGKILLed, leaving its sshd, namespace, links, dir.
    cli = subprocess.Popen([sys.executable, str(REPO / "scripts/hostlab.py"), "--prefix", prefix,
                            "up", "1", "--net", str(LIFECYCLE_NET)], stdout=subprocess.PIPE, text=True)
    hung = threading.Timer(30, cli.kill)  # a CLI that hangs silently ends the readline below too
    hung.start()
    try:
        while "ready" not in (line := cli.stdout.readline()):
            assert line, "the CLI exited or hung before its lab was up"
    finally:
        hung.cancel()
        cli.send_signal(signal.SIGKILL)
        cli.wait()
        cli.stdout.close()
    # And a namespace and a link made by hand, with a process in the namespace.
    subprocess.run(["ip", "netns", "add", f"{prefix}-h7"], check=True)
    subprocess.run(["ip", "link", "add", f"{prefix}-x", "type", "veth", "peer", "name", f"{prefix}-y"], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", f"{prefix}-h7", "sleep", "600"])
    before = leftovers(prefix)
    assert any("sshd" in item for item in before) and any("-h7" in item for item in before), before
    with make_lab(1) as lab:
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        now = leftovers(prefix)
        assert not [item for item in now if names_any(item, f"{prefix}-h7", f"{prefix}-x")], now
        assert not set(before) & {i for i in now if i.startswith(("process", "dir"))}, now  # old sshd, old dir
        assert lab.ssh(lab.hosts[0], "true").returncode == 0
    assert leftovers(prefix) == []


def test_a_lab_that_fails_halfway_through_its_start_leaves_nothing(make_lab, monkeypatch):
    add_host = HostLab._add_host

    def add_then_fail(self, host):
        add_host(self, host)  # its namespace, veth and sshd config exist
        if host == self.hosts[1]:
            raise RuntimeError("injected")

    monkeypatch.setattr(HostLab, "_add_host", add_then_fail)
    lab = make_lab(3)
    with pytest.raises(RuntimeError, match="injected"):
        lab.start()
    assert leftovers(LIFECYCLE_PREFIX) == []

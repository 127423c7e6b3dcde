"""The host lab's fixture (``tools.hostlab``): three namespace hosts with sshd, shared by a test module.

The lab needs root, ``ip``/``tc``/``ssh``/``ssh-keygen``/``ping``/sshd (scripts/setup_env.sh installs them)
and a kernel that lets us create network namespaces; without any of them the tests skip and say why.
A lab that then fails to start is a failure, not a skip. The tests' labs use their own prefixes and
subnets, so a developer's ``scripts/hostlab.py up`` (``spec-lab``, 198.18.0.0/24) keeps running meanwhile.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tools.hostlab import HostLab, cleanup_stale, missing_tools

PREFIX, NET = "spec-t1", 1  # the shared lab: 198.18.1.0/24
LIFECYCLE_PREFIX, LIFECYCLE_NET = "spec-t2", 2  # the labs that tests start, kill and tear down themselves


def lab_skip_reason(prefix: str) -> str | None:
    if os.geteuid() != 0:
        return "the host lab needs root (network namespaces, veths, sshd)"
    if missing := missing_tools():
        return f"the host lab needs {', '.join(missing)} (scripts/setup_env.sh installs them with apt)"
    probe = f"{prefix}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def net_namespace_ids(prefix: str) -> set[str]:
    """The kernel's ids (``net:[inode]``) of the lab's network namespaces, as /proc/PID/ns/net names them."""
    return {f"net:[{os.stat(path).st_ino}]" for path in Path("/run/netns").glob(prefix + "-*")}


def leftovers(prefix: str, namespace_ids: set[str] = frozenset()) -> list[str]:
    """Anything carrying ``prefix``, read straight from ip, /proc and /tmp (not through tools.hostlab), and
    any process still in one of ``namespace_ids`` (a Ray process on a lab host names no prefix)."""
    found = [f"netns {line}" for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
             .stdout.splitlines() if prefix in line]
    found += [f"link {line}" for line in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True)
              .stdout.splitlines() if prefix in line]
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            net = os.readlink(proc / "ns" / "net")
        except OSError:
            continue
        if (prefix in cmdline or net in namespace_ids) and int(proc.name) != os.getpid():
            found.append(f"process {proc.name} ({net}): {cmdline}")
    found += [f"dir {p}" for p in Path("/tmp").glob(prefix + "-*")]
    return found


@pytest.fixture(scope="module")
def lab():
    if reason := lab_skip_reason(PREFIX):
        pytest.skip(reason)
    lab = HostLab(3, prefix=PREFIX, net=NET)
    lab.start()  # tears down what it made if it fails
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture
def make_lab():
    """For tests that start, kill and close their own labs (prefix ``LIFECYCLE_PREFIX``): skips like ``lab``;
    afterwards closes the labs it made and removes whatever else carries the prefix (a killed CLI's lab),
    whether or not the test got as far as its own teardown."""
    if reason := lab_skip_reason(LIFECYCLE_PREFIX):
        pytest.skip(reason)
    labs = []

    def make(n: int) -> HostLab:
        labs.append(HostLab(n, prefix=LIFECYCLE_PREFIX, net=LIFECYCLE_NET))
        return labs[-1]

    try:
        yield make
    finally:
        for made in labs:
            made.close()
        cleanup_stale(LIFECYCLE_PREFIX)

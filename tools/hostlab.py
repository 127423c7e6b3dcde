"""A host lab: N "hosts" on this machine, each a Linux network namespace with its own address and sshd.

A host has its own network, its own process table (its sshd is the first process of a PID namespace, so
what a session starts sees only that host's processes), its own home directory (root's home is the lab's
``<host>/home``, through a copy of ``/etc/passwd`` mounted in the host's mount namespace) and its own
``/tmp/ray`` (Ray's session files: sockets, logs); otherwise the hosts share this machine's filesystem.
``home_links`` puts the same symlinks in every home, standing for what a machine image would hold (an
installed checkout at ``~/specserve``, say). They hang off
a private bridge with no uplink, on a subnet of 198.18.0.0/15 (RFC 2544's benchmarking range, routed
nowhere): by default 198.18.0.0/24, this machine's end of the bridge .1, the hosts .11, .12, ... A host's
default route points at .254, an address no one holds (the sink): software that finds "its" address by
asking the kernel for a route to the internet (Ray does) gets the host's lab address, as on a real host,
while a packet sent that way is never answered nor forwarded, so nothing a host sends can leave the lab. A
lab refuses a subnet this machine already routes elsewhere.

Everything a lab makes carries its prefix (default ``spec-lab``): the namespaces and the veths' ends on this
machine (``spec-lab-h1`` ...), the bridge (``spec-lab-br``), the lab directory (``/tmp/spec-lab-XXXX``, 0700:
keys, sshd configs and logs). A lock (``/tmp/spec-lab.lock``) allows one live lab per prefix, so the
``cleanup_stale`` that a lab runs at start removes only what a killed run left behind, and a second lab
with the same prefix waits for the first instead of tearing it down.

    with HostLab(3) as lab:
        lab.ssh(lab.hosts[0], "hostname -I")
        lab.netem(lab.hosts[1], delay_ms=20)

``ssh_config()`` is a config for ``ssh -F`` (user root, the lab key, host keys not pinned), so Ray's cluster
launcher (local provider, ``auth: ssh_user: root, ssh_private_key: lab.key_file``) can reach the hosts too.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "spec-lab"
SSHD = "/usr/sbin/sshd"  # sshd refuses to start unless invoked by its absolute path
REQUIRED = ("ip", "tc", "ssh", "ssh-keygen", "ping", "unshare", SSHD)
IFNAMSIZ = 15  # Linux interface names: at most 15 characters, so link names are the short prefix + "-h<i>"
# The lab's host keys are new each run, so they are not pinned; BatchMode: fail rather than prompt.
SSH_OPTIONS = ("-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
               "-o", "IdentitiesOnly=yes", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=5")
RAY_TMP = "/tmp/ray"  # Ray's default temp dir: each host mounts its own there
NETEM_MISSING = "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): it cannot delay or drop packets"


class NetemUnavailable(RuntimeError):
    """This kernel cannot delay or drop packets (built without netem)."""


@dataclass(frozen=True)
class Host:
    name: str  # the namespace's name, and that of its veth's end on this machine
    address: str


def _with_home(passwd_line: str, home: Path) -> str:
    fields = passwd_line.rstrip("\n").split(":")
    fields[5] = str(home)
    return ":".join(fields) + "\n"


def missing_tools() -> list[str]:
    return [tool for tool in REQUIRED if shutil.which(tool) is None]


def _run(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=timeout)


def _ours(name: str, prefix: str) -> bool:
    return name.startswith(prefix + "-")


def lab_namespaces(prefix: str = PREFIX) -> list[str]:
    lines = _run("ip", "netns", "list").stdout.splitlines()  # "name (id: 3)" or "name"
    return [line.split()[0] for line in lines if line and _ours(line.split()[0], prefix)]


def lab_links(prefix: str = PREFIX) -> list[str]:
    lines = _run("ip", "-o", "link", "show").stdout.splitlines()  # "7: name@peer: <FLAGS> ..."
    names = [line.split(":")[1].strip().split("@")[0] for line in lines if ":" in line]
    return [name for name in names if _ours(name, prefix)]


def lab_dirs(prefix: str = PREFIX) -> list[Path]:
    return sorted(Path(tempfile.gettempdir()).glob(prefix + "-*"))


def lab_processes(prefix: str = PREFIX) -> list[int]:
    """Processes outside any namespace we still know of whose command line names a lab directory (an sshd
    whose namespace was deleted under it keeps running, unreachable, in a namespace nobody names)."""
    marker = os.path.join(tempfile.gettempdir(), prefix + "-").encode()
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (proc / "cmdline").read_bytes() and int(proc.name) != os.getpid():
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return pids


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def netns_pids(ns: str) -> list[int]:
    return [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]


def _kill_netns(ns: str, wait_s: float = 5) -> None:
    """SIGKILL every process in ``ns`` and wait until the kernel lists none (they exit asynchronously)."""
    deadline = time.monotonic() + wait_s
    while (pids := netns_pids(ns)) and time.monotonic() < deadline:
        _kill(pids)
        time.sleep(0.05)


def lock_path(prefix: str = PREFIX) -> str:
    return os.path.join(tempfile.gettempdir(), f"{prefix}.lock")


def lock_holder(prefix: str = PREFIX) -> int | None:
    """The pid of the live lab with this prefix, or None when no lab holds the lock."""
    try:
        with open(lock_path(prefix)) as f:
            return None if _try_flock(f, fcntl.LOCK_SH) else int(f.read().strip() or 0) or None
    except FileNotFoundError:
        return None


def _try_flock(f, kind: int) -> bool:
    try:
        fcntl.flock(f, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Remove everything carrying ``prefix``: processes, namespaces, links, lab directories. Never raises
    on a piece that is already gone; returns what it removed. Call it only while holding the prefix's lock
    (``HostLab`` does), or when no lab of that prefix is running."""
    removed = []
    for ns in lab_namespaces(prefix):
        _kill_netns(ns)
    _kill(lab_processes(prefix))
    # Links before namespaces: deleting a veth's host end removes its peer at once, whereas a deleted
    # namespace's devices go away later, in the kernel's own time.
    for link in lab_links(prefix):
        if _run("ip", "link", "del", link, check=False).returncode == 0:
            removed.append(f"link {link}")
    for ns in lab_namespaces(prefix):
        if _run("ip", "netns", "del", ns, check=False).returncode == 0:
            removed.append(f"netns {ns}")
    for d in lab_dirs(prefix):
        shutil.rmtree(d, ignore_errors=True)
        removed.append(f"dir {d}")
    return removed


def _check_subnet_free(subnet: ipaddress.IPv4Network) -> None:
    """Refuse a subnet this machine already routes somewhere (a real network that happens to use it):
    the lab's bridge must be the only way to its addresses."""
    for line in _run("ip", "-4", "route", "show").stdout.splitlines():
        for word in line.split()[:2]:  # "198.18.0.0/24 dev ..." or "unreachable 198.18.0.0/16 ..."
            try:
                dst = ipaddress.ip_network(word, strict=False)
            except ValueError:  # "default", a route type
                continue
            if dst.overlaps(subnet):
                raise RuntimeError(f"{subnet} is already routed on this machine ({line.strip()}); pick another net=")


class HostLab:
    def __init__(self, n: int = 3, prefix: str = PREFIX, net: int = 0, lock_timeout_s: float = 180,
                 home_links: dict[str, Path] | None = None):
        if not 1 <= n <= 89:
            raise ValueError("1 to 89 hosts (addresses .11 to .99)")
        if len(f"{prefix}-h{n}") > IFNAMSIZ or len(f"{prefix}-br") > IFNAMSIZ:
            raise ValueError(f"prefix {prefix!r} too long for interface names ({IFNAMSIZ} characters)")
        self.prefix, self.net, self.lock_timeout_s = prefix, net, lock_timeout_s
        self.home_links = dict(home_links or {})
        self.subnet = ipaddress.ip_network(f"198.18.{net}.0/24")  # net 0..255: all inside 198.18.0.0/15
        self.gateway = str(self.subnet[1])
        self.sink = str(self.subnet[254])  # the hosts' default route: a neighbour that never answers
        self.bridge = f"{prefix}-br"
        self.hosts = [Host(f"{prefix}-h{i}", str(self.subnet[10 + i])) for i in range(1, n + 1)]
        self.dir: Path | None = None
        self._sshd: dict[str, subprocess.Popen] = {}
        self._lock = None

    def __enter__(self) -> HostLab:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> HostLab:
        self._acquire_lock()
        try:
            cleanup_stale(self.prefix)
            _check_subnet_free(self.subnet)
            self.dir = Path(tempfile.mkdtemp(prefix=self.prefix + "-"))  # 0700
            self.key_file = self.dir / "id_ed25519"
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.prefix, "-f", str(self.key_file))
            # The bridge ignores this machine's iptables (nf_call_iptables 0): a host firewall's FORWARD
            # policy must not decide whether two lab hosts can talk. No STP, so a port forwards at once.
            _run("ip", "link", "add", self.bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0",
                 "nf_call_iptables", "0")
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
            for host in self.hosts:
                self._add_host(host)
            for host in self.hosts:
                self.restart_sshd(host)
            self.config_file = self.dir / "ssh_config"
            self.config_file.write_text(self.ssh_config())
        except BaseException:
            self.close()
            raise
        return self

    def _acquire_lock(self) -> None:
        # The lock file stays in /tmp after close: removing it would let a waiter lock a deleted file.
        lock = open(lock_path(self.prefix), "a+")
        deadline = time.monotonic() + self.lock_timeout_s
        while not _try_flock(lock, fcntl.LOCK_EX):
            if time.monotonic() > deadline:
                lock.close()
                raise TimeoutError(f"another {self.prefix} lab is running (lock {lock_path(self.prefix)})")
            time.sleep(0.5)
        self._lock = lock
        self._lock.truncate(0)
        self._lock.write(f"{os.getpid()}\n")  # for `scripts/hostlab.py status`
        self._lock.flush()

    def _add_host(self, host: Host) -> None:
        ns = host.name
        _run("ip", "netns", "add", ns)
        # The veth's far end is created inside the namespace as eth0; its near end joins the bridge.
        _run("ip", "link", "add", ns, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", ns, "master", self.bridge, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "route", "add", "default", "via", self.sink, "dev", "eth0")
        hdir = self.dir / ns
        hdir.mkdir(mode=0o700)
        home = hdir / "home"
        home.mkdir(mode=0o700)
        (home / ".bashrc").touch()  # as /etc/skel gives a user: Ray's launcher sources it in every command
        for name, target in self.home_links.items():
            (home / name).symlink_to(target)  # a symlink, not a mount: removing the lab never enters it
        (hdir / "ray").mkdir(mode=0o700)
        (hdir / "passwd").write_text("".join(
            _with_home(line, home) if line.startswith("root:") else line
            for line in Path("/etc/passwd").read_text().splitlines(keepends=True)))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", ns, "-f", str(hdir / "host_key"))
        (hdir / "sshd_config").write_text("\n".join([
            f"ListenAddress {host.address}:22",
            f"HostKey {hdir / 'host_key'}",
            f"PidFile {hdir / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.key_file}.pub",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            # The lab directory is under /tmp, which is world-writable: StrictModes would refuse any key there.
            "StrictModes no",
            # scp speaks sftp since OpenSSH 9; Ray's launcher copies files with rsync or scp.
            "Subsystem sftp internal-sftp",
            ""]))

    def close(self) -> None:
        """Tear everything down, whatever state ``start`` reached; safe to call twice."""
        if self._lock is None:  # never started, or closed: what carries the prefix now is not ours
            return
        for proc in self._sshd.values():
            proc.kill()
        cleanup_stale(self.prefix)  # every name with our prefix is ours while we hold the lock
        for proc in self._sshd.values():
            proc.wait(timeout=10)  # reap them: no zombies left in the process list
        self._sshd.clear()
        self._lock.close()  # releases the flock
        self._lock = None

    # -- using the hosts -----------------------------------------------------------------------------------

    def host(self, host: Host | str) -> Host:
        name = host.name if isinstance(host, Host) else host
        return next(h for h in self.hosts if h.name == name)

    def home(self, host: Host | str) -> Path:
        """The host's home directory (root's, as its sessions see it), a path on this machine too."""
        return self.dir / self.host(host).name / "home"

    def exec(self, host: Host | str, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """Run ``argv`` inside the host's namespace (as root, on this machine's filesystem)."""
        return _run("ip", "netns", "exec", self.host(host).name, *argv, check=False, timeout=timeout)

    def ssh(self, host: Host | str, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return _run("ssh", "-i", str(self.key_file), *SSH_OPTIONS, f"root@{self.host(host).address}", command,
                    check=False, timeout=timeout)

    def ssh_config(self) -> str:
        """For ``ssh -F``: the hosts by name, then what every lab host (by name or address) shares."""
        named = [f"Host {h.name}\n  HostName {h.address}\n" for h in self.hosts]
        shared = [f"Host {self.prefix}-h* 198.18.{self.net}.*", "  User root",
                  f"  IdentityFile {self.key_file}"] + ["  " + opt.replace("=", " ") for opt in SSH_OPTIONS[1::2]]
        return "".join(named) + "\n".join(shared) + "\n"

    def restart_sshd(self, host: Host | str, wait_s: float = 10) -> None:
        host = self.host(host)
        if (old := self._sshd.pop(host.name, None)) is not None:
            old.kill()
            old.wait(timeout=10)
        hdir = self.dir / host.name
        log = open(hdir / "sshd.log", "ab")
        # -D: stay in the foreground (our child, so close() can reap it); -e: log to the lab's log file. sshd is
        # the first process of a PID namespace of its own, so what a session starts sees only its host's
        # processes: `ray stop` in a host's start commands must not stop the other hosts' Ray. --kill-child:
        # when unshare dies, so does sshd, and with it everything in the namespace.
        # Its mount namespace (private: nothing mounted there shows on this machine) gets the host's passwd,
        # so root's home is the host's own, and the host's own /tmp/ray.
        os.makedirs(RAY_TMP, exist_ok=True)  # the mount point
        mounts = f"mount --bind {hdir / 'passwd'} /etc/passwd && mount --bind {hdir / 'ray'} {RAY_TMP}"
        self._sshd[host.name] = proc = subprocess.Popen(
            ["ip", "netns", "exec", host.name, "unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
             "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sshd",
             SSHD, "-D", "-e", "-f", str(hdir / "sshd_config")],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + wait_s
        while True:
            try:
                socket.create_connection((host.address, 22), timeout=1).close()
                return
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (hdir / "sshd.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"sshd on {host.name} did not come up:\n{tail}") from None
                time.sleep(0.05)

    def kill_host(self, host: Host | str) -> None:
        """SIGKILL every process in the host's namespace (its sshd and whatever ssh started there)."""
        host = self.host(host)
        _kill_netns(host.name)
        if (proc := self._sshd.pop(host.name, None)) is not None:
            proc.wait(timeout=10)

    # -- the host's link ----------------------------------------------------------------------------------

    def netem(self, host: Host | str, delay_ms: float = 0, jitter_ms: float = 0, loss_pct: float = 0) -> None:
        """Delay (± jitter) and drop packets on the host's link, in both directions: netem on the veth's
        near end delays what reaches the host, and on its far end (eth0) what the host sends. A round trip
        through one such host so gains 2 × delay_ms and loses about 2 × loss_pct of its packets. Raises
        ``NetemUnavailable`` on a kernel built without netem (``netem_available``)."""
        host = self.host(host)
        spec = ["netem", "delay", f"{delay_ms}ms", f"{jitter_ms}ms", "loss", f"{loss_pct}%"]
        for netns in ([], ["-n", host.name]):
            out = _run("tc", *netns, "qdisc", "replace", "dev", "eth0" if netns else host.name, "root", *spec,
                       check=False)
            if out.returncode != 0:
                self.clear_netem(host)  # never leave one direction impaired
                if "kind is unknown" in out.stderr:
                    raise NetemUnavailable(NETEM_MISSING)
                raise RuntimeError(f"tc netem on {host.name}: {out.stderr.strip()}")

    def netem_available(self) -> bool:
        """Whether this kernel has the netem qdisc (tried on the lab's bridge, then removed)."""
        ok = _run("tc", "qdisc", "replace", "dev", self.bridge, "root", "netem", check=False).returncode == 0
        _run("tc", "qdisc", "del", "dev", self.bridge, "root", check=False)
        return ok

    def clear_netem(self, host: Host | str) -> None:
        host = self.host(host)
        _run("tc", "qdisc", "del", "dev", host.name, "root", check=False)
        _run("tc", "-n", host.name, "qdisc", "del", "dev", "eth0", "root", check=False)

    def link_down(self, host: Host | str) -> None:
        """Partition the host: its veth's near end goes down, so the bridge (every other host and this
        machine) loses it; its processes keep running."""
        _run("ip", "link", "set", self.host(host).name, "down")

    def link_up(self, host: Host | str) -> None:
        _run("ip", "link", "set", self.host(host).name, "up")

"""specserve on the host lab with `ray up`: a head, "target" and "draft" hosts, brought up and down by the
unchanged ``ray up`` / ``ray down`` from this machine (the operator's), over SSH.

The cluster file is ``tools.ray_launch.on_prem`` — the shipped on-prem file's function — with the lab's
addresses, its SSH key, and the token, API key and Serve config the lab writes into its directory: the
set-up and start commands the hosts run are the shipped ones. Every host's ``~/specserve`` is this checkout
(``HostLab(home_links=...)``), as a machine image would hold it, so the set-up command finds the
environment installed and the hosts need no network.

    with HostLab(4, home_links=LabCluster.HOME_LINKS) as lab:
        cluster = LabCluster(lab, targets=2, drafts=1)
        cluster.up()               # `ray up -y`; then wait until /health answers
        ...                        # cluster.base_url, cluster.api_key, cluster.on_head(...)
        cluster.down()             # `ray down -y`

No Ray import: the test process is the operator's machine, outside the cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from cluster.config import ClusterConfig
from tools.hostlab import HostLab
from tools.ray_launch import API_KEY, INSTALL, RAY_ENV, RAY_TOKEN, HostPool, on_prem, render, tls_env, tls_mounts
from tools.tls_certs import make_certs
from tools.serve_config import REPO, dump_yaml, serve_config

LAB_CONFIG = REPO / "cluster" / "examples" / "lab.yaml"
RAY_CLI = str(Path(sys.executable).with_name("ray"))  # this checkout's Ray, as the operator runs it
CLIENT_ENV = RAY_ENV + tls_env()  # a Ray client on a lab host: the token and the TLS files the nodes use
TARGET_ROLE, DRAFT_ROLE, FRONT_ROLE = {"specserve_target": 1}, {"specserve_draft": 1}, {"specserve_front": 1}


class LabCluster:
    HOME_LINKS = {"specserve": REPO}  # ~/specserve on every host: tools.ray_launch.INSTALL

    def __init__(self, lab: HostLab, *, targets: int = 2, drafts: int = 1, spare_drafts: int = 0,
                 config: Path = LAB_CONFIG, idle_timeout_minutes: float | None = None):
        """Hosts in order: the head, ``targets`` target hosts, ``drafts`` draft hosts that ``ray up`` starts,
        ``spare_drafts`` more that the autoscaler starts when draft replicas wait for room (and stops after
        ``idle_timeout_minutes`` idle); any further lab host is not in the cluster (an outsider on the same
        network)."""
        need = 1 + targets + drafts + spare_drafts
        if len(lab.hosts) < need:
            raise ValueError(f"the lab has {len(lab.hosts)} hosts; this cluster needs {need}")
        if INSTALL != "~/" + next(iter(self.HOME_LINKS)):
            raise AssertionError("HOME_LINKS must provide tools.ray_launch.INSTALL")
        self.lab = lab
        self.head = lab.hosts[0]
        self.targets = lab.hosts[1:1 + targets]
        self.drafts = lab.hosts[1 + targets:need]  # the draft pool's hosts, spares last
        self.min_drafts = drafts
        self.outsiders = lab.hosts[need:]
        self.members = [self.head, *self.targets, *self.drafts]
        self.idle_timeout_minutes = idle_timeout_minutes
        self.config = config
        self.dir = lab.dir
        self.cluster_file = self.dir / "cluster.yaml"
        self.token_file, self.key_file = self.dir / "ray_token", self.dir / "api_key"
        self.tls_dir = self.dir / "tls"  # the CA and node certificate for Ray's TLS (tools.tls_certs)
        self.api_key = os.urandom(24).hex()
        self.cfg = self._serve_cfg()
        self.base_url = f"http://{self.head.address}:{self.cfg.http.port}"

    def _serve_cfg(self) -> ClusterConfig:
        data = yaml.safe_load(self.config.read_text(encoding="utf-8"))
        for role in ("target", "draft"):
            path = data[role].get("path")
            if path and not path.startswith("builtin:") and not os.path.isabs(path):
                data[role]["path"] = str(REPO / path)  # every host sees this checkout at this path
        return ClusterConfig.from_dict(data)

    def write_files(self) -> Path:
        """The Ray token, the API key, the TLS certificates, the Serve config and the cluster file, in the
        lab's directory (0700)."""
        for path, text in ((self.token_file, os.urandom(32).hex()), (self.key_file, self.api_key)):
            path.write_text(text + "\n")
            path.chmod(0o600)
        if not (self.tls_dir / "ca.crt").exists():
            make_certs(self.tls_dir, [h.address for h in self.members])
        serve_file = self.dir / "serve.yaml"
        serve_file.write_text(dump_yaml(serve_config(self.cfg)))
        pools = [HostPool("target", TARGET_ROLE, [h.address for h in self.targets]),
                 HostPool("draft", DRAFT_ROLE, [h.address for h in self.drafts], min_hosts=self.min_drafts)]
        spec = on_prem(self.lab.prefix, str(serve_file), self.head.address, pools, ssh_user="root",
                       ssh_private_key=str(self.lab.key_file),
                       mounts={RAY_TOKEN: str(self.token_file), API_KEY: str(self.key_file),
                               **tls_mounts(str(self.tls_dir))},
                       head_resources=FRONT_ROLE, tls=True, idle_timeout_minutes=self.idle_timeout_minutes,
                       header="The host lab's cluster (tools/lab_cluster.py).")
        self.cluster_file.write_text(render(spec))
        return self.cluster_file

    # -- ray up / ray down ----------------------------------------------------------------------------

    def _ray(self, *argv: str, timeout_s: float) -> subprocess.CompletedProcess:
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        return subprocess.run([RAY_CLI, *argv, str(self.cluster_file)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)

    def up(self, timeout_s: float = 600) -> subprocess.CompletedProcess:
        """``ray up -y``: the head set up and started over SSH, the app deployed; the head's autoscaler
        starts the workers. Returns ``ray up``'s result (the caller checks its exit status)."""
        self.write_files()
        return self._ray("up", "-y", "--no-config-cache", "--disable-usage-stats", timeout_s=timeout_s)

    def down(self, timeout_s: float = 300) -> subprocess.CompletedProcess:
        return self._ray("down", "-y", timeout_s=timeout_s)

    # -- the running cluster --------------------------------------------------------------------------

    def get(self, path: str, timeout_s: float = 5) -> tuple[int, Any]:
        req = urllib.request.Request(self.base_url + path, headers={"Authorization": f"Bearer {self.api_key}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:  # 4xx/5xx: the body is the API's JSON error (or text)
            text = e.read().decode(errors="replace")
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, text

    def wait_healthy(self, timeout_s: float = 600) -> dict:
        """Until ``/health`` says ok (the whole app placed and loaded); ``TimeoutError`` with the last answer."""
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            try:
                status, body = self.get("/health")
                last = (status, body)
                if status == 200 and isinstance(body, dict) and body.get("status") == "ok":
                    return body
            except (OSError, ValueError) as e:
                last = repr(e)
            time.sleep(2)
        raise TimeoutError(f"{self.base_url}/health not ok after {timeout_s:.0f} s: {last}\n{self.diagnosis()}")

    def diagnosis(self) -> str:
        """``ray status`` and ``serve status`` as the head sees them (for a failure's message)."""
        out = self.lab.ssh(self.head, f"{CLIENT_ENV}{INSTALL}/.venv/bin/ray status; "
                                      f"{INSTALL}/.venv/bin/serve status", timeout=120)
        return (out.stdout + out.stderr)[-6000:]

    def on_head(self, python: str, timeout_s: float = 120) -> Any:
        """Run ``python`` on the head with the checkout's interpreter, inside the cluster (``ray.init``
        with the token), and return what it printed last, parsed as JSON."""
        # log_to_driver off: the autoscaler's event log would otherwise print to this driver's stdout.
        script = f"import json, ray\nray.init(address='auto', logging_level='ERROR', log_to_driver=False)\n{python}"
        out = self.lab.ssh(self.head, f"{CLIENT_ENV}{INSTALL}/.venv/bin/python - <<'PY'\n{script}\nPY",
                           timeout=timeout_s)
        if out.returncode != 0:
            raise RuntimeError(f"on the head: {out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def actor_hosts(self) -> dict[str, list[str]]:
        """Alive actors' class names → the addresses of the hosts they run on."""
        return self.on_head(
            "from ray.util.state import list_actors\n"
            "ip = {n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes()}\n"
            "out = {}\n"
            "for a in list_actors(filters=[('state', '=', 'ALIVE')], limit=10000):\n"
            "    out.setdefault(a.class_name, []).append(ip.get(a.node_id))\n"
            "print(json.dumps(out))")

    def node_hosts(self) -> dict[str, dict[str, float]]:
        """Alive nodes' addresses → their Ray resources."""
        return self.on_head("print(json.dumps({n['NodeManagerAddress']: n['Resources'] for n in ray.nodes() "
                            "if n['Alive']}))")

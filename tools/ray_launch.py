"""`ray up` cluster files: the shipped ones in cluster/launch/ and the host lab's, from one function.

    python scripts/render_launch.py            # (re)write the shipped files
    python scripts/render_launch.py --check    # exit 1 if a committed file is stale

``cluster_file`` writes every part that is not the provider's — file mounts, set-up, and the head's and the
workers' start commands — the same way for every file, so the commands the host lab runs under
``ray up`` (tests/lab) are the shipped files' commands. A file differs from another only in its
``provider``, ``auth``, node types and which Serve config the head deploys.

Roles. A node advertises the custom resources of the roles it may host (``cluster.placement``): its node
type's ``resources``, which the launcher exports to ``ray start``. On machines you already have, a node type
is a pool of hosts by address (``HostPool``), started by ``deployments.host_pools`` (Ray's ``local``
provider, which knows one node type only, with a pool per node type): the autoscaler takes a free host of
the draft pool when a draft replica waits for one, and gives an idle one back.

No Ray import: the tests that check the shipped files run without a cluster.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.placement import REFERENCE_NODES, NodeType
from tools.serve_config import REPO, RENDERED, dump_yaml, write_or_check
from tools.tls_certs import FILES as TLS_FILES

INSTALL = "~/specserve"  # the checkout on every node (file_mounts copies it), with its .venv
RAY = f"{INSTALL}/.venv/bin/ray"
SERVE = f"{INSTALL}/.venv/bin/serve"
RAY_TOKEN = "~/.ray/auth_token"  # the Ray token Ray reads by default; the same file on every node
API_KEY = "~/.specserve/api_key"  # the HTTP bearer key (http.api_key_file of the shipped configs)
GCS_PORT, OBJECT_MANAGER_PORT = 6379, 8076
SETUP = f"cd {INSTALL} && bash scripts/setup_env.sh"
# `ray down`, `ray exec` and `ray attach` run a bare `ray` in a login shell: put the checkout's first on its PATH.
LOGIN_PATH = ("grep -qs 'specserve/.venv/bin' ~/.profile || "
              "echo 'export PATH=\"$HOME/specserve/.venv/bin:$PATH\"' >> ~/.profile")
RAY_ENV = "export RAY_AUTH_MODE=token TOKENIZERS_PARALLELISM=false; ulimit -n 65536\n"
TLS_DIR = "~/.ray/tls"  # tools.tls_certs.FILES on every node, when the cluster uses Ray's TLS


def tls_env() -> str:
    """What every Ray process of a TLS cluster (nodes and clients alike) needs in its environment."""
    home = TLS_DIR.replace("~", "$HOME", 1)
    return (f"export RAY_USE_TLS=1 RAY_TLS_SERVER_CERT={home}/node.crt RAY_TLS_SERVER_KEY={home}/node.key "
            f"RAY_TLS_CA_CERT={home}/ca.crt\n")


def tls_mounts(local_dir: str = TLS_DIR) -> dict[str, str]:
    """file_mounts for the three TLS files: node path → the operator's copy under ``local_dir``."""
    return {f"{TLS_DIR}/{f}": f"{local_dir}/{f}" for f in TLS_FILES}


@dataclass(frozen=True)
class LaunchFile:
    """What sets one `ray up` file apart from another; ``cluster_file`` adds the rest."""

    cluster_name: str
    serve_config: str  # the Serve config the head deploys: a path inside the checkout, or an absolute one
    provider: Mapping[str, Any]
    auth: Mapping[str, Any]
    header: str = ""  # comment lines at the top of the file
    node_types: Sequence[NodeType] = ()  # cloud providers; the first is the head's
    node_configs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # node type → node_config
    idle_timeout_minutes: float | None = None
    tls: bool = False  # Ray's mutual TLS between all processes; ``mounts`` must then hold ``tls_mounts()``
    mounts: Mapping[str, str] = field(default_factory=lambda: {RAY_TOKEN: RAY_TOKEN, API_KEY: API_KEY})
    initialization_commands: Sequence[str] = ()
    head_setup_commands: Sequence[str] = ()
    worker_setup_commands: Sequence[str] = ()


def head_start_commands(serve_config: str, *, local: bool, env: str = RAY_ENV) -> list[str]:
    # Ray 2.60's v2 autoscaler with the local provider counts the head as one of the workers and then stops
    # launching the rest (seen in the host lab); the v1 autoscaler records the head and starts them all.
    v1 = "export RAY_enable_autoscaler_v2=0\n" if local else ""
    return [
        f"{RAY} stop",
        f"{env}{v1}{RAY} start --head --port={GCS_PORT} --object-manager-port={OBJECT_MANAGER_PORT} "
        f"--autoscaling-config=~/ray_bootstrap_config.yaml --dashboard-host=127.0.0.1",
        # Retried while the dashboard, which `serve deploy` talks to, comes up; replicas then wait for the
        # worker nodes the autoscaler is starting.
        f"export RAY_AUTH_MODE=token\nfor i in $(seq 30); do\n  {SERVE} deploy {_in_install(serve_config)} && exit 0\n"
        "  sleep 5\ndone\nexit 1",
    ]


def worker_start_commands(env: str = RAY_ENV) -> list[str]:
    start = f"{RAY} start --address=$RAY_HEAD_IP:{GCS_PORT} --object-manager-port={OBJECT_MANAGER_PORT}"
    return [f"{RAY} stop", f"{env}{start}"]


def _in_install(path: str) -> str:
    return path if path.startswith("/") else f"{INSTALL}/{path}"


def cluster_file(spec: LaunchFile) -> dict[str, Any]:
    """The `ray up` document for ``spec`` (a plain dict, in the order a reader wants it)."""
    doc: dict[str, Any] = {"cluster_name": spec.cluster_name}
    if spec.node_types:
        doc["max_workers"] = sum(n.max_count for n in spec.node_types[1:])
        doc["upscaling_speed"] = 1.0
    if spec.idle_timeout_minutes is not None:
        doc["idle_timeout_minutes"] = spec.idle_timeout_minutes
    doc["provider"] = dict(spec.provider)
    doc["auth"] = dict(spec.auth)
    if spec.node_types:
        head, *workers = spec.node_types
        types = {head.name: {"resources": _ints(head.resources), "node_config": dict(spec.node_configs[head.name])}}
        for n in workers:
            types[n.name] = {"min_workers": n.min_count, "max_workers": n.max_count,
                             "resources": _ints(n.resources), "node_config": dict(spec.node_configs[n.name])}
        doc["available_node_types"] = types
        doc["head_node_type"] = head.name
    doc["file_mounts"] = {INSTALL: ".", **spec.mounts}
    # Spelt out although they are Ray's defaults: with the local provider, the head's autoscaler reads the
    # config `ray up` hands it without filling defaults in, and fails on a missing key.
    doc["cluster_synced_files"] = []
    doc["file_mounts_sync_continuously"] = False
    doc["rsync_filter"] = [".gitignore"]
    doc["rsync_exclude"] = [".git", "**/.git", "**/__pycache__"]
    doc["initialization_commands"] = list(spec.initialization_commands)
    doc["setup_commands"] = [SETUP, LOGIN_PATH]
    doc["head_setup_commands"] = list(spec.head_setup_commands)
    doc["worker_setup_commands"] = list(spec.worker_setup_commands)
    if spec.tls and not set(tls_mounts()) <= set(spec.mounts):
        raise ValueError(f"{spec.cluster_name}: tls needs the TLS files in its mounts ({sorted(tls_mounts())})")
    env = RAY_ENV + (tls_env() if spec.tls else "")
    on_prem_hosts = spec.provider["type"] in ("local", "external")
    doc["head_start_ray_commands"] = head_start_commands(spec.serve_config, local=on_prem_hosts, env=env)
    doc["worker_start_ray_commands"] = worker_start_commands(env) if spec.node_types else []
    return doc


def render(spec: LaunchFile) -> str:
    header = "".join(f"# {line}".rstrip() + "\n" for line in spec.header.strip("\n").splitlines())
    return (header + "# Rendered by scripts/render_launch.py (tools/ray_launch.py); do not edit by hand.\n"
            + dump_yaml(cluster_file(spec)))


def _ints(resources: Mapping[str, float]) -> dict[str, int]:
    return {k: int(v) for k, v in resources.items()}  # Ray's schema: whole numbers per node


@dataclass(frozen=True)
class HostPool:
    """A node type of hosts you already have: each advertises ``resources``; ``min_hosts`` of them run from
    ``ray up`` on, the rest are started by the autoscaler when a replica waits for them."""

    name: str
    resources: Mapping[str, float]
    hosts: Sequence[str]
    min_hosts: int | None = None  # None: all of them


HOST_POOL_PROVIDER = "deployments.host_pools.HostPoolProvider"  # deployments.host_pools.MODULE (it imports Ray)


def on_prem(cluster_name: str, serve_config: str, head_ip: str, pools: Sequence[HostPool], *,
            ssh_user: str, ssh_private_key: str, header: str = "",
            mounts: Mapping[str, str] | None = None, head_resources: Mapping[str, float] | None = None,
            tls: bool = False, idle_timeout_minutes: float | None = None) -> LaunchFile:
    """Machines you already have, reached by SSH: a head by address and worker ``pools``, the head
    advertising ``head_resources``; with ``tls``, Ray's mutual TLS between them (``mounts`` then defaults
    to the token, the API key and ``tls_mounts()``). No pools: Ray's own ``local`` provider, the head alone.
    The host lab's files are these, with the lab's addresses and key."""
    if mounts is None and tls:
        mounts = {RAY_TOKEN: RAY_TOKEN, API_KEY: API_KEY, **tls_mounts()}
    workers = [h for p in pools for h in p.hosts]
    if len(set(workers)) != len(workers) or head_ip in workers:
        raise ValueError(f"{cluster_name}: a host is in more than one pool, or is the head: {workers}")
    provider: dict[str, Any] = {"type": "local", "head_ip": head_ip, "worker_ips": []}
    node_types, node_configs = (), {}
    if pools:
        provider = {"type": "external", "module": HOST_POOL_PROVIDER, "head_ip": head_ip, "worker_ips": workers}
        node_types = (NodeType("head", dict(head_resources or {})),
                      *(NodeType(p.name, dict(p.resources), max_count=len(p.hosts),
                                 min_count=len(p.hosts) if p.min_hosts is None else p.min_hosts) for p in pools))
        node_configs = {"head": {}, **{p.name: {"hosts": list(p.hosts)} for p in pools}}
    return LaunchFile(cluster_name, serve_config, header=header, tls=tls, provider=provider,
                      auth={"ssh_user": ssh_user, "ssh_private_key": ssh_private_key},
                      node_types=node_types, node_configs=node_configs, idle_timeout_minutes=idle_timeout_minutes,
                      **({"mounts": dict(mounts)} if mounts is not None else {}))


_PREPARE = f"""
Before `ray up` (from the repository root):
  ray get-auth-token --generate          # {RAY_TOKEN}: token auth for the whole cluster
  mkdir -p ~/.specserve && (umask 077; openssl rand -hex 32 > {API_KEY})   # HTTP bearer key"""

_AMI = "ami-REPLACE-ubuntu-24-04-dlami"
REFERENCE = LaunchFile(
    "specserve-h200", RENDERED["cluster/examples/h200.yaml"],
    provider={"type": "aws", "region": "us-east-2", "cache_stopped_nodes": False},
    auth={"ssh_user": "ubuntu"},
    node_types=REFERENCE_NODES,
    node_configs={n.name: {"InstanceType": n.instance_type, "ImageId": _AMI, "BlockDeviceMappings": [
        {"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": size, "VolumeType": "gp3"}}]}
        for n, size in zip(REFERENCE_NODES, (200, 1000, 300))},
    idle_timeout_minutes=10,
    initialization_commands=("sudo apt-get update -qq && sudo apt-get install -y -qq python3-venv git rsync",),
    head_setup_commands=(f'{INSTALL}/.venv/bin/python -m pip install -q "boto3>=1.28"',),
    worker_setup_commands=('test -f /models/target/config.json && test -f /models/draft/config.json || '
                           '{ echo "models missing under /models" >&2; exit 1; }',),
    header=f"""
specserve reference cluster for `ray up` (AWS): 4 x p5e.48xlarge (8 x H200 each) host the four TP = 8
verifier groups, one per node (specserve_target: 8); 1-2 x g6.12xlarge (4 x L4 each) host the draft pool
(specserve_draft: 4, two replicas per L4); a small CPU head (CPU: 0) hosts only Ray's control plane and the
Serve controller. It deploys cluster/launch/serve-h200.yaml, rendered from cluster/examples/h200.yaml; the
node types are cluster.placement.REFERENCE_NODES, which the KubeRay manifests are rendered from too.
cache_stopped_nodes: false terminates idle nodes (stopped GPU nodes keep their EBS costs).
{_PREPARE}
  pip install "ray[default]==2.60.0" boto3       # locally, for `ray up`
  replace ImageId ({_AMI}) with an Ubuntu 24.04 Deep Learning Base AMI (NVIDIA driver) of your region,
  and make /models/target and /models/draft exist on every worker (an FSx/EFS mount or a baked AMI).
Then: ray up cluster/launch/reference-4xh200.yaml   (docs/platform.md: checks, updates, teardown).""")

ON_PREM = on_prem(
    "specserve-on-prem", RENDERED["cluster/examples/h200.yaml"], "192.0.2.10",
    [HostPool(n.name, n.custom, hosts, min_hosts=n.min_count) for n, hosts in zip(
        REFERENCE_NODES[1:], ([f"192.0.2.{i}" for i in range(11, 15)], [f"192.0.2.{i}" for i in range(21, 23)]))],
    ssh_user="ubuntu", ssh_private_key="~/.ssh/id_ed25519", tls=True, idle_timeout_minutes=10,
    header=f"""
specserve on machines you already have (reached by SSH, one pool of hosts per node type): the layout of
cluster/launch/reference-4xh200.yaml on your own hosts. REPLACE the addresses: head_ip hosts Ray's control
plane, the router and the HTTP API; each node type lists its hosts in node_config.hosts (and all of them
again in worker_ips): four 8 x H200 hosts (specserve_target: 8), started by `ray up`, and two 4 x L4 hosts
for the draft pool (specserve_draft: 4), the first started by `ray up`, the second by the autoscaler when
draft replicas wait for room (deployments/host_pools.py). Every host needs Python >= 3.11 with venv,
rsync, the NVIDIA driver, and the model folders /models/target and /models/draft. Ray's traffic between the hosts is mutual TLS
(RAY_USE_TLS): every process needs a certificate signed by the cluster's CA.
{_PREPARE}
  python scripts/make_tls_certs.py {TLS_DIR} 192.0.2.10 192.0.2.11 ...   # CA and node certificate, every host listed
Then: ray up cluster/launch/on-prem-h200.yaml   (docs/platform.md: checks, updates, teardown).""")

SINGLE_NODE = on_prem(
    "specserve-single", RENDERED["cluster/examples/single-node.yaml"], "192.0.2.10", [],
    ssh_user="ubuntu", ssh_private_key="~/.ssh/id_ed25519",
    header=f"""
specserve on one GPU box with `ray up` (Ray's `local` provider: a machine you already have, reached by SSH).
It serves cluster/examples/single-node.yaml (target on the GPU, draft colocated in the verifier replica)
through cluster/launch/serve-single-node.yaml. The box needs >= 1 NVIDIA GPU with its driver, >= 4 CPUs,
Python >= 3.11 with venv, and the model folders /models/target and /models/draft. REPLACE head_ip and the
SSH user and key.
{_PREPARE}
Then: ray up cluster/launch/single-node.yaml   (docs/platform.md: checks, updates, teardown).""")

SHIPPED: dict[str, LaunchFile] = {
    "cluster/launch/reference-4xh200.yaml": REFERENCE,
    "cluster/launch/on-prem-h200.yaml": ON_PREM,
    "cluster/launch/single-node.yaml": SINGLE_NODE,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the files on disk; exit 1 if stale")
    args = parser.parse_args(argv)
    return write_or_check({REPO / path: render(spec) for path, spec in SHIPPED.items()}, check=args.check,
                          script="scripts/render_launch.py")

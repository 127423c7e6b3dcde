"""The KubeRay manifests in k8s/, checked offline.

- They are exactly what scripts/render_k8s.py renders from cluster/examples/h200.yaml (no drift).
- They validate against the KubeRay CRDs vendored in k8s/schemas/kuberay (jsonschema on the served
  version's openAPIV3Schema), plus a strict pass for keys the schema does not define (the CRDs accept
  unknown keys silently), plus KubeRay's replica-count rules. The vendored files match the hashes their
  SOURCE.md records.
- ``serveConfigV2`` validates against Ray Serve's ``ServeDeploySchema`` with a strict unknown-key pass, and
  its ``args`` load with ``ClusterConfig.from_dict`` into the config they were rendered from.
- The worker groups can place every replica and rank the config asks for (``cluster.placement.check_fits``).
- Deliberately broken copies fail with a readable message.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import ClusterConfig
from cluster.placement import ACCELERATOR_PREFIX, NodeType, check_fits, role_resources
from deployments.serve_schema import validate_serve_config
from tools.k8s_manifests import (DEFAULT_CONFIG, committed_files, render, render_files, unknown_keys,
                                 validate_manifest)
from tools.serve_config import RenderError

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
CRD_DIR = K8S / "schemas" / "kuberay"
CRD_FILES = ("ray.io_rayservices.yaml", "ray.io_rayclusters.yaml")
FILES = ("rayservice.yaml", "raycluster.yaml", "rayservice-gcs-ft.yaml")  # KubeRay resources
POLICY = "networkpolicy.yaml"


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((K8S / name).read_text(encoding="utf-8"))


def cluster_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["rayClusterConfig"] if doc["kind"] == "RayService" else doc["spec"]


def _quantity(value: str) -> float:
    return float(value)  # cpu and nvidia.com/gpu here are plain integers ("184", "8")


def node_types(doc: dict[str, Any]) -> list[NodeType]:
    """What each group's pods advertise to Ray: CPU and GPU from the container limits (KubeRay's
    --num-cpus / --num-gpus), custom resources from rayStartParams.resources; head counted once."""
    spec = cluster_spec(doc)
    out = []
    head = spec["headGroupSpec"]
    out.append(NodeType("head", {"CPU": float(head["rayStartParams"]["num-cpus"])}, max_count=1, min_count=1))
    for group in spec["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        resources = {"CPU": _quantity(limits["cpu"]), "GPU": _quantity(limits.get("nvidia.com/gpu", "0"))}
        custom = group.get("rayStartParams", {}).get("resources")
        if custom:
            resources.update(json.loads(json.loads(custom)))  # the documented '"{\"name\": n}"' form
        out.append(NodeType(group["groupName"], resources, max_count=group["maxReplicas"],
                            min_count=group["minReplicas"]))
    return out


# ---- rendering ------------------------------------------------------------------------------------


def test_committed_manifests_are_current() -> None:
    rendered = committed_files()
    assert sorted(rendered) == sorted((*FILES, POLICY))
    for name, text in rendered.items():
        on_disk = (K8S / name).read_text(encoding="utf-8") if (K8S / name).is_file() else None
        assert on_disk == text, f"k8s/{name} is stale: run python scripts/render_k8s.py"


@pytest.mark.parametrize("name", ["rayservice.yaml", "rayservice-gcs-ft.yaml"])
def test_serve_config_v2_is_valid_and_carries_the_config(name: str) -> None:
    text = load(name)["spec"]["serveConfigV2"]
    assert validate_serve_config(text) == []
    serve = yaml.safe_load(text)
    (app,) = serve["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    assert ClusterConfig.from_dict(app["args"]) == ClusterConfig.from_yaml(REPO / DEFAULT_CONFIG)
    assert serve["http_options"] == {"host": "0.0.0.0", "port": 8000}
    # the same document `ray up` deploys
    launch = yaml.safe_load((REPO / "cluster/launch/serve-h200.yaml").read_text(encoding="utf-8"))
    assert serve == launch


@pytest.mark.parametrize("name", FILES)
def test_worker_groups_place_the_config(name: str) -> None:
    cfg = ClusterConfig.from_yaml(REPO / DEFAULT_CONFIG)
    nodes = node_types(load(name))
    assert check_fits(cfg, nodes) == []
    advertised = {k for n in nodes for k in n.custom if not k.startswith(ACCELERATOR_PREFIX)}
    assert role_resources(cfg) == advertised
    by_name = {n.name: n for n in nodes}
    assert by_name["verifier-h200"].resources[ACCELERATOR_PREFIX + cfg.verifier.accelerator_type] == 1
    assert by_name["draft-l4"].resources[ACCELERATOR_PREFIX + cfg.draft_pool.accelerator_type] == 1


def test_groups_pin_their_machines_and_token_auth_is_on() -> None:
    spec = cluster_spec(load("rayservice.yaml"))
    assert spec["authOptions"] == {"mode": "token"}
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    selectors = {g["groupName"]: g["template"]["spec"]["nodeSelector"] for g in spec["workerGroupSpecs"]}
    assert selectors == {"verifier-h200": {"node.kubernetes.io/instance-type": "p5e.48xlarge"},
                         "draft-l4": {"node.kubernetes.io/instance-type": "g6.12xlarge"}}
    # The API key: the Secret as the file http.api_key_file names (~ = /home/ray) in every pod, in no env.
    for pod in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        pod_spec = pod["template"]["spec"]
        container = pod_spec["containers"][0]
        assert [e["name"] for e in container["env"]] == ["TOKENIZERS_PARALLELISM"]
        volume = next(v for v in pod_spec["volumes"] if v["name"] == "api-key")
        assert volume["secret"] == {"secretName": "specserve-api-key", "items": [{"key": "api-key", "path": "api_key"}]}
        assert {"name": "api-key", "mountPath": "/home/ray/.specserve", "readOnly": True} in container["volumeMounts"]


def test_the_network_policy_admits_the_cluster_the_operator_and_the_api() -> None:
    """Ray's ports reach the cluster's own pods only; the dashboard, which the head binds to its pod address
    for the operator, the operator's pods too; the HTTP API and the metrics port anyone."""
    policy, spec = load(POLICY), cluster_spec(load("rayservice.yaml"))
    cfg = ClusterConfig.from_yaml(REPO / DEFAULT_CONFIG)
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    selected = policy["spec"]["podSelector"]["matchLabels"]
    for pod in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:  # it covers every pod of the cluster
        assert selected.items() <= pod["template"]["metadata"]["labels"].items(), pod["template"]["metadata"]
    own, operator, anyone = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": selected}}]}  # every port, from the cluster's pods
    assert operator["from"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "kuberay-operator"}}}]
    assert [p["port"] for p in operator["ports"]] == [8265]
    assert "from" not in anyone and sorted(p["port"] for p in anyone["ports"]) == sorted([cfg.http.port, 8080])
    (head,) = spec["headGroupSpec"]["template"]["spec"]["containers"]
    head_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert head_ports["dashboard"] == 8265 and head_ports["serve"] == cfg.http.port
    outside = {p["port"] for rule in (operator, anyone) for p in rule["ports"]}
    assert not outside & {head_ports["gcs-server"], head_ports["client"]}  # GCS and Ray client: the cluster's only
    # a custom render writes it too, for its own HTTP port
    assert "networkpolicy.yaml" in render_files(image="reg.example/specserve:2")


def test_gcs_fault_tolerance_flag() -> None:
    assert "gcsFaultToleranceOptions" not in cluster_spec(load("rayservice.yaml"))
    ft = cluster_spec(load("rayservice-gcs-ft.yaml"))["gcsFaultToleranceOptions"]
    assert ft == {"redisAddress": "redis:6379",
                  "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis-password-secret",
                                                                   "key": "password"}}}}
    files = render_files(gcs_ft_redis="redis://ha-redis.infra:6379", redis_password_secret=("ha-redis", "pw"))
    for name in ("rayservice.yaml", "raycluster.yaml"):
        doc = yaml.safe_load(files[name])
        assert cluster_spec(doc)["gcsFaultToleranceOptions"]["redisAddress"] == "redis://ha-redis.infra:6379"
        assert "--gcs-ft-redis redis://ha-redis.infra:6379 --redis-password-secret ha-redis:pw" in files[name]


def test_render_refuses_secrets_in_clear_and_disabled_auth() -> None:
    data = yaml.safe_load((REPO / DEFAULT_CONFIG).read_text(encoding="utf-8"))
    with_key = copy.deepcopy(data)
    with_key["http"].pop("api_key_file")
    with_key["http"]["api_key"] = "s3cret"
    with pytest.raises(RenderError, match=r"^http\.api_key: would be written in clear"):
        render(ClusterConfig.from_dict(with_key))
    open_cluster = copy.deepcopy(data)
    open_cluster["ray"]["auth_mode"] = "disabled"
    with pytest.raises(ValueError, match=r"ray\.auth_mode: 'disabled' is allowed only for a cluster on loopback"):
        ClusterConfig.from_dict(open_cluster)  # address auto: the config itself refuses it
    # A config that would be fine on one machine (a local cluster on loopback) is not, rendered for Kubernetes.
    open_cluster["ray"] = {"auth_mode": "disabled"}
    del open_cluster["cluster"]
    with pytest.raises(RenderError, match=r"^ray\.auth_mode: .*token"):
        render(ClusterConfig.from_dict(open_cluster))


# ---- CRD validation -------------------------------------------------------------------------------


def test_vendored_crds_match_their_source_record() -> None:
    source = (CRD_DIR / "SOURCE.md").read_text(encoding="utf-8")
    assert "Apache License" in (CRD_DIR / "LICENSE").read_text(encoding="utf-8")
    for name in CRD_FILES:
        digest = hashlib.sha256((CRD_DIR / name).read_bytes()).hexdigest()
        assert f"`{name}` `{digest}`" in source, f"{name}: SHA-256 {digest} is not the one SOURCE.md records"


@pytest.mark.parametrize("name", FILES)
def test_manifest_validates_against_kuberay_crd(name: str) -> None:
    # crd_dir's default: the vendored CRDs, the same as CRD_DIR
    assert validate_manifest(load(name), serve_check=validate_serve_config) == []


def test_strict_pass_skips_maps_and_preserved_objects() -> None:
    schema = {"type": "object", "properties": {
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "spec": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    doc = {"labels": {"anything": "x"}, "free": {"whatever": {"deep": 1}}, "spec": {"a": 1, "b": 2}}
    assert unknown_keys(doc, schema) == ["spec.b: unknown key (not in the CRD schema; known here: a)"]


def _edit(path: str, action: str, value: Any = None):
    """Edit ``doc`` at a dotted path (``[i]`` for list items): set, rename to ``value``, or delete."""
    def apply(doc: dict) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for p in parents:
            name, _, index = p.partition("[")
            node = node[name]
            if index:
                node = node[int(index.rstrip("]"))]
        if action == "set":
            node[last] = value
        elif action == "rename":
            node[value] = node.pop(last)
        else:
            del node[last]
    return apply


def _serve_edit(edit):
    """An edit of the parsed serveConfigV2, written back as YAML."""
    def apply(doc: dict) -> None:
        serve = yaml.safe_load(doc["spec"]["serveConfigV2"])
        edit(serve)
        doc["spec"]["serveConfigV2"] = yaml.safe_dump(serve, sort_keys=False)
    return apply


G0 = "spec.rayClusterConfig.workerGroupSpecs[0]"
BROKEN = [
    ("typo'd key in a worker group", _edit(f"{G0}.minReplicas", "rename", "minReplica"),
     "spec.rayClusterConfig.workerGroupSpecs[0].minReplica: unknown key (not in the CRD schema"),
    ("typo'd key in a container", _edit(f"{G0}.template.spec.containers[0].resources", "rename", "resource"),
     "spec.rayClusterConfig.workerGroupSpecs[0].template.spec.containers[0].resource: unknown key"),
    ("typo'd metadata key", _edit("metadata.labels", "rename", "labls"), "metadata.labls: unknown key (ObjectMeta)"),
    ("wrong type", _edit(f"{G0}.replicas", "set", "4"),
     "spec.rayClusterConfig.workerGroupSpecs.0.replicas: '4' is not of type 'integer'"),
    ("wrong enum value", _edit("spec.rayClusterConfig.authOptions.mode", "set", "tokens"),
     "spec.rayClusterConfig.authOptions.mode: 'tokens' is not one of ['disabled', 'token']"),
    ("missing required field", _edit(f"{G0}.groupName", "delete"),
     "spec.rayClusterConfig.workerGroupSpecs.0: 'groupName' is a required property"),
    ("minReplicas > maxReplicas", _edit(f"{G0}.minReplicas", "set", 5),
     "spec.rayClusterConfig.workerGroupSpecs[verifier-h200]: minReplicas (5) must be ≤ maxReplicas (4)"),
    ("replicas outside [min, max]", _edit(f"{G0}.replicas", "set", 9),
     "workerGroupSpecs[verifier-h200]: replicas (9) must be within [minReplicas 4, maxReplicas 4]"),
    ("serveConfigV2: typo'd key", _serve_edit(_edit("applications[0].import_path", "rename", "import_pth")),
     "spec.serveConfigV2: applications[0].import_pth: unknown key (Ray Serve's ServeApplicationSchema ignores it"),
    ("serveConfigV2: missing required field", _serve_edit(_edit("applications[0].import_path", "delete")),
     "spec.serveConfigV2: applications.0.import_path: Field required"),
    ("serveConfigV2: wrong type", _serve_edit(_edit("http_options.port", "set", "eighty")),
     "spec.serveConfigV2: http_options.port: Input should be a valid integer"),
    ("serveConfigV2: bad specserve args", _serve_edit(_edit("applications[0].args.verifier.num_groups", "rename",
                                                            "num_group")),
     "spec.serveConfigV2: applications[0].args.verifier.num_group: Extra inputs are not permitted"),
]


@pytest.mark.parametrize("what,edit,message", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_copy_fails_readably(what: str, edit, message: str) -> None:
    doc = load("rayservice.yaml")
    edit(doc)
    problems = validate_manifest(doc, CRD_DIR, serve_check=validate_serve_config)
    assert any(message in p for p in problems), problems
    assert all("\n" not in p for p in problems), problems


def test_raycluster_broken_copy_fails_readably() -> None:
    doc = load("raycluster.yaml")
    doc["spec"]["workerGroupSpecs"][1]["maxReplicas"] = 0
    doc["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # rayStartParams values are strings
    problems = validate_manifest(doc, CRD_DIR, serve_check=validate_serve_config)
    assert "spec.headGroupSpec.rayStartParams.num-cpus: 0 is not of type 'string'" in problems, problems
    assert "spec.workerGroupSpecs[draft-l4]: minReplicas (1) must be ≤ maxReplicas (0)" in problems, problems

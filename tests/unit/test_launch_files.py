"""The `ray up` launch files in cluster/launch/, checked offline with Ray's own cluster-config schema.

``check_launch_config`` checks what ``ray up`` checks before touching a cloud — the file against the
cluster-file schema the installed Ray ships (read as data: no Ray import), the head node type, the sum of
min_workers — plus the per-node-type rule Ray leaves to run time (min_workers ≤ max_workers), with one-line
messages. Deliberately broken copies must fail with a
readable message; the reference file's node types must match ``cluster.placement.REFERENCE_NODES`` (which
the KubeRay manifests are rendered from) and must be able to place the config they deploy.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from cluster.config import ClusterConfig
from cluster.placement import (ACCELERATOR_PREFIX, REFERENCE_NODES, NodeType, check_fits, role_resources,
                               sizing_markdown)
from deployments.serve_schema import IMPORT_PATH, validate_serve_config
from tools.ray_launch import SHIPPED, render
from tools.serve_config import IMPORT_PATH as RENDERED_IMPORT_PATH
from tools.serve_config import RENDERED, render_file

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "cluster" / "launch"
# launch file → the ClusterConfig it deploys (through the Serve config rendered from it)
LAUNCH_FILES = {
    "reference-4xh200.yaml": "cluster/examples/h200.yaml",
    "on-prem-h200.yaml": "cluster/examples/h200.yaml",
    "single-node.yaml": "cluster/examples/single-node.yaml",
}


def ray_cluster_schema() -> dict[str, Any]:
    """The JSON schema of ``ray up`` cluster files that the installed Ray ships (``ray/autoscaler/ray-schema.json``).

    Located with ``find_spec``, which finds the package without importing it: the schema is data, and this
    test suite does not import Ray.
    """
    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.submodule_search_locations, "ray is not installed"
    path = Path(next(iter(spec.submodule_search_locations))) / "autoscaler" / "ray-schema.json"
    return json.loads(path.read_text(encoding="utf-8"))


def check_launch_config(raw: dict[str, Any]) -> None:
    """``ValueError`` with a one-line reason (key path first where there is one) unless ``raw`` passes the
    checks ``ray up`` makes before touching a cloud: Ray's cluster-file schema, the head node type among
    the node types, each node type's min_workers ≤ its max_workers (Ray leaves that to run time), and the
    node types' min_workers summing to at most the global max_workers. Ray fills provider defaults at
    ``ray up``; this judges what the file itself says."""
    if not isinstance(raw, dict) or not isinstance(raw.get("provider"), dict):
        raise ValueError("provider: required (a mapping with at least `type`)")
    # Before the schema, so that the specific message wins over a generic one.
    node_types = raw.get("available_node_types")
    if isinstance(node_types, dict):
        for name, node in node_types.items():
            head = name == raw.get("head_node_type")
            lo, hi = node.get("min_workers", 0), node.get("max_workers", 0 if head else raw.get("max_workers"))
            if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
                raise ValueError(f"available_node_types.{name}: min_workers ({lo}) must be ≤ max_workers ({hi})")
    try:
        jsonschema.validate(raw, ray_cluster_schema())
    except jsonschema.ValidationError as e:
        where = ".".join(str(p) for p in e.absolute_path) or "<root>"
        raise ValueError(f"{where}: {e.message}") from None
    if node_types:
        if raw.get("head_node_type") not in node_types:
            raise ValueError(f"head_node_type: {raw.get('head_node_type')!r} is not one of available_node_types "
                             f"({', '.join(node_types)})")
        total = sum(node.get("min_workers", 0) for node in node_types.values())
        if "max_workers" in raw and total > raw["max_workers"]:
            raise ValueError(f"max_workers: {raw['max_workers']} is smaller than the node types' min_workers "
                             f"together ({total})")


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((LAUNCH / name).read_text(encoding="utf-8"))


def node_types(raw: dict[str, Any]) -> list[NodeType]:
    """The node types a launch file declares, as ``cluster.placement.NodeType`` (head counted once)."""
    out = []
    for name, node in raw["available_node_types"].items():
        head = name == raw["head_node_type"]
        out.append(NodeType(name, {k: float(v) for k, v in node["resources"].items()},
                            max_count=1 if head else node.get("max_workers", 0),
                            min_count=1 if head else node.get("min_workers", 0),
                            instance_type=node["node_config"].get("InstanceType")))
    return out


def all_commands(raw: dict[str, Any]) -> list[str]:
    keys = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
            "head_start_ray_commands", "worker_start_ray_commands")
    return [c for k in keys for c in raw.get(k) or []]


# ---- the committed files ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LAUNCH_FILES))
def test_launch_file_passes_rays_schema(name: str) -> None:
    check_launch_config(load(name))


def test_reference_node_types_match_placement_layout() -> None:
    """ray up and KubeRay (rendered from REFERENCE_NODES) describe the same machines and role resources."""
    declared = {n.name: n for n in node_types(load("reference-4xh200.yaml"))}
    assert declared == {n.name: n for n in REFERENCE_NODES}


@pytest.mark.parametrize("name", sorted(LAUNCH_FILES))
def test_launch_file_deploys_its_current_serve_config(name: str) -> None:
    raw = load(name)
    config = LAUNCH_FILES[name]
    serve_file = RENDERED[config]
    deploys = [c for c in raw["head_start_ray_commands"] if "serve deploy" in c]
    assert deploys and all(f"~/specserve/{serve_file}" in c for c in deploys), deploys
    text = (REPO / serve_file).read_text(encoding="utf-8")
    assert text == render_file(config), f"{serve_file} is stale: run python scripts/render_serve_config.py"
    assert validate_serve_config(text) == []
    args = yaml.safe_load(text)["applications"][0]["args"]
    assert ClusterConfig.from_dict(args) == ClusterConfig.from_yaml(REPO / config)


def test_launch_files_are_what_the_renderer_writes() -> None:
    assert {f"cluster/launch/{name}" for name in LAUNCH_FILES} == set(SHIPPED)
    for path, spec in SHIPPED.items():
        assert (REPO / path).read_text(encoding="utf-8") == render(spec), f"{path} is stale: run scripts/render_launch.py"


def test_on_prem_node_types_are_pools_of_hosts_that_advertise_their_roles() -> None:
    """One node type per role, its hosts by address; the launcher exports the type's resources to `ray
    start` (RAY_OVERRIDE_RESOURCES), so the start command names none itself."""
    raw = load("on-prem-h200.yaml")
    provider, types = raw["provider"], raw["available_node_types"]
    assert provider["type"] == "external" and provider["module"] == "deployments.host_pools.HostPoolProvider"
    pools = {name: t["node_config"]["hosts"] for name, t in types.items() if name != raw["head_node_type"]}
    assert sorted(h for hosts in pools.values() for h in hosts) == sorted(provider["worker_ips"])
    assert types["verifier_h200"]["resources"]["specserve_target"] == 8 and len(pools["verifier_h200"]) == 4
    assert types["draft_l4"]["resources"]["specserve_draft"] == 4
    assert (types["draft_l4"]["min_workers"], types["draft_l4"]["max_workers"]) == (1, 2)  # one spare
    assert not [c for c in raw["worker_start_ray_commands"] if "--resources" in c]


def test_the_provider_module_the_files_name_is_the_one_in_deployments() -> None:
    from deployments.host_pools import MODULE
    from tools.ray_launch import HOST_POOL_PROVIDER

    assert HOST_POOL_PROVIDER == MODULE


def test_renderer_and_validator_name_the_same_app() -> None:
    # validate_serve_config checks the args only of applications with its IMPORT_PATH: were the renderer's to
    # differ, the rendered files' args would go unchecked.
    assert RENDERED_IMPORT_PATH == IMPORT_PATH == "deployments.app:build_app"


def test_reference_cluster_places_the_h200_config() -> None:
    cfg = ClusterConfig.from_yaml(REPO / LAUNCH_FILES["reference-4xh200.yaml"])
    nodes = node_types(load("reference-4xh200.yaml"))
    assert check_fits(cfg, nodes) == []
    advertised = {k for n in nodes for k in n.custom if not k.startswith(ACCELERATOR_PREFIX)}
    assert role_resources(cfg) == advertised == {"specserve_target", "specserve_draft"}
    # the data-parallel groups need every verifier node from the start
    assert next(n for n in nodes if n.name == "verifier_h200").min_count == cfg.verifier.num_groups


def test_tp16_across_two_nodes_fits_the_reference_cluster() -> None:
    """The docs' variant for a target too large for one node: TP 16 over two nodes, two groups."""
    data = yaml.safe_load((REPO / "cluster/examples/h200.yaml").read_text(encoding="utf-8"))
    data["target"]["tensor_parallel"] = 16
    data["verifier"].update(num_groups=2, placement_strategy="PACK")
    cfg = ClusterConfig.from_dict(data)
    assert check_fits(cfg, node_types(load("reference-4xh200.yaml"))) == []
    data["verifier"]["num_groups"] = 3
    problems = check_fits(ClusterConfig.from_dict({**data, "cluster": {"total_gpus": 56, "gpus_per_node": 8}}),
                          node_types(load("reference-4xh200.yaml")))
    assert problems and "verifier-rank" in problems[0] and "no room left" in problems[0]


def test_a_misspelt_role_resource_is_reported() -> None:
    data = yaml.safe_load((REPO / "cluster/examples/h200.yaml").read_text(encoding="utf-8"))
    data["draft_pool"]["resources"] = {"specserve_drafts": 0.5}
    problems = check_fits(ClusterConfig.from_dict(data), node_types(load("reference-4xh200.yaml")))
    assert len(problems) == 1 and problems[0].startswith("draft: no node type can host {")
    assert "specserve_drafts: 0.5" in problems[0]


def test_single_node_config_fits_one_gpu_box() -> None:
    from cluster.placement import SINGLE_NODE

    cfg = ClusterConfig.from_yaml(REPO / LAUNCH_FILES["single-node.yaml"])
    assert cfg.draft_pool.placement == "colocated" and cfg.target.tensor_parallel == 1
    assert check_fits(cfg, SINGLE_NODE) == []


@pytest.mark.parametrize("name", sorted(LAUNCH_FILES))
def test_token_auth_and_api_key_on_every_node(name: str) -> None:
    raw = load(name)
    cfg = ClusterConfig.from_yaml(REPO / LAUNCH_FILES[name])
    assert cfg.ray.auth_mode == "token"
    assert raw["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    # The API key: a file on every node that the ingress alone reads, in no command's environment.
    assert cfg.http.api_key_file == "~/.specserve/api_key" and cfg.http.api_key_env is None
    assert raw["file_mounts"][cfg.http.api_key_file] == "~/.specserve/api_key"
    starts = [c for c in raw["head_start_ray_commands"] + raw["worker_start_ray_commands"] if "ray start" in c]
    assert starts, "no ray start command"
    for cmd in starts:
        assert "RAY_AUTH_MODE=token" in cmd, cmd
    assert not [c for c in all_commands(raw) if "api_key" in c]
    for cmd in (c for c in all_commands(raw) if "serve deploy" in c):
        assert "RAY_AUTH_MODE=token" in cmd, cmd


def test_on_prem_hosts_speak_ray_over_mutual_tls_with_the_mounted_certificates() -> None:
    """Every Ray process the on-prem file starts has RAY_USE_TLS and the three files the launcher copies."""
    raw = load("on-prem-h200.yaml")
    starts = [c for c in raw["head_start_ray_commands"] + raw["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2
    for cmd in starts:
        line = next(line for line in cmd.splitlines() if "RAY_USE_TLS" in line)
        env = dict(w.split("=", 1) for w in line.split()[1:])
        assert env["RAY_USE_TLS"] == "1", cmd
        for var, file in (("RAY_TLS_CA_CERT", "ca.crt"), ("RAY_TLS_SERVER_CERT", "node.crt"),
                          ("RAY_TLS_SERVER_KEY", "node.key")):
            assert env[var] == f"$HOME/.ray/tls/{file}" and f"~/.ray/tls/{file}" in raw["file_mounts"], var
    assert "ca.key" not in str(raw["file_mounts"])  # the CA's key never leaves the operator's machine
    assert "RAY_USE_TLS" not in str(load("single-node.yaml"))  # one host: no traffic between hosts


def test_tls_without_its_files_mounted_is_refused() -> None:
    spec = dataclasses.replace(SHIPPED["cluster/launch/on-prem-h200.yaml"], mounts={})
    with pytest.raises(ValueError, match="tls needs the TLS files"):
        render(spec)


@pytest.mark.parametrize("name", sorted(LAUNCH_FILES))
def test_commands_use_the_project_environment(name: str) -> None:
    raw = load(name)
    assert raw["file_mounts"]["~/specserve"] == "."
    assert "cd ~/specserve && bash scripts/setup_env.sh" in raw["setup_commands"]
    for cmd in all_commands(raw):
        # a bare `ray`/`serve` would be whatever the image has on PATH, not the project's .venv
        assert not re.search(r"(^|[;&|]\s*)(ray|serve) ", cmd), cmd


def test_docs_sizing_table_is_current() -> None:
    docs = (REPO / "docs" / "platform.md").read_text(encoding="utf-8")
    assert sizing_markdown() in docs, "docs/platform.md: paste cluster.placement.sizing_markdown() (sizing table)"


# ---- deliberately broken copies ---------------------------------------------------------------------


def _set(path: str, value: Any):
    def edit(raw: dict) -> None:
        *parents, last = path.split(".")
        node = raw
        for p in parents:
            node = node[p]
        node[last] = value
    return edit


def _rename(path: str, new: str):
    def edit(raw: dict) -> None:
        *parents, last = path.split(".")
        node = raw
        for p in parents:
            node = node[p]
        node[new] = node.pop(last)
    return edit


def _delete(path: str):
    def edit(raw: dict) -> None:
        *parents, last = path.split(".")
        node = raw
        for p in parents:
            node = node[p]
        del node[last]
    return edit


BROKEN = [
    ("typo'd top-level key", _rename("head_start_ray_commands", "head_start_ray_comands"),
     "<root>: Additional properties are not allowed ('head_start_ray_comands' was unexpected)"),
    ("typo'd node-type key", _rename("available_node_types.draft_l4.min_workers", "min_worker"),
     "available_node_types.draft_l4: Additional properties are not allowed ('min_worker' was unexpected)"),
    ("wrong type", _set("max_workers", "six"), "max_workers: 'six' is not of type 'integer'"),
    ("fractional node resource", _set("available_node_types.draft_l4.resources.specserve_draft", 0.5),
     "available_node_types.draft_l4.resources.specserve_draft: 0.5 is not of type 'integer'"),
    ("missing required field", _delete("available_node_types.verifier_h200.node_config"),
     "available_node_types.verifier_h200: 'node_config' is a required property"),
    ("missing provider", _delete("provider"), "provider: required"),
    ("min_workers > max_workers", _set("available_node_types.draft_l4.min_workers", 3),
     "available_node_types.draft_l4: min_workers (3) must be ≤ max_workers (2)"),
    ("sum of min_workers > max_workers", _set("max_workers", 4),
     "max_workers: 4 is smaller than the node types' min_workers together (5)"),
]


@pytest.mark.parametrize("what,edit,message", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_copy_fails_readably(what: str, edit, message: str) -> None:
    raw = load("reference-4xh200.yaml")
    edit(raw)
    with pytest.raises(ValueError) as info:
        check_launch_config(raw)
    text = str(info.value)
    assert message in text and "\n" not in text, text

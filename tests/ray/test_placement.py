"""Placement on Ray: the resource requests ``cluster.placement`` documents are the ones the app makes, and
the tensor-parallel ranks ask for the bundle the group reserves.

Where those requests put each actor on real hosts (draft replicas on draft hosts, one rank per target host,
the router and ingress on the head) is checked on a cluster brought up with ``ray up`` across network
namespace hosts: tests/lab/test_ray_up.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.config import ClusterConfig
from cluster.placement import requests, resource_bundle

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
ROLE_OF = {"DraftPool": "draft", "Verifier": "verifier", "Router": "router", "OpenAIIngress": "ingress"}


def _configs() -> dict[str, ClusterConfig]:
    h200 = yaml.safe_load((REPO / "cluster/examples/h200.yaml").read_text(encoding="utf-8"))
    tp1 = {**h200, "target": {**h200["target"], "tensor_parallel": 1}}
    colocated = {**tp1, "draft_pool": {**h200["draft_pool"], "placement": "colocated"}}
    return {"h200": ClusterConfig.from_dict(h200), "h200-tp1": ClusterConfig.from_dict(tp1),
            "colocated": ClusterConfig.from_dict(colocated),
            "single-node": ClusterConfig.from_yaml(REPO / "cluster/examples/single-node.yaml")}


@pytest.mark.parametrize("name", ["h200", "h200-tp1", "colocated", "single-node"])
def test_requests_match_what_build_app_asks_ray_for(name: str) -> None:
    build = pytest.importorskip("ray.serve._private.build_app", reason="Ray Serve's app builder moved")
    from deployments.app import build_app

    cfg = _configs()[name]
    built = build.build_app(build_app(cfg.to_serve_args()), name="placement-check")
    actual = {}
    for d in built.deployments:
        opts = dict(d.ray_actor_options or {})
        auto = d._deployment_config.autoscaling_config
        count = auto.max_replicas if auto is not None else d.num_replicas
        actual[ROLE_OF[d.name]] = (count, resource_bundle(opts.get("num_cpus", 0), opts.get("num_gpus", 0),
                                                          opts.get("accelerator_type"), opts.get("resources") or {}))
    expected = {r.role: (r.count, r.bundle) for r in requests(cfg) if r.role != "verifier-rank"}
    assert actual == expected


def test_rank_bundle_matches_the_verifier_group() -> None:
    from deployments.verifier_group import GroupSpec, VerifierGroup

    cfg = _configs()["h200"]
    v = cfg.verifier
    group = VerifierGroup(GroupSpec({"tiny": {"seed": 0}}, tp_size=cfg.target.tensor_parallel, num_cpus=v.num_cpus,
                                    num_gpus=v.num_gpus, resources=v.resources, accelerator_type=v.accelerator_type,
                                    placement_strategy=v.placement_strategy), start=False)
    (rank,) = [r for r in requests(cfg) if r.role == "verifier-rank"]
    assert group._bundle() == rank.bundle
    assert (group.tp_size, group.spec.strategy) == (rank.gang, rank.strategy)

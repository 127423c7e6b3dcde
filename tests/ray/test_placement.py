"""Placement on Ray: the resource requests ``cluster.placement`` documents are the ones the app makes, and
on a simulated multi-node cluster draft replicas land only on draft nodes, tensor-parallel rank actors only
on target nodes, and a request is served through the handle API.

The multi-node cluster (``ray.cluster_utils.Cluster``) cannot coexist with the suite's session cluster in
one driver process, so it runs in a subprocess (tests/ray/placement_scenario.py) that prints JSON. It starts
three raylets and one app with a TP = 2 verifier; ~70 s of wall time on the 2-core box. The scenario can
also deploy a TP = 1 app (``--tp 1,2``: its verifier replicas land on the target node too); the suite leaves
it out because the resource requests that put it there are the ones checked above, and serving through a
TP = 1 verifier is what most other Ray tests do.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.config import ClusterConfig
from cluster.placement import requests, resource_bundle
from tests.ray.conftest import tiny_greedy

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "tests" / "ray" / "placement_scenario.py"
SCENARIO_BUDGET_S = 300.0  # a ceiling for loaded CI boxes; see the module docstring for typical times
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


def _run_scenario(budget_s: float) -> tuple[int, str, str]:
    """Run the scenario in its own process group; past its budget (plus a grace period for its own
    shutdown) kill the whole group, so that no raylet or agent of the simulated cluster outlives it."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(SCENARIO), "--tp", "2", "--budget", str(budget_s)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=budget_s + 60)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        out, err = proc.communicate()
        pytest.fail(f"placement scenario did not finish within {budget_s + 60:.0f} s; stderr tail:\n{err[-3000:]}")
    return proc.returncode, out, err


def test_multi_node_placement_and_a_served_request() -> None:
    rc, stdout, stderr = _run_scenario(SCENARIO_BUDGET_S)
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON from the scenario (rc {rc}); stderr tail:\n{stderr[-3000:]}"
    out = json.loads(lines[-1])
    assert "error" not in out, f"{out['error']}\nstderr tail:\n{stderr[-3000:]}"

    where: dict[str, set[str]] = {}
    for actor in out["actors"]:
        cls = actor["class"] or ""
        if cls.startswith("ServeReplica:"):
            _, app, deployment = cls.split(":")
            where.setdefault(f"{app}/{deployment}", set()).add(actor["node"])
        elif cls == "VerifierRankActor":
            where.setdefault("rank", set()).add(actor["node"])

    # draft replicas only on the draft node
    assert where["placement-tp2/DraftPool"] == {"draft"}, where
    # the rank actors hold the target shards; the coordinating replica reserves only CPU (app.py)
    assert where["rank"] == {"target"}, where
    assert len([a for a in out["actors"] if a["class"] == "VerifierRankActor"]) == 2
    # nothing that needs a role resource ran on the head
    assert all("head" not in nodes for key, nodes in where.items() if "DraftPool" in key or key == "rank")

    # served through the handle API; greedy, so token for token what the target alone decodes
    (reference,) = tiny_greedy([out["prompt"]], out["max_tokens"])
    assert out["tokens"]["2"] == reference, (out["tokens"], reference)
    print(f"placement scenario: cluster {out['cluster_s']} s, deployed {out['deploy_s']} s, total {out['total_s']} s")

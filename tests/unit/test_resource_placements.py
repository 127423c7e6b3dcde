"""``cluster.placement.placements``: the one place the app's Ray resources are computed.

``deployments/app.py`` reserves ``serve_placements`` as each deployment's ``ray_actor_options``;
``requests``/``check_fits`` count ``placements`` (tests/ray/test_placement.py builds the app and compares).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from cluster.config import ClusterConfig
from cluster.placement import Placement, placements, requests, resource_bundle, serve_placements

REPO = Path(__file__).resolve().parents[2]


def _h200(**sections) -> ClusterConfig:
    data = yaml.safe_load((REPO / "cluster/examples/h200.yaml").read_text(encoding="utf-8"))
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return ClusterConfig.from_dict(data)


def test_actor_options_reserve_the_bundle() -> None:
    p = Placement(2, 0.5, "L4", {"specserve_draft": 0.5})
    assert p.actor_options() == {"num_cpus": 2, "num_gpus": 0.5, "accelerator_type": "L4",
                                 "resources": {"specserve_draft": 0.5}}
    opts = p.actor_options()
    assert p.bundle() == resource_bundle(opts["num_cpus"], opts["num_gpus"], opts["accelerator_type"],
                                         opts["resources"])
    assert Placement(0.25).actor_options() == {"num_cpus": 0.25}


def test_worker_mode_moves_the_gpus_off_the_replica_not_out_of_the_requests() -> None:
    cfg = _h200(target={"tensor_parallel": 1}, router={"transport": "compiled"},
                draft_pool={"autoscaling": None, "num_replicas": 8})  # Serve cannot autoscale worker mode
    assert cfg.worker_stages == {"verifier", "draft"}
    served = serve_placements(cfg)
    assert served["verifier"].num_gpus == 0 and served["draft"].num_gpus == 0
    assert served["verifier"].resources == cfg.verifier.resources  # the role resource pins the node
    bundles = {r.role: r.bundle for r in requests(cfg)}
    assert bundles["verifier"]["GPU"] == cfg.verifier.num_gpus  # its worker's, on the same node
    assert bundles["draft"]["GPU"] == cfg.draft_pool.num_gpus


def test_local_stages_put_the_verifier_share_on_the_router() -> None:
    cfg = ClusterConfig.from_yaml(REPO / "cluster/examples/default.yaml")
    assert cfg.router.stages == "local" and cfg.draft.kind != "none"
    v, r = cfg.verifier, cfg.router
    assert set(placements(cfg)) == {"router", "ingress"}  # no verifier or draft deployment
    (router,) = [q for q in requests(cfg) if q.role == "router"]
    assert router.bundle == resource_bundle(v.num_cpus + r.num_cpus, v.num_gpus, v.accelerator_type, v.resources)

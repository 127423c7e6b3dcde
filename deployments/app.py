"""``build_app(args)``: the Serve application, from Python or as a ``serve run``/``serve deploy`` import path.

    serve run deployments.app:build_app config=cluster/examples/local.yaml   # or args inline
    # YAML: applications: [{name: specserve, import_path: deployments.app:build_app, args: {...}}]

``args`` is a ``ClusterConfig`` as a dict (native or seeds-shaped), or ``{"config": "path.yaml"}``.
The graph: Verifier (one replica per data-parallel group) ← DraftPool (N replicas, or none when the
draft is colocated or absent) ← Router (step loop + handle API) ← OpenAI HTTP ingress.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from cluster.config import ClusterConfig
from deployments.draft_pool import DraftPool
from deployments.ingress import OpenAIIngress
from deployments.router import Router
from deployments.verifier import Verifier

STAGE_MAX_ONGOING = 256  # stage calls are one per micro-batch step; Serve's default of 5 would throttle them
STAGE_SHUTDOWN_S = 10.0  # stage calls last milliseconds; a replica going away need not wait Serve's default 20 s


def load_config(args: dict[str, Any]) -> ClusterConfig:
    if set(args) == {"config"}:
        return ClusterConfig.from_yaml(args["config"])
    return ClusterConfig.from_dict(args)


def _placement(num_cpus: float, num_gpus: float, accelerator_type: str | None, resources: dict) -> dict:
    opts: dict[str, Any] = {"num_cpus": num_cpus}
    if num_gpus:
        opts["num_gpus"] = num_gpus
    if accelerator_type:
        opts["accelerator_type"] = accelerator_type
    if resources:
        opts["resources"] = dict(resources)
    return opts


def build_app(args: dict[str, Any]):
    cfg = load_config(args)
    plain = cfg.to_serve_args()
    v = cfg.verifier
    if cfg.target.tensor_parallel > 1:
        # The replica only coordinates; the rank actors it creates hold the GPUs (see verifier_group).
        verifier_opts = _placement(v.num_cpus, 0, None, {})
    else:
        verifier_opts = _placement(v.num_cpus, v.num_gpus, v.accelerator_type, v.resources)
    verifier = Verifier.options(num_replicas=v.num_groups, ray_actor_options=verifier_opts,
                                max_ongoing_requests=STAGE_MAX_ONGOING,
                                graceful_shutdown_timeout_s=STAGE_SHUTDOWN_S).bind(plain)

    draft = None
    pool = cfg.draft_pool
    if cfg.draft.kind != "none":
        if pool.placement == "colocated":
            draft = verifier
        else:
            scaling: dict[str, Any] = {"num_replicas": pool.num_replicas}
            if pool.autoscaling is not None:
                scaling = {"autoscaling_config": {"min_replicas": pool.autoscaling.min_replicas,
                                                  "max_replicas": pool.autoscaling.max_replicas,
                                                  "target_ongoing_requests": 2}}
            draft = DraftPool.options(
                **scaling, max_ongoing_requests=STAGE_MAX_ONGOING, graceful_shutdown_timeout_s=STAGE_SHUTDOWN_S,
                ray_actor_options=_placement(pool.num_cpus, pool.num_gpus, pool.accelerator_type,
                                             pool.resources)).bind(plain)

    r = cfg.router
    router = Router.options(
        num_replicas=1, ray_actor_options={"num_cpus": r.num_cpus},
        max_ongoing_requests=r.max_running + r.max_queue + 64,
        # Scale-down and redeploys wait for in-flight requests instead of dropping them.
        graceful_shutdown_timeout_s=r.request_timeout_s).bind(plain, draft, verifier)
    return _ingress(cfg, plain, router)


def _ingress(cfg: ClusterConfig, plain: dict, router):
    return OpenAIIngress.options(ray_actor_options={"num_cpus": cfg.router.num_cpus},
                                 max_ongoing_requests=cfg.router.max_running + cfg.router.max_queue + 64
                                 ).bind(plain, router)

"""``build_app(args)``: the Serve application, from Python or as a ``serve run``/``serve deploy`` import path.

    serve run deployments.app:build_app config=cluster/examples/local.yaml   # or args inline
    # YAML: applications: [{name: specserve, import_path: deployments.app:build_app, args: {...}}]

``args`` is a ``ClusterConfig`` as a dict (native or seeds-shaped), ``{"config": "path.yaml"}``, or a
``ClusterConfig`` the caller validated already (``specserve serve``).
The graph: Verifier (one replica per data-parallel group) ← DraftPool (N replicas, or none when the
draft is colocated or absent) ← Router (step loop + handle API) ← OpenAI HTTP ingress; with
``router.stages: local``, just Router (step loop and both models) ← ingress.

On a local cluster (no ``ray.address``) the whole app is checked against this machine before anything is
deployed: thread counts against its cores, the memory plan (``cluster.memory_plan``) against the memory it
has available; a config that cannot fit is refused with the plan and what to lower. Every replica checks
its own share again on the node it lands on (``deployments.replica_process``).

The config is validated here, once: every deployment is bound the validated ``ClusterConfig`` and never
validates it again. What replicas derive from it that reads model files (engine settings, wire limits,
the tokenizer) they derive on their own node, since a model folder may exist only on worker nodes.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from cluster.config import ClusterConfig
from cluster.memory_plan import plan
from cluster.model_files import ModelFileError
from cluster.node import cpu_cores, memory_available
from cluster.placement import serve_placements
from cluster.threads import node_threads
from deployments.draft_pool import DraftPool
from deployments.ingress import OpenAIIngress
from deployments.replica_process import model_process_env
from deployments.router import Router
from deployments.verifier import Verifier

STAGE_MAX_ONGOING = 256  # stage calls are one per micro-batch step; Serve's default of 5 would throttle them
STAGE_SHUTDOWN_S = 10.0  # stage calls last milliseconds; a replica going away need not wait Serve's default 20 s
INGRESS_BURST = 4096  # requests the ingress may hold beyond its own limits (see _ingress)
# Serve writes an access-log line for every call a replica serves. The ingress's lines are the HTTP requests;
# the router's would repeat them, and a stage's would be one per micro-batch step, written on the step's path.
QUIET = {"logging_config": {"enable_access_log": False}}
# The ingress and the router run only non-blocking async code (the router's engine steps on a thread of
# its own), so Serve may run it on the replica's own event loop instead of handing every request between
# threads; the ingress also routes its handle calls from that loop (the router's come from its step thread,
# which needs Serve's own routing loop): a third less CPU per request (docs/measurements.md#serve-app).
# The stage replicas compute in their handlers: Serve's defaults.
SAME_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
INGRESS_ENV = {**SAME_LOOP_ENV, "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}

log = logging.getLogger(__name__)


def load_config(args: ClusterConfig | dict[str, Any]) -> ClusterConfig:
    if isinstance(args, ClusterConfig):  # validated by the caller (``specserve serve``)
        return args
    if set(args) == {"config"}:
        return ClusterConfig.from_yaml(args["config"])
    return ClusterConfig.from_dict(args)


def _model_env(threads: int | str, extra: dict[str, str] | None = None) -> dict:
    """The environment a model replica's process starts with (``replica_process.model_process_env``)."""
    return {"runtime_env": {"env_vars": {**model_process_env(threads), **(extra or {})}}}


def check_local_node(cfg: ClusterConfig) -> None:
    """Refuse a config this machine cannot run (threads, memory); Ray is already up, so its own processes'
    memory is in use already and not counted again."""
    cores = cpu_cores()
    try:
        app = plan(cfg)
    except ModelFileError as exc:  # a model that is not on this machine: its replicas check themselves
        log.warning("no memory plan before deploying (%s); each replica checks its own share at start", exc)
        node_threads(cfg, cores, None)
        return
    threads = node_threads(cfg, cores, app)
    started = sum(r.replicas * threads.get(r.role, 0) for r in app.replicas)
    if started > cores:
        log.warning("the model replicas start %d torch threads on this node's %d cores (%s); they take turns at "
                    "batch 1, but concurrent micro-batches will contend (docs/configuration.md, CPU threads)",
                    started, cores, ", ".join(f"{k} {n}" for k, n in threads.items()))
    app.check(host_available=memory_available(), include_system=False)


def build_app(args: ClusterConfig | dict[str, Any]):
    cfg = load_config(args)
    if cfg.ray.address is None:
        check_local_node(cfg)
    generation = secrets.token_hex(4)  # this build's stage workers (deployments.transport.directory.app_key)
    v, r = cfg.verifier, cfg.router
    # What each deployment's replicas reserve, computed in cluster.placement (requests/check_fits count the
    # same); in worker mode a replica's stage worker holds its GPUs.
    place = {role: p.actor_options() for role, p in serve_placements(cfg).items()}
    router_opts = dict(
        **QUIET, num_replicas=1, max_ongoing_requests=r.max_running + r.max_queue + 64,
        # Scale-down and redeploys wait for in-flight requests instead of dropping them.
        graceful_shutdown_timeout_s=r.request_timeout_s)
    if r.stages == "local":  # the router hosts both models (see deployments.router): it holds the verifier's share
        opts = {**place["router"], **_model_env(v.num_threads, SAME_LOOP_ENV)}
        return _ingress(cfg, place["ingress"],
                        Router.options(ray_actor_options=opts, **router_opts).bind(cfg, None, None, generation))
    # With tensor parallelism the replica only coordinates; the rank actors it creates hold the GPUs.
    verifier_opts = {**place["verifier"], **_model_env(v.num_threads)}
    verifier = Verifier.options(**QUIET, num_replicas=v.num_groups, ray_actor_options=verifier_opts,
                                max_ongoing_requests=STAGE_MAX_ONGOING,
                                graceful_shutdown_timeout_s=STAGE_SHUTDOWN_S).bind(cfg, generation)

    draft = None
    pool = cfg.draft_pool
    if cfg.draft.kind != "none":
        if pool.placement == "colocated":
            draft = verifier
        else:
            scaling: dict[str, Any] = {"num_replicas": pool.num_replicas}
            if pool.autoscaling is not None:
                scaling = {"autoscaling_config": pool.autoscaling.model_dump()}
            draft = DraftPool.options(
                **QUIET, **scaling, max_ongoing_requests=STAGE_MAX_ONGOING,
                graceful_shutdown_timeout_s=STAGE_SHUTDOWN_S,
                ray_actor_options={**place["draft"], **_model_env(pool.num_threads)}).bind(cfg, generation)

    router = Router.options(ray_actor_options={**place["router"], "runtime_env": {"env_vars": SAME_LOOP_ENV}},
                            **router_opts).bind(cfg, draft, verifier, generation)
    return _ingress(cfg, place["ingress"], router)


def _ingress(cfg: ClusterConfig, placement: dict[str, Any], router):
    # A replica at max_ongoing_requests makes Serve's proxy queue every further request, /health included,
    # and stall them all. The ingress enforces its own limits instead and answers past them at once (503
    # past max_pending_bodies bodies being received or the router's capacity, 408 past the body deadline),
    # so Serve's limit sits above them by INGRESS_BURST: room for a burst of those quick answers and for
    # /health, /v1/models and /debug, which no limit of the ingress counts.
    limit = cfg.http.max_pending_bodies + cfg.router.max_running + cfg.router.max_queue + INGRESS_BURST
    return OpenAIIngress.options(ray_actor_options={**placement, "runtime_env": {"env_vars": INGRESS_ENV}},
                                 max_ongoing_requests=limit).bind(cfg, router)

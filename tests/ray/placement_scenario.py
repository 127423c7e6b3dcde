"""A simulated 3-node Ray cluster (``ray.cluster_utils.Cluster``): where do draft replicas, verifier replicas
and tensor-parallel rank actors land? Run by tests/ray/test_placement.py in a subprocess (a ``Cluster``
cannot share a driver process with the suite's session cluster); prints one JSON line on stdout.

    RAY_AUTH_MODE=disabled python tests/ray/placement_scenario.py [--tp 1,2] [--budget 150]

Nodes (2 CPUs each, the dashboard off): ``head`` with no special resources, ``target`` with
``{"specserve_target": 4, "accelerator_type:H200": 1}`` and ``draft`` with ``{"specserve_draft": 4,
"accelerator_type:L4": 1}``. One Serve app per tensor-parallel size, each asking as cluster/examples/h200.yaml
does (``draft_pool``: L4 + ``{specserve_draft: 1}``; ``verifier``: H200 + ``{specserve_target: 1}``) for the
builtin tiny target and draft on CPU, deployed together; one greedy request per app through the Router's
handle API. Actor locations come from the GCS actor table (no dashboard needed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")  # a loaded 2-core box registers raylets slowly
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PROMPT = [5, 17, 42, 8, 23, 61]
MAX_TOKENS = 8


def app_config(tp: int) -> dict:
    return {
        "target": {"path": "builtin:tiny", "device": "cpu", "dtype": "float32", "max_model_len": 128,
                   "tensor_parallel": tp},
        "draft": {"kind": "model", "path": "builtin:tiny"},
        "speculation": {"gamma": 4, "gamma_max": 8},
        "draft_pool": {"num_replicas": 1, "placement": "offload", "num_cpus": 0.25,
                       "accelerator_type": "L4", "resources": {"specserve_draft": 1}, "max_batch_size": 8,
                       "batch_size": 8},
        "verifier": {"num_groups": 1 if tp > 1 else 2, "num_cpus": 0.25, "accelerator_type": "H200",
                     "resources": {"specserve_target": 1},
                     "placement_strategy": "STRICT_PACK"},
        "router": {"max_running": 8, "max_queue": 8, "num_cpus": 0.25, "request_timeout_s": 120},
        "ray": {"auth_mode": "disabled"},
        "defaults": {"temperature": 0.0},
    }


def _run_nowait(app, name: str) -> None:
    try:
        from ray.serve.api import _run  # Ray 2.60: serve.run waits; its private twin can return at once
    except ImportError:
        from ray import serve

        serve.run(app, name=name, route_prefix=None)
        return
    _run(app, name=name, route_prefix=None, _blocking=False)


def wait_running(names: list[str], timeout_s: float) -> None:
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline = time.monotonic() + timeout_s
    while True:
        apps = serve.status().applications
        failed = [f"{n}: {apps[n].message}" for n in names if n in apps
                  and apps[n].status == ApplicationStatus.DEPLOY_FAILED]
        if failed:
            raise RuntimeError("deploy failed: " + "; ".join(failed))
        if all(n in apps and apps[n].status == ApplicationStatus.RUNNING for n in names):
            return
        if time.monotonic() > deadline:
            # Serve's per-deployment messages name a replica it cannot schedule and the resources it wants.
            details = [f"{n}/{d}: {st.status} {st.message}".strip() for n in names if n in apps
                       for d, st in apps[n].deployments.items() if st.status != "HEALTHY"]
            raise TimeoutError(f"not RUNNING after {timeout_s:.0f} s: " + " | ".join(
                details or [f"{n}: {apps[n].status if n in apps else 'absent'}" for n in names]))
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, one app each")
    parser.add_argument("--budget", type=float, default=150.0,
                        help="seconds for everything before the cluster is shut down (an error is reported)")
    args = parser.parse_args()
    tps = [int(x) for x in args.tp.split(",")]

    t0 = time.monotonic()
    left = lambda: max(1.0, args.budget - (time.monotonic() - t0))  # noqa: E731
    import ray
    from ray import serve
    from ray._private import state
    from ray.cluster_utils import Cluster

    out: dict = {"tp": tps, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        # As the reference node types declare them (cluster/placement.py), accelerator type included.
        target = cluster.add_node(num_cpus=2, resources={"specserve_target": 4, "accelerator_type:H200": 1})
        draft = cluster.add_node(num_cpus=2, resources={"specserve_draft": 4, "accelerator_type:L4": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
        roles = {cluster.head_node.node_id: "head", target.node_id: "target", draft.node_id: "draft"}
        out["cluster_s"] = round(time.monotonic() - t0, 1)

        from deployments.api import GenerateRequest
        from deployments.app import build_app

        serve.start(proxy_location="Disabled")  # handle API only: three "nodes" share one machine's ports
        names = [f"placement-tp{tp}" for tp in tps]
        for tp, name in zip(tps, names):
            # Submit every app before waiting for any (serve.run would wait for each in turn).
            _run_nowait(build_app(app_config(tp)), name=name)
        wait_running(names, left())
        out["deploy_s"] = round(time.monotonic() - t0, 1)

        out["tokens"] = {}
        for tp, name in zip(tps, names):
            router = serve.get_deployment_handle("Router", name)
            resp = router.generate.remote(GenerateRequest(prompt_token_ids=list(PROMPT), max_tokens=MAX_TOKENS,
                                                          temperature=0.0)).result(timeout_s=left())
            out["tokens"][str(tp)] = list(resp.token_ids)

        actors = []
        for info in state.actors().values():
            if info.get("State") != "ALIVE":
                continue
            node = info.get("Address", {}).get("NodeID")
            actors.append({"class": info.get("ActorClassName"), "name": info.get("Name", ""),
                           "node": roles.get(node, node)})
        out["actors"] = sorted(actors, key=lambda a: (a["class"] or "", a["name"] or ""))
        out["total_s"] = round(time.monotonic() - t0, 1)
    except Exception as exc:  # reported to the test as JSON, with whatever was gathered
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
    print(json.dumps(out), flush=True)
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""A local Ray cluster every socket of which listens on loopback only.

Ray binds GCS, raylet, object manager, workers' gRPC servers, the dashboard and runtime-env agents and the
metrics exporters to its node IP, and the node IP is 127.0.0.1 only in Ray's local-only mode
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, its default on macOS and Windows). Every Ray process reads that
variable when it imports ray, so ``init_local_ray`` sets it before Ray starts and the cluster's processes
inherit it; a process that imported ray earlier cannot be switched, and ``init_local_ray`` refuses the
cluster it got. A client process attaching to such a cluster needs the same variable (else it looks for
a node on its network IP and waits).

One server ignores the node IP: each Serve replica's inter-deployment gRPC server binds ``[::]:0`` (every
interface). ``bind_wildcard_grpc_to_node_ip`` — a ``worker_process_setup_hook`` that ``init_local_ray``
installs in every worker of the job — makes Ray's ``add_port_to_grpc_server`` bind that address to the
node IP instead, which is where Serve's handles connect anyway. It patches the light ``tls_utils`` module
before Serve's replica module imports the function (importing Serve in every worker would slow each
one's start). ``tests/ray/test_sockets.py`` fails if a Ray upgrade adds another wildcard listener.

The HTTP API of such a cluster is served by the ingress replica itself (Serve's direct ingress,
``direct_ingress_env``): Serve's proxy spends CPU on every request, so on a small node a burst queues
behind it even when the answer is an immediate 503 (docs/measurements.md#loopback-cluster). Serve still
starts its proxy (on an ephemeral loopback port, unused); multi-node clusters keep the proxy, which
spreads requests over ingress replicas.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from cluster.config import is_loopback_host

LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
SETUP_HOOK = f"{__name__}.bind_wildcard_grpc_to_node_ip"
_REPLICA_MODULE = "ray.serve._private.replica"
_WILDCARD_ANY_PORT = "[::]:0"


def direct_ingress_env(port: int, count: int = 1) -> dict[str, str]:
    """Environment for Ray (set before it starts: the controller and replicas read it at import) that makes
    each ingress replica serve HTTP itself, on one of the ``count`` ports from ``port`` (Serve allocates
    direct-ingress ports from [MIN, MAX); ``specserve serve`` has one ingress and one port).

    Serve keeps a stopping direct-ingress replica up for a minimum draining period (30 s) so that a load
    balancer in front of it notices; nothing stands in front of these, so Ctrl-C need not wait it out
    (docs/measurements.md#loopback-cluster). Without that period a stopping replica still waits for the
    requests in flight (``graceful_shutdown_timeout_s``)."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + count),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


def init_local_ray(runtime_env: dict[str, Any] | None = None, **kwargs: Any) -> None:
    """``ray.init`` of a fresh single-node cluster on loopback; ``kwargs`` go to ``ray.init``. Raises (after
    shutting the cluster down) if its node came up on another address."""
    os.environ[LOCAL_ONLY_ENV] = "0"
    import ray

    # address="local": always a fresh cluster, never one a `ray start` left behind on this machine.
    ray.init(address="local", runtime_env={**(runtime_env or {}), "worker_process_setup_hook": SETUP_HOOK},
             **kwargs)
    node_ip = ray.util.get_node_ip_address()
    if not is_loopback_host(node_ip):
        ray.shutdown()
        raise RuntimeError(f"Ray's node IP is {node_ip}, not loopback: ray was imported before {LOCAL_ONLY_ENV}=0 "
                           "was set; set it in the environment before Python starts")


def bind_wildcard_grpc_to_node_ip() -> None:
    """Worker setup hook: a gRPC server asked to listen on ``[::]:0`` listens on the node IP instead."""
    import ray
    from ray._common import tls_utils

    add_port = tls_utils.add_port_to_grpc_server

    def add_port_on_node_ip(server, address: str) -> int:
        if address == _WILDCARD_ANY_PORT:
            host = ray.util.get_node_ip_address()
            address = f"[{host}]:0" if ":" in host else f"{host}:0"
        return add_port(server, address)

    tls_utils.add_port_to_grpc_server = add_port_on_node_ip
    replica = sys.modules.get(_REPLICA_MODULE)  # imported already (preloaded): it holds its own reference
    if replica is not None:
        replica.add_port_to_grpc_server = add_port_on_node_ip

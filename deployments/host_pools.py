"""A `ray up` node provider for machines you already have, with one pool of hosts per node type.

Ray's ``local`` provider puts every host in one node type that declares no resources, so its autoscaler can
start a host only to reach ``min_workers``, never for a replica that waits for a role resource
(``specserve_draft``): its planner only learns CPU, GPU and memory from a running node. This provider keeps
the local provider's SSH launcher and state file and adds node types: each ``available_node_types`` entry
lists its hosts in ``node_config.hosts`` and declares the resources its hosts advertise (the launcher exports
them to ``ray start``), so a pending draft replica makes the autoscaler take a free host of the draft pool,
and an idle one goes back to it. Used as::

    provider: {type: external, module: deployments.host_pools.HostPoolProvider,
               head_ip: 10.0.0.10, worker_ips: [every pool's hosts]}
"""

from __future__ import annotations

from typing import Any

from ray.autoscaler._private.local.node_provider import LocalNodeProvider
from ray.autoscaler.tags import NODE_KIND_WORKER, TAG_RAY_NODE_KIND

MODULE = f"{__name__}.HostPoolProvider"


class HostPoolProvider(LocalNodeProvider):
    def create_node(self, node_config: dict[str, Any], tags: dict[str, str], count: int) -> None:
        """Start up to ``count`` free hosts of the node type's pool, in the order the pool lists them."""
        if tags[TAG_RAY_NODE_KIND] != NODE_KIND_WORKER:
            return super().create_node(node_config, tags, count)
        hosts = node_config.get("hosts") or []
        unknown = sorted(set(hosts) - set(self.provider_config["worker_ips"]))
        if unknown:
            raise ValueError(f"node_config.hosts {unknown} are not in provider.worker_ips")
        with self.state.lock, self.state.file_lock:
            workers = self.state.get()
            for host in hosts:
                info = workers[host]
                if count and info["state"] == "terminated":
                    info.update(tags=tags, state="running")
                    info.pop("teardown_complete", None)
                    self.state.put(host, info)
                    count -= 1

    @staticmethod
    def bootstrap_config(cluster_config: dict[str, Any]) -> dict[str, Any]:
        return cluster_config

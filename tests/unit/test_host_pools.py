"""deployments.host_pools.HostPoolProvider with Ray's own state file and lock (no cluster needed): a node
type's launch takes free hosts of its own pool only, in pool order; a terminated host is free again; the
head is recorded as Ray's local provider records it; a pool naming a host outside worker_ips is refused."""

from __future__ import annotations

import os
import uuid

import pytest

from deployments.host_pools import HostPoolProvider

HEAD, TARGETS, DRAFTS = "10.9.0.1", ["10.9.0.11", "10.9.0.12"], ["10.9.0.21", "10.9.0.22"]


@pytest.fixture
def provider():
    from ray.autoscaler._private.local.config import get_lock_path, get_state_path

    name = f"unit-{uuid.uuid4().hex[:8]}"
    yield HostPoolProvider({"type": "external", "head_ip": HEAD, "worker_ips": TARGETS + DRAFTS}, name)
    for path in (get_state_path(name), get_lock_path(name)):
        if os.path.exists(path):
            os.remove(path)


def _tags(node_type: str) -> dict[str, str]:
    from ray.autoscaler.tags import NODE_KIND_WORKER, TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

    return {TAG_RAY_NODE_KIND: NODE_KIND_WORKER, TAG_RAY_USER_NODE_TYPE: node_type}


def _running(provider, node_type: str) -> list[str]:
    from ray.autoscaler.tags import TAG_RAY_USER_NODE_TYPE

    return sorted(provider.non_terminated_nodes({TAG_RAY_USER_NODE_TYPE: node_type}))


def test_each_node_type_starts_hosts_of_its_own_pool_in_order(provider):
    provider.create_node({"hosts": TARGETS}, _tags("target"), 5)  # asks more than the pool has
    assert _running(provider, "target") == TARGETS
    provider.create_node({"hosts": DRAFTS}, _tags("draft"), 1)
    assert _running(provider, "draft") == DRAFTS[:1]
    provider.create_node({"hosts": DRAFTS}, _tags("draft"), 1)  # the spare, on demand
    assert _running(provider, "draft") == DRAFTS
    provider.terminate_node(DRAFTS[0])  # idle, or lost: free again, and the first a launch takes
    assert _running(provider, "draft") == DRAFTS[1:]
    provider.create_node({"hosts": DRAFTS}, _tags("draft"), 1)
    assert _running(provider, "draft") == DRAFTS
    assert _running(provider, "target") == TARGETS  # no draft launch ever took a target host


def test_the_head_is_recorded_as_the_local_provider_does(provider):
    from ray.autoscaler._private.local.node_provider import record_local_head_state_if_needed

    record_local_head_state_if_needed(provider)
    assert HEAD in provider.non_terminated_nodes({})


def test_a_pool_host_outside_worker_ips_is_refused(provider):
    with pytest.raises(ValueError, match=r"\['10.9.0.99'\] are not in provider.worker_ips"):
        provider.create_node({"hosts": ["10.9.0.99"]}, _tags("draft"), 1)

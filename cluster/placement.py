"""Placement: which node types host the draft pool and the verifier groups, as Ray resource requests.

Contract:
- ``placements(cfg)`` is the one place the app's Ray resources are computed: what one replica (or rank) of
  each role reserves, as a ``Placement`` (``num_cpus``, ``num_gpus``, ``accelerator_type``, ``resources``).
  ``serve_placements(cfg)`` is the same as the Serve deployments reserve it: ``deployments/app.py`` turns it
  into each deployment's ``ray_actor_options`` (``Placement.actor_options``).
- ``requests(cfg)`` lists those as Ray resource bundles (``Placement.bundle``), with counts, in the same terms
  as ``deployments/verifier_group.py`` (one placement-group bundle per tensor-parallel rank). A test builds
  the app and compares, so the two cannot drift.
- ``NodeType`` is what one kind of node advertises (``ray up``'s ``available_node_types[*].resources``, a
  KubeRay worker group's resources); ``REFERENCE_NODES`` is the reference cluster's layout, shared by
  ``cluster/launch/reference-4xh200.yaml`` (checked by a test) and ``scripts/render_k8s.py`` (rendered).
- ``check_fits(cfg, nodes)`` packs every request, at its most replicas, onto at most ``max_count`` nodes
  of each type (first fit, largest gangs first) and returns readable problems; ``[]`` means it fits.
- ``SIZING_TARGET`` / ``SIZING_DRAFT`` are the sizing table of docs/platform.md (``sizing_markdown()``).

Role resources. A node advertises one custom resource per role it may host, counted in GPUs of that role:
``specserve_target: 8`` on an 8 × H200 verifier node, ``specserve_draft: 4`` on a 4 × L4 draft node. A
verifier rank asks for ``verifier.resources: {specserve_target: 1}`` (with ``num_gpus: 1``) and a draft
replica for ``draft_pool.resources: {specserve_draft: 0.5}`` (with ``num_gpus: 0.5``). ``accelerator_type``
alone would pin drafts to L4s too, but the role resources also keep other work off the expensive nodes,
name the intent in ``ray status``, and work on CPU-only test clusters. Ray reserves
``accelerator_type:<T>: 0.001`` for an actor that sets ``accelerator_type``; nodes of that type carry
``accelerator_type:<T>: 1`` (Ray detects it on the node; launch files declare it so the autoscaler can
plan for it before the node exists).

No ray import: the launch-file tests and the k8s renderer run without a Ray cluster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cluster.config import ClusterConfig

TARGET_RESOURCE = "specserve_target"
DRAFT_RESOURCE = "specserve_draft"
ACCELERATOR_PREFIX = "accelerator_type:"
ACCELERATOR_REQUEST = 0.001  # what Ray reserves for ``accelerator_type=...`` (ray_constants)
_EPS = 1e-9


def resource_bundle(num_cpus: float, num_gpus: float, accelerator_type: str | None,
                    resources: Mapping[str, float]) -> dict[str, float]:
    """The Ray resources one actor with these options reserves (zero amounts left out)."""
    bundle: dict[str, float] = {}
    if num_cpus:
        bundle["CPU"] = float(num_cpus)
    if num_gpus:
        bundle["GPU"] = float(num_gpus)
    for name, amount in resources.items():
        bundle[name] = float(amount)
    if accelerator_type:
        bundle[ACCELERATOR_PREFIX + accelerator_type] = ACCELERATOR_REQUEST
    return bundle


@dataclass(frozen=True)
class Placement:
    """What one Ray actor reserves, in the terms of Ray's actor options."""

    num_cpus: float = 0.0
    num_gpus: float = 0.0
    accelerator_type: str | None = None
    resources: Mapping[str, float] = field(default_factory=dict)

    def actor_options(self) -> dict[str, Any]:
        """Ray actor options that reserve it (a Serve deployment's ``ray_actor_options``): ``num_cpus``
        always, the others when set."""
        opts: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            opts["num_gpus"] = self.num_gpus
        if self.accelerator_type:
            opts["accelerator_type"] = self.accelerator_type
        if self.resources:
            opts["resources"] = dict(self.resources)
        return opts

    def bundle(self) -> dict[str, float]:
        """The Ray resources it reserves (``resource_bundle``)."""
        return resource_bundle(self.num_cpus, self.num_gpus, self.accelerator_type, self.resources)


def placements(cfg: ClusterConfig) -> dict[str, Placement]:
    """What one replica of each role of the app for ``cfg`` reserves, a stage replica's worker included.

    Roles: ``verifier`` (with tensor parallelism it only coordinates, and each of its ``verifier-rank``
    actors holds a GPU share), ``draft`` (an offloaded draft pool's replica), ``router`` and ``ingress``.
    With ``router.stages: local`` the router replica hosts both models: it holds the verifier's share on top
    of its own, and there is no verifier or draft deployment. A stage in ``cfg.worker_stages`` runs its model
    in a stage worker on its replica's node, which holds the stage's GPUs: counted here with the replica,
    since they share a node; ``serve_placements`` leaves them out of the replica's own.
    """
    v, pool, r = cfg.verifier, cfg.draft_pool, cfg.router
    rank = Placement(v.num_cpus, v.num_gpus, v.accelerator_type, dict(v.resources))
    if r.stages == "local":
        return {"router": replace(rank, num_cpus=v.num_cpus + r.num_cpus,
                                  resources={**rank.resources, **r.resources}),
                "ingress": Placement(r.num_cpus, resources=dict(r.resources))}
    out: dict[str, Placement] = {}
    if cfg.target.tensor_parallel > 1:
        out["verifier"] = Placement(v.num_cpus)  # the rank actors it creates hold the GPUs (verifier_group)
        out["verifier-rank"] = rank
    else:
        out["verifier"] = rank
    if cfg.draft.kind != "none" and pool.placement == "offload":
        out["draft"] = Placement(pool.num_cpus, pool.num_gpus, pool.accelerator_type, dict(pool.resources))
    out["router"] = Placement(r.num_cpus, resources=dict(r.resources))
    out["ingress"] = Placement(r.num_cpus, resources=dict(r.resources))
    return out


def serve_placements(cfg: ClusterConfig) -> dict[str, Placement]:
    """``placements`` of the Serve deployments (no ``verifier-rank``), as their replicas reserve them: a
    stage in ``cfg.worker_stages`` leaves its GPUs to its stage worker (deployments/stage_host.py)."""
    out = {role: p for role, p in placements(cfg).items() if role != "verifier-rank"}
    for stage in cfg.worker_stages:
        if stage in out:
            out[stage] = replace(out[stage], num_gpus=0)
    return out


@dataclass(frozen=True)
class Request:
    """``count`` gangs of ``gang`` bundles each; a STRICT_PACK gang must share one node."""

    role: str
    count: int
    bundle: dict[str, float]
    gang: int = 1
    strategy: str = "PACK"


def requests(cfg: ClusterConfig) -> list[Request]:
    """What the app for ``cfg`` reserves at its largest (autoscaling at ``max_replicas``): ``placements``
    as bundles, with counts (a stage worker's GPUs in its replica's bundle: they share a node)."""
    v = cfg.verifier
    counts = {"verifier": v.num_groups, "verifier-rank": v.num_groups, "draft": cfg.draft_pool.max_replicas,
              "router": 1, "ingress": 1}
    out: list[Request] = []
    for role, placement in placements(cfg).items():
        if role == "verifier-rank":
            out.append(Request(role, counts[role], placement.bundle(), gang=cfg.target.tensor_parallel,
                               strategy=v.placement_strategy))
        else:
            out.append(Request(role, counts[role], placement.bundle()))
    return out


@dataclass(frozen=True)
class NodeType:
    """One kind of node: what each advertises and how many of it the cluster may hold."""

    name: str
    resources: dict[str, float]
    max_count: int = 1
    min_count: int = 0
    instance_type: str | None = None  # the cloud machine (AWS instance type) behind it, for docs and k8s

    @property
    def custom(self) -> dict[str, float]:
        """Custom Ray resources (role resources and accelerator type), as ``ray start --resources``."""
        return {k: v for k, v in self.resources.items() if k not in ("CPU", "GPU", "memory")}


# The reference cluster (AWS names; KubeRay uses the same instance types as node selectors).
# p5e.48xlarge: 8 × H200 141 GB (NVLink), 192 vCPU, 2 TiB, 3.2 Tbit/s EFA.
# g6.12xlarge: 4 × L4 24 GB, 48 vCPU, 192 GiB.  Head: CPU-only and reserves no CPU for replicas.
REFERENCE_NODES: tuple[NodeType, ...] = (
    NodeType("head", {"CPU": 0}, max_count=1, min_count=1, instance_type="m7i.2xlarge"),
    NodeType("verifier_h200", {"CPU": 192, "GPU": 8, TARGET_RESOURCE: 8, ACCELERATOR_PREFIX + "H200": 1},
             max_count=4, min_count=4, instance_type="p5e.48xlarge"),
    NodeType("draft_l4", {"CPU": 48, "GPU": 4, DRAFT_RESOURCE: 4, ACCELERATOR_PREFIX + "L4": 1},
             max_count=2, min_count=1, instance_type="g6.12xlarge"),
)

# The smallest box cluster/examples/single-node.yaml needs (everything on one machine, one GPU).
SINGLE_NODE: tuple[NodeType, ...] = (NodeType("single", {"CPU": 4, "GPU": 1}, max_count=1, min_count=1),)


def _fits(free: dict[str, float], bundle: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + _EPS >= amount for k, amount in bundle.items())


def _take(free: dict[str, float], bundle: Mapping[str, float]) -> None:
    for k, amount in bundle.items():
        free[k] = free.get(k, 0.0) - amount


def check_fits(cfg: ClusterConfig, nodes: Sequence[NodeType]) -> list[str]:
    """Problems placing every request of ``cfg`` on ``nodes`` (at most ``max_count`` of each); [] = fits.

    Resource arithmetic only (no memory, no object store), like Ray's scheduler; a gang with STRICT_PACK
    must fit on one node, PACK/SPREAD gangs may span nodes.
    """
    problems: list[str] = []
    pool = [(n.name, dict(n.resources)) for n in nodes for _ in range(n.max_count)]
    # Impossible on any single node: say so plainly (a missing role resource, a wrong accelerator type).
    for req in requests(cfg):
        if not any(_fits(dict(n.resources), req.bundle) for n in nodes):
            problems.append(f"{req.role}: no node type can host {_fmt(req.bundle)} "
                            f"(node types: {', '.join(f'{n.name} {_fmt(n.resources)}' for n in nodes)})")
    if problems:
        return problems
    ordered = sorted(requests(cfg), key=lambda q: (-q.gang * sum(q.bundle.values()), q.role))
    for req in ordered:
        for i in range(req.count):
            if req.gang > 1 and req.strategy == "STRICT_PACK":
                home = next((f for _, f in pool if _fits(f, {k: v * req.gang for k, v in req.bundle.items()})), None)
                if home is None:
                    problems.append(f"{req.role} group {i + 1} of {req.count}: no node has room for "
                                    f"{req.gang} × {_fmt(req.bundle)} together (STRICT_PACK)")
                    continue
                for _ in range(req.gang):
                    _take(home, req.bundle)
                continue
            for rank in range(req.gang):
                home = next((f for _, f in pool if _fits(f, req.bundle)), None)
                if home is None:
                    what = f"rank {rank} of group {i + 1}" if req.gang > 1 else f"replica {i + 1}"
                    problems.append(f"{req.role} {what} of {req.count}: no room left for {_fmt(req.bundle)}")
                    break
                _take(home, req.bundle)
    return problems


def role_resources(cfg: ClusterConfig) -> set[str]:
    """Custom resources (not CPU/GPU/accelerator type) that the config's replicas and ranks ask for."""
    names: set[str] = set()
    for req in requests(cfg):
        names.update(k for k in req.bundle if k not in ("CPU", "GPU") and not k.startswith(ACCELERATOR_PREFIX))
    return names


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


# ---- sizing ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SizingRow:
    size: str
    weights: str
    layout: str
    node: str
    note: str = ""


# Weights at bf16 = 2 bytes per parameter; an H200 holds 141 GB. Leave at least a third of each GPU for
# KV slots (``router.max_running`` × ``target.max_model_len`` tokens) and activations.
SIZING_TARGET: tuple[SizingRow, ...] = (
    SizingRow("≤ 8B", "≤ 16 GB", "TP 1; up to 8 groups per node", "any one GPU; 1 H200 per group",
              "data parallel beats TP at this size"),
    SizingRow("8–34B", "16–68 GB", "TP 2", "2 H200 per group, 4 groups per node", ""),
    SizingRow("34–70B", "68–140 GB", "TP 4", "4 H200 per group, 2 groups per node", ""),
    SizingRow("70–200B", "140–400 GB", "TP 8", "one p5e.48xlarge (8 × H200) per group",
              "reference: 4 groups on 4 nodes"),
    SizingRow("200–400B", "400–800 GB", "TP 8 (KV-tight) or TP 16", "one node, or two nodes with PACK",
              "TP 16 all-reduces over EFA/InfiniBand every layer"),
    SizingRow("> 400B", "> 800 GB", "TP 16", "two p5e.48xlarge per group (PACK)", "reference: 2 groups on 4 nodes"),
)

SIZING_DRAFT: tuple[SizingRow, ...] = (
    SizingRow("n-gram", "none", "num_gpus 0", "CPU on any node", "prompt lookup; no second model"),
    SizingRow("≤ 1B", "≤ 2 GB", "num_gpus 0.5 (2 replicas per GPU)", "L4 24 GB (g6) or A10G 24 GB (g5)",
              "reference: 16 replicas on 2 × g6.12xlarge"),
    SizingRow("1–3B", "2–6 GB", "num_gpus 1", "L4 / A10G", ""),
    SizingRow("3–8B", "6–16 GB", "num_gpus 1", "L40S 48 GB (g6e) or a slice of the verifier node",
              "c rises: check acceptance pays for it"),
    SizingRow("any, batch-1 latency", "", "placement: colocated", "inside each verifier replica",
              "no draft hop; TP 1 targets only"),
)


def sizing_markdown() -> str:
    """The two sizing tables of docs/platform.md, as Markdown."""
    lines = ["| target size (params) | bf16 weights | tensor parallel | node type | note |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r.size} | {r.weights} | {r.layout} | {r.node} | {r.note} |" for r in SIZING_TARGET]
    lines += ["", "| draft size (params) | bf16 weights | draft_pool | GPU type | note |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r.size} | {r.weights} | {r.layout} | {r.node} | {r.note} |" for r in SIZING_DRAFT]
    return "\n".join(lines)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token costs (keys and values, every layer); × slots × max_model_len = the pool."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


__all__ = [
    "ACCELERATOR_PREFIX", "DRAFT_RESOURCE", "NodeType", "Placement", "REFERENCE_NODES", "Request", "SINGLE_NODE",
    "SIZING_DRAFT", "SIZING_TARGET", "TARGET_RESOURCE", "check_fits", "kv_bytes_per_token", "placements",
    "requests", "resource_bundle", "role_resources", "serve_placements", "sizing_markdown",
]

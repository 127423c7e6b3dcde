"""Render the KubeRay manifests in k8s/ from a specserve ``ClusterConfig`` (default: cluster/examples/h200.yaml).

    python scripts/render_k8s.py                          # (re)write k8s/*.yaml
    python scripts/render_k8s.py --check                  # exit 1 if a committed manifest is stale
    python scripts/render_k8s.py --config my.yaml --image reg/specserve:1.2 --out-dir out/ \
        [--gcs-ft-redis redis:6379 --redis-password-secret redis-password-secret:password]

Files (a run without options writes all four into k8s/; with options, all but the GCS one, into --out-dir):
- ``rayservice.yaml``: a ``RayService`` whose ``serveConfigV2`` is ``tools.serve_config.serve_config``
  of the same ClusterConfig — the placement (role resources, accelerator types) in the Serve app's args and
  the worker groups below come from one file, so they cannot drift (tests re-render and compare).
- ``raycluster.yaml``: a ``RayCluster`` with the same layout, for ``serve deploy`` by hand.
- ``rayservice-gcs-ft.yaml``: the RayService with ``gcsFaultToleranceOptions`` (external Redis; the password
  from a Secret), which lets Serve keep serving through a head-pod restart.
- ``networkpolicy.yaml``: a ``NetworkPolicy`` (``network_policy``) that lets only the cluster's own pods reach
  Ray's ports, the KubeRay operator the dashboard, and anyone the HTTP API and the metrics port.

Layout (``cluster.placement.REFERENCE_NODES``): a CPU head with ``num-cpus: 0`` (no replicas), one worker
group per GPU node type — ``verifier-h200`` (``nvidia.com/gpu: 8``, ``specserve_target: 8``) and
``draft-l4`` (``nvidia.com/gpu: 4``, ``specserve_draft: 4``) — pinned to their instance types with a
nodeSelector. Ray's token auth is on (``authOptions.mode: token``; KubeRay ≥ 1.5.1 makes and mounts the
token). The HTTP API key is the Secret ``specserve-api-key`` (key ``api-key``) mounted in every pod as the
file ``http.api_key_file`` names (``~`` = the image user's home, /home/ray), which only the ingress reads.
``validate_manifest`` checks a manifest against the KubeRay CRD (jsonschema on the served
version's ``openAPIV3Schema``, plus a strict pass for keys the schema does not define, plus KubeRay's own
replica-count rules) and its ``serveConfigV2`` with the checker it is given (Ray Serve's schema:
``deployments.serve_schema.validate_serve_config``, which needs Ray, so this module does not import it).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
from cluster.config import ClusterConfig
from cluster.placement import REFERENCE_NODES, NodeType
from tools.serve_config import RenderError, dump_yaml, serve_config, write_or_check

DEFAULT_CONFIG = "cluster/examples/h200.yaml"
DEFAULT_IMAGE = "registry.example.com/specserve:0.1.0"  # replace: the project image (docs/platform.md)
RAY_VERSION = "2.60.0"
NAME = "specserve"
APP_LABELS = {"app.kubernetes.io/name": NAME}  # on every pod and object: what the NetworkPolicy selects
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}  # the labels KubeRay's Helm chart gives it
DASHBOARD_PORT, METRICS_PORT = 8265, 8080  # Ray's dashboard; the metrics port KubeRay gives every Ray pod
NODE_SELECTOR_KEY = "node.kubernetes.io/instance-type"
API_KEY_SECRET = ("specserve-api-key", "api-key")  # Secret name and key holding the HTTP API key
IMAGE_HOME = "/home/ray"  # HOME of the rayproject images' user: what `~` in http.api_key_file means in a pod
MODELS_CLAIM = "specserve-models"  # a ReadOnlyMany PersistentVolumeClaim with /models/target, /models/draft
CRD_DIR = REPO / "k8s" / "schemas" / "kuberay"  # vendored KubeRay CRDs (SOURCE.md there: origin, licence)

# Pod size per node type: what a pod may request on that machine (the kubelet and daemons keep the rest).
POD_SIZE = {
    "head": {"cpu": "8", "memory": "32Gi"},
    "verifier_h200": {"cpu": "184", "memory": "1900Gi"},
    "draft_l4": {"cpu": "44", "memory": "170Gi"},
}
GROUP_NAMES = {"verifier_h200": "verifier-h200", "draft_l4": "draft-l4"}
ROLES = {"verifier_h200": "verifier", "draft_l4": "draft"}


def _env(cfg: ClusterConfig) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "TOKENIZERS_PARALLELISM", "value": "false"}]
    if cfg.http.api_key_env:  # the config's choice; every Ray process of the pod then holds it (prefer the file)
        name, key = API_KEY_SECRET
        env.append({"name": cfg.http.api_key_env, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    return env


def _api_key_file(cfg: ClusterConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Volumes and mounts that put the Secret's key at ``http.api_key_file`` in every pod (the ingress may
    land on any): a file only the ingress reads, in no process's environment."""
    if cfg.http.api_key_file is None:
        return [], []
    raw = cfg.http.api_key_file
    path = PurePosixPath(IMAGE_HOME + raw[1:] if raw.startswith("~/") else raw)
    if not path.is_absolute() or path.parent == PurePosixPath("/"):
        raise RenderError(f"http.api_key_file: {raw!r} must be an absolute path below a folder, or start with ~/, "
                          "to be mounted from the Secret")
    name, key = API_KEY_SECRET
    volume = {"name": "api-key", "secret": {"secretName": name, "items": [{"key": key, "path": path.name}]}}
    return [volume], [{"name": "api-key", "mountPath": str(path.parent), "readOnly": True}]


def _ray_resources(node: NodeType) -> str:
    # KubeRay passes it to `ray start --resources=...`; this quoted-JSON form is the one KubeRay documents.
    return '"' + json.dumps(node.custom, sort_keys=True).replace('"', '\\"') + '"'


def _container(name: str, image: str, size: Mapping[str, str], gpus: int, env: list, key_mounts: list, *,
               head: bool) -> dict:
    limits = dict(size)
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    c: dict[str, Any] = {"name": name, "image": image, "env": env,
                         "resources": {"limits": limits, "requests": dict(limits)}}
    if head:
        c["ports"] = [{"containerPort": 6379, "name": "gcs-server"},
                      {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
                      {"containerPort": 10001, "name": "client"}, {"containerPort": 8000, "name": "serve"}]
        if key_mounts:
            c["volumeMounts"] = list(key_mounts)
    else:
        c["volumeMounts"] = [{"name": "models", "mountPath": "/models", "readOnly": True},
                             {"name": "dshm", "mountPath": "/dev/shm"}, *key_mounts]
    return c


def _worker_group(node: NodeType, image: str, env: list, key_file: tuple[list, list]) -> dict[str, Any]:
    gpus = int(node.resources.get("GPU", 0))
    return {
        "groupName": GROUP_NAMES[node.name],
        "replicas": node.min_count,
        "minReplicas": node.min_count,
        "maxReplicas": node.max_count,
        "rayStartParams": {"resources": _ray_resources(node)},
        "template": {
            "metadata": {"labels": {**APP_LABELS, "specserve/role": ROLES[node.name]}},
            "spec": {
                "nodeSelector": {NODE_SELECTOR_KEY: node.instance_type},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "containers": [_container("ray-worker", image, POD_SIZE[node.name], gpus, env, key_file[1],
                                          head=False)],
                "volumes": [
                    {"name": "models", "persistentVolumeClaim": {"claimName": MODELS_CLAIM, "readOnly": True}},
                    # NCCL and the object store want a large /dev/shm; the container default is 64 MiB.
                    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}},
                    *key_file[0],
                ],
            },
        },
    }


def ray_cluster_spec(cfg: ClusterConfig, *, image: str = DEFAULT_IMAGE, gcs_ft_redis: str | None = None,
                     redis_password_secret: tuple[str, str] = ("redis-password-secret", "password"),
                     nodes: tuple[NodeType, ...] = REFERENCE_NODES) -> dict[str, Any]:
    """``spec`` of a RayCluster (and ``spec.rayClusterConfig`` of a RayService) for ``cfg`` on ``nodes``."""
    if cfg.ray.auth_mode != "token":
        raise RenderError("ray.auth_mode: a Kubernetes cluster is reachable by other pods; render it with "
                          "auth_mode 'token' (the manifests turn on KubeRay's authOptions)")
    env = _env(cfg)
    key_file = _api_key_file(cfg)
    head = next(n for n in nodes if n.name == "head")
    spec: dict[str, Any] = {
        "rayVersion": RAY_VERSION,
        "enableInTreeAutoscaling": True,  # the draft pool autoscales; its demand adds draft-l4 pods
        "autoscalerOptions": {"upscalingMode": "Default", "idleTimeoutSeconds": 600},
        "authOptions": {"mode": "token"},
    }
    if gcs_ft_redis:
        name, key = redis_password_secret
        spec["gcsFaultToleranceOptions"] = {
            "redisAddress": gcs_ft_redis,
            "redisPassword": {"valueFrom": {"secretKeyRef": {"name": name, "key": key}}},
        }
    spec["headGroupSpec"] = {
        # num-cpus 0: no replica lands on the head; Serve's controller and proxy reserve no CPU.
        # dashboard-host 0.0.0.0 inside the pod: the KubeRay operator deploys serveConfigV2 and reads Serve's
        # status through the dashboard API via the head Service; token auth (authOptions) guards it, and
        # networkpolicy.yaml lets only the operator's pods and the cluster's own reach it.
        "rayStartParams": {"num-cpus": str(int(head.resources.get("CPU", 0))), "dashboard-host": "0.0.0.0"},
        "template": {
            "metadata": {"labels": {**APP_LABELS, "specserve/role": "head"}},
            "spec": {"containers": [_container("ray-head", image, POD_SIZE["head"], 0, env, key_file[1], head=True)],
                     **({"volumes": key_file[0]} if key_file[0] else {})},
        },
    }
    spec["workerGroupSpecs"] = [_worker_group(n, image, env, key_file) for n in nodes if n.name != "head"]
    return spec


def render(cfg: ClusterConfig, *, image: str = DEFAULT_IMAGE, gcs_ft_redis: str | None = None,
           redis_password_secret: tuple[str, str] = ("redis-password-secret", "password")) -> dict[str, dict]:
    """``{"RayService": ..., "RayCluster": ...}`` manifests for ``cfg``."""
    cluster = ray_cluster_spec(cfg, image=image, gcs_ft_redis=gcs_ft_redis,
                               redis_password_secret=redis_password_secret)
    meta = {"name": NAME, "labels": dict(APP_LABELS)}
    service = {
        "apiVersion": "ray.io/v1", "kind": "RayService", "metadata": meta,
        "spec": {"serveConfigV2": dump_yaml(serve_config(cfg)), "rayClusterConfig": cluster},
    }
    ray_cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": meta, "spec": cluster}
    return {"RayService": service, "RayCluster": ray_cluster}


def network_policy(cfg: ClusterConfig) -> dict[str, Any]:
    """A NetworkPolicy for every specserve pod: from each other, every port (GCS, raylets, object
    transfers); from the KubeRay operator's pods in any namespace, the dashboard (it deploys the app and
    reads its status there); from anywhere, the HTTP API (``http.port``, guarded by the API key) and the
    metrics port (Prometheus). Nothing else reaches Ray's ports, whatever else runs in the Kubernetes
    cluster; token auth stays on behind it."""
    def tcp(*ports: int) -> list[dict[str, Any]]:
        return [{"protocol": "TCP", "port": p} for p in ports]

    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": NAME, "labels": dict(APP_LABELS)},
        "spec": {
            "podSelector": {"matchLabels": dict(APP_LABELS)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": dict(APP_LABELS)}}]},
                {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}],
                 "ports": tcp(DASHBOARD_PORT)},
                {"ports": tcp(cfg.http.port, METRICS_PORT)},
            ],
        },
    }


KUBERAY_NEEDS = ("KubeRay >= 1.5.1 (authOptions), the Secret specserve-api-key (key api-key) and the PVC "
                 "specserve-models")


def _header(kind: str, what: str, source: str, flags: str, needs: str = KUBERAY_NEEDS) -> str:
    return (f"# {kind}: {what}\n# Rendered by scripts/render_k8s.py{flags} from {source}; do not edit by hand.\n"
            f"# Needs {needs}: docs/platform.md.\n")


def render_files(config: str = DEFAULT_CONFIG, *, image: str = DEFAULT_IMAGE, gcs_ft_redis: str | None = None,
                 redis_password_secret: tuple[str, str] = ("redis-password-secret", "password")) -> dict[str, str]:
    """``rayservice.yaml``, ``raycluster.yaml`` and ``networkpolicy.yaml`` for a config (GCS fault tolerance on
    with ``gcs_ft_redis``)."""
    cfg = ClusterConfig.from_yaml(REPO / config if not Path(config).is_absolute() else config)
    docs = render(cfg, image=image, gcs_ft_redis=gcs_ft_redis, redis_password_secret=redis_password_secret)
    flags = "" if image == DEFAULT_IMAGE else f" --image {image}"
    if gcs_ft_redis:
        flags += f" --gcs-ft-redis {gcs_ft_redis}"
        if redis_password_secret != ("redis-password-secret", "password"):
            flags += f" --redis-password-secret {':'.join(redis_password_secret)}"
    ft = " GCS fault tolerance on an external (HA) Redis, its password from a Secret." if gcs_ft_redis else ""
    return {
        "rayservice.yaml": _header("RayService", "the specserve app on the reference layout." + ft, config, flags)
        + dump_yaml(docs["RayService"]),
        "raycluster.yaml": _header("RayCluster", "the same layout; deploy the app with `serve deploy`." + ft, config,
                                   flags) + dump_yaml(docs["RayCluster"]),
        "networkpolicy.yaml": _header("NetworkPolicy", "who reaches the specserve pods, on which ports.", config,
                                      flags, needs="a network plugin that enforces NetworkPolicy")
        + dump_yaml(network_policy(cfg)),
    }


def committed_files() -> dict[str, str]:
    """What k8s/ holds: the plain pair, and the RayService again with GCS fault tolerance (redis:6379)."""
    files = render_files()
    files["rayservice-gcs-ft.yaml"] = render_files(gcs_ft_redis="redis:6379")["rayservice.yaml"]
    return files


# ---- offline validation ----------------------------------------------------------------------------

OBJECT_META_KEYS = {"name", "namespace", "labels", "annotations", "generateName", "finalizers", "ownerReferences"}


@functools.lru_cache(maxsize=8)
def load_crd_schema(crd_dir: Path, kind: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of the served, storage version of the KubeRay CRD for ``kind`` (cached: the
    CRD files are ~1 MB each; libyaml's loader where PyYAML has it)."""
    file = crd_dir / f"ray.io_{kind.lower()}s.yaml"
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(file.read_text(encoding="utf-8"))  # safe loaders only
    try:
        crd = loader.get_single_data()
    finally:
        loader.dispose()
    versions = [v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage")]
    if not versions:
        raise ValueError(f"{file}: no served storage version")
    return versions[0]["schema"]["openAPIV3Schema"]


def unknown_keys(doc: Any, schema: Mapping[str, Any], path: str = "") -> list[str]:
    """Keys in ``doc`` that ``schema`` does not define. Free-form places are skipped: objects marked
    ``x-kubernetes-preserve-unknown-fields`` and maps (``additionalProperties``: labels, resource limits,
    rayStartParams), whose values are still walked."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out: list[str] = []
    if isinstance(doc, dict):
        if "additionalProperties" in schema:
            sub = schema["additionalProperties"]
            if isinstance(sub, dict):
                for k, v in doc.items():
                    out += unknown_keys(v, sub, f"{path}.{k}")
            return out
        props = schema.get("properties")
        if props is None:
            return out
        for k, v in doc.items():
            if k not in props:
                out.append(f"{path.lstrip('.') + '.' if path else ''}{k}: unknown key (not in the CRD schema; "
                           f"known here: {', '.join(sorted(props))})")
            else:
                out += unknown_keys(v, props[k], f"{path}.{k}")
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(doc):
            out += unknown_keys(v, schema["items"], f"{path}[{i}]")
    return out


def _kuberay_rules(spec: Mapping[str, Any], where: str) -> list[str]:
    """Rules KubeRay's controller enforces that the CRD schema cannot express."""
    out = []
    for i, group in enumerate(spec.get("workerGroupSpecs") or []):
        if not isinstance(group, Mapping):
            continue
        name = group.get("groupName", i)
        lo, hi, n = group.get("minReplicas", 0), group.get("maxReplicas", 2147483647), group.get("replicas")
        if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            out.append(f"{where}.workerGroupSpecs[{name}]: minReplicas ({lo}) must be ≤ maxReplicas ({hi})")
        elif isinstance(n, int) and isinstance(lo, int) and isinstance(hi, int) and not lo <= n <= hi:
            out.append(f"{where}.workerGroupSpecs[{name}]: replicas ({n}) must be within [minReplicas {lo}, "
                       f"maxReplicas {hi}]")
    return out


def validate_manifest(doc: Mapping[str, Any], crd_dir: Path = CRD_DIR, *,
                      serve_check: Callable[[str], list[str]] | None) -> list[str]:
    """Readable problems with a RayService / RayCluster manifest; [] = valid.

    ``serve_check`` checks a RayService's ``serveConfigV2`` (pass
    ``deployments.serve_schema.validate_serve_config``); it is required, so that leaving the Serve config
    unchecked is a visible choice (``None``)."""
    import jsonschema

    kind = doc.get("kind")
    if kind not in ("RayService", "RayCluster"):
        return [f"kind: expected RayService or RayCluster, got {kind!r}"]
    schema = load_crd_schema(crd_dir, kind)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.absolute_path))
    out = [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in errors]
    out += unknown_keys({k: v for k, v in doc.items() if k != "metadata"}, schema)
    meta = doc.get("metadata")
    if isinstance(meta, Mapping):
        out += [f"metadata.{k}: unknown key (ObjectMeta)" for k in meta if k not in OBJECT_META_KEYS]
    spec = doc.get("spec")
    if isinstance(spec, Mapping):
        cluster = spec.get("rayClusterConfig") if kind == "RayService" else spec
        where = "spec.rayClusterConfig" if kind == "RayService" else "spec"
        if isinstance(cluster, Mapping):
            out += _kuberay_rules(cluster, where)
        if kind == "RayService" and serve_check is not None and isinstance(spec.get("serveConfigV2"), str):
            out += [f"spec.serveConfigV2: {p}" for p in serve_check(spec["serveConfigV2"])]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"ClusterConfig YAML (default {DEFAULT_CONFIG})")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="container image with specserve installed")
    parser.add_argument("--gcs-ft-redis", metavar="HOST:PORT",
                        help="turn GCS fault tolerance on with this external Redis (redis:6379, redis://...)")
    parser.add_argument("--redis-password-secret", default="redis-password-secret:password", metavar="NAME:KEY",
                        help="Secret and key holding the Redis password (default redis-password-secret:password)")
    parser.add_argument("--out-dir", default="k8s", help="where to write (default k8s/)")
    parser.add_argument("--check", action="store_true", help="compare with the files on disk; exit 1 if stale")
    args = parser.parse_args(argv)
    secret_name, _, secret_key = args.redis_password_secret.partition(":")
    if not secret_name or not secret_key:
        parser.error("--redis-password-secret: expected NAME:KEY")
    custom = (args.config, args.image, args.gcs_ft_redis, args.redis_password_secret, args.out_dir) != (
        DEFAULT_CONFIG, DEFAULT_IMAGE, None, "redis-password-secret:password", "k8s")
    try:
        files = render_files(args.config, image=args.image, gcs_ft_redis=args.gcs_ft_redis,
                             redis_password_secret=(secret_name, secret_key)) if custom else committed_files()
    except RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_dir = REPO / args.out_dir if not Path(args.out_dir).is_absolute() else Path(args.out_dir)
    return write_or_check({out_dir / name: text for name, text in files.items()}, check=args.check,
                          script="scripts/render_k8s.py")

if __name__ == "__main__":
    raise SystemExit(main())

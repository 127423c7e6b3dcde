"""Render a Ray Serve config (``serve deploy`` YAML) from a specserve ``ClusterConfig``.

    python scripts/render_serve_config.py                 # (re)write every file in RENDERED
    python scripts/render_serve_config.py --check         # exit 1 if a committed file is stale
    python scripts/render_serve_config.py --config my.yaml --out my-serve.yaml

The Serve config holds one application whose ``import_path`` is ``deployments.app:build_app`` and whose
``args`` are ``ClusterConfig.to_serve_args()``: the whole validated config, so replicas never read a file
and placement (``ray_actor_options``) is derived by ``build_app`` alone — the Serve config sets no
per-deployment overrides that could disagree with it. ``http_options`` come from ``http.host/port``.
A config with ``http.api_key`` set is refused: the key would sit in clear in a committed file and in
Ray's dashboard; use ``http.api_key_file`` (a file on every node that only the ingress reads).

The same ``serve_config()`` feeds ``serveConfigV2`` of the KubeRay manifests (scripts/render_k8s.py).
Checking a rendered file against Ray Serve's own schema needs Ray: ``deployments.serve_schema``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
from cluster.config import ClusterConfig

APP_NAME = "specserve"  # the name deployments/launch.py deploys under, too
IMPORT_PATH = "deployments.app:build_app"  # deployments.serve_schema.IMPORT_PATH (a test checks they agree)

# ClusterConfig example → the Serve config the `ray up` launch files deploy.
RENDERED: dict[str, str] = {
    "cluster/examples/h200.yaml": "cluster/launch/serve-h200.yaml",
    "cluster/examples/single-node.yaml": "cluster/launch/serve-single-node.yaml",
}


class RenderError(ValueError):
    """The config cannot be rendered into a deployable file (the message says why)."""


def serve_config(cfg: ClusterConfig, *, app_name: str = APP_NAME) -> dict[str, Any]:
    """The ``serve deploy`` document for ``cfg`` (a plain, JSON-able dict)."""
    if cfg.http.api_key is not None:
        raise RenderError("http.api_key: would be written in clear into the Serve config; use http.api_key_file "
                          "(a file on every node, read by the ingress replica only) instead")
    return {
        "proxy_location": cfg.http.proxy_location,
        "http_options": {"host": cfg.http.host, "port": cfg.http.port},
        "applications": [{
            "name": app_name,
            "route_prefix": "/",
            "import_path": IMPORT_PATH,
            "args": cfg.to_serve_args(),
        }],
    }


class _Dumper(yaml.SafeDumper):
    """Block style, keys in insertion order, multi-line strings as literal blocks, no anchors/aliases."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def dump_yaml(doc: Any) -> str:
    """Deterministic YAML (what the drift tests compare byte for byte)."""
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True, width=100)


def render_file(config_path: str | Path) -> str:
    config_path = Path(config_path)
    cfg = ClusterConfig.from_yaml(REPO / config_path if not config_path.is_absolute() else config_path)
    shown = config_path.as_posix()
    header = (f"# Rendered by scripts/render_serve_config.py from {shown}; do not edit by hand.\n"
              f"# Deploy: serve deploy <this file> (on the head node, RAY_AUTH_MODE=token where the cluster uses it).\n")
    return header + dump_yaml(serve_config(cfg))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a ClusterConfig YAML (default: every file in RENDERED)")
    parser.add_argument("--out", help="where to write it (with --config; default: stdout)")
    parser.add_argument("--check", action="store_true", help="compare with the files on disk; exit 1 if stale")
    args = parser.parse_args(argv)
    if args.config:
        pairs = {args.config: args.out}
    else:
        pairs = dict(RENDERED)
    files = {}
    for config, out in pairs.items():
        text = render_file(config)
        if out is None:
            sys.stdout.write(text)
            continue
        files[REPO / out if not Path(out).is_absolute() else Path(out)] = text
    return write_or_check(files, check=args.check, script="scripts/render_serve_config.py")


def write_or_check(files: dict[Path, str], *, check: bool, script: str) -> int:
    """Write rendered files, or with ``check`` report the ones that differ from disk (exit code 1)."""
    stale = []
    for target, text in files.items():
        if check:
            if not target.is_file() or target.read_text(encoding="utf-8") != text:
                stale.append(str(target.relative_to(REPO) if target.is_relative_to(REPO) else target))
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        print(f"wrote {target}", file=sys.stderr)
    if stale:
        print(f"stale (re-run {script}): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    raise SystemExit(main())

"""``specserve dashboards render DIR`` and ``specserve dashboards push --url --token-file``.

render: every generated monitoring file (``cluster.dashboards.render_files``: Grafana dashboard JSON, Grafana
file-provisioning YAML, the Prometheus alert rules, ``k8s/monitoring.yaml``) under DIR; ``render .`` at the
repository root rewrites the committed copies. push: the dashboards into a Grafana folder through its HTTP
API with ``grafana-client`` (a service-account token read from a file, so it stays out of shell history and
``ps``). Alert rules are Prometheus rules; load them into Prometheus (rule_files) or the PrometheusRule.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_render(args: argparse.Namespace) -> int:
    from cluster.dashboards import render_files

    out = Path(args.dir)
    for rel, text in render_files().items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(path)
    return 0


def push(url: str, token: str, timeout_s: float = 10.0) -> list[str]:
    """Create the folder when missing and upload every dashboard (overwriting); returns the dashboard uids."""
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError

    from cluster.dashboards import FOLDER, boards, dashboard_json

    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    try:
        api.folder.get_folder(FOLDER)
    except GrafanaClientError as exc:
        if exc.status_code != 404:
            raise
        api.folder.create_folder(FOLDER, uid=FOLDER)
    uids = []
    for board in boards():
        api.dashboard.update_dashboard({"dashboard": dashboard_json(board), "folderUid": FOLDER, "overwrite": True,
                                        "message": "specserve dashboards push"})
        uids.append(board.uid)
    return uids


def cmd_push(args: argparse.Namespace) -> int:
    from grafana_client.client import GrafanaException

    token = Path(args.token_file).read_text(encoding="utf-8").strip()
    if not token:
        print(f"specserve dashboards push: {args.token_file} is empty", file=sys.stderr)
        return 2
    try:
        for uid in push(args.url, token):
            print(f"pushed {uid}")
    except GrafanaException as exc:
        print(f"specserve dashboards push: Grafana refused: {exc}", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    dash = sub.add_parser("dashboards", help="render or push the Grafana dashboards and alert rules")
    verbs = dash.add_subparsers(dest="verb", required=True)
    render = verbs.add_parser("render", help="write dashboards JSON, provisioning YAML, alert rules, k8s objects")
    render.add_argument("dir", help="output folder (the repository root rewrites the committed files)")
    render.set_defaults(func=cmd_render)
    push_p = verbs.add_parser("push", help="upload the dashboards to Grafana (grafana-client)")
    push_p.add_argument("--url", required=True, help="Grafana base URL, e.g. http://grafana:3000")
    push_p.add_argument("--token-file", required=True, help="file holding a Grafana service-account token")
    push_p.set_defaults(func=cmd_push)

"""Draw each generated Grafana dashboard's layout as a PNG (docs/observability.md), from its JSON.

    python scripts/render_dashboard_layouts.py [--out docs/images]

Grafana cannot run here, so this is the layout, not a screenshot: one box per panel at its grid position
(24 columns; a grid row drawn 30 px high as in Grafana), titled, with its visualisation type, unit and the
legends of its queries.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cluster.dashboards import MONITORING_DIR, boards  # noqa: E402

COLOURS = {"timeseries": "#dbe9f6", "bargauge": "#e3f1dc", "stat": "#fbeed5"}


def draw(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in doc["panels"])
    fig, ax = plt.subplots(figsize=(16, 16 * rows * 30 / (24 * 70) + 0.8), dpi=90)
    for p in doc["panels"]:
        g = p["gridPos"]
        x, y, w, h = g["x"], rows - g["y"] - g["h"], g["w"], g["h"]
        ax.add_patch(FancyBboxPatch((x + 0.15, y + 0.15), w - 0.3, h - 0.3, boxstyle="round,pad=0.02",
                                    fc=COLOURS.get(p["type"], "#eeeeee"), ec="#555555"))
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        ax.text(x + 0.5, y + h - 0.7, p["title"], fontsize=11, weight="bold", va="top")
        ax.text(x + 0.5, y + h - 1.9, f"{p['type']} · {unit}", fontsize=8, color="#444444", va="top")
        legends = "\n".join(textwrap.shorten(t.get("legendFormat") or t["expr"], 60) for t in p["targets"])
        ax.text(x + 0.5, y + h - 3.0, legends, fontsize=8, family="monospace", va="top")
    ax.set_xlim(0, 24)
    ax.set_ylim(0, rows)
    ax.axis("off")
    ax.set_title(f"{doc['title']}  (uid {doc['uid']})", fontsize=14, loc="left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "images"))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    for board in boards():
        doc = json.loads((REPO / MONITORING_DIR / "grafana" / "dashboards" / f"{board.uid}.json").read_text())
        path = out / f"dashboard-{board.uid}.png"
        draw(doc, path)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

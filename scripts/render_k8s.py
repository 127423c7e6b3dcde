#!/usr/bin/env python3
"""Render the KubeRay manifests in k8s/ from a specserve ``ClusterConfig`` (default: cluster/examples/h200.yaml).  (`tools.k8s_manifests`; options: --help)"""

from tools.k8s_manifests import main

if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Render a Ray Serve config (``serve deploy`` YAML) from a specserve ``ClusterConfig``.  (`tools.serve_config`; options: --help)"""

from tools.serve_config import main

if __name__ == "__main__":
    raise SystemExit(main())

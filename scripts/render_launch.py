#!/usr/bin/env python3
"""Render the `ray up` cluster files in cluster/launch/.  (`tools.ray_launch`; options: --help)"""

from tools.ray_launch import main

if __name__ == "__main__":
    raise SystemExit(main())

"""The layer contract in pyproject.toml ([tool.importlinter]) holds, and it is a check that can fail.

Layers, top to bottom: specserve (CLI) > deployments (Ray) > evaluation > engine > verifier | draftpool >
runtime > cluster; beside them tools/ (scripts and tests only: no Ray, and no product package imports it);
inside deployments/, the transport package uses nothing of the rest. `lint-imports` must pass on the
repository; a copy of the packages with one upward import added (runtime -> engine), one Ray import outside
deployments/, one Ray import in tools/, one import of tools/ from the product and one of the replica side
from the transport must fail it, naming each.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def _packages() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def _copy(root: Path) -> None:
    """The packages and their contracts, for a copy to break."""
    for pkg in _packages():
        shutil.copytree(REPO / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")


def test_repository_keeps_every_contract():
    res = _lint(REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "BROKEN" not in res.stdout and res.stdout.count("KEPT") == 7, res.stdout


def test_an_upward_import_and_ray_outside_deployments_break_it(tmp_path):
    _copy(tmp_path)
    assert _lint(tmp_path).returncode == 0  # the copy alone is clean

    kv = tmp_path / "runtime" / "kv_cache.py"
    kv.write_text(kv.read_text() + "\nfrom engine import engine as _upward  # noqa: E402,F401\n")
    res = _lint(tmp_path)
    assert res.returncode != 0 and "runtime.kv_cache -> engine.engine" in res.stdout, res.stdout

    kv.write_text(kv.read_text().replace("from engine import engine as _upward", "import ray as _ray"))
    res = _lint(tmp_path)
    assert res.returncode != 0 and "runtime.kv_cache -> ray" in res.stdout, res.stdout


def test_ray_in_tools_and_tools_in_the_product_break_it(tmp_path):
    _copy(tmp_path)
    assert "tools" in _packages() and _lint(tmp_path).returncode == 0

    loadgen = tmp_path / "tools" / "loadgen.py"
    clean = loadgen.read_text()
    loadgen.write_text(clean + "\nimport ray as _ray  # noqa: E402,F401\n")
    res = _lint(tmp_path)
    assert res.returncode != 0 and "tools/ imports no Ray" in res.stdout and "BROKEN" in res.stdout, res.stdout
    assert "tools.loadgen -> ray" in res.stdout, res.stdout

    loadgen.write_text(clean)
    launch = tmp_path / "deployments" / "launch.py"
    launch.write_text(launch.read_text() + "\nfrom tools import loadgen as _tool  # noqa: E402,F401\n")
    res = _lint(tmp_path)
    assert res.returncode != 0 and "deployments.launch -> tools.loadgen" in res.stdout, res.stdout


def test_the_transport_importing_the_replica_side_breaks_it(tmp_path):
    _copy(tmp_path)
    links = tmp_path / "deployments" / "transport" / "links.py"
    links.write_text(links.read_text() + "\nfrom deployments import stage_workers as _replica  # noqa: E402,F401\n")
    res = _lint(tmp_path)
    assert res.returncode != 0 and "deployments.transport.links -> deployments.stage_workers" in res.stdout, res.stdout

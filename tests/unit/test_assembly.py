"""One assembly path, one validation per deploy, one home for each default.

- ``Engine(...)`` is constructed only in ``engine/assembly.py`` (every package and script, read as ASTs),
  and the router, the CLI, the benchmarks and the test helpers build engines with ``make_engine``.
- ``build_app`` validates the config once; constructing each deployment's replica class in-process with
  what ``build_app`` bound validates it no more and reads the target's tokenizer only where it is needed
  (the router), once.
- ``EngineSettings`` and the CLI take their defaults from the config's fields.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from cluster import defaults as D
from cluster.config import ClusterConfig
from deployments.settings import engine_settings
from engine.assembly import EngineSettings
from specserve.cli import build_parser
from tests.fixtures_tokenizer import tiny_pair

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "runtime", "verifier", "draftpool", "engine", "evaluation", "deployments", "specserve",
            "scripts")
ASSEMBLY = "engine/assembly.py"
# Where engines are built: each must call engine.assembly.make_engine.
BUILDERS = ("deployments/router.py", "specserve/cli.py", "scripts/bench_served.py", "evaluation/scenarios.py",
            "tests/unit/helpers.py")


def _called_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ""))
    return names


def _assembly_aliases(path: Path) -> set[str]:
    """Local names under which ``path`` imports ``engine.assembly.make_engine``."""
    return {alias.asname or alias.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module == "engine.assembly"
            for alias in node.names if alias.name == "make_engine"}


def test_engines_are_constructed_only_by_the_assembly():
    constructing = sorted(str(p.relative_to(REPO)) for package in PACKAGES for p in (REPO / package).rglob("*.py")
                          if "Engine" in _called_names(p))
    assert constructing == [ASSEMBLY]


@pytest.mark.parametrize("builder", BUILDERS)
def test_engine_builders_call_the_assembly(builder):
    path = REPO / builder
    aliases = _assembly_aliases(path)
    assert aliases and aliases & _called_names(path), f"{builder} does not build its engine with make_engine"


def test_engine_settings_defaults_are_the_configs():
    cfg = ClusterConfig.from_dict({"target": {"path": "builtin:tiny"}, "draft": {"kind": "ngram"}})
    from_config, bare = engine_settings(cfg), EngineSettings(target=None)
    for name in EngineSettings.__dataclass_fields__:
        if name not in ("target", "draft", "micro_batches"):  # micro_batches: see EngineSettings
            assert getattr(bare, name) == getattr(from_config, name), name
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert (args.max_tokens, args.gamma, args.gamma_max, args.max_len) == (
        D.MAX_TOKENS, bare.gamma, bare.gamma_max, bare.max_len)


# -- validation and tokenizer reads per replica start ------------------------------------------------


@pytest.fixture
def counted(monkeypatch):
    """Counts ``ClusterConfig`` validations and tokenizer loads; restores what a replica start changes."""
    counts: Counter = Counter()
    validate, load = ClusterConfig.model_validate.__func__, AutoTokenizer.from_pretrained.__func__

    def counting_validate(cls, *args, **kwargs):
        counts["validations"] += 1
        return validate(cls, *args, **kwargs)

    def counting_load(cls, *args, **kwargs):
        counts["tokenizer reads"] += 1
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(ClusterConfig, "model_validate", classmethod(counting_validate))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counting_load))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # start_replica sets them
        monkeypatch.setenv(var, "1")
    threads = torch.get_num_threads()
    yield counts
    torch.set_num_threads(threads)


def _nodes(app) -> list:
    """Every deployment of the app's graph, as bound."""
    found, stack = [], [app]
    while stack:
        node = stack.pop()._bound_deployment
        stack.extend(a for a in node.init_args if hasattr(a, "_bound_deployment"))
        found.append(node)
    return found


def _deployments(app) -> dict:
    """Deployment name → (replica class, bound args with handles as None), for the app's whole graph."""
    return {node.name: (node.func_or_class, [None if hasattr(a, "_bound_deployment") else a for a in node.init_args])
            for node in _nodes(app)}


class _UnusedHandle:
    """A deployment handle that is never called: ``options`` gives itself back."""

    def options(self, **_):
        return self


def _starts(app, counts: Counter) -> dict:
    """Construct each deployment's replica class once (stage handles None); what each start counted."""
    started = {}
    for name, (cls, args) in _deployments(app).items():
        if name == "OpenAIIngress":
            cls = cls.__mro__[1]  # the class under serve.ingress's ASGI wrapper, whose __init__ is a coroutine
            args = [_UnusedHandle() if a is None else a for a in args]  # it sets its router handle's options
        counts.clear()
        replica = cls(*args)
        started[name] = dict(counts)
        if name == "Router":
            replica.__del__()  # stops the step thread (and the stage prober)
    return started


@pytest.mark.parametrize("stages", ["local", "remote"])
def test_the_config_is_validated_once_per_deploy(counted, stages):
    from deployments.app import build_app

    pair = tiny_pair()
    args = {"target": {"path": pair.target, "device": "cpu", "max_model_len": 128},
            "draft": {"kind": "model", "path": pair.draft},
            "router": {"stages": stages, "max_running": 4, "micro_batches": 1},
            "draft_pool": {"placement": "offload", "num_replicas": 1}}
    app = build_app(args)
    assert counted == {"validations": 1}
    assert all(isinstance(args[0], ClusterConfig) for _, args in _deployments(app).values())
    expected = {"OpenAIIngress": {}, "Router": {"tokenizer reads": 1},
                **({"Verifier": {}, "DraftPool": {}} if stages == "remote" else {})}
    assert _starts(app, counted) == expected
    # Serve's access log: the ingress's lines are the HTTP requests; the router and the stages, called once per
    # request and once per step, write none.
    access_log = {n.name: (n.logging_config or {}).get("enable_access_log", True) for n in _nodes(app)}
    assert access_log == {name: name == "OpenAIIngress" for name in expected}


def test_specserve_serve_validates_its_config_once(counted, tmp_path, monkeypatch):
    """The launcher's path: read the file, make paths absolute, apply the command line's host and port, move
    the API key into a private file, build the app — one validation in all, and the changes reach the app."""
    from deployments.app import build_app
    from deployments.launch import key_to_private_file, load_launch_config

    pair = tiny_pair()
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "target": {"path": pair.target, "device": "cpu", "max_model_len": 128},
        "draft": {"kind": "model", "path": pair.draft},
        "router": {"stages": "local", "max_running": 4, "micro_batches": 1},
        "http": {"api_key_env": "SPECSERVE_UNIT_KEY"}}))
    monkeypatch.setenv("SPECSERVE_UNIT_KEY", "sk-unit")
    cfg = load_launch_config(str(config), host="127.0.0.2", port=8123)
    http, key_file = key_to_private_file(cfg.http)
    try:
        app = build_app(cfg.model_copy(update={"http": http}))
    finally:
        key_file.unlink()
        key_file.parent.rmdir()
    assert counted == {"validations": 1}
    bound = {name: args[0] for name, (_, args) in _deployments(app).items()}
    assert {(c.http.host, c.http.port, c.http.api_key_file) for c in bound.values()} == {
        ("127.0.0.2", 8123, str(key_file))}
    with pytest.raises(ValueError, match="port"):
        load_launch_config(str(config), port=70000)

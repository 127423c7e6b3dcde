"""The memory plan (``cluster/memory_plan.py``), the thread settings (``cluster/threads.py``) and the checks
that refuse a config before it loads.

- The plan's weights and KV cache are exactly what building the models allocates (parameter and pool
  bytes, packed layers included), tied and untied, Llama and Qwen2 (biases).
- Its total matches the measured peak of a fresh process that builds the engine of a config and runs the
  config's largest step, within 15 %: for the embedded pair (models/default) and for a pair built from
  config here (``tests/unit/memory_probe.py`` measures).
- A config that cannot fit is refused by ``build_app`` with the plan's table and what to lower; ``specserve
  plan`` prints the table and exits 1 for such a config, 0 for one that fits.
- Threads: 'auto' and explicit counts resolve as documented, and more threads than cores are refused.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.config import ClusterConfig, ConfigError
from cluster.memory_plan import ModelLoad, PlanError, plan, read_shape
from cluster.threads import resolve_threads
from runtime.cpu_linear import PackedLinear, packing_available
from runtime.models import build_model, tiny_llama
from runtime.runner import ModelRunner

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
EMBEDDED = REPO / "models" / "default"
TOLERANCE = 0.15


def _held_bytes(model) -> int:
    """Bytes the model's parameters and packed weights hold (a tied matrix once, its packed copy apart)."""
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = sum(m.in_features * m.out_features * 4 for m in model.modules() if isinstance(m, PackedLinear))
    return dense + packed


@pytest.fixture(scope="module")
def test_pair(tmp_path_factory) -> tuple[str, str]:
    """An untied Qwen2 pair (attention biases) from config: big enough that the plan's terms all show."""
    root = tmp_path_factory.mktemp("plan-pair")
    dims = {"target": dict(vocab_size=8192, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                           intermediate_size=704),
            "draft": dict(vocab_size=8192, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=1,
                          intermediate_size=352)}
    for name, kw in dims.items():
        tiny_llama(0, model_type="qwen2", max_position_embeddings=1024, **kw).save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


@pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("which", ["embedded", "test pair"])
def test_weights_and_kv_are_exactly_what_building_allocates(which, test_pair):
    target = str(EMBEDDED / "target") if which == "embedded" else test_pair[0]
    model = build_model(target, "cpu", "float32")
    load = ModelLoad(read_shape(target, "target.path"), "cpu", "float32", slots=3, max_len=40, rows=1, logits=1)
    assert load.weights() + load.packed_copy() == _held_bytes(model)
    assert (load.packed_copy() > 0) == (which == "embedded")  # the embedded pair ties its LM head
    pool = ModelRunner(model, max_slots=3, max_len=40).pool
    assert load.kv_cache() == 2 * pool.k.numel() * pool.k.element_size()


def test_a_bfloat16_gpu_load_holds_the_dtype_and_no_packed_copy():
    load = ModelLoad(read_shape(str(EMBEDDED / "target"), "t"), "cuda", "bfloat16", slots=2, max_len=16, rows=1,
                     logits=1)
    assert load.packed_copy() == 0
    assert load.weights() == sum(p.numel() for p in _meta_model(EMBEDDED / "target").parameters()) * 2


def _meta_model(folder: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


def test_gguf_metadata_gives_the_folder_shape():
    pytest.importorskip("gguf")
    from tests.fixtures_gguf import gguf_pair
    from tests.fixtures_tokenizer import tiny_pair

    folder, gguf = read_shape(tiny_pair().target, "t"), read_shape(gguf_pair().target, "t")
    assert gguf == folder.__class__(**{**folder.__dict__, "tied": False})  # untied: the larger, on GPU


def _measured(cfg: dict) -> dict[str, int]:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to read peak resident memory")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "tests.unit.memory_probe", json.dumps(cfg)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=240)
    if out.returncode != 0 and "clear_refs" in out.stderr:
        pytest.skip("cannot reset the peak-memory counter here (/proc/self/clear_refs)")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("which", ["embedded", "test pair"])
def test_plan_matches_measured_peak(which, test_pair):
    target, draft = (str(EMBEDDED / "target"), str(EMBEDDED / "draft")) if which == "embedded" else test_pair
    cfg = {"target": {"path": target, "max_model_len": 512}, "draft": {"kind": "model", "path": draft},
           "draft_pool": {"placement": "colocated"}, "router": {"max_running": 8, "micro_batches": 1}}
    replica = plan(ClusterConfig.from_dict(cfg)).replicas[0]
    assert replica.role == "verifier" and len(replica.models) == 2  # the draft is colocated: one process
    measured = _measured(cfg)["peak"]
    print(f"{which}: plan {replica.model_bytes / 2**20:.1f} MiB, measured peak {measured / 2**20:.1f} MiB")
    assert abs(measured - replica.model_bytes) <= TOLERANCE * replica.model_bytes


def test_a_config_that_cannot_fit_is_refused_with_the_plan():
    from deployments.app import build_app

    huge = {"target": {"path": "builtin:tiny", "max_model_len": 1 << 20},
            "router": {"max_running": 4096, "max_queue": 0}}
    with pytest.raises(PlanError) as refused:
        build_app(huge)
    message = str(refused.value)
    assert "of host memory" in message and "available" in message
    assert "KV cache" in message and "workspace" in message and "host total" in message  # the table
    assert "lower router.max_running" in message and "target.max_model_len" in message  # what to lower
    blocks = 4096 * (1 << 20) // 16 + 1  # every slot at max_model_len, + the scratch block
    expected_kv = 2 * 2 * blocks * 16 * 2 * 16 * 4  # K and V, layers, blocks, positions, kv heads, head dim
    assert plan(ClusterConfig.from_dict(huge)).replicas[0].kv_cache == expected_kv


def test_specserve_plan_prints_the_table_and_exits_by_fit(tmp_path, capsys):
    from specserve.cli import main

    fits = tmp_path / "fits.yaml"
    fits.write_text(f"target: {{path: {EMBEDDED / 'target'}, max_model_len: 256}}\n"
                    f"draft: {{kind: model, path: {EMBEDDED / 'draft'}}}\n")
    assert main(["plan", "--config", str(fits)]) == 0
    out = capsys.readouterr().out
    assert "verifier" in out and "draft pool" in out and "KV cache" in out and "fits." in out
    huge = tmp_path / "huge.yaml"
    huge.write_text("target: {path: builtin:tiny, max_model_len: 1048576}\nrouter: {max_running: 4096}\n")
    assert main(["plan", "--config", str(huge)]) == 1
    assert "does not fit" in capsys.readouterr().err


def test_draft_slots_never_exceed_what_the_router_runs():
    cfg = ClusterConfig.from_dict({"target": {"path": "builtin:tiny"},
                                   "draft": {"kind": "model", "path": "builtin:tiny"},
                                   "router": {"max_running": 32, "micro_batches": 2}})
    draft = next(r for r in plan(cfg).replicas if r.role == "draft pool")
    assert draft.models[0].slots == 32  # not max_batch_size × micro_batches = 128


def test_threads_resolve_and_more_than_cores_is_refused():
    assert resolve_threads("auto", cores=8, on_gpu=False, num_cpus=0.25, where="x") == 8
    assert resolve_threads("auto", cores=8, on_gpu=False, num_cpus=0.25, where="x", sharing=4) == 2
    assert resolve_threads("auto", cores=8, on_gpu=True, num_cpus=2.5, where="x") == 2
    assert resolve_threads("auto", cores=1, on_gpu=False, num_cpus=0, where="x", sharing=4) == 1
    # Sized by weights: the embedded pair (~57 MiB with its draft) gets one thread, a 6 GB target all cores.
    assert resolve_threads("auto", cores=8, on_gpu=False, num_cpus=0.25, where="x", weight_bytes=57 << 20) == 1
    assert resolve_threads("auto", cores=8, on_gpu=False, num_cpus=0.25, where="x", weight_bytes=600 << 20) == 2
    assert resolve_threads("auto", cores=8, on_gpu=False, num_cpus=0.25, where="x", weight_bytes=6 << 30) == 8
    assert resolve_threads(3, cores=8, on_gpu=False, num_cpus=0.25, where="x") == 3
    with pytest.raises(ConfigError, match=r"draft_pool\.num_threads \(9\) is more than the 8 CPU cores"):
        resolve_threads(9, cores=8, on_gpu=False, num_cpus=0.25, where="draft_pool.num_threads")
    for bad in (0, True, "2", 1.5):
        with pytest.raises(ValueError, match="verifier.num_threads"):
            ClusterConfig.from_dict({"target": {"path": "builtin:tiny"}, "verifier": {"num_threads": bad}})


def test_plan_threads_and_node_modules_import_neither_torch_nor_ray():
    for name in ("memory_plan.py", "threads.py", "node.py", "builtin_models.py"):
        tree = ast.parse((REPO / "cluster" / name).read_text())
        modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not any(m.split(".")[0] in ("torch", "ray") for m in modules), name

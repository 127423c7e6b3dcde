"""cluster.config: examples load, the speculative_decoding layout maps, and every mistake names its key."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from cluster.config import BUILTIN_TINY, ClusterConfig, ConfigError, resolve_dtype

EXAMPLES = Path(__file__).resolve().parents[2] / "cluster" / "examples"
TINY = {"target": {"path": BUILTIN_TINY}}


def with_(base: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    return {**base, **sections}


def write_model(folder: Path, tokenizer_vocab: dict[str, int] | None = None, **config: Any) -> str:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    if tokenizer_vocab is not None:
        added = [{"id": 0, "content": "<s>"}]
        tokenizer = {"model": {"type": "BPE", "vocab": tokenizer_vocab}, "added_tokens": added}
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return str(folder)


# ---- examples and the speculative_decoding layout ----------------------------------------------


def test_local_example_loads() -> None:
    cfg = ClusterConfig.from_yaml(EXAMPLES / "local.yaml")
    assert cfg.target.path == BUILTIN_TINY and cfg.target.device == "cpu"
    assert cfg.draft.kind == "model" and cfg.speculation.acceptance == "exact"
    assert cfg.ray.auth_mode == "token" and not cfg.ray.include_dashboard


def test_h200_example_fits_its_budget() -> None:
    cfg = ClusterConfig.from_yaml(EXAMPLES / "h200.yaml")
    assert cfg.target.tensor_parallel == 8 and cfg.verifier.num_groups == 4
    assert cfg.draft_pool.accelerator_type == "L4" and cfg.draft_pool.num_replicas is None
    assert cfg.draft_pool.max_replicas == 16 and cfg.cluster is not None


def test_seeds_example_maps_with_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # the example's relative model folders must not exist here
    with caplog.at_level(logging.WARNING, logger="specserve.config"):
        cfg = ClusterConfig.from_yaml(EXAMPLES / "seeds.yaml")
    assert cfg.target.path == "models/default/target" and cfg.target.tensor_parallel == 8
    assert cfg.draft.kind == "model" and cfg.draft.path == "models/default/draft"
    assert cfg.draft_pool.max_batch_size == 64
    assert cfg.speculation.acceptance == "threshold" and cfg.speculation.threshold == 0.85
    assert cfg.speculation.dynamic_adjust
    [record] = [r for r in caplog.records if r.name == "specserve.config"]
    assert record.levelno == logging.WARNING
    assert "lossy threshold acceptance" in record.message
    assert "speculative_decoding.acceptance.threshold" in record.message


def test_flat_seeds_shape_merges_with_native_sections(caplog: pytest.LogCaptureFixture) -> None:
    block = {"draft_num": 1, "temperature": 0.7, "verify_threshold": 0.9, "batch_size": 32}
    with caplog.at_level(logging.WARNING, logger="specserve.config"):
        cfg = ClusterConfig.from_dict({**TINY, "speculative_decoding": block, "router": {"max_running": 8}})
    assert cfg.speculation.acceptance == "threshold" and cfg.speculation.threshold == 0.9
    assert cfg.defaults.temperature == 0.7 and cfg.draft_pool.batch_size == 32
    assert cfg.router.max_running == 8
    assert "speculative_decoding.verify_threshold" in caplog.text


def test_exact_config_logs_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="specserve.config"):
        ClusterConfig.from_dict(TINY)
    assert caplog.records == []


def test_the_configuration_example_with_six_drafts_maps_onto_native_fields() -> None:
    """The alternative layout's configuration example, verbatim: six candidate chains per step."""
    block = {"draft_num": 6, "temperature": 0.7, "verify_threshold": 0.9, "batch_size": 32}
    cfg = ClusterConfig.from_dict({**TINY, "speculative_decoding": block})
    assert cfg.speculation.draft_num == 6
    assert (cfg.speculation.acceptance, cfg.speculation.threshold) == ("threshold", 0.9)
    assert ClusterConfig.from_dict(cfg.to_serve_args()).speculation.draft_num == 6


def test_draft_num_must_be_a_positive_int() -> None:
    with pytest.raises(ValueError, match=r"speculation\.draft_num"):
        ClusterConfig.from_dict({**TINY, "speculative_decoding": {"draft_num": 0}})


def test_seeds_value_conflicting_with_native_refused() -> None:
    d = {**TINY, "speculative_decoding": {"main_model": {"path": "other"}}}
    with pytest.raises(ConfigError, match=r"speculative_decoding\.main_model\.path.*target\.path"):
        ClusterConfig.from_dict(d)
    d = {**TINY, "speculative_decoding": {"verify_threshold": 0.9, "acceptance": {"threshold": 0.8}}}
    with pytest.raises(ConfigError, match="verify_threshold"):
        ClusterConfig.from_dict(d)


# ---- unknown keys ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "d, key",
    [
        ({**TINY, "speculaton": {}}, "speculaton"),
        ({**TINY, "speculation": {"gama": 3}}, "gama"),
        ({"target": {"path": BUILTIN_TINY, "tp": 2}}, "tp"),
        ({**TINY, "draft_pool": {"autoscaling": {"min_replicas": 1, "max_replicas": 2, "target": 3}}}, "target"),
        ({**TINY, "speculative_decoding": {"draft_nums": 1}}, r"speculative_decoding\.draft_nums"),
        ({**TINY, "speculative_decoding": {"draft_model": {"path": "x", "dtype": "fp16"}}},
         r"speculative_decoding\.draft_model\.dtype"),
    ],
)
def test_unknown_key_refused_by_name(d: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        ClusterConfig.from_dict(d)


def test_duplicate_yaml_key_refused(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("target: {path: builtin:tiny}\nspeculation: {gamma: 2}\nspeculation: {gamma: 3}\n")
    with pytest.raises(ConfigError, match="duplicate key 'speculation'"):
        ClusterConfig.from_yaml(file)


def test_yaml_that_is_not_a_mapping_refused(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        ClusterConfig.from_yaml(file)
    file.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        ClusterConfig.from_yaml(file)


# ---- impossible values -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sections, key",
    [
        ({"speculation": {"gamma_min": 5, "gamma": 5, "gamma_max": 4}}, "speculation.gamma_max"),
        ({"speculation": {"gamma_min": 3, "gamma": 2}}, "speculation.gamma_min"),
        ({"speculation": {"gamma_max": 17}}, "speculation.gamma_max"),
        ({"speculation": {"acceptance": "threshold"}}, "speculation.threshold"),
        ({"speculation": {"threshold": 0.5}}, "speculation.threshold"),
        ({"speculation": {"acceptance": "threshold", "threshold": 1.5}}, "speculation.threshold"),
        ({"speculation": {"dynamic_adjust": True}}, "speculation.dynamic_adjust"),
        ({"speculation": {"confidence_threshold": 1.0}}, "speculation.confidence_threshold"),
        ({"speculation": {"draft_num": 9}}, "speculation.draft_num"),
        ({"speculation": {"draft_num": 2}, "draft": {"kind": "none"}}, "speculation.draft_num"),
        ({"speculation": {"tree_nodes": 8, "gamma_max": 8}}, "speculation.tree_nodes"),
        ({"speculation": {"tree_nodes": 32, "draft_num": 2}}, "speculation.tree_nodes"),
        ({"draft_pool": {"num_replicas": -1}}, "draft_pool.num_replicas"),
        ({"draft_pool": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}},
         "draft_pool.autoscaling.min_replicas"),
        ({"draft_pool": {"num_replicas": 2, "autoscaling": {"min_replicas": 1, "max_replicas": 2}}},
         "draft_pool.num_replicas"),
        ({"draft": {"kind": "model", "path": BUILTIN_TINY}, "router": {"transport": "compiled"},
          "draft_pool": {"autoscaling": {"min_replicas": 1, "max_replicas": 2}}}, "draft_pool.autoscaling"),
        ({"draft_pool": {"batch_size": 128}}, "draft_pool.batch_size"),
        ({"draft_pool": {"num_gpus": 1.5}}, "draft_pool.num_gpus"),
        ({"draft_pool": {"resources": {"L4": -1}}}, "draft_pool.resources.L4"),
        ({"draft": {"kind": "model"}}, "draft.path"),
        ({"draft": {"kind": "ngram", "path": "x"}}, "draft.path"),
        ({"draft": {"ngram_min": 5, "ngram_max": 2}}, "draft.ngram_min"),
        ({"target": {"path": "builtin:huge"}}, "target.path"),
        ({"target": {"path": BUILTIN_TINY, "tensor_parallel": 0}}, "target.tensor_parallel"),
        ({"target": {"path": BUILTIN_TINY, "dtype": "fp8"}}, "target.dtype"),
        ({"target": {"path": BUILTIN_TINY, "device": "cuda"}}, "verifier.num_gpus"),
        ({"verifier": {"placement_strategy": "STRICT_SPREAD"}}, "verifier.placement_strategy"),
        ({"router": {"request_timeout_s": 0}}, "router.request_timeout_s"),
        ({"router": {"request_timeout_s": float("inf")}}, "router.request_timeout_s"),
        ({"http": {"port": 70000}}, "http.port"),
        ({"http": {"api_key": "k", "api_key_env": "K"}}, "http.api_key"),
        ({"ray": {"auth_mode": "password"}}, "ray.auth_mode"),
        ({"ray": {"auth_mode": "disabled", "address": "10.0.0.5:6379"}}, "ray.auth_mode"),
        ({"http": {"api_key_env": "K", "api_key_file": "/k"}}, "http.api_key_env"),
        ({"defaults": {"top_p": 0}}, "defaults.top_p"),
    ],
)
def test_impossible_values_name_their_key(sections: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        ClusterConfig.from_dict({**TINY, **sections})


def gpu_config(**budget: Any) -> dict[str, Any]:
    return {
        "target": {"path": BUILTIN_TINY, "tensor_parallel": 8, "device": "cuda"},
        "draft": {"kind": "model", "path": BUILTIN_TINY},
        "verifier": {"num_groups": 4, "num_gpus": 1},
        "draft_pool": {"autoscaling": {"min_replicas": 2, "max_replicas": 8}, "num_gpus": 0.5},
        "cluster": budget,
    }


def test_gpu_budget() -> None:
    ClusterConfig.from_dict(gpu_config(total_gpus=36, gpus_per_node=8))  # 32 + 8 × 0.5
    with pytest.raises(ValueError, match=r"cluster\.total_gpus") as e:
        ClusterConfig.from_dict(gpu_config(total_gpus=35))
    assert "4 groups × 8 ranks" in str(e.value) and "8 replicas × 0.5" in str(e.value)
    with pytest.raises(ValueError, match=r"target\.tensor_parallel.*gpus_per_node"):
        ClusterConfig.from_dict(gpu_config(total_gpus=64, gpus_per_node=4))
    spanning = gpu_config(total_gpus=64, gpus_per_node=4)
    spanning["verifier"]["placement_strategy"] = "PACK"
    ClusterConfig.from_dict(spanning)


# ---- model folders -----------------------------------------------------------------------------


def test_tensor_parallel_must_divide_heads(tmp_path: Path) -> None:
    target = write_model(tmp_path / "t", num_attention_heads=12, num_key_value_heads=4, vocab_size=100)
    with pytest.raises(ConfigError, match=r"target\.tensor_parallel \(8\).*num_attention_heads \(12\)"):
        ClusterConfig.from_dict({"target": {"path": target, "tensor_parallel": 8}})
    with pytest.raises(ConfigError, match=r"target\.tensor_parallel \(3\).*num_key_value_heads \(4\)"):
        ClusterConfig.from_dict({"target": {"path": target, "tensor_parallel": 3}})
    assert ClusterConfig.from_dict({"target": {"path": target, "tensor_parallel": 4}}).target.tensor_parallel == 4


def test_heads_read_from_text_config(tmp_path: Path) -> None:
    target = write_model(tmp_path / "t", text_config={"num_attention_heads": 6, "vocab_size": 100})
    with pytest.raises(ConfigError, match="num_attention_heads"):
        ClusterConfig.from_dict({"target": {"path": target, "tensor_parallel": 4}})


def test_folder_without_config_json_refused(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    with pytest.raises(ConfigError, match=r"target\.path.*config\.json"):
        ClusterConfig.from_dict({"target": {"path": str(tmp_path / "t")}})


def test_vocab_mismatch_refused(tmp_path: Path) -> None:
    target = write_model(tmp_path / "t", num_attention_heads=4, vocab_size=100)
    draft = write_model(tmp_path / "d", num_attention_heads=2, vocab_size=120)
    d = {"target": {"path": target}, "draft": {"kind": "model", "path": draft}}
    with pytest.raises(ConfigError, match=r"draft\.path.*vocab_size \(120\).*\(100\)"):
        ClusterConfig.from_dict(d)


def test_identical_tokenizers_allow_padded_vocab(tmp_path: Path) -> None:
    vocab = {"a": 1, "b": 2}
    target = write_model(tmp_path / "t", vocab, num_attention_heads=4, vocab_size=128)
    draft = write_model(tmp_path / "d", vocab, num_attention_heads=2, vocab_size=100)
    ClusterConfig.from_dict({"target": {"path": target}, "draft": {"kind": "model", "path": draft}})


def test_different_tokenizers_refused_even_with_equal_vocab_size(tmp_path: Path) -> None:
    target = write_model(tmp_path / "t", {"a": 1, "b": 2}, num_attention_heads=4, vocab_size=100)
    draft = write_model(tmp_path / "d", {"a": 2, "b": 1}, num_attention_heads=2, vocab_size=100)
    with pytest.raises(ConfigError, match=r"draft\.path.*tokenizer"):
        ClusterConfig.from_dict({"target": {"path": target}, "draft": {"kind": "model", "path": draft}})


# ---- serve args, secrets, helpers --------------------------------------------------------------


@pytest.mark.parametrize("name", ["local.yaml", "h200.yaml"])
def test_serve_args_round_trip(name: str) -> None:
    cfg = ClusterConfig.from_yaml(EXAMPLES / name)
    args = cfg.to_serve_args()
    assert json.loads(json.dumps(args)) == args
    assert ClusterConfig.from_dict(args) == cfg


def test_api_key_hidden_in_repr_but_carried_in_serve_args() -> None:
    cfg = ClusterConfig.from_dict(with_(TINY, http={"api_key": "s3cret-key"}))
    assert "s3cret-key" not in repr(cfg) and "s3cret-key" not in str(cfg)
    args = cfg.to_serve_args()
    assert args["http"]["api_key"] == "s3cret-key"
    back = ClusterConfig.from_dict(args)
    assert back == cfg and back.http.resolve_api_key() == "s3cret-key"


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ClusterConfig.from_dict(with_(TINY, http={"api_key_env": "SPECSERVE_TEST_KEY"}))
    monkeypatch.delenv("SPECSERVE_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"http\.api_key_env"):
        cfg.http.resolve_api_key()
    monkeypatch.setenv("SPECSERVE_TEST_KEY", "k")
    assert cfg.http.resolve_api_key() == "k"
    assert ClusterConfig.from_dict(TINY).http.resolve_api_key() is None


def test_exposed_http_without_key_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="specserve.config"):
        ClusterConfig.from_dict(with_(TINY, http={"host": "0.0.0.0"}))
    assert "http.host=0.0.0.0" in caplog.text


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", on_gpu=False) == "float32"
    assert resolve_dtype("auto", on_gpu=True) == "bfloat16"
    assert resolve_dtype("float16", on_gpu=False) == "float16"


def test_every_field_is_described_and_every_model_forbids_extras() -> None:
    seen, todo = set(), [ClusterConfig]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        assert model.model_config.get("extra") == "forbid", model.__name__
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            for arg in getattr(field.annotation, "__args__", (field.annotation,)):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    todo.append(arg)
    assert len(seen) == 14  # ClusterConfig and its 13 section models
    ClusterConfig.model_json_schema()  # documentation tooling can render it



@pytest.mark.parametrize("sections, expected", [
    ({}, set()),  # handles: no stage workers
    ({"router": {"transport": "compiled"}}, {"draft", "verifier"}),
    ({"router": {"transport": "compiled"}, "draft": {"kind": "none", "path": None}}, {"verifier"}),
    # the verifier's worker drives the group of ranks
    ({"router": {"transport": "compiled"}, "target": {"tensor_parallel": 2}}, {"draft", "verifier"}),
    ({"router": {"transport": "compiled"}, "draft_pool": {"placement": "colocated"}}, set()),
])
def test_worker_stages_follow_the_transport(sections: dict[str, Any], expected: set[str]) -> None:
    d: dict[str, Any] = {"target": {"path": BUILTIN_TINY}, "draft": {"kind": "model", "path": BUILTIN_TINY}}
    for key, values in sections.items():
        d[key] = {**d.get(key, {}), **values}
    assert ClusterConfig.from_dict(d).worker_stages == expected


def test_compiled_transport_with_local_stages_refused() -> None:
    with pytest.raises(ValueError, match=r"router\.transport"):
        ClusterConfig.from_dict({"target": {"path": BUILTIN_TINY}, "router": {"stages": "local", "transport": "compiled"}})


def test_a_kv_pool_that_cannot_hold_one_full_sequence_is_refused() -> None:
    base = {"target": {"path": BUILTIN_TINY, "max_model_len": 256}}
    ClusterConfig.from_dict({**base, "kv": {"num_blocks": 16}})  # 16 × 16 positions: one full sequence
    with pytest.raises(ValueError, match=r"kv\.num_blocks.*need ≥ 16"):
        ClusterConfig.from_dict({**base, "kv": {"num_blocks": 15}})
    with pytest.raises(ValueError, match=r"kv\.block_size"):
        ClusterConfig.from_dict({**base, "kv": {"block_size": 0}})

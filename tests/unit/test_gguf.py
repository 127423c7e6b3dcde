"""GGUF model files: a .gguf target and draft serve exactly like the Hugging Face folders they were written from.

The test writes the GGUF files itself with the ``gguf`` package's ``GGUFWriter`` from
``tests.fixtures_tokenizer``'s tiny pair (Llama target and noisy-copy draft, byte-level BPE tokenizer with a
chat template): F32 tensors, so transformers' GGUF loader gives back the same float weights, and the
tokenizer as ``tokenizer.ggml.*`` metadata, which is what llama.cpp's converter writes.

- ``cluster.model_files.inspect_model`` reads the same family, vocabulary, heads and token table from the
  GGUF header as from config.json / tokenizer.json, and ``check_draft_matches`` accepts a mixed pair.
- Loaded, the GGUF model has the folder's weights bit for bit and its tokenizer encodes like the folder's.
- A Q8_0 pair is dequantised at load and served token for token like HF ``generate`` on those weights.
- Served greedily through the config → engine assembly (``deployments.settings.engine_settings`` +
  ``make_engine``) and through ``specserve generate --target X.gguf --draft Y.gguf``, the GGUF pair emits the
  HF folder pair's tokens and Hugging Face ``generate``'s (the fidelity reference), token for token.
- Config validation refuses, naming the key: tensor parallelism that does not divide the GGUF's heads, a
  draft whose token table differs, an unsupported architecture, a split file, a file that is not GGUF, a
  folder with several .gguf files; a folder holding one .gguf file is accepted as the model path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cluster.config import ClusterConfig, ConfigError
from cluster.model_files import check_draft_matches, inspect_model
from tests.fixtures_gguf import gguf_pair, write_gguf
from tests.fixtures_tokenizer import prompts, reference, tiny_pair
from tests.unit.helpers import hf_greedy
from runtime.models import load_causal_lm, load_tokenizer, tiny_llama

pytestmark = pytest.mark.timeout(120)

MAX_NEW = 20


@pytest.fixture(scope="module")
def files():
    """The tiny pair as HF folders and as GGUF files (each GGUF alone in its own folder)."""
    pair, ggufs = tiny_pair(), gguf_pair()
    return {"target": pair.target, "draft": pair.draft, "target_gguf": ggufs.target, "draft_gguf": ggufs.draft}


def test_gguf_header_reads_like_the_folder(files):
    folder, file = inspect_model(files["target"], "t"), inspect_model(files["target_gguf"], "t")
    assert file.files.gguf_file == str(Path(files["target_gguf"]).resolve()) and folder.files.gguf_file is None
    for attr in ("model_type", "vocab_size", "num_attention_heads", "num_key_value_heads", "has_tokenizer"):
        assert getattr(file, attr) == getattr(folder, attr), attr
    assert file.tokens == folder.tokens and len(file.tokens) == tiny_pair().vocab_size
    check_draft_matches(folder, inspect_model(files["draft_gguf"], "d"))  # one table, whatever the format
    check_draft_matches(file, inspect_model(files["draft"], "d"))


def test_gguf_loads_the_folders_weights_and_tokenizer(files):
    want = load_causal_lm(files["target"], "float32", "cpu").state_dict()
    got = load_causal_lm(files["target_gguf"], "float32", "cpu").state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    tok_folder, tok_file = load_tokenizer(files["target"]), load_tokenizer(files["target_gguf"])
    for text in [*prompts(4), "def add(a, b):\n    return a + b", '{"name": "Ada"}', "naïve café 😀"]:
        assert tok_file(text)["input_ids"] == tok_folder(text)["input_ids"], text
    assert (tok_file.bos_token_id, tok_file.eos_token_id, tok_file.pad_token_id) == (0, 1, 2)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok_file.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        tok_folder.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _serve_greedy(target: str, draft: str, texts: list[str]) -> list[tuple[int, ...]]:
    """Greedy outputs through what a replica builds from a validated config (one assembly path)."""
    from deployments.settings import engine_settings
    from engine.engine import Request
    from engine.assembly import make_engine

    cfg = ClusterConfig.from_dict({"target": {"path": target, "device": "cpu", "max_model_len": 128},
                                   "draft": {"kind": "model", "path": draft},
                                   "speculation": {"gamma": 4, "adaptive": False},
                                   "router": {"max_running": len(texts)}})
    tok = load_tokenizer(target)
    engine = make_engine(engine_settings(cfg), eos_token_ids=[tok.eos_token_id])
    outputs = engine.generate([Request(tuple(tok(t)["input_ids"]), max_tokens=MAX_NEW) for t in texts])
    assert engine.stats.accepted > 0  # the draft really speculated
    return [tuple(o.tokens) for o in outputs]


def test_gguf_pair_serves_token_for_token_like_the_folders(files):
    texts = prompts(4)
    from_gguf = _serve_greedy(files["target_gguf"], files["draft_gguf"], texts)
    assert from_gguf == _serve_greedy(files["target"], files["draft"], texts)
    assert from_gguf == [reference(t, MAX_NEW)[0] for t in texts]


def test_quantised_gguf_pair_serves_its_own_weights_exactly(tmp_path):
    """Q8_0 weights are dequantised at load: the served tokens are those of HF ``generate`` on that model."""
    pair = tiny_pair()
    target = str(write_gguf(pair.target, tmp_path / "t" / "target-q8_0.gguf", quantize="Q8_0"))
    draft = str(write_gguf(pair.draft, tmp_path / "d" / "draft-q8_0.gguf", quantize="Q8_0"))
    model, tok = load_causal_lm(target, "float32", "cpu"), load_tokenizer(target)
    unquantised = load_causal_lm(pair.target, "float32", "cpu")
    assert not torch.equal(model.lm_head.weight, unquantised.lm_head.weight)  # really another model
    texts = prompts(3)
    want = [hf_greedy(model, tok(t)["input_ids"], MAX_NEW, eos=tok.eos_token_id) for t in texts]
    assert _serve_greedy(target, draft, texts) == want


def test_cli_generate_with_gguf_files(files, capsys):
    from specserve.cli import main

    prompt = prompts(1)[0]

    def generate(target: str, draft: str) -> dict:
        assert main(["generate", "--target", target, "--draft", draft, "--prompt", prompt, "--max-tokens",
                     str(MAX_NEW), "--device", "cpu", "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    from_gguf = generate(files["target_gguf"], files["draft_gguf"])
    assert from_gguf["text"] == generate(files["target"], files["draft"])["text"] == reference(prompt, MAX_NEW)[1]
    assert from_gguf["stats"]["accepted"] > 0


def _config(target: str, draft: str | None = None, tp: int = 1) -> ClusterConfig:
    d = {"target": {"path": target, "tensor_parallel": tp}}
    if draft is not None:
        d["draft"] = {"kind": "model", "path": draft}
    return ClusterConfig.from_dict(d)


def test_config_checks_gguf_files(files, tmp_path):
    _config(files["target_gguf"], files["draft_gguf"], tp=2)  # 4 heads, 2 kv heads
    folder = str(Path(files["target_gguf"]).parent)
    assert _config(folder).target.path == folder  # a folder holding one .gguf file
    assert inspect_model(folder, "t").files.gguf_file == str(Path(files["target_gguf"]).resolve())
    with pytest.raises(ConfigError, match=r"target\.tensor_parallel \(4\).*num_key_value_heads \(2\)"):
        _config(files["target_gguf"], tp=4)

    pair = tiny_pair()
    tokens = [t for _, t in sorted(inspect_model(pair.draft, "d").tokens.items())]
    tokens[40], tokens[41] = tokens[41], tokens[40]
    swapped = write_gguf(pair.draft, tmp_path / "swapped.gguf", tokens=tokens)
    with pytest.raises(ConfigError, match=r"draft\.path: draft and target tokenizers differ \(2 token ids"):
        _config(files["target_gguf"], str(swapped))
    with pytest.raises(ConfigError, match=r"draft\.path: draft and target tokenizers differ"):
        _config(files["target"], str(swapped))  # a folder target, a GGUF draft: the same rule

    split = write_gguf(pair.target, tmp_path / "split" / "tiny-00001-of-00002.gguf", extra={"split.count": 2})
    with pytest.raises(ConfigError, match=r"target\.path: .* split GGUF \(2 parts\)"):
        _config(str(split))
    shutil.copy(files["target_gguf"], tmp_path / "split" / "other.gguf")
    with pytest.raises(ConfigError, match=r"target\.path: .* several \.gguf files .*name one"):
        _config(str(tmp_path / "split"))
    with pytest.raises(ConfigError, match=r"target\.path: .*config\.json is a file but not a \.gguf file"):
        _config(str(Path(pair.target) / "config.json"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all, just bytes")
    with pytest.raises(ConfigError, match=r"target\.path: cannot read .*junk\.gguf as a GGUF file"):
        _config(str(tmp_path / "junk.gguf"))


def test_unsupported_gguf_architecture_is_refused(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), arch="gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"target\.path: model_type 'gpt2' is not supported.*llama"):
        _config(str(tmp_path / "gpt2.gguf"))


def test_qwen2_gguf_gives_the_folders_logits(tmp_path):
    """Qwen2 (attention biases, no q/k interleave in llama.cpp's layout) round-trips too."""
    model = tiny_llama(3, model_type="qwen2")
    model.save_pretrained(tmp_path / "qwen2")
    loaded = load_causal_lm(str(write_gguf(str(tmp_path / "qwen2"), tmp_path / "qwen2.gguf", arch="qwen2")),
                            "float32", "cpu")
    assert loaded.config.model_type == "qwen2"
    tokens = torch.tensor([[5, 9, 13, 40, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)

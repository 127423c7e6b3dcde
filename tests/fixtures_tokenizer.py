"""A tiny target/draft pair WITH a tokenizer and a chat template, built on disk (no hub, no downloads).

``tiny_pair()`` trains a byte-level BPE on a few KB of embedded text with the ``tokenizers`` library,
wraps it as a ``PreTrainedTokenizerFast`` (``<s>`` / ``</s>`` / ``<pad>`` at ids 0 / 1 / 2, which is what
``runtime.models.tiny_llama`` puts in its config), and saves it next to ``tiny_llama(seed)`` and a
draft ``noisy_copy(target, 0.05, 1)`` in a temporary folder that is removed at interpreter exit. The
result is cached per process, so every test module of a session shares one pair.

``reference(...)`` is the greedy reference of docs/design.md#fidelity-and-test-models: the target alone, HF
``generate``, greedy, one prompt at a time, no padding, fp32 on CPU.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SEED = 0
# With this vocabulary a 0.05 copy agrees with the target so rarely that adaptive γ stops proposing;
# 0.01 gives acceptance rate ≈ 0.75 and acceptance length ≈ 2.5, so the HTTP tests exercise real speculation.
DRAFT_NOISE = 0.01
VOCAB_SIZE = 384  # 256 bytes + 3 specials + merges
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat watches from the warm window sill.
Speculative decoding lets a small draft model propose several tokens that a large target model checks
in a single forward pass; the accepted prefix keeps the output distribution of the target exactly.
A serving cluster batches many requests together, keeps a key value cache for every sequence and
frees it when the request finishes or when the client goes away.
Once upon a time there was a little robot who liked to count the stars. Every night it climbed the hill
behind the village and counted one, two, three, four, five, six, seven, eight, nine, ten and more.
The weather today is sunny with a light breeze from the west; tomorrow brings clouds and some rain.
Please convert the following record to JSON: name Ada, age 36, city London, language Python.
{"name": "Ada", "age": 36, "city": "London", "languages": ["Python", "Rust", "C"]}
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i))
User: What is the capital of France? Assistant: The capital of France is Paris.
User: How many legs does a spider have? Assistant: A spider has eight legs.
Rivers flow to the sea, mountains rise toward the sky, and forests cover the valleys in green.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 3.14159 2.71828.
"""


@dataclass(frozen=True)
class TinyPair:
    root: Path
    target: str  # folder with config.json, weights and the tokenizer
    draft: str  # the draft's folder (same tokenizer)
    vocab_size: int


@functools.lru_cache(maxsize=None)
def tiny_pair() -> TinyPair:
    import torch

    from runtime.models import noisy_copy, tiny_llama

    root = Path(tempfile.mkdtemp(prefix="specserve-tiny-pair-"))
    atexit.register(shutil.rmtree, root, True)
    tokenizer = _train_tokenizer()
    vocab = len(tokenizer)
    torch.manual_seed(SEED)
    target = tiny_llama(SEED, vocab_size=vocab, max_position_embeddings=1024)
    draft = noisy_copy(target, DRAFT_NOISE, 1)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return TinyPair(root, str(root / "target"), str(root / "draft"), vocab)


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    assert [tok.token_to_id(t) for t in (BOS, EOS, PAD)] == [0, 1, 2]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    return fast


@functools.lru_cache(maxsize=None)
def _loaded(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    return model, AutoTokenizer.from_pretrained(path)


def tokenizer(pair: TinyPair | None = None):
    return _loaded((pair or tiny_pair()).target)[1]


def chat_prompt_ids(messages: list[dict], pair: TinyPair | None = None) -> list[int]:
    """The token ids the router serves a chat request with (template, then no added special tokens)."""
    tok = tokenizer(pair)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


@functools.lru_cache(maxsize=None)
def _reference(path: str, prompt_ids: tuple[int, ...], max_new: int) -> tuple[tuple[int, ...], str, str]:
    import torch

    model, tok = _loaded(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt_ids)]), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ids = tuple(out[0, len(prompt_ids):].tolist())
    finish = "stop" if ids and ids[-1] == tok.eos_token_id else "length"
    return ids, tok.decode(list(ids), skip_special_tokens=True), finish


def reference(prompt: str | list[int], max_new: int, pair: TinyPair | None = None
              ) -> tuple[tuple[int, ...], str, str]:
    """(token ids, text, finish_reason) of the target alone, greedy, for a text prompt or token ids."""
    pair = pair or tiny_pair()
    ids = tokenizer(pair)(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
    return _reference(pair.target, tuple(ids), max_new)


def prompts(n: int, words: int = 4) -> list[str]:
    """``n`` distinct short text prompts: the first few words of the corpus's lines, shifted."""
    lines = [line.split() for line in CORPUS.splitlines() if len(line.split()) >= words + 3]
    out: list[str] = []
    shift = 0
    while len(out) < n:
        for line in lines:
            p = " ".join(line[shift: shift + words])
            if p not in out:
                out.append(p)
            if len(out) == n:
                break
        shift += 1
    return out

"""A GGUF target and draft served over HTTP: the Serve app built from a config whose model paths are
``.gguf`` files answers a completion and a chat request, asked with the official ``openai`` client, with
the tokens of the Hugging Face folders the files were written from (``tests.fixtures_gguf``) — greedy, so
the reference is the target folder alone under Hugging Face ``generate``. The router loads the tokenizer and
chat template from the GGUF metadata; the verifier and draft replicas load the weights through
transformers' GGUF loader.
"""

from __future__ import annotations

import pytest

from tests.fixtures_gguf import gguf_pair
from tests.fixtures_tokenizer import chat_prompt_ids, reference
from tests.ray.openai_app import MODEL, app_args, delete_app, deploy_app, openai_client

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

MAX_NEW = 16


@pytest.fixture(scope="module")
def client(ray_cluster):
    pair = gguf_pair()
    args = app_args(max_running=4, max_queue=4, target={"path": pair.target},
                    draft={"kind": "model", "path": pair.draft})
    app = deploy_app("gguf", "/gguf", args)
    yield openai_client(app)
    delete_app("gguf")


def test_completion_from_gguf_matches_the_folder(client):
    ids, text, finish = reference("Once upon a time there", MAX_NEW)
    r = client.completions.create(model=MODEL, prompt="Once upon a time there", max_tokens=MAX_NEW, temperature=0,
                                  extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == list(ids) and choice.text == text and choice.finish_reason == finish
    assert r.model_extra["speculation"]["proposed"] > 0  # the GGUF draft proposed


def test_chat_from_gguf_uses_its_template(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids, text, _ = reference(chat_prompt_ids(messages), MAX_NEW)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_NEW, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == list(ids) and r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(chat_prompt_ids(messages))

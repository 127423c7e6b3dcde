"""evaluation/quality.py on canned outputs: completion continuations and chat answers (fenced or raw).

The chat cases are what an instruct model answers (a Markdown fence, often after a sentence of prose);
the continuation cases are what the embedded pair answers to the repository's prompt sets. Each check
has negative controls, so a checker that accepts everything fails here.
"""

from __future__ import annotations

import pytest

from evaluation.quality import code_has_statement, code_ok, completed_code, fenced_block, json_ok

pytestmark = pytest.mark.timeout(60)

JSON_PROMPT = "Convert to JSON: name Bob, age 40, city Rome\n{"
CODE_PROMPT = 'def is_even(n):\n    """Return True if n is an even integer."""\n'


@pytest.mark.parametrize("output, ok", [
    ('"name": "Bob", "age": 40}', True),
    ('"name": "Bob", "age": 40}\nConvert to JSON: next', True),  # the model goes on after the value
    ('"name": "Bob", "age": 40', False),  # cut off by max_tokens
    ('"name": Bob}', False),
    ("", False),
])
def test_json_continuation(output, ok):
    assert json_ok(JSON_PROMPT, output) is ok


def test_json_continuation_of_an_array_and_a_partial_object():
    assert json_ok("Numbers:\n[", "1, 2, 3]")
    assert json_ok('Record:\n{"id": 7, ', '"ok": true}')
    assert not json_ok('Record:\n{"id": 7, ', '"ok": tru')


@pytest.mark.parametrize("answer, ok", [
    ('```json\n{"name": "Bob", "age": 40}\n```', True),
    ('Sure! Here is the JSON:\n\n```json\n{"name": "Bob",\n "age": 40}\n```\nAnything else?', True),
    ('```\n[1, 2, 3]\n```', True),  # unlabelled fence
    ('```JSON\n{"a": null}\n```', True),
    ('{"name": "Bob", "age": 40}', True),  # raw answer, no fence
    ('Here you go: {"name": "Bob"} — done.', True),
    ('```json\n{"name": "Bob", "age": }\n```', False),
    ('```json\n{"name": "Bob"}\n{"second": 1}\n```', False),  # a fenced block must be one value
    ('```json\n{"name": "Bob", "age"', False),  # cut off inside the fence
    ('```python\nprint(1)\n```', False),  # no JSON block, no brace
    ("I cannot do that.", False),
])
def test_json_chat_answers(answer, ok):
    assert json_ok("", answer) is ok


@pytest.mark.parametrize("output, ok, statement", [
    ("    return n % 2 == 0\n", True, True),
    ("    return n % 2 == 0\n\n\ndef next_one(x):\n    return", True, True),  # next def cut off: not judged
    ("    # check the parity\n    return n % 2 == 0\n    # done\n    if n", True, True),  # cut line dropped
    ("    for i in range(n):\n", False, False),  # an opener without a body is dropped: nothing left
    ("    x = n\n    for i in range(n):\n", True, True),
    ("    # only a comment\n", False, False),  # adds no code
    ("    return n %% 2 ==\n", False, False),
    ("    return n % 2 == 0", False, False),  # no complete line
])
def test_code_continuation(output, ok, statement):
    assert code_ok(CODE_PROMPT, output) is ok
    assert code_has_statement(CODE_PROMPT, output) is statement


@pytest.mark.parametrize("answer, ok, statement", [
    ("```python\ndef is_even(n):\n    return n % 2 == 0\n```", True, True),
    ("Here is a function that checks parity:\n\n```py\ndef is_even(n):\n    return n % 2 == 0\n```\n"
     "It uses the modulo operator.", True, True),
    ("```\nimport math\nprint(math.pi)\n```", True, True),  # unlabelled fence, no function
    ('```python\ndef is_even(n):\n    """Parity."""\n```', True, False),  # parses, but no implementation
    ("def is_even(n):\n    return n % 2 == 0\n", True, True),  # raw answer
    ("Sure.\ndef is_even(n):\n    return n % 2 == 0\n", True, True),  # prose, then raw code
    ("```python\ndef is_even(n):\n    return n % 2 == 0\n    if n", True, True),  # cut inside the fence
    ("```python\ndef is_even(n)\n    return n % 2 == 0\n```", False, False),  # missing colon
    ("```json\n{\"a\": 1}\n```", False, False),  # a JSON block is not code
    ("The answer is that n % 2 tells you.", False, False),
])
def test_code_chat_answers(answer, ok, statement):
    assert code_ok("", answer) is ok
    assert code_has_statement("", answer) is statement


def test_fenced_block_picks_the_first_block_of_the_language():
    text = "```bash\npip install x\n```\n```python\nx = 1\n```\n```python\ny = 2\n```"
    assert fenced_block(text, ("python",)) == ("x = 1\n", True)
    assert fenced_block("```python\nx = 1\n", ("python",)) == ("x = 1\n", False)
    assert fenced_block("no fence", ("python", "")) is None


def test_continuation_prompt_that_opens_no_code_is_judged_as_an_answer():
    # A raw prompt in prose ("Write a function …") opens no code: the output is judged on its own.
    prompt = "Write a Python function that tells whether n is even.\n"
    assert code_ok(prompt, "def is_even(n):\n    return n % 2 == 0\n")
    assert completed_code(prompt, "It is even when n % 2 is 0.") is None

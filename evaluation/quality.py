"""Is a generated answer valid JSON / Python? The one definition the scenario benchmark and the default
pair's build (``scripts/bench_scenarios.py``, ``scripts/build_default_pair.py``) report.

An output is judged in one of two ways:

- **Continuation** (``prompt`` is the text the output continues): the prompt opens the value and the
  output completes it, e.g. ``Convert to JSON: …\\n{`` + ``"name": "Bob"}``, or a ``def`` header with its
  docstring + the body.
- **Answer** (``prompt == ""``: a chat reply, or a prompt that opens nothing): the first fenced block
  (```json …```, ```python …```, or an unlabelled ``` … ```) when the answer has one, otherwise the
  answer itself, from its first ``{``/``[`` (JSON) or its first line of code (Python).

Outputs cut off by ``max_tokens`` are judged on what is complete: the last, possibly cut, line is
dropped (Python), and a JSON value must be complete to count.
"""

from __future__ import annotations

import ast
import json
import re

JSON_FENCES = ("json", "jsonc", "")
CODE_FENCES = ("python", "py", "python3", "")
# ```lang, the block, then the closing fence (None when the answer was cut off inside the block)
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(```|\Z)", re.S)
_CODE_START = re.compile(r"^(?:async\s+def|def|class|import|from|@)\b", re.M)


def fenced_block(text: str, languages: tuple[str, ...]) -> tuple[str, bool] | None:
    """The first fenced block labelled with one of ``languages`` ("" = unlabelled): (body, closed)."""
    for m in _FENCE.finditer(text):
        if m.group(1).lower() in languages:
            return m.group(2), bool(m.group(3))
    return None


def json_opening(prompt: str) -> str:
    """The JSON a continuation prompt opens: its last line, if that starts a value ("" otherwise)."""
    last = prompt.rsplit("\n", 1)[-1]
    return last if last.lstrip().startswith(("{", "[")) else ""


def json_ok(prompt: str, output: str) -> bool:
    """Does the output hold one complete, valid JSON value (see the module docstring for where)?"""
    opening = json_opening(prompt)
    decoder = json.JSONDecoder()
    if opening:
        text = opening + output
    else:
        block = fenced_block(output, JSON_FENCES)
        if block is not None:
            try:  # a fenced block is exactly one value
                json.loads(block[0])
                return True
            except ValueError:
                return False
        starts = [i for i in (output.find("{"), output.find("[")) if i >= 0]
        if not starts:
            return False
        text = output[min(starts):]
    try:
        decoder.raw_decode(text.lstrip())
        return True
    except ValueError:
        return False


def code_opening(prompt: str) -> str:
    """The code a continuation prompt opens: the prompt from its first line of code ("" if none)."""
    start = _CODE_START.search(prompt)
    return prompt[start.start():] if start else ""


def _drop_cut_tail(lines: list[str], keep: int) -> list[str]:
    """Drop trailing blank lines and body-less block openers (``for x in y:`` cut off before its body)."""
    while len(lines) > keep and (not lines[-1].strip() or lines[-1].rstrip().endswith(":")):
        lines.pop()
    return lines


def _has_code(lines: list[str]) -> bool:
    return any(ln.strip() and not ln.lstrip().startswith("#") for ln in lines)


def completed_code(prompt: str, output: str) -> ast.Module | None:
    """The Python the output completes, parsed; None if it does not parse or adds no code.

    Continuation (the prompt opens code): the prompt from its first line of code + output up to its
    last complete line, stopped before a new top-level statement (the function is done; what follows is
    cut off by max_tokens), trailing openers dropped. Answer: the fenced block (whole if closed) or the
    answer from its first line of code, to its last complete line.
    Comments alone add no code: the output must hold a line that is not blank and not a comment.
    """
    opening = code_opening(prompt)
    if opening:
        text = opening + output
        lines = text[: text.rfind("\n") + 1].split("\n")
        n_prompt = opening.count("\n")
        kept = lines[:n_prompt]
        for ln in lines[n_prompt:]:
            if ln and not ln[0].isspace() and not ln.startswith(("#", ")", "]", "}")):
                break
            kept.append(ln)
        kept = _drop_cut_tail(kept, n_prompt)
        generated = kept[n_prompt:]
    else:
        block = fenced_block(output, CODE_FENCES)
        if block is not None:
            body, closed = block
        else:
            start = _CODE_START.search(output)
            body, closed = (output[start.start():] if start else output), False
        if not closed:
            body = body[: body.rfind("\n") + 1]
        kept = generated = _drop_cut_tail(body.split("\n"), 0)
    if not _has_code(generated):
        return None
    try:
        return ast.parse("\n".join(kept) + "\n")
    except SyntaxError:
        return None


def code_ok(prompt: str, output: str) -> bool:
    return completed_code(prompt, output) is not None


def code_has_statement(prompt: str, output: str) -> bool:
    """Stricter than ``code_ok``: a function (or, without one, the module) holds a statement that is not
    a string. A body of only comments and docstrings parses, but is not an implementation."""
    tree = completed_code(prompt, output)
    if tree is None:
        return False
    defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    bodies = [d.body for d in defs] if defs else [tree.body]
    return any(not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))
               for body in bodies for stmt in body)

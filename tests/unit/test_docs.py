"""The documentation stays inside the repository and its links resolve.

- Every markdown link and image in the repository's markdown files (README.md, docs/, the vendored data's
  SOURCE.md, ...) that is not a URL points at a file or folder inside the repository, and an ``#anchor``
  into a markdown file names one of its headings (GitHub's heading slugs).
- Every ``docs/<name>.md[#anchor]`` reference in any text file (comments and docstrings included) resolves
  the same way.
- No text file in the repository points at a design document or a folder outside it, and user-facing
  text does not use the jargon of the project's planning notes (see docs/design.md#glossary).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".json", ".jsonl", ".jinja", ".cfg"}
# Spelt in pieces so that this file does not match itself.
FORBIDDEN = {
    "DESIGN" + ".md": "a design document outside the repository (use docs/design.md)",
    "../" + "shared": "a folder outside the repository",
    "seeds" + "'": "planning jargon: say what the thing is (e.g. the reference article, docs/design.md)",
}

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
DOC_REF = re.compile(r"(?<![\w/.-])(docs/[\w./-]+?\.md(?:#[\w-]+)?)")  # written from the repository root


def repo_files() -> list[Path]:
    """Files git tracks or would track (untracked but not ignored); every file when git is unavailable."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                             capture_output=True, check=True, timeout=30).stdout.decode()
        files = [REPO / name for name in out.split("\0") if name]
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", "bench-out", "build"}
        files = [p for p in REPO.rglob("*")
                 if p.is_file() and not skip & set(p.relative_to(REPO).parts)
                 and not any(part.endswith(".egg-info") for part in p.parts)]
    return sorted(p for p in files if p.is_file())


def text_files() -> list[Path]:
    return [p for p in repo_files() if p.suffix in TEXT_SUFFIXES or p.parent.name == ".ci"]


def markdown_files() -> list[Path]:
    return [p for p in repo_files() if p.suffix == ".md"]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, INLINE_CODE.sub("``", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, code marks and punctuation dropped, spaces → '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        out += [(number, m.group(1)) for m in LINK.finditer(line)]
        ref = REFERENCE_DEF.match(line)
        if ref:
            out.append((number, ref.group(1)))
    return out


def problem(source: Path, number: int, target: str, base: Path | None = None) -> str | None:
    """Why ``target``, written in ``source`` at line ``number`` relative to ``base`` (default: the source's
    folder), does not resolve; None when it does."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...: not a repository path
        return None
    where = f"{source.relative_to(REPO)}:{number}: {target}"
    path_part, _, anchor = target.partition("#")
    file = ((base or source.parent) / path_part).resolve() if path_part else source
    if not file.is_relative_to(REPO):
        return f"{where}: points outside the repository"
    if not file.exists():
        return f"{where}: {file.relative_to(REPO)} does not exist"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"{where}: no heading #{anchor} in {file.relative_to(REPO)}"
    return None


def test_the_checks_see_the_documentation() -> None:
    names = {str(p.relative_to(REPO)) for p in markdown_files()}
    assert {"README.md", "docs/design.md", "docs/http_api.md"} <= names, names
    assert ("README.md", "docs/design.md") in {(str(p.relative_to(REPO)), t) for p in markdown_files()
                                               for _, t in links(p)}


def test_slugs_follow_githubs_rules() -> None:
    assert slug("The reference article") == "the-reference-article"
    assert slug("`ray up` (AWS)") == "ray-up-aws"
    assert slug("Reference topology: 4 nodes × 8 H200") == "reference-topology-4-nodes--8-h200"
    assert slug("Scenario benchmark (embedded default pair, CPU)") == "scenario-benchmark-embedded-default-pair-cpu"


def test_a_broken_link_is_reported(tmp_path: Path) -> None:
    doc = REPO / "docs" / "design.md"
    assert problem(doc, 1, "http_api.md#errors") is None
    assert problem(doc, 1, "#glossary") is None
    assert problem(doc, 1, "https://example.com/x.md#nothing") is None
    assert "does not exist" in problem(doc, 1, "no_such_file.md")
    assert "no heading #nothing-here" in problem(doc, 1, "http_api.md#nothing-here")
    assert "outside the repository" in problem(doc, 1, "../../elsewhere.md")
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[a](x.md) ![b](img/y.png \"t\") `[not](a-link.md)`\n\n```\n[no](code.md)\n```\n"
                    "[ref]: z.md#part\n", encoding="utf-8")
    assert [t for _, t in links(page)] == ["x.md", "img/y.png", "z.md#part"]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_markdown_links_resolve_inside_the_repository(path: Path) -> None:
    problems = [p for number, target in links(path) if (p := problem(path, number, target))]
    assert problems == []


def test_doc_references_in_text_files_resolve() -> None:
    problems, seen = [], 0
    for path in text_files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for m in DOC_REF.finditer(line):
                seen += 1
                if p := problem(path, number, m.group(1), base=REPO):
                    problems.append(p)
    assert seen > 10  # the design document is referenced from code, tests and docs
    assert problems == []


def test_no_text_file_points_outside_the_repository_or_uses_planning_jargon() -> None:
    problems = []
    for path in text_files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            problems += [f"{path.relative_to(REPO)}:{number}: {word!r} — {why}"
                         for word, why in FORBIDDEN.items() if word in line]
    assert problems == []

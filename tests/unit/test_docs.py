"""The documentation stays inside the repository and its links resolve.

- Every markdown link and image in the repository's markdown files (README.md, docs/, the vendored data's
  SOURCE.md, ...) that is not a URL points at a file or folder inside the repository, and an ``#anchor``
  into a markdown file names one of its headings (GitHub's heading slugs).
- Every ``docs/<name>.md[#anchor]`` reference in any text file (comments and docstrings included) resolves
  the same way.
- No text file in the repository points at a design document or a folder outside it, and user-facing
  text does not use the jargon of the project's planning notes (see docs/design.md#glossary).
- The README stays a front page (at most ``README_MAX_LINES`` lines; the rest lives in docs/), and
  docs/index.md lists every document in docs/.
- Every code name in backticks in README.md and docs/*.md that names a piece of this repository still
  names one: a path under one of the repository's top-level folders (``scripts/serve.sh``,
  ``engine/gamma.py:expected_speedup``, ``docs/results/x.{json,md}``, ``cluster/launch/serve-*.yaml``) or
  any ``pkg/mod.py`` exists, and a dotted name rooted in one of the repository's Python packages
  (``runtime.wire``, ``engine.engine.random_first_seq_id``, ``deployments.app:build_app``) is a module, or
  a module and a name that module's source defines (``def``, ``class``, an assignment or an import), then
  attributes its source defines. Checked by reading files, never by importing them. Config keys that share
  a package's name (``verifier.num_threads``) are recognised as config keys, and names outside the
  repository (``torch.compile``, ``application/json``) are left alone.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import tomllib
from functools import cache
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


# -- the README as a front page, the index of docs/ ------------------------------------------------------

README_MAX_LINES = 200


def test_the_readme_stays_a_front_page() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move reference text into docs/"


def unindexed(index: Path, docs: Path) -> list[str]:
    """The markdown files of ``docs`` that ``index`` (a file in ``docs``) does not link to."""
    listed = {(index.parent / target.partition("#")[0]).resolve() for _, target in links(index)}
    return sorted(p.name for p in docs.glob("*.md") if p != index and p.resolve() not in listed)


def test_the_docs_index_lists_every_document() -> None:
    assert unindexed(REPO / "docs" / "index.md", REPO / "docs") == []


def test_an_unindexed_document_is_reported(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n", encoding="utf-8")
    (tmp_path / "b.md").write_text("# B\n", encoding="utf-8")
    index = tmp_path / "index.md"
    index.write_text("# Index\n\n- [a.md](a.md) — what a answers\n- `b.md` is named but not linked\n",
                     encoding="utf-8")
    assert unindexed(index, tmp_path) == ["b.md"]


# -- code names in backticks ------------------------------------------------------------------------------

CODE_SPAN = re.compile(r"`([^`\n]+)`")
# a/b/c.py, scripts/x.sh, docs/results/x.{json,md}, cluster/launch/serve-*.yaml, scripts/bench_<name>.py, with
# an optional :name or ::name after a .py file. Not the tail of a URL, a home-relative or absolute path.
CODE_PATH = re.compile(r"(?<![\w./~$:<>{}-])([A-Za-z_][\w-]*(?:/(?:[\w.*<>-]|\{[\w.,-]*\})+)+/?)"
                       r"(?:::?([A-Za-z_]\w*))?")
# pkg.mod, pkg.mod.Name.attr, pkg.mod:Name; not part of a path or of a longer dotted word.
DOTTED = re.compile(r"(?<![\w./$~-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?::([A-Za-z_]\w*))?(?![\w./-])")
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "jsonl", "toml", "sh", "txt", "png", "gguf", "safetensors",
                 "jinja", "cfg", "html", "so", "log"}


@cache
def top_level(root: Path = REPO) -> frozenset[str]:
    return frozenset(p.name for p in root.iterdir() if not p.name.startswith("."))


@cache
def python_packages(root: Path = REPO) -> frozenset[str]:
    """The repository's top-level Python packages: folders with an ``__init__.py``, and the packages
    ``pyproject.toml`` declares (so that a package named there but not yet on disk is still checked)."""
    names = {p.parent.name for p in root.glob("*/__init__.py")}
    pyproject = root / "pyproject.toml"
    if pyproject.exists():
        found = tomllib.loads(pyproject.read_text(encoding="utf-8"))
        include = found.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {}).get("include", [])
        names |= {pattern.rstrip("*.") for pattern in include}
    return frozenset(names)


@cache
def config_keys(root: Path = REPO) -> tuple[frozenset[str], frozenset[str]]:
    """(section names of ``ClusterConfig``, every field name declared in cluster/config.py), from its source."""
    source = (root / "cluster" / "config.py").read_text(encoding="utf-8") if (root / "cluster" / "config.py").exists() else ""
    fields = frozenset(re.findall(r"^\s+(\w+)\s*:\s*[^=\n]+=\s*Field\(", source, re.M))
    block = re.search(r"^class ClusterConfig\b.*?(?=^\S)", source + "\nEND", re.M | re.S)
    sections = frozenset(re.findall(r"^    (\w+)\s*:", block.group(0), re.M)) if block else frozenset()
    return sections, fields


def defines(source: str, name: str, *, anywhere: bool = False) -> bool:
    """Whether module ``source`` defines ``name``: ``def``/``class``, an assignment or annotation (one of
    several targets too), or an import; with ``anywhere``, also as an attribute (``self.name = ...``)."""
    n = re.escape(name)
    patterns = [rf"^\s*(?:async\s+)?(?:def|class)\s+{n}\b",
                rf"^\s*(?:\w+\s*,\s*)*{n}\s*(?:,\s*\w+\s*)*(?::[^=\n]*)?=(?!=)",
                rf"^\s*{n}\s*:",
                rf"^\s*(?:from\s+\S+\s+)?import\s+[^\n]*\b{n}\b"]
    if anywhere:
        patterns.append(rf"\bself\.{n}\s*(?::[^=\n]*)?=(?!=)")
    return any(re.search(p, source, re.M) for p in patterns)


def expand(path: str) -> list[str]:
    """``a/{b,c}.md`` → ``a/b.md``, ``a/c.md``; ``<name>`` becomes the glob ``*``."""
    path = re.sub(r"<[^<>/]*>", "*", path)
    parts = re.split(r"(\{[^{}]*\})", path)
    options = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(combo) for combo in itertools.product(*options)]


def path_problem(path: str, name: str | None, root: Path = REPO) -> str | None:
    """Why the code path ``path`` (with an optional ``:name`` in a .py file) does not resolve; None when it
    does, or when it is not a path of this repository."""
    path = path.rstrip("/")
    first = path.split("/", 1)[0]
    if first not in top_level(root) and not path.endswith(".py"):
        return None  # application/json, my-k8s/rayservice.yaml, bench-out/...: not the repository's
    for candidate in expand(path):
        hits = sorted(root.glob(candidate)) if "*" in candidate else [root / candidate]
        if not any(h.exists() for h in hits):
            return f"{candidate} does not exist"
        if name and candidate.endswith(".py") and "*" not in candidate:
            if not defines(hits[0].read_text(encoding="utf-8"), name):
                return f"{candidate} defines no {name}"
    return None


def dotted_problem(dotted: str, name: str | None, root: Path = REPO) -> str | None:
    """Why the dotted name ``dotted`` (``pkg.mod.Name.attr``; ``name`` from ``pkg.mod:name``) does not name a
    module of this repository and what it defines; None when it does, or when it is not rooted in one of
    the repository's packages."""
    parts = dotted.split(".")
    if parts[0] not in python_packages(root) or parts[-1] in FILE_SUFFIXES:
        return None  # torch.compile, router.transport, engine.py, ...
    if name:
        parts.append(name)
    module, k = None, 0
    for i in range(len(parts), 0, -1):  # the longest prefix that is a module or a package
        base = root.joinpath(*parts[:i])
        for file in (base.with_suffix(".py"), base / "__init__.py"):
            if file.exists():
                module, k = file, i
                break
        if module is not None or base.is_dir():
            k = k or i
            break
    if k == 0:
        return f"{dotted}: no package {parts[0]}/ in the repository"
    rest = parts[k:]
    if not rest:
        return None
    source = module.read_text(encoding="utf-8") if module is not None else ""
    if not defines(source, rest[0]):
        sections, fields = config_keys(root)
        if k == 1 and parts[0] in sections and all(p in fields for p in rest):
            return None  # a config key such as verifier.num_threads
        where = module.relative_to(root) if module is not None else "/".join(parts[:k]) + "/"
        return f"{dotted}: {where} defines no {rest[0]}"
    for attr in rest[1:]:
        if not defines(source, attr, anywhere=True):
            return f"{dotted}: {module.relative_to(root)} defines no attribute {attr}"
    return None


def code_name_problems(path: Path, root: Path = REPO) -> list[str]:
    problems = []
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for span in CODE_SPAN.findall(line):
            found = [path_problem(m.group(1), m.group(2), root) for m in CODE_PATH.finditer(span)]
            found += [dotted_problem(m.group(1), m.group(2), root) for m in DOTTED.finditer(span)]
            problems += [f"{path.relative_to(root)}:{number}: `{span}`: {p}" for p in found if p]
    return problems


def documentation(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", documentation(), ids=lambda p: str(p.relative_to(REPO)))
def test_code_names_in_the_documentation_exist(path: Path) -> None:
    assert code_name_problems(path) == []


def test_a_stale_code_name_is_reported(tmp_path: Path) -> None:
    for package in ("engine", "verifier"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "engine" / "gamma.py").write_text(
        "from x import imported_name\nA, B = 1, 2\nLIMIT: int = 3\n\nclass Policy:\n    def __init__(self):\n"
        "        self.window = 4\n\n    def choose(self):\n        pass\n\n\ndef expected_speedup():\n    pass\n",
        encoding="utf-8")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "serve.sh").write_text("", encoding="utf-8")
    (tmp_path / "scripts" / "bench_served.py").write_text("", encoding="utf-8")
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "config.py").write_text(
        "class VerifierSpec(_Spec):\n    num_threads: int = Field(1)\n\n\nclass ClusterConfig(_Spec):\n"
        "    verifier: VerifierSpec = Field(default_factory=VerifierSpec)\n", encoding="utf-8")
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "run.json").write_text("{}", encoding="utf-8")
    good = ["scripts/serve.sh", "bash scripts/serve.sh --port 1", "engine/gamma.py:expected_speedup",
            "engine.gamma", "engine.gamma.Policy.choose", "engine.gamma.Policy.window", "engine.gamma:B",
            "engine.gamma.imported_name", "engine.gamma.LIMIT", "scripts/bench_<name>.py", "docs/results/run.{json}",
            "docs/results/*.json", "engine/", "gamma.py", "engine.py", "torch.compile", "router.transport",
            "application/json", "bench-out/x.json", "~/.local/state/x", "http://127.0.0.1:8000/v1",
            "verifier.num_threads", "cluster/config.py"]
    bad = ["scripts/no_such.sh", "tests/unit/test_nothing.py", "tools/loadgen.py", "engine/gamma.py:gone",
           "engine.gone", "engine.gamma.gone_function", "engine.gamma.Policy.gone", "docs/results/run.{json,md}",
           "scripts/render_*.py", "verifier.no_such_key"]
    page = tmp_path / "docs" / "page.md"
    page.write_text("\n".join(f"`{span}`" for span in good + bad) + "\n```\n`engine.in_a_fence`\n```\n",
                    encoding="utf-8")
    problems = code_name_problems(page, root=tmp_path)
    assert [p.split(": ", 1)[1].split("`: ")[0].strip("`") for p in problems] == bad, problems


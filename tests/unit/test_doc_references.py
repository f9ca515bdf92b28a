"""Every pointer in the code and docs leads to something in this repository.

The design lives in the repo (docs/design.md#the-design-lives-in-the-repo): a comment may cite
``docs/<page>.md#<anchor>`` or say the thing itself, never a section number of a document
the repo does not hold. Three checks, each failing with ``file:line`` for every hit:

* no ``§<number>``, ``DESIGN <n>``, "the brief", "spec section", ``spec <number>`` or the
  team's shared folder, and no ``*.md`` file name that exists nowhere in the repo, in
  ``areal/``, ``examples/``, ``bench/``, ``docs/`` and the top-level ``README*.md`` (tests
  may name their cases);
* every relative markdown link in ``docs/`` and the READMEs reaches a file, and its
  ``#anchor`` a heading of that file (GitHub's anchors: lower case, punctuation dropped,
  spaces to hyphens, ``-1``, ``-2`` for repeats);
* every ``<path>.md#<anchor>`` and ``bench/results/<file>`` named in code, tests or docs
  exists.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIPPED_DIRS = {".git", ".venv", ".cache", "__pycache__", "node_modules", ".pytest_cache"}
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg"}

FORBIDDEN = [
    (re.compile(r"§\s*\d"), "a section number (§)"),
    (re.compile(r"\bDESIGN(?: decision)? \d+"), "a DESIGN decision number"),
    (re.compile(r"\bthe brief\b", re.IGNORECASE), "'the brief'"),
    (re.compile(r"\bspec(?:ification)? section\b", re.IGNORECASE), "a spec section"),
    (re.compile(r"\bspec \d+(?:\.\d+)*\b"), "a spec section number"),
    (re.compile(r"(?:\.\./|/work/)shared/|\bshared/(?:spec|notes)\b"), "the team's shared folder"),
]
MD_NAME = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]*\w\.md)\b")
MD_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MD_POINTER = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)#([\w-]+)")
RESULTS_POINTER = re.compile(r"\bbench/results/([\w.{},-]+\w)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
FENCE = re.compile(r"^\s*(```|~~~)")


def _files(*tops: str) -> Iterator[Path]:
    for top in tops:
        path = ROOT / top
        if path.is_file():
            yield path
            continue
        for folder, dirs, names in os.walk(path):
            dirs[:] = sorted(
                d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")
            )
            for name in sorted(names):
                if Path(name).suffix in TEXT_SUFFIXES:
                    yield Path(folder) / name


def _readmes() -> list[str]:
    return sorted(p.name for p in ROOT.glob("README*.md"))


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    yield from enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)


def _prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Lines of a markdown file outside fenced code blocks."""
    fenced = False
    for number, line in _lines(path):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


@cache
def _md_names() -> frozenset[str]:
    return frozenset(p.name for p in _files(".") if p.suffix == ".md")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts as its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in _prose_lines(path):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def _where(path: Path, number: int) -> str:
    return f"{path.relative_to(ROOT)}:{number}"


def _check_anchor(target: Path, anchor: str) -> str | None:
    if not target.is_file():
        return f"{target.relative_to(ROOT) if target.is_relative_to(ROOT) else target} missing"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return f"no heading with anchor #{anchor} in {target.relative_to(ROOT)}"
    return None


def _expand_braces(name: str) -> list[str]:
    parts = re.split(r"\{([^{}]*)\}", name)
    fixed, choices = parts[0::2], [p.split(",") for p in parts[1::2]]
    return [
        "".join(itertools.chain.from_iterable(zip(fixed, (*combo, ""), strict=True)))
        for combo in itertools.product(*choices)
    ]


# --- the checks ---


def test_no_references_to_documents_outside_the_repo():
    hits = []
    for path in _files("areal", "examples", "bench", "docs", *_readmes()):
        for number, line in _lines(path):
            for pattern, what in FORBIDDEN:
                if pattern.search(line):
                    hits.append(f"{_where(path, number)}: {what}: {line.strip()}")
            for name in MD_NAME.findall(line):
                if Path(name).name not in _md_names():
                    hits.append(f"{_where(path, number)}: {name} is not in the repo")
    assert not hits, "references to documents outside the repo:\n" + "\n".join(hits)


def test_markdown_links_resolve():
    broken = []
    for path in _files("docs", "bench", *_readmes()):
        if path.suffix != ".md":
            continue
        for number, line in _prose_lines(path):
            for target in MD_LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto: ...
                    continue
                file_part, _, anchor = target.partition("#")
                resolved = (path.parent / file_part).resolve() if file_part else path
                problem = _check_anchor(resolved, anchor)
                if problem:
                    broken.append(f"{_where(path, number)}: ({target}): {problem}")
    assert not broken, "broken markdown links:\n" + "\n".join(broken)


def test_doc_pointers_resolve():
    """``docs/x.md#anchor`` and ``bench/results/...`` named anywhere lead somewhere."""
    broken = []
    for path in _files("areal", "examples", "bench", "docs", "tests", *_readmes()):
        if path == Path(__file__).resolve():  # its own examples are not pointers
            continue
        for number, line in _lines(path):
            for name, anchor in MD_POINTER.findall(line):
                candidates = [ROOT / name, path.parent / name, ROOT / "docs" / name]
                target = next((c for c in candidates if c.is_file()), candidates[0])
                problem = _check_anchor(target.resolve(), anchor)
                if problem:
                    broken.append(f"{_where(path, number)}: {name}#{anchor}: {problem}")
            for name in RESULTS_POINTER.findall(line):
                for one in _expand_braces(name):
                    if not (ROOT / "bench" / "results" / one).is_file():
                        broken.append(f"{_where(path, number)}: bench/results/{one} missing")
    assert not broken, "pointers that lead nowhere:\n" + "\n".join(broken)


def test_slug_follows_github():
    assert slug("Route modes (`econfig.arena_llm_route_mode`)") == (
        "route-modes-econfigarena_llm_route_mode"
    )
    assert slug("What this port runs, at what shape") == "what-this-port-runs-at-what-shape"
    assert slug("Failures: train with zero, or reject") == "failures-train-with-zero-or-reject"
    assert _expand_braces("inference_server_{cpu,gpu}.json") == [
        "inference_server_cpu.json",
        "inference_server_gpu.json",
    ]

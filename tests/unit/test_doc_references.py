"""The docs cite tests and files as evidence for what they promise (docs/guarantees.md above all):
a citation that no longer resolves sends a reader looking for a proof that is not there, and a
renamed or moved test silently stops backing the sentence that names it. Two such slipped through
a review before this check existed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])
# A path from the repository's root, or relative to the doc (`../bench/...` from docs/).
PATH = re.compile(r"(?<![\w/.])((?:\.\./)*(?:src|tests|bench|scripts)/[\w/.*-]+\.(?:py|sql|md|toml|sh|json))")
TEST_NAME = re.compile(r"::(test_\w+)")
BARE_FILE = re.compile(r"(?<![\w/.])(test_\w+\.py)(?=::)")  # `test_x.py::test_y`, its folder left out
CITATION = re.compile(f"{PATH.pattern}|{TEST_NAME.pattern}|{BARE_FILE.pattern}")
# Patterns the docs describe, not files.
PATTERN_PATHS = ("bench/peers/NAME_bench.py", "src/stepwarden/store/sql/postgres/migrations/NNNN_*.sql")


def _resolves(doc: Path, path: str) -> bool:
    if "*" in path:  # a glob: at least one file matches it
        base = doc.parent if path.startswith("../") else ROOT
        return any(base.glob(path))
    return (doc.parent / path).exists() if path.startswith("../") else (ROOT / path).exists()


def _tests_in(path: Path) -> set[str]:
    return set(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", path.read_text(), re.M))


def test_every_file_the_docs_cite_exists() -> None:
    missing = [
        f"{doc.relative_to(ROOT)}: {path}"
        for doc in DOCS
        for path in PATH.findall(doc.read_text())
        if path not in PATTERN_PATHS and not _resolves(doc, path)
    ]
    assert missing == []


def test_every_test_the_docs_cite_is_in_the_file_named_before_it() -> None:
    """A `::test_name` belongs to the last test file cited before it in the same doc (the docs
    write `tests/x.py` then one or more `::test_...`); with no test file before it, to any."""
    everywhere: set[str] = set()
    for module in (ROOT / "tests").rglob("*.py"):
        everywhere |= _tests_in(module)
    missing = []
    for doc in DOCS:
        current: Path | None = None
        for m in CITATION.finditer(doc.read_text()):
            path, name, bare = m.group(1), m.group(2), m.group(3)
            if bare is not None:
                found = sorted((ROOT / "tests").rglob(bare))
                if len(found) != 1:
                    missing.append(f"{doc.relative_to(ROOT)}: {bare} names {len(found)} files in tests/")
                current = found[0] if found else None
                continue
            if path is not None:
                target = (doc.parent / path) if path.startswith("../") else ROOT / path
                if target.name.startswith("test_") and target.suffix == ".py" and target.exists():
                    current = target
                continue
            defined = _tests_in(current) if current is not None else everywhere
            if name not in defined:
                where = current.relative_to(ROOT) if current is not None else "tests/"
                missing.append(f"{doc.relative_to(ROOT)}: {name} (looked in {where})")
    assert missing == []


def test_the_checks_find_what_they_look_for() -> None:
    # Guards the checks above against passing because their patterns match nothing.
    text = (ROOT / "docs" / "guarantees.md").read_text()
    assert len(TEST_NAME.findall(text)) > 20
    assert len(PATH.findall(text)) > 20
    assert "../bench/results/" in "".join(PATH.findall((ROOT / "docs" / "performance.md").read_text()))
    assert "bench/CHAOS.md" in PATH.findall(text)

"""The docs cite tests and files as evidence for what they promise (docs/guarantees.md above all):
a citation that no longer resolves sends a reader looking for a proof that is not there, and a
renamed test silently stops backing the sentence that names it. Two such slipped through a
review before this check existed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])
TEST_NAME = re.compile(r"::(test_\w+)")
PATH = re.compile(r"(?<![\w/.])((?:src|tests|bench|scripts)/[\w/.-]+\.(?:py|sql|md|toml|sh))")
PLACEHOLDER = re.compile(r"[A-Z]{3,}")  # bench/peers/NAME_bench.py: a pattern, not a file


def _defined_tests() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names.update(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", path.read_text(), re.M))
    return names


def test_every_test_the_docs_cite_exists() -> None:
    defined = _defined_tests()
    missing = [
        f"{doc.relative_to(ROOT)}: {name}"
        for doc in DOCS
        for name in TEST_NAME.findall(doc.read_text())
        if name not in defined
    ]
    assert missing == []


def test_every_file_the_docs_cite_exists() -> None:
    missing = [
        f"{doc.relative_to(ROOT)}: {path}"
        for doc in DOCS
        for path in PATH.findall(doc.read_text())
        if not PLACEHOLDER.search(path) and not (ROOT / path).exists()
    ]
    assert missing == []


def test_the_checks_find_what_they_look_for() -> None:
    # Guards the two checks above against passing because their patterns match nothing.
    text = (ROOT / "docs" / "guarantees.md").read_text()
    assert len(TEST_NAME.findall(text)) > 20
    assert len(PATH.findall(text)) > 20

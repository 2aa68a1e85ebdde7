"""Every document the code points to exists."""

from __future__ import annotations

import re
from pathlib import Path

from tests.project.docs_text import docs_text

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "src").rglob("*.py"))


def test_there_are_sources_to_scan() -> None:
    assert len(SOURCES) > 10


def test_every_docs_file_named_in_src_exists() -> None:
    named = {
        (source.relative_to(ROOT), ref)
        for source in SOURCES
        for ref in re.findall(r"\bdocs/[\w./-]+\.md\b", source.read_text())
    }
    missing = sorted((str(src), ref) for src, ref in named if not (ROOT / ref).is_file())
    assert missing == []


def test_every_readme_section_named_in_src_exists() -> None:
    headings = {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", docs_text(), re.M)}
    named = {
        (source.relative_to(ROOT), section)
        for source in SOURCES
        for section in re.findall(r"README's (\w[\w ]*?) section", source.read_text())
    }
    assert named  # the pattern still finds the references
    missing = sorted((str(src), section) for src, section in named if section not in headings)
    assert missing == []

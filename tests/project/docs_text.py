"""The project's documentation as the tests read it: the README, the changelog and docs/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def doc_files() -> list[Path]:
    """README.md first, then CHANGELOG.md and every page under docs/, in a stable order."""
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def docs_text() -> str:
    """Every documentation file, joined: a section is found whichever page holds it."""
    return "\n\n".join(path.read_text(encoding="utf-8") for path in doc_files())

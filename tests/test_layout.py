"""The lab (bench/) apart from the library and its tests, and without import circles."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_neither_the_library_nor_the_tests_import_the_lab() -> None:
    for folder in ("src", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            lab = {m for m in _imports(path) if m == "bench" or m.startswith("bench.")}
            assert not lab, f"{path.relative_to(ROOT)} imports {sorted(lab)}"


def test_the_lab_has_no_import_circle() -> None:
    modules = {p.stem: p for p in (ROOT / "bench").glob("*.py")}
    graph = {
        name: {m.split(".")[1] for m in _imports(path) if m.startswith("bench.")} & modules.keys()
        for name, path in modules.items()
    }

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph[start]:
            if nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt})):
                return True
        return False

    circles = sorted(name for name in graph if reaches(name, name, {name}))
    assert not circles, f"bench modules on an import circle: {circles}"

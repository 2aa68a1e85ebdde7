"""The lab (bench/) apart from the library and its tests; no import circle in the lab or in
the library, whose top shows its roles as folders."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def _src_graph() -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports, at any
    level of the file except under ``if TYPE_CHECKING:`` (a function-level import is
    still an arrow: it only hides the circle until the call)."""
    pkg = ROOT / "src" / "asgi_idempotency"
    names: dict[str, Path] = {}
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(ROOT / "src").with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        names[".".join(parts)] = path

    def imported(path: Path, module: str) -> set[str]:
        tree = ast.parse(path.read_text())
        skip: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip.update(id(n) for b in node.body for n in ast.walk(b))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, ast.ImportFrom | ast.Import):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            found.update(t for t in targets if t in names and t != module)
        return found

    graph = {name: imported(path, name) for name, path in names.items()}
    # A package imports its own modules to re-export them: not an arrow back up.
    return {
        name: {
            t
            for t in targets
            if not (t.startswith(name + ".") and names[name].name == "__init__.py")
        }
        for name, targets in graph.items()
    }


def test_the_library_has_no_import_circle() -> None:
    graph = _src_graph()
    # The package's face (asgi_idempotency/__init__.py) imports lazily and is imported
    # by everything that reads __version__: it is the root, not part of the house.
    graph.pop("asgi_idempotency", None)
    for targets in graph.values():
        targets.discard("asgi_idempotency")

    circles: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in done:
                visit(nxt, [*path, nxt])
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    assert not circles, "import circles in src: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_package_top_shows_its_roles() -> None:
    top = ROOT / "src" / "asgi_idempotency"
    modules = sorted(p.name for p in top.glob("*.py"))
    folders = sorted(p.name for p in top.iterdir() if (p / "__init__.py").exists())
    assert len(modules) <= 12, modules
    for role in ("core", "http", "functions", "integrations", "stores", "observability", "ops"):
        assert role in folders, f"no {role}/ in {folders}"


def test_the_tests_mirror_the_package() -> None:
    """A folder of tests per role of the package, and at most five files at the top of tests/
    (its package file, the shared fixtures and the app factory): a new test goes with its role."""
    tests = ROOT / "tests"
    top = sorted(p.name for p in tests.iterdir() if p.is_file() and p.suffix == ".py")
    assert len(top) <= 5, f"more than 5 files at the top of tests/: {top}"
    assert not [n for n in top if n.startswith("test_")], f"tests at the top of tests/: {top}"
    folders = {p.name for p in tests.iterdir() if (p / "__init__.py").exists()}
    roles = [
        p.name
        for p in (ROOT / "src" / "asgi_idempotency").iterdir()
        if (p / "__init__.py").exists()
    ]
    # testing/ (the public contract kit) is tried where it is used: tests/stores, tests/ops.
    missing = sorted(set(roles) - {"testing"} - folders)
    assert not missing, f"no tests/ folder for the package's {missing}"

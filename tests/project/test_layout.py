"""The lab (bench/) apart from the library and its tests; no import circle in the lab or in
the library (``TYPE_CHECKING`` imports included), whose top shows its roles as folders, on
floors: core < stores, observability < http, functions < integrations < ops; the core
imports nothing above it, and at most :data:`MAX_UPWARD` imports climb a floor."""

from __future__ import annotations

import ast
import subprocess
import sys
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


PACKAGE = ROOT / "src" / "asgi_idempotency"

# The floors of the house, lowest first: a folder imports its own floor and the ones
# below. client/, testing/ and the migrations stand beside the house, not in it.
LAYERS = {
    "core": 0,
    "stores": 1,
    "observability": 1,
    "http": 2,
    "functions": 2,
    "integrations": 3,
    "ops": 4,
}
# Imports that still climb a floor, counted per import statement: at most this many.
MAX_UPWARD = 4


def _module_names() -> dict[str, Path]:
    names: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT / "src").with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        names[".".join(parts)] = path
    return names


def _import_statements(path: Path, module: str) -> list[tuple[int, list[str]]]:
    """Each import statement of the file, at any level, ``TYPE_CHECKING`` blocks and
    function bodies included (a type is an arrow too; a function-level import only
    hides a circle until the call): its line and the absolute names it imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.append((node.lineno, [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            found.append((node.lineno, [base, *(f"{base}.{a.name}" for a in node.names)]))
    return found


def _src_graph() -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports."""
    names = _module_names()

    def imported(path: Path, module: str) -> set[str]:
        return {
            t
            for _, targets in _import_statements(path, module)
            for t in targets
            if t in names and t != module
        }

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


def _folder(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "asgi_idempotency" else None


def _upward_imports() -> list[str]:
    """Import statements from a folder of the house to a folder on a higher floor."""
    climbs: list[str] = []
    for module, path in sorted(_module_names().items()):
        here = _folder(module)
        if here is None or here not in LAYERS or path.parent == PACKAGE:
            continue
        for line, targets in _import_statements(path, module):
            floors = {f for f in map(_folder, targets) if f is not None and f in LAYERS}
            climbs.extend(
                f"{path.relative_to(PACKAGE)}:{line} {here} -> {there}"
                for there in sorted(floors)
                if LAYERS[there] > LAYERS[here]
            )
    return climbs


def test_the_core_imports_nothing_above_it() -> None:
    # The ground floor: the store protocol, the policy it runs under and the observer
    # it reports to are the core's own protocols; nothing of the package above it.
    for module, path in sorted(_module_names().items()):
        if _folder(module) != "core":
            continue
        for line, targets in _import_statements(path, module):
            above = {t for t in targets if t.startswith("asgi_idempotency.")}
            above -= {t for t in above if _folder(t) == "core"}
            assert not above, f"{path.relative_to(PACKAGE)}:{line} imports {sorted(above)}"


def test_few_imports_climb_a_floor() -> None:
    climbs = _upward_imports()
    assert len(climbs) <= MAX_UPWARD, "imports from a lower floor to a higher one:\n" + (
        "\n".join(climbs)
    )


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


def test_the_redis_store_loads_no_sql_driver() -> None:
    """The Redis store declares its own error boundary (redis-py's types): importing it,
    in a fresh interpreter, loads neither SQLAlchemy nor asyncpg."""
    probe = (
        "import sys\n"
        "import asgi_idempotency.stores.redis\n"
        "print(sorted(m for m in ('sqlalchemy', 'asyncpg') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr

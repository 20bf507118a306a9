"""The package's shape (docs/design.md "Layout"): layering, no import circles, file sizes, no path hacks.

Imports are read with `ast` (every import statement, also inside functions), so a lazy import that
breaks the layering is caught as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "megatron_dapo"
LOWER = ("megatron_dapo.data", "megatron_dapo.reward", "megatron_dapo.algo", "megatron_dapo.types",
         "megatron_dapo.config", "megatron_dapo.sandbox")
UPPER = ("megatron_dapo.actor", "megatron_dapo.rollout", "megatron_dapo.loop")
TOP = ("megatron_dapo.collect", "megatron_dapo.schedule")
"""collect/ sits on rollout/ (and imports no actor, loop or schedule); schedule/ on collect/ and actor/, below loop/."""
MAX_PACKAGE_LINES = 400
MAX_TOOL_LINES = 250


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Absolute names of every megatron_dapo module `path` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path).split(".")
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here if is_pkg else here[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in found if n.startswith("megatron_dapo")}


def package_files() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "cpu_shims" not in p.parts)


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_lower_layers_import_no_upper_layer():
    bad = []
    for path in package_files():
        mod = module_name(path)
        upper = UPPER + TOP if _under(mod, LOWER) else ("megatron_dapo.actor", "megatron_dapo.loop") + TOP \
            if _under(mod, ("megatron_dapo.rollout",)) else ("megatron_dapo.actor", "megatron_dapo.loop",
                                                            "megatron_dapo.schedule") \
            if _under(mod, ("megatron_dapo.collect",)) else ("megatron_dapo.loop",) \
            if _under(mod, ("megatron_dapo.schedule",)) else ()
        bad += [f"{mod} imports {name}" for name in imports_of(path) if _under(name, upper)]
    assert not bad, "layering broken:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules():
    """Module-level import graph of the package has no cycle (a -> b -> ... -> a)."""
    modules = {module_name(p): p for p in package_files()}
    graph = {m: {n for n in imports_of(p) if n in modules and n != m} for m, p in modules.items()}
    graph = {m: {n for n in deps if not modules[m].name == "__init__.py" or not n.startswith(m + ".")}
             for m, deps in graph.items()}
    for m in graph:  # a package's __init__ re-exporting its children is not a cycle
        if modules[m].name == "__init__.py":
            graph[m] = set()
    visiting, done, cycles = set(), set(), []

    def visit(m: str, trail: list[str]) -> None:
        if m in done:
            return
        if m in visiting:
            cycles.append(" -> ".join(trail[trail.index(m):] + [m]))
            return
        visiting.add(m)
        for n in sorted(graph[m]):
            visit(n, trail + [m])
        visiting.discard(m)
        done.add(m)

    for m in sorted(graph):
        visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("folder, limit", [("megatron_dapo", MAX_PACKAGE_LINES), ("tools", MAX_TOOL_LINES),
                                           ("tests", MAX_PACKAGE_LINES)])
def test_files_stay_short(folder, limit):
    long = [f"{p.relative_to(REPO)}: {n} lines" for p in sorted((REPO / folder).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > limit]
    assert not long, f"files over {limit} lines:\n" + "\n".join(long)


PATH_HACK = "sys.path." + "insert"  # spelled in two pieces so this file does not match itself


def test_no_sys_path_hacks():
    hits = [f"{p.relative_to(REPO)}:{i}" for folder in ("tests", "tools", "examples")
            for p in sorted((REPO / folder).rglob("*")) if p.suffix in (".py", ".sh")
            for i, line in enumerate(p.read_text().splitlines(), 1) if PATH_HACK in line]
    assert not hits, f"{PATH_HACK} found:\n" + "\n".join(hits)


MAX_README_LINES = 250


def test_the_readme_stays_short():
    """The README is what a newcomer reads first; measurements and design notes live in docs/
    (docs/performance.md, docs/design.md, docs/study_dapo_small/README.md), linked from it."""
    n = len((REPO / "README.md").read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES})"


def test_no_test_module_imports_another():
    """Helpers shared by test modules live in tests/support.py (fixtures in conftest.py): a test module is
    never imported by another file of tests/ (`import test_x` or `from test_x import ...`, anywhere)."""
    test_modules = {p.stem for p in (REPO / "tests").glob("test_*.py")}
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            bad += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[0] in test_modules]
    assert not bad, "test modules imported by others (move helpers to tests/support.py):\n" + "\n".join(bad)

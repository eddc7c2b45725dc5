"""The package's shape, checked: import levels, no cycles, small modules, short functions, a light core.

docs/design.md draws the map these tests enforce. A failure here means a change reached across a
boundary (an upward import, a cycle) or grew a module past what one reader can hold in mind.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "grape_stream"

#: Lower levels never import higher ones; the two level-2 siblings never import each other.
LEVELS: dict[str, int] = {
    "grape_stream.world": 0,
    "grape_stream.atomic": 0,
    "grape_stream.user_dir": 0,
    "grape_stream.simplex": 0,
    "grape_stream.models": 0,
    "grape_stream.config": 0,
    "grape_stream.errors": 0,
    "grape_stream.console": 0,
    "grape_stream.retry": 0,
    "grape_stream.testing": 0,
    "grape_stream.stale_temp": 0,
    "grape_stream.lazy": 0,
    "grape_stream.version": 0,
    "grape_stream.streaming_compat": 1,
    "grape_stream.mixing": 2,
    "grape_stream.convert": 2,
    "grape_stream.grape": 3,
    "grape_stream.mixture": 3,
    "grape_stream.recipe": 4,
    "grape_stream.integrations": 5,
    "grape_stream.apps": 6,
    "grape_stream.cli": 6,
}
SIBLINGS_APART = {("grape_stream.mixing", "grape_stream.convert"), ("grape_stream.convert", "grape_stream.mixing")}
MAX_MODULE_LINES = 420  # the "~400": a module past this is split
MAX_FUNCTION_LINES = 80
#: A function may run longer if its docstring says why, in a sentence starting with this.
LONG_REASON = "Long because"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


#: The package root (``grape_stream/__init__.py``): its public API is lazy (grape_stream.lazy), so at run time
#: it imports only level-0 modules, and nothing inside the package may import it (version.py holds the version).
ROOT = "grape_stream"
ROOT_LEVEL = 0


def _area(module: str) -> str | None:
    """The LEVELS key a module belongs to (its longest matching prefix); the root is its own area."""
    if module == ROOT:
        return ROOT
    best = None
    for key in LEVELS:
        if (module == key or module.startswith(key + ".")) and (best is None or len(key) > len(best)):
            best = key
    return best


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (annotations only: no runtime edge)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def _imports(module: str, path: Path, *, annotations: bool = False) -> set[str]:
    """Every grape_stream module this one imports at run time, at top level or inside functions (lazy
    imports count); with ``annotations``, also those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    skip = set() if annotations else _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import sub` imports the submodule when one exists
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("grape_stream") and name != module:
                found.add(name)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}
#: The same edges plus the imports for annotations only: a cycle through them is still a cycle of design
#: (two modules that each need the other to be read), even though Python never runs it.
GRAPH_ANNOTATED = {m: _imports(m, p, annotations=True) for m, p in MODULES.items()}


def _level(area: str) -> int:
    return ROOT_LEVEL if area == ROOT else LEVELS[area]


def test_every_module_has_a_level() -> None:
    missing = [m for m in MODULES if _area(m) is None]
    assert not missing, f"add these to LEVELS (and to docs/design.md's map): {missing}"


def test_nothing_imports_the_package_root() -> None:
    """The root only re-exports (lazily): a module importing it would reach higher levels through it."""
    bad = sorted(m for m, deps in GRAPH_ANNOTATED.items() if ROOT in deps)
    assert not bad, f"import what you need from its module (grape_stream.version for __version__), not the root: {bad}"


def test_no_upward_or_sideways_imports() -> None:
    bad = []
    for mod, deps in GRAPH.items():
        src = _area(mod)
        if src is None:
            continue
        for dep in deps:
            dst = _area(dep)
            if dst is None:
                continue
            if _level(dst) > _level(src) or (src, dst) in SIBLINGS_APART:
                bad.append(f"{mod} -> {dep}")
    assert not bad, "imports that go up (or across level-2 siblings):\n" + "\n".join(sorted(bad))


def test_no_import_cycles() -> None:
    # A package's __init__ re-exporting its own submodules is not a cycle of design; everything else is,
    # imports for annotations only (under TYPE_CHECKING) included.
    def edges(m: str) -> set[str]:
        return {d for d in GRAPH_ANNOTATED[m] if not (m.startswith(d + ".") and MODULES[d].name == "__init__.py")}

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(MODULES):
        if m not in index:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"


def test_modules_are_small() -> None:
    big = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_long_functions_say_why() -> None:
    long_ = []
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                body = node.body[1:] if doc and len(node.body) > 1 else node.body  # the docstring is not code
                n = (node.end_lineno or node.lineno) - body[0].lineno + 1
                if n > MAX_FUNCTION_LINES and LONG_REASON not in doc:
                    long_.append(f"{mod}.{node.name} ({n} lines)")
    assert not long_, f"functions over {MAX_FUNCTION_LINES} lines without '{LONG_REASON} ...' in the docstring: {long_}"


@pytest.mark.parametrize(
    "modules, forbidden",
    [
        # the core runs without Composer / llm-foundry (its last release pins an old torch)
        (["grape_stream", "grape_stream.mixing", "grape_stream.grape.controller", "grape_stream.recipe",
          "grape_stream.convert.pipeline"], ["composer", "llmfoundry"]),
        # `grape-stream convert` must start without torch
        (["grape_stream.cli", "grape_stream.convert.cli", "grape_stream.convert.pipeline"], ["torch"]),
    ],
)
def test_light_imports(modules: list[str], forbidden: list[str]) -> None:
    code = "import importlib, sys\n"
    code += "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += f"print(sorted(m for m in {forbidden!r} if m in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", f"importing {modules} pulled in {out.stdout.strip()}"

"""The package's shape: layers that only import downwards (the import-linter contract in
pyproject.toml, read here too), no import cycle counting imports inside functions, imports at
the top of modules, and the size limits that keep modules readable."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dflash_train"
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 250
MAX_PARAMETERS = 9
MAX_README_LINES = 300


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def imported_modules(name: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package's modules that one import statement of module `name` loads."""
    if isinstance(node, ast.Import):
        candidates = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = name.split(".")[: -node.level] if not MODULES[name].name == "__init__.py" else name.split(".")
            base = ".".join(package + ([node.module] if node.module else []))
        candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
    found = []
    for candidate in candidates:
        while candidate and candidate not in MODULES:
            candidate = candidate.rpartition(".")[0]
        if candidate and candidate != name and candidate != "dflash_train":
            found.append(candidate)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, at the top or inside functions."""
    graph = {name: set() for name in MODULES}
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(imported_modules(name, node))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def layers() -> list[str]:
    """The import-linter contract's layers, top to bottom."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return contract["layers"]


def layer_of(module: str, ordered: list[str]) -> int | None:
    for depth, layer in enumerate(ordered):
        if module == layer or module.startswith(layer + "."):
            return depth
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_counting_imports_inside_functions():
    assert cycles(import_graph()) == []


def test_every_module_is_in_a_layer_and_imports_only_its_own_or_lower_layers():
    ordered = layers()
    top_level = {"dflash_train", "dflash_train.__main__"}
    outside = [m for m in MODULES if m not in top_level and layer_of(m, ordered) is None]
    assert outside == [], "modules in no layer of the contract"
    upward = [(m, imported) for m, imports in import_graph().items() if m not in top_level
              for imported in imports if layer_of(imported, ordered) < layer_of(m, ordered)]
    assert upward == []


def function_imports() -> list[tuple[str, int, str]]:
    """(file, line, its lines, the node) of every import inside a function or class body."""
    found = []
    for name, tree in TREES.items():
        top = {id(node) for node in tree.body}
        lines = MODULES[name].read_text().splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                found.append((str(MODULES[name].relative_to(ROOT)), node.lineno, lines, node))
    return found


def test_imports_inside_functions_are_only_the_optional_ones_and_say_why():
    """Imports go at the top of modules; one inside a function is an optional or heavy
    dependency that only that path needs, with a comment saying so (on the line or above it)."""
    unexplained = []
    for path, line, lines, node in function_imports():
        here, above = lines[line - 1], lines[line - 2].strip() if line >= 2 else ""
        if "#" not in here and not above.startswith("#"):
            unexplained.append(f"{path}:{line}: {here.strip()}")
    assert unexplained == []


def test_the_drafter_file_imports_nothing_of_the_package():
    """Exports carry core/drafter.py and core/modeling_dflash.py to consumers that do not have
    this package."""
    for name in ("dflash_train.core.drafter", "dflash_train.core.modeling_dflash"):
        tree = TREES[name]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not (node.module or "").startswith("dflash_train"), name
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("dflash_train") for a in node.names), name


def definitions():
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield f"{MODULES[name].relative_to(ROOT)}:{node.lineno} {node.name}", node


def parameter_count(node: ast.FunctionDef) -> int:
    args = node.args
    named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    return len([a for a in named if a.arg not in ("self", "cls")])


@pytest.mark.parametrize("kind, limit", [("function", MAX_FUNCTION_LINES), ("class", MAX_CLASS_LINES)])
def test_no_function_or_class_is_longer_than_its_limit(kind, limit):
    wanted = ast.ClassDef if kind == "class" else (ast.FunctionDef, ast.AsyncFunctionDef)
    long = [f"{where}: {node.end_lineno - node.lineno + 1} lines" for where, node in definitions()
            if isinstance(node, wanted) and node.end_lineno - node.lineno + 1 > limit]
    assert long == []


def test_no_function_takes_a_long_argument_list():
    """Ten or more parameters is a config section or a small dataclass waiting to be passed."""
    many = [f"{where}: {parameter_count(node)}" for where, node in definitions()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and parameter_count(node) > MAX_PARAMETERS]
    assert many == []


def test_every_module_says_what_it_owns():
    silent = [name for name, tree in TREES.items() if not ast.get_docstring(tree)]
    assert silent == []


def test_the_readme_is_a_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= MAX_README_LINES

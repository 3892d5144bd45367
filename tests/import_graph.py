"""The import graph of megarl's own packages, read from source (nothing is imported).

Every ``import`` / ``from ... import`` counts, including those inside functions: a cycle hidden in
a function body is still a cycle in the design. Used by tests/unit/test_import_structure.py.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("megarl", "checkpoints_tools")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported name, fully qualified (a module or a name inside one)
    line: int


def modules(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under ``packages``."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports(module: str, path: Path) -> Iterator[Import]:
    """Every name ``module`` imports, wherever in the file the import stands."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, is_package)
            for alias in node.names:
                yield Import(module, f"{base}.{alias.name}", node.lineno)


def _owner(target: str, known: dict[str, Path]) -> str | None:
    """The module of ``known`` that ``target`` names or lies in (None: outside the project)."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def module_graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a package importing its own parts and a module
    importing its enclosing package's ``__init__`` are not edges: Python runs those anyway)."""
    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        for imp in imports(module, path):
            target = _owner(imp.target, known)
            if target is None or target == module:
                continue
            if target.startswith(module + ".") or module.startswith(target + "."):
                continue
            graph[module].add(target)
    return graph


def package_graph(graph: dict[str, set[str]], depth: int = 2) -> dict[str, set[str]]:
    """The module graph folded by the first ``depth`` name parts (``megarl.trainer``, ...)."""

    def fold(name: str) -> str:
        return ".".join(name.split(".")[:depth])

    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(fold(a), set()).update(fold(b) for b in targets if fold(b) != fold(a))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (each one holds a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@dataclass(frozen=True)
class LocalImport:
    module: str  # the importing module
    target: str  # the imported module (an own module: the project module it names)
    own: bool  # a module of the project
    line: int


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _split_imports(module: str, path: Path, known: dict[str, Path]):
    """(imports at module level, imports inside functions) of one module; ``if TYPE_CHECKING``
    blocks are neither (they never run)."""
    is_package = path.name == "__init__.py"
    top: list[LocalImport] = []
    local: list[LocalImport] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import | ast.ImportFrom):
                if isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                else:
                    base = _absolute(child, module, is_package)
                    names = [f"{base}.{a.name}" for a in child.names]
                    if not child.level and base.split(".")[0] not in PACKAGES:
                        names = [base]
                for name in names:
                    owner = _owner(name, known)
                    found = LocalImport(module, owner or name, owner is not None, child.lineno)
                    (local if in_function else top).append(found)
            visit(child, inside)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return top, local


def local_imports(known: dict[str, Path]) -> list[LocalImport]:
    """Every import inside a function body (``from m import a, b``: one per name of an own
    module, one for a library)."""
    return [imp for m, p in known.items() for imp in _split_imports(m, p, known)[1]]


def _libraries(target: str) -> set[str]:
    """The top-level packages importing ``target`` loads (``safetensors.torch`` loads torch)."""
    top = target.split(".")[0]
    return {top, "torch"} if target.startswith("safetensors.torch") else {top}


def import_time_libraries(known: dict[str, Path]) -> dict[str, frozenset[str]]:
    """Module -> the third-party top-level packages importing it loads (its module-level imports,
    those of the own modules they import and of its enclosing packages, transitively)."""
    direct: dict[str, tuple[set[str], set[str]]] = {}
    for m, p in known.items():
        top = _split_imports(m, p, known)[0]
        own = {i.target for i in top if i.own and i.target != m}
        parts = m.split(".")
        own |= {".".join(parts[:i]) for i in range(1, len(parts))} & set(known)
        libraries = set().union(*(_libraries(i.target) for i in top if not i.own))
        direct[m] = (own, libraries)
    found = {m: set(libraries) for m, (_, libraries) in direct.items()}
    changed = True
    while changed:  # to a fixed point: a package and its parts import each other
        changed = False
        for m, (own, _) in direct.items():
            grown = found[m].union(*(found[t] for t in own))
            if grown != found[m]:
                found[m], changed = grown, True
    return {m: frozenset(libraries) for m, libraries in found.items()}

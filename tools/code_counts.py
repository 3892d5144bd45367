"""Counts a reader of megarl's source trips on: uses of ``typing.Any``, imports inside functions
and functions that take the whole run config.

Run from the repository root::

    python tools/code_counts.py            # megarl/
    python tools/code_counts.py megarl checkpoints_tools

Everything is read from source with ``ast`` (nothing is imported). An ``Any`` use is a name
``Any`` (or an attribute ``typing.Any``) anywhere in an expression, including string annotations;
the ``from typing import Any`` lines themselves are not uses. An import inside a function is an
``import`` statement anywhere in a function body (``from m import a, b`` is one import of ``m``,
``import a, b`` two), split into megarl's own modules (``megarl``, ``checkpoints_tools``, relative imports), the
standard library and third-party packages. A function takes the run config when one of its
parameters is annotated with ``RunConfig`` (plain, quoted, or inside a union or ``Optional``):
only the assembly and the entry points should, the components taking their own sections.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OWN_PACKAGES = ("megarl", "checkpoints_tools")


@dataclass
class Counts:
    lines: int = 0
    any_uses: int = 0
    # imports inside functions (one per imported module)
    local_own: int = 0
    local_stdlib: int = 0
    local_third_party: int = 0
    # third-party top-level package -> imports of it inside functions
    third_party: dict[str, int] = field(default_factory=dict)
    run_config_functions: int = 0  # functions with a parameter annotated RunConfig

    @property
    def local_imports(self) -> int:
        return self.local_own + self.local_stdlib + self.local_third_party

    def add(self, other: Counts) -> None:
        self.lines += other.lines
        self.any_uses += other.any_uses
        self.local_own += other.local_own
        self.local_stdlib += other.local_stdlib
        self.local_third_party += other.local_third_party
        self.run_config_functions += other.run_config_functions
        for name, n in other.third_party.items():
            self.third_party[name] = self.third_party.get(name, 0) + n


def _is_any(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "Any"
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "Any"
        and isinstance(node.value, ast.Name)
        and node.value.id in ("typing", "t")
    )


def _string_annotation_any(text: str) -> int:
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return 0
    return sum(1 for node in ast.walk(tree) if _is_any(node))


def _annotations(tree: ast.AST) -> Iterator[ast.expr]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None and arg.annotation is not None:
                    yield arg.annotation
            if node.returns is not None:
                yield node.returns
        elif isinstance(node, ast.AnnAssign):
            yield node.annotation


def count_any(tree: ast.AST) -> int:
    """Uses of ``Any`` in ``tree``: names and ``typing.Any`` attributes, plus those inside
    string (quoted) annotations."""
    uses = sum(1 for node in ast.walk(tree) if _is_any(node))
    for annotation in _annotations(tree):
        for node in ast.walk(annotation):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                uses += _string_annotation_any(node.value)
    return uses


def _names_run_config(annotation: ast.expr) -> bool:
    for node in ast.walk(annotation):
        if (isinstance(node, ast.Name) and node.id == "RunConfig") or (
            isinstance(node, ast.Attribute) and node.attr == "RunConfig"
        ):
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                quoted = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                continue
            if _names_run_config(quoted):
                return True
    return False


def count_run_config_functions(tree: ast.AST) -> int:
    """Functions (and methods) of ``tree`` with a parameter annotated ``RunConfig``."""
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
            if any(
                p is not None and p.annotation is not None and _names_run_config(p.annotation)
                for p in params
            ):
                count += 1
    return count


def _local_imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(relative level, imported module) for each import statement inside a function body."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, in_function = stack.pop()
        if in_function and isinstance(node, ast.Import):
            for alias in node.names:  # `import a, b` is two imports
                yield 0, alias.name
        elif in_function and isinstance(node, ast.ImportFrom):
            yield node.level, node.module or ""
        inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        stack.extend((child, inside) for child in ast.iter_child_nodes(node))


def count_source(source: str, own: Iterable[str] = OWN_PACKAGES) -> Counts:
    """The counts of one module's source text."""
    own = tuple(own)
    tree = ast.parse(source)
    counts = Counts(
        lines=len(source.splitlines()),
        any_uses=count_any(tree),
        run_config_functions=count_run_config_functions(tree),
    )
    for level, module in _local_imports(tree):
        top = module.split(".")[0]
        if level > 0 or top in own:
            counts.local_own += 1
        elif top in sys.stdlib_module_names or top == "__future__":
            counts.local_stdlib += 1
        else:
            counts.local_third_party += 1
            counts.third_party[top] = counts.third_party.get(top, 0) + 1
    return counts


def count_tree(root: Path) -> Counts:
    """The counts of every ``.py`` file under ``root``."""
    total = Counts()
    for path in sorted(root.rglob("*.py")):
        total.add(count_source(path.read_text(encoding="utf-8")))
    return total


def report(name: str, counts: Counts) -> str:
    per_kloc = 1000 / max(counts.lines, 1)
    third = ", ".join(
        f"{k} {v}" for k, v in sorted(counts.third_party.items(), key=lambda kv: -kv[1])
    )
    return "\n".join(
        [
            f"{name}: {counts.lines} lines",
            f"  Any uses: {counts.any_uses} ({counts.any_uses * per_kloc:.1f} per 1,000 lines)",
            f"  imports inside functions: {counts.local_imports}"
            f" ({counts.local_imports * per_kloc:.1f} per 1,000 lines)",
            f"    megarl's own modules: {counts.local_own}",
            f"    standard library: {counts.local_stdlib}",
            f"    third-party: {counts.local_third_party}" + (f" ({third})" if third else ""),
            f"  functions taking RunConfig: {counts.run_config_functions}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["megarl"], help="folders to count")
    args = parser.parse_args(argv)
    for name in args.paths:
        root = Path(name)
        if not root.is_absolute() and not root.exists():
            root = REPO / name
        if not root.is_dir():
            parser.error(f"{name}: no such folder")
        print(report(name, count_tree(root)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

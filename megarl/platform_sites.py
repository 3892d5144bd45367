"""Find CUDA-only call sites in megatron-core's source (used by the platform pin test and by
``python -m megarl.platform_sites`` to list them after an upgrade)."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

_CUDA_TYPE_NAMES = ("torch.cuda.FloatTensor", "torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor")
# torch.cuda APIs that answer correctly on a CPU-only torch: not CUDA-only.
_SAFE_ON_CPU = ("torch.cuda.is_available",)


def dotted_name(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


class _SiteFinder(ast.NodeVisitor):
    def __init__(self) -> None:
        self.stack: list[str] = []
        self.sites: set[tuple[str, str]] = set()

    def _scoped(self, node) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def _add(self, kind: str) -> None:
        self.sites.add((".".join(self.stack) or "<module>", kind))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = dotted_name(node)
        if (
            dotted.startswith("torch.cuda.")
            and dotted.count(".") == 2
            and dotted not in _SAFE_ON_CPU
        ):
            self._add(dotted)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and node.func.attr == "cuda" and not node.args:
            self._add(".cuda()")
        for kw in node.keywords:
            if (
                kw.arg == "device"
                and isinstance(kw.value, ast.Constant)
                and kw.value.value == "cuda"
            ):
                self._add('device="cuda"')
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if node.value in _CUDA_TYPE_NAMES:
            self._add("type()==cuda")


def module_sites(module_name: str) -> set[tuple[str, str]]:
    """{(function qualname, kind)} of CUDA-only uses in one module's source."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(module_name)
    tree = ast.parse(Path(spec.origin).read_text())
    finder = _SiteFinder()
    finder.visit(tree)
    return finder.sites


def loaded_megatron_modules() -> list[str]:
    return sorted(
        n for n in sys.modules if n.startswith("megatron.core") and sys.modules[n] is not None
    )


if __name__ == "__main__":
    for name in sys.argv[1:]:
        for site in sorted(module_sites(name)):
            print(name, *site)

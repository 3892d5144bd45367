"""tools/code_counts.py counts what it says on a fixture whose counts are known by reading it,
and prints megarl's figures (the ones the type-checking note quotes)."""

from __future__ import annotations

import re
import textwrap

import pytest

from tools.code_counts import count_source, count_tree, main

pytestmark = pytest.mark.unit

FIXTURE = textwrap.dedent(
    """
    from __future__ import annotations

    import typing
    from typing import Any

    import torch  # top level: not counted

    X: dict[str, Any] = {}  # 1


    def f(a: Any, b: "list[Any]", cfg: RunConfig) -> typing.Any:  # 2, 3 (quoted), 4; RunConfig 1
        import json  # stdlib
        import numpy, os  # third-party + stdlib
        from megarl.config import Config  # own
        from . import sibling  # own (relative)
        from .x import a, b, c  # own: one import

        def inner() -> None:
            from transformers import AutoModel  # third-party, nested function

        return Any  # 5


    class C:
        field: Any  # 6

        def method(self, cfg: "config.RunConfig | None" = None) -> None:  # RunConfig 2
            import megarl.algos  # own, inside a method
            "Any"  # a string that is not an annotation: not a use
    """
)


def test_counts_of_the_fixture():
    counts = count_source(FIXTURE)
    assert counts.any_uses == 6
    assert (counts.local_own, counts.local_stdlib, counts.local_third_party) == (4, 2, 2)
    assert counts.local_imports == 8
    assert counts.third_party == {"numpy": 1, "transformers": 1}
    assert counts.lines == len(FIXTURE.splitlines())
    assert counts.run_config_functions == 2  # f (plain) and method (quoted, in a union)


def test_a_module_without_either_counts_zero():
    counts = count_source(
        "from typing import Any\nimport torch\n\nAnyway = 1\n"
        "def g(run: MyRunConfigs, cfg: RolloutConfig) -> RunConfig: ...\n"
    )
    assert counts.any_uses == 0
    assert counts.local_imports == 0
    assert counts.run_config_functions == 0  # other names, and a return annotation


def test_tree_sums_its_files(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(FIXTURE)
    (tmp_path / "b.py").write_text("def g(x: Any) -> None:\n    import torch\n")
    total = count_tree(tmp_path)
    assert total.any_uses == 7
    assert total.local_third_party == 3
    assert total.third_party == {"numpy": 1, "transformers": 1, "torch": 1}


def test_prints_megarl_figures(capsys):
    assert main(["megarl", "checkpoints_tools"]) == 0
    out = capsys.readouterr().out
    print(out)  # the figures, in the test log
    assert out.startswith("megarl: ")
    assert "checkpoints_tools: " in out
    uses = re.findall(r"^  Any uses: (\d+) ", out, re.M)
    local = re.findall(r"^  imports inside functions: (\d+) ", out, re.M)
    assert len(uses) == len(local) == 2  # one of each per folder
    assert int(local[0]) > 0  # megarl imports its heavy packages inside functions
    taking = re.findall(r"^  functions taking RunConfig: (\d+)$", out, re.M)
    assert len(taking) == 2 and int(taking[0]) > 0

"""tools/bench_provenance.py: the provenance table of docs/benchmarks.md is the stored results'
own (commit, clean or dirty tree, machine, load, citing pages), and every results file the
README's tables cite was measured on a clean tree at a recorded commit (or, for a GPU check,
states in words which tree ran)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench_provenance import (
    PAGE,
    RESULTS,
    all_rows,
    doc_pages,
    linked_results,
    page_table,
    read,
    table,
)

pytestmark = pytest.mark.unit


def _write(path: Path, record: dict) -> Path:
    path.write_text(json.dumps(record))
    return path


def test_a_record_reads_as_its_commit_tree_machine_and_load(tmp_path):
    bench = {
        "written_utc": "2026-12-07T02:30:00Z",
        "machine": {"cpu_model": "AMD EPYC", "cores": 2},
        "load_1min": {"start": 0.81, "end": 1.83},
    }
    clean = read(
        _write(
            tmp_path / "a.json", {**bench, "git": {"commit": "17beb22" + "0" * 33, "dirty": False}}
        )
    )
    dirty = read(
        _write(
            tmp_path / "b.json", {**bench, "git": {"commit": "2c895c4" + "0" * 33, "dirty": True}}
        )
    )
    gpu = read(
        _write(
            tmp_path / "c.json",
            {
                "date": "2026-12-04",
                "machine": {"gpu": "NVIDIA H200 (143771 MiB)"},
                "code": "tree X",
            },
        )
    )
    assert clean.clean and not dirty.clean and not gpu.clean
    assert (clean.machine, clean.written, clean.load) == (
        "AMD EPYC, 2 cores",
        "2026-12-07",
        (0.81, 1.83),
    )
    assert (gpu.machine, gpu.written, gpu.load, gpu.commit) == (
        "NVIDIA H200",
        "2026-12-04",
        None,
        None,
    )
    page = tmp_path / "page.md"
    page.write_text("a.json is quoted here; so is c.json\n")
    rows = table([clean, dirty, gpu], [page]).splitlines()
    assert rows[2].startswith(
        "| `a.json` | 17beb22 clean | AMD EPYC, 2 cores | 2026-12-07 | 0.8 -> 1.8 |"
    )
    assert "| 2c895c4 dirty |" in rows[3] and rows[3].endswith("| - |")  # cited nowhere
    assert "| no commit recorded: tree X | NVIDIA H200 |" in rows[4]


def test_the_benchmarks_page_shows_the_stored_results_provenance():
    assert page_table(PAGE.read_text(encoding="utf-8")) == table(all_rows(), doc_pages()), (
        "docs/benchmarks.md's provenance table is out of date: run "
        "`python tools/bench_provenance.py --write`"
    )


def test_every_results_file_a_page_links_to_was_measured_on_a_clean_tree(tmp_path):
    cited = linked_results(doc_pages())
    # the parser finds the README's and the docs' links
    assert {"startup.json", "learn_arithmetic.json", "learn_calculator_40steps.json"} <= cited
    page = tmp_path / "page.md"
    page.write_text("[a](../bench/results/a.json), `bench/results/b.json` is a record\n")
    assert linked_results([page]) == {"a.json"}
    rows = {r.name: r for r in all_rows()}
    for name in sorted(cited):
        assert (RESULTS / name).is_file(), f"a page links to bench/results/{name}, not there"
        r = rows[name]
        assert r.clean or (r.commit is None and r.code), (
            f"a page links to bench/results/{name}, measured at {r.commit} on a "
            f"{'dirty' if r.dirty else 'unrecorded'} tree: measure it again from a clean checkout"
        )

"""Where every stored benchmark figure comes from: ``python tools/bench_provenance.py [--write]``.

Reads each ``bench/results/*.json`` and prints one row per file: the commit it was measured at
and whether that tree was clean, the machine, when it was written, the 1-minute load at its
start and end, and the pages of the docs that cite it (README.md and docs/*.md, by file name).
``--write`` puts the table into docs/benchmarks.md between its provenance markers; the unit test
``tests/unit/test_bench_provenance.py`` fails when the page's table differs from the files, and
when a file the README's tables cite was measured on a dirty tree or at no recorded commit.

A GPU check's file (``scripts/gpu_check.sh``) records no git state of its own: it ran from a
wheel set carried to the GPU machine, and its ``code`` field says in words which tree that was;
the table shows that text instead of a commit.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- provenance:start -->", "<!-- provenance:end -->"


@dataclass(frozen=True)
class Provenance:
    """What one results file says about how it was measured."""

    name: str
    commit: str | None  # the full hash; None where the file records none
    dirty: bool | None  # None where the file records no git state
    code: str | None  # a GPU check's own words about the tree that ran
    machine: str
    written: str
    load: tuple[float, float] | None

    @property
    def clean(self) -> bool:
        return self.commit is not None and self.dirty is False


def _machine(record: dict) -> str:
    m = record.get("machine")
    if isinstance(m, dict):
        if "gpu" in m:
            return str(m["gpu"]).split(" (")[0]
        cores = f", {m['cores']} cores" if "cores" in m else ""
        return f"{m.get('cpu_model', '?')}{cores}"
    return "not recorded"


def read(path: Path) -> Provenance:
    record = json.loads(path.read_text())
    git = record.get("git") or {}
    load = record.get("load_1min")
    stamp = record.get("written_utc") or record.get("date")
    return Provenance(
        name=path.name,
        commit=git.get("commit") or None,
        dirty=git.get("dirty"),
        code=record.get("code"),
        machine=_machine(record),
        written=str(stamp)[:10] if stamp else "not recorded",
        load=(float(load["start"]), float(load["end"])) if isinstance(load, dict) else None,
    )


def without_table(page: str) -> str:
    """``page`` without its provenance section (the table names every file)."""
    if START in page and END in page:
        return page.split(START, 1)[0] + page.split(END, 1)[1]
    return page


def citations(name: str, pages: list[Path]) -> list[str]:
    """The pages (relative to the repository) whose text names ``name``."""
    return [
        str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name
        for p in pages
        if name in without_table(p.read_text(encoding="utf-8"))
    ]


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def table(rows: list[Provenance], pages: list[Path]) -> str:
    lines = [
        "| File | Tree | Machine | Written | Load (1 min) | Cited by |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.commit is not None:
            tree = f"{r.commit[:7]} {'clean' if r.dirty is False else 'dirty'}"
        else:
            tree = f"no commit recorded: {r.code}" if r.code else "no commit recorded"
        load = f"{r.load[0]:.1f} -> {r.load[1]:.1f}" if r.load else "-"
        cited = ", ".join(citations(r.name, pages)) or "-"
        lines.append(f"| `{r.name}` | {tree} | {r.machine} | {r.written} | {load} | {cited} |")
    return "\n".join(lines)


def all_rows() -> list[Provenance]:
    return [read(p) for p in sorted(RESULTS.glob("*.json"))]


def linked_results(pages: list[Path]) -> set[str]:
    """The results files the pages link to (``[...](.../bench/results/NAME.json)``): the sources
    of the figures they quote. A file only named in backticks is a record, not a quoted figure."""
    names: set[str] = set()
    for page in pages:
        text = without_table(page.read_text(encoding="utf-8"))
        names |= set(re.findall(r"\]\([^)\s]*bench/results/([\w.-]+\.json)\)", text))
    return names


def page_table(page: str) -> str:
    """The table between the markers of ``page``'s text."""
    if START not in page or END not in page:
        raise ValueError(f"{PAGE.relative_to(ROOT)} has no {START} ... {END} section")
    return page.split(START, 1)[1].split(END, 1)[0].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"update {PAGE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    text = table(all_rows(), doc_pages())
    if args.write:
        page = PAGE.read_text(encoding="utf-8")
        page_table(page)  # the markers are there
        before, rest = page.split(START, 1)
        after = rest.split(END, 1)[1]
        PAGE.write_text(f"{before}{START}\n{text}\n{END}{after}", encoding="utf-8")
        print(f"wrote the table into {PAGE.relative_to(ROOT)}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

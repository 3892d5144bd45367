"""The GPU check's table: one row per figure, each ``ok``, ``FAIL`` or ``info``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Row:
    section: str
    check: str
    value: str
    bound: str = ""
    status: str = "info"  # ok | FAIL | info


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)

    def add(self, section: str, check: str, value: str, bound: str = "", ok: bool | None = None):
        status = "info" if ok is None else ("ok" if ok else "FAIL")
        self.rows.append(Row(section, check, value, bound, status))

    @property
    def ok(self) -> bool:
        return all(r.status != "FAIL" for r in self.rows)

    def table(self) -> str:
        head = Row("section", "check", "value", "bound / target", "status")
        rows = [head, *self.rows]
        widths = [max(len(getattr(r, f)) for r in rows) for f in Row.__dataclass_fields__]
        lines = []
        for i, r in enumerate(rows):
            cells = [
                getattr(r, f).ljust(w)
                for f, w in zip(Row.__dataclass_fields__, widths, strict=True)
            ]
            lines.append(" | ".join(cells).rstrip())
            if i == 0:
                lines.append("-+-".join("-" * w for w in widths))
        return "\n".join(lines)

"""One row of the validation table, and how the table prints."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Row:
    check: str  # what was compared, e.g. "greedy tokens, 8 prompts x 64"
    reference: str  # "transformers" or "vLLM"
    measured: str  # the figure, e.g. "max |dlogit| 3.1e-05"
    criterion: str  # what passing means, e.g. "< 1e-4"
    passed: bool
    # What the row was measured on, for readers of the JSON (e.g. {"isa": "vec", "cpu_kind": "avx2"});
    # the table shows what matters of it in the other columns.
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def format_table(rows: list[Row]) -> str:
    headers = ["check", "reference", "measured", "criterion", "result"]
    cells = [[r.check, r.reference, r.measured, r.criterion, "pass" if r.passed else "FAIL"] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(c) for c in cells]
    return "\n".join(out)

"""Bold follows the printed interval, in every committed document (issue 56, item 6): a table cell
'm [lo, hi]' is bold exactly where its printed ends exclude zero (lo > 0 or hi < 0), so that an
end printed as 0.0 is never bold and an interval that excludes zero is never left plain. Reads
the documents' text only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted(p for p in (ROOT / "docs").rglob("*.md") if "-runs" not in str(p))
NUM = r"[+\u2212-]?\d+(?:\.\d+)?"
CELL = re.compile(rf"(\*\*)?({NUM}) \[({NUM}), ({NUM})\](\*\*)?")


def _value(text: str) -> float:
    return float(text.replace("\u2212", "-"))


def violations(text: str) -> list[str]:
    """Table cells whose bold disagrees with their printed interval."""
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            continue
        for cell in line.strip("|").split("|"):
            for m in CELL.finditer(cell):
                bold = bool(m.group(1) and m.group(5))
                low, high = _value(m.group(3)), _value(m.group(4))
                if bold != (low > 0 or high < 0):
                    out.append(f"line {lineno}: {m.group(0)}")
    return out


def test_the_check_sees_both_mistakes():
    table = "| a | b |\n|---|---|\n| x | **+1.2 [0.0, +2.4]** |\n| y | +1.2 [+0.1, +2.4] |\n"
    assert violations(table) == ["line 3: **+1.2 [0.0, +2.4]**", "line 4: +1.2 [+0.1, +2.4]"]
    ok = "| x | **+1.2 [+0.1, +2.4]** | −0.4 [−0.8, 0.0] | **−3.1 [−6.5, −0.1]** |\n"
    assert violations(ok) == []


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT / "docs")))
def test_bold_follows_the_printed_interval(path):
    bad = violations(path.read_text())
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad[:5])

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


BEGIN, END = "<!-- BEGIN hand-written", "<!-- END hand-written"
INTERVAL = re.compile(rf"{NUM} \[{NUM}, {NUM}\]")


def _split(text: str) -> tuple[str, str]:
    """(the generated part, the hand-written reading) of a document."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        return text, ""
    return text[:i] + text[j:], text[i:j]


GENERATED = "\n".join(_split(p.read_text())[0] for p in DOCUMENTS)


def test_the_quote_check_sees_a_stale_number():
    doc = f"| x | +1.2 [+0.1, +2.4] |\n{BEGIN} -->\nA is +1.2 [+0.1, +2.5] better.\n{END} -->\n"
    generated, reading = _split(doc)
    assert [q for q in INTERVAL.findall(reading) if q not in generated] == ["+1.2 [+0.1, +2.5]"]


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT / "docs")))
def test_a_reading_quotes_only_intervals_a_document_prints(path):
    """Every 'm [lo, hi]' a hand-written reading quotes is printed in the generated part of a
    committed document: a reading cannot keep a number its tables no longer show (the documents
    were regenerated with a new interval, issue 56)."""
    stale = [q for q in INTERVAL.findall(_split(path.read_text())[1]) if q not in GENERATED]
    assert not stale, f"{path.relative_to(ROOT)}: {len(stale)} stale: " + "; ".join(stale[:6])

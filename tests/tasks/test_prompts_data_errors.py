"""Data errors a user can act on (issue 36, item 4): a bad row is named by its 1-based file line
(whatever rows were held out for the test split), a UTF-8 BOM is accepted, an empty or
non-string prompt is refused, and `task.skip_bad_rows: true` skips and counts malformed rows
(in the log, the first metrics row and the report) instead of stopping."""

from __future__ import annotations

import json
import logging

import pytest

from ftis.report import skipped_rows_warnings, zero_reward_warnings
from ftis.tasks import PromptsTask, build_task
from ftis.tasks.base import TaskDataError

GOOD = [{"prompt": f"{i}+1?", "answer": str(i + 1)} for i in range(12)]


def lines_of(rows) -> list[str]:
    return [r if isinstance(r, str) else json.dumps(r) for r in rows]


def write(path, lines: list[str], *, bom: bool = False) -> str:
    path.write_text(("\ufeff" if bom else "") + "".join(line + "\n" for line in lines))
    return str(path)


def test_a_bad_row_is_named_by_its_file_line(tmp_path):
    lines = lines_of(GOOD)
    lines.insert(3, "")  # a blank line still counts as a line of the file
    lines[10] = json.dumps({"text": "no prompt here"})  # file line 11
    f = write(tmp_path / "rows.jsonl", lines)
    for fraction in (0.1, 0.5):  # wherever the held-out rows fall
        with pytest.raises(TaskDataError) as err:
            PromptsTask({"train_file": f, "test_fraction": fraction})
        msg = str(err.value)
        assert f"{f}:11: the row has neither 'prompt' nor 'messages'" in msg
        assert "task.skip_bad_rows: true" in msg


def test_a_line_that_is_not_json_is_named_by_its_line(tmp_path):
    lines = lines_of(GOOD)
    lines[6] = '{"prompt": "7+1?", "answer": '  # line 7
    f = write(tmp_path / "rows.jsonl", lines)
    with pytest.raises(TaskDataError, match=f"{f}:7 is not valid JSON.*skip_bad_rows"):
        PromptsTask({"train_file": f})


def test_a_test_file_row_is_named_by_its_line(tmp_path):
    f = write(tmp_path / "rows.jsonl", lines_of(GOOD))
    t = write(tmp_path / "test.jsonl", lines_of([GOOD[0], {"prompt": 5}]))
    with pytest.raises(TaskDataError, match=f"test_file: {t}:2: 'prompt' is a int \\(5\\)"):
        PromptsTask({"train_file": f, "test_file": t})


@pytest.mark.parametrize("suffix", ["jsonl", "json", "csv"])
def test_a_utf8_bom_is_accepted(tmp_path, suffix):
    path = tmp_path / f"rows.{suffix}"
    if suffix == "jsonl":
        write(path, lines_of(GOOD), bom=True)
    elif suffix == "json":
        path.write_text("\ufeff" + json.dumps(GOOD))
    else:
        write(path, ["prompt,answer", *(f"{r['prompt']},{r['answer']}" for r in GOOD)], bom=True)
    task = PromptsTask({"train_file": str(path), "test_fraction": 0.25})
    questions = {p.question for s in ("train", "test") for p in task.split(s)}
    assert questions == {r["prompt"] for r in GOOD}


def test_csv_rows_are_named_by_the_line_they_start_on(tmp_path):
    f = write(
        tmp_path / "rows.csv",
        ["prompt,answer", '"two\nlines",1', "ok,2", ",3", "fine,4"],  # the empty one: line 5
    )
    with pytest.raises(TaskDataError, match=f"{f}:5: 'prompt' is empty"):
        PromptsTask({"train_file": f, "test_file": f})


@pytest.mark.parametrize(
    "row, why",
    [
        ({"prompt": 123}, "'prompt' is a int (123), not a string"),
        ({"prompt": "   "}, "'prompt' is empty"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, "'messages' must be a non-empty list"),
        ([1, 2], "the row is not an object"),
    ],
)
def test_a_prompt_that_is_empty_or_not_a_string_is_refused(tmp_path, row, why):
    f = write(tmp_path / "rows.jsonl", lines_of([*GOOD[:3], row]))
    with pytest.raises(
        TaskDataError, match=f"{f}:4: {why}".replace("(", "\\(").replace(")", "\\)")
    ):
        PromptsTask({"train_file": f, "test_file": f})


def test_skip_bad_rows_skips_and_counts(tmp_path, caplog):
    bad = ['{"prompt": ', json.dumps({"prompt": 7}), json.dumps({"prompt": ""}), "[1]"]
    lines = lines_of(GOOD[:6]) + bad + lines_of(GOOD[6:])  # bad rows on lines 7-10
    f = write(tmp_path / "rows.jsonl", lines)
    cfg = {"train_file": f, "test_fraction": 0.25, "skip_bad_rows": True}
    with caplog.at_level(logging.WARNING, logger="ftis.tasks.prompts"):
        task = PromptsTask(cfg)
    assert task.skipped_rows == 4
    kept = [p for s in ("train", "test") for p in task.split(s)]
    assert sorted(p.question for p in kept) == sorted(r["prompt"] for r in GOOD)
    for split in ("train", "test"):  # indices stay 0..n-1: peers rebuild problems from them
        assert [p.index for p in task.split(split)] == list(range(len(task.split(split))))
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "skipped 4 malformed row(s) (task.skip_bad_rows)" in warning
    assert f"{f}:7 is not valid JSON" in warning
    # the first metrics row carries the count, once; the report and the console say it
    built = build_task({"kind": "prompts", "reward": "builtin:exact_match", **cfg})
    first = built.pop_reward_stats()
    assert first["data/skipped_rows"] == 4.0
    assert "data/skipped_rows" not in built.pop_reward_stats()
    rows = [{"step": 0, "node": "a", **first}, {"step": 0, "node": "b", **first}]
    line = "the task's data: 4 malformed row(s) were skipped (task.skip_bad_rows; each node's"
    assert skipped_rows_warnings(rows)[0].startswith(line)
    assert skipped_rows_warnings(rows) == [s for s in zero_reward_warnings(rows) if "data" in s]


def test_skip_bad_rows_with_nothing_left_is_an_error(tmp_path):
    f = write(tmp_path / "rows.jsonl", ["nope", json.dumps({"prompt": ""})])
    with pytest.raises(TaskDataError, match="no rows left after skipping the malformed ones"):
        PromptsTask({"train_file": f, "test_file": f, "skip_bad_rows": True})

"""docs/BENCHMARKS.md is what `ftis bench --report-only` writes from the committed raw numbers
(docs/results/bench.json and the separate benchmarks' .json files), and the separate benchmarks'
rows and pages read their .json files as written (no measuring here: synthetic results)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def test_benchmarks_page_regenerates_from_its_json(tmp_path):
    from bench.run import rewrite

    out = tmp_path / "BENCHMARKS.md"
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "bench.json").write_bytes(
        (ROOT / "docs" / "results" / "bench.json").read_bytes()
    )
    rewrite(out)
    assert out.read_text() == (ROOT / "docs" / "BENCHMARKS.md").read_text()


def test_report_only_without_raw_numbers_says_what_to_run(tmp_path):
    import pytest

    from bench.run import rewrite

    with pytest.raises(FileNotFoundError, match="run `ftis bench` first"):
        rewrite(tmp_path / "BENCHMARKS.md")


def test_separate_section_reads_each_json_and_names_missing_ones(tmp_path):
    from bench.separate import separate_section

    (tmp_path / "sweep-jobs.json").write_text(
        json.dumps(
            {
                "environment": {"commit": "abc1234"},
                "study": "studies/collab.yaml",
                "runs": ["a", "b"],
                "speedup": 1.734,
                "differ": [],
            }
        )
    )
    (tmp_path / "bf16-sampler.json").write_text(
        json.dumps(
            {
                "commit": "def5678",
                "rows": [
                    {"model": "llama-20m", "threads": 1, "ftis_ratio": 0.5, "generate_ratio": 0.7},
                    {"model": "llama-20m", "threads": 2, "ftis_ratio": 0.6, "generate_ratio": 0.8},
                ],
                "skipped": [{"model": "SmolLM2-135M", "why": "not in ftis's cache"}],
            }
        )
    )
    text = "\n".join(separate_section(tmp_path))
    assert (
        "| 1.73x | >= 1.6x, identical | [sweep-jobs.md](results/sweep-jobs.md) (`abc1234`) |"
        in text
    )
    assert "first 2 runs of `studies/collab.yaml` (identical results)" in text
    # one thread's row only, with its target; a skipped model says why
    assert "llama-20m (1 thread; `generate` bf16 / f32: 0.700) | 0.500 | <= 0.6 |" in text
    assert "0.600" not in text
    assert "SmolLM2-135M | skipped: not in ftis's cache |" in text
    assert "| `python -m bench.trl_real` | not run yet |" in text


def test_sweep_jobs_compare_ignores_timings_only(tmp_path):
    from bench.sweep_jobs import compare

    for side, t, loss in (("a", 1.0, 0.5), ("b", 2.0, 0.5), ("c", 1.0, 0.25)):
        d = tmp_path / side / "r1"
        d.mkdir(parents=True)
        (d / "evals.jsonl").write_text('{"step": 0}\n')
        row = {"step": 1, "loss/loss": loss, "time/sample": t, "train/step_seconds": t,
               "memory/peak_rss_mb": t, "train/no_signal": 0.0}  # fmt: skip
        (d / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    assert compare(tmp_path / "a", tmp_path / "b", ["r1"]) == []
    assert compare(tmp_path / "a", tmp_path / "c", ["r1"]) == ["r1"]
    # two nodes' rows in either order are the same run; a row of another node is not
    rows = [{"step": 1, "node": "x", "loss/loss": 0.5}, {"step": 1, "node": "y", "loss/loss": 0.7}]
    for side, order in (("d", rows), ("e", rows[::-1]), ("f", [rows[0], rows[0]])):
        d = tmp_path / side / "r2"
        d.mkdir(parents=True)
        (d / "evals.jsonl").write_text('{"step": 0}\n')
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in order))
    assert compare(tmp_path / "d", tmp_path / "e", ["r2"]) == []
    assert compare(tmp_path / "d", tmp_path / "f", ["r2"]) == ["r2"]

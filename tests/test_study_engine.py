"""The generic study engine (ftis.study.engine, ftis.study.registry): a renderer registered from
here, not from the study package, writes the document of a study of hand-written run rows
through `ftis sweep`; unknown kinds and renderers are refused with the registered names; the
study package imports no particular algorithm."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ftis.cli import app
from ftis.study.document import READING_BEGIN, READING_END
from ftis.study.registry import STUDY_RENDERERS, register_study_renderer
from tests.conftest import tiny_run_config

SRC = Path(__file__).resolve().parents[1] / "src" / "ftis"


def render_tiny(study, results, missing, out_dir, report_path, reading) -> str:
    """Per arm: how many runs are complete and the mean over them of the last logged accuracy."""
    lines = [f"# {study.spec.name}", ""]
    for arm in study.spec.arms:
        finals = [
            [r for r in res.rows if "eval/accuracy" in r][-1]["eval/accuracy"]
            for res in results
            if res.run.arm == arm
        ]
        mean = f"{sum(finals) / len(finals):.4f}" if finals else "-"
        lines.append(f"- {arm}: {len(finals)} complete, final accuracy {mean}")
    lines += [
        "",
        f"Missing: {', '.join(missing) or 'none'}.",
        "",
        READING_BEGIN,
        reading,
        READING_END,
    ]
    return "\n".join(lines) + "\n"


@pytest.fixture
def tiny_renderer():
    register_study_renderer("tiny-test", render_tiny)
    yield
    STUDY_RENDERERS.pop("tiny-test")


def _rows(acc_start: float, acc_end: float, last_step: int) -> list[dict]:
    rows = [{"step": 0, "node": "xs", "eval/accuracy": acc_start}]
    rows += [{"step": s, "node": "xs", "loss/total": 0.1} for s in range(1, last_step + 1)]
    if last_step == 3:
        rows[-1]["eval/accuracy"] = acc_end
    return rows


def _study(tmp_path: Path, results: str = "tiny-test") -> Path:
    tmp_path.mkdir(exist_ok=True)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_run_config()))
    spec = {
        "kind": "arms",
        "name": "tiny",
        "out": str(tmp_path / "out"),
        "report": str(tmp_path / "tiny.md"),
        "results": results,
        "seeds": [0, 1],
        "set": ["train.seed={seed}"],
        "arms": {"a": {"config": "tiny.yaml"}, "b": {"config": "tiny.yaml"}},
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    # a: 50% and 25% at the last step (mean 37.5%); b: seed 0 ends at 12.5%, seed 1 stopped at
    # step 2 (incomplete: the engine leaves it out and lists it as missing)
    runs = {"a-s0": (0.1, 0.5, 3), "a-s1": (0.1, 0.25, 3), "b-s0": (0.1, 0.125, 3)}
    runs["b-s1"] = (0.1, None, 2)
    for rid, (start, end, last) in runs.items():
        d = tmp_path / "out" / rid
        d.mkdir(parents=True)
        text = "".join(json.dumps(r) + "\n" for r in _rows(start, end, last))
        (d / "metrics.jsonl").write_text(text)
    return path


def test_a_renderer_registered_outside_the_study_package_writes_the_document(
    tmp_path, tiny_renderer
):
    path = _study(tmp_path)
    report = tmp_path / "tiny.md"
    report.write_text(f"old text\n{READING_BEGIN}\nKept by hand.\n{READING_END}\n")
    runner = CliRunner()
    res = runner.invoke(app, ["sweep", str(path), "--dry-run"])
    assert res.exit_code == 0, res.output
    for rid, status in [("a-s0", "done"), ("b-s0", "done"), ("b-s1", "incomplete")]:
        assert any(rid in line and status in line for line in res.output.splitlines()), rid
    res = runner.invoke(app, ["sweep", str(path), "--report-only"])
    assert res.exit_code == 0, res.output
    assert report.read_text() == (
        "# tiny\n"
        "\n"
        "- a: 2 complete, final accuracy 0.3750\n"
        "- b: 1 complete, final accuracy 0.1250\n"
        "\n"
        "Missing: b-s1.\n"
        "\n"
        f"{READING_BEGIN}\n"
        "Kept by hand.\n"
        f"{READING_END}\n"
    )


def test_report_only_that_finds_no_run_leaves_the_document_as_it_is(tmp_path, tiny_renderer):
    """A document's printed `--report-only` run where its runs are not (here an empty --out)
    refuses in one line that says where it looked and how to look elsewhere, and leaves the
    existing document byte for byte; a document that does not exist yet is still written."""
    path = _study(tmp_path)
    report = tmp_path / "tiny.md"
    committed = b"# tiny\n\n- a: 2 complete\n" + f"{READING_BEGIN}\nMine.\n{READING_END}\n".encode()
    report.write_bytes(committed)
    empty = tmp_path / "elsewhere"
    runner = CliRunner()
    for extra in ([], ["--report", str(report)]):
        res = runner.invoke(app, ["sweep", str(path), "--report-only", "--out", str(empty), *extra])
        assert res.exit_code != 0, res.output
        assert report.read_bytes() == committed
        (line,) = [x for x in res.output.splitlines() if "error:" in x]  # one line
        assert f"no complete run of study 'tiny' in {empty}" in line and "--out" in line
        assert f"{report} left as it is" in line and "Traceback" not in res.output
    # with the runs where the study says (`out:`) it regenerates as before
    res = runner.invoke(app, ["sweep", str(path), "--report-only"])
    assert res.exit_code == 0, res.output
    assert "- a: 2 complete, final accuracy 0.3750" in report.read_text()
    assert "\nMine.\n" in report.read_text()
    # a new document of no runs may still be written (a study that has not run yet)
    new = tmp_path / "new.md"
    res = runner.invoke(
        app, ["sweep", str(path), "--report-only", "--out", str(empty), "--report", str(new)]
    )
    assert res.exit_code == 0, res.output
    assert "Missing: a-s0, b-s0, a-s1, b-s1." in new.read_text()


def _git(root: Path, *args: str) -> str:
    import subprocess

    cmd = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, check=True).stdout


def test_uncommitted_studies_or_configs_mark_the_code_dirty(tmp_path):
    """code_version names the commit, '+dirty' when a tracked file under src/, studies/ or
    configs/ differs from it (a run's results depend on its study and configs as on the code);
    edits elsewhere (a document) leave it clean."""
    from ftis.study.runner import code_version

    root = tmp_path / "checkout"
    files = ["src/ftis/x.py", "studies/s.yaml", "configs/c.yaml", "docs/d.md"]
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("a: 1\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "init")
    rev = _git(root, "rev-parse", "--short", "HEAD").strip()
    assert code_version(root) == rev
    (root / "docs/d.md").write_text("edited\n")
    (root / "studies/untracked.yaml").write_text("new: 1\n")
    assert code_version(root) == rev
    for f in files[:3]:
        (root / f).write_text("a: 2\n")
        assert code_version(root) == rev + "+dirty", f
        (root / f).write_text("a: 1\n")
        assert code_version(root) == rev, f
    assert code_version(tmp_path / "not-a-checkout") is None


def test_the_code_line_names_the_arms_each_code_version_made():
    """One code version: the counts only. Several: also which arms each made, an arm whose runs
    span versions named under each with its share (issue 39, item 5: dpo.md's arms came from two
    commits and the document did not say which)."""
    from types import SimpleNamespace as R

    from ftis.study.document import code_line

    def runs(*pairs):
        return [R(arm=a, code=c) for a, c in pairs]

    one = runs(("a", "c1"), ("b", "c1"))
    assert code_line(one, arm=lambda r: r.arm) == "Code the runs were made with: `c1` (2 runs)."
    mixed = runs(
        ("alone", "old"),
        ("alone", "old"),
        ("fed", "new"),
        ("fed", "new"),
        ("fed", "new"),
        ("alone", "new"),
    )
    line = code_line(mixed, arm=lambda r: r.arm)
    assert line.startswith("Code the runs were made with: `new` (4 runs), `old` (2 runs). ")
    assert "2 code versions" in line
    assert line.endswith(
        "Arms by version: `new`: alone (1 of 3 runs), fed; `old`: alone (2 of 3 runs)."
    )
    assert code_line(mixed) == "Code the runs were made with: `new` (4 runs), `old` (2 runs)."
    assert code_line(runs(("a", "c1"), ("b", None))).endswith("(1 run).")


def test_an_unregistered_renderer_or_kind_is_refused_with_the_registered_names(tmp_path):
    runner = CliRunner()
    path = _study(tmp_path, results="nope")
    res = runner.invoke(app, ["sweep", str(path), "--dry-run"])
    assert res.exit_code != 0
    assert "'nope' is not a registered study renderer" in res.output
    assert "population" in res.output and "Traceback" not in res.output
    path = _study(tmp_path / "other", results="fgrpo")  # FGRPO's renders only its own kind
    res = runner.invoke(app, ["sweep", str(path), "--dry-run"])
    assert res.exit_code != 0
    assert "'fgrpo' renders no study of kind 'arms'" in res.output
    data = yaml.safe_load(path.read_text())
    data["kind"] = "nope"
    path.write_text(yaml.safe_dump(data))
    res = runner.invoke(app, ["sweep", str(path), "--dry-run"])
    assert res.exit_code != 0
    assert "'nope' is not a study kind" in res.output and "fgrpo" in res.output


def test_the_study_package_imports_no_algorithm():
    """Only the generic registry entry point of ftis.algos (load_plugins) may be imported."""
    for py in sorted((SRC / "study").glob("*.py")):
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for mod in mods:
                assert not mod.startswith("ftis.algos."), f"{py.name} imports {mod}"
                if mod == "ftis.algos":
                    assert [a.name for a in node.names] == ["load_plugins"], py.name

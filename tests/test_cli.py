import json

import pytest
import yaml
from typer.testing import CliRunner

from ftis.cli import app
from ftis.train.metrics import decode_outcomes
from tests.conftest import tiny_run_config

runner = CliRunner()


def _config(tmp_path, **train) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_run_config(**train)))
    return str(path)


def test_run_writes_the_run_directory(tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(app, ["run", _config(tmp_path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert yaml.safe_load((out / "config.yaml").read_text())["nodes"][0]["name"] == "xs"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["node"] == "xs" for r in rows)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2, 3]  # step 0, every 2, and the last step
    assert 0.0 <= evals[0]["eval/accuracy"] <= 1.0 and "eval/ood/accuracy" in evals[0]
    assert "eval/pass@2" in evals[0]
    assert all(k in rows[1] for k in ("reward/mean", "time/sample", "time/update"))
    # the loss's quantities are in every row with an optimizer step and absent from one without
    for r in rows[1:]:
        assert ("loss/filtered_frac" in r) == (r["train/optimizer_steps"] > 0), r
    ckpt = out / "nodes" / "xs" / (out / "nodes" / "xs" / "latest").read_text().strip()
    assert (ckpt / "model" / "config.json").exists() and (ckpt / "trainer_state.pt").exists()
    report = (out / "report.md").read_text()
    assert (
        "| xs |" in report and (out / "accuracy.png").exists() and (out / "training.png").exists()
    )
    # evals.jsonl: one line per evaluation and split, whose outcomes give the row's accuracy
    lines = [json.loads(line) for line in (out / "evals.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in lines] == [
        (s, split) for s in (0, 2, 3) for split in ("test", "ood")
    ]
    by_step = {r["step"]: r for r in evals}
    for r in lines:
        assert r["node"] == "xs" and r["n"] == 16  # eval.size
        bits = decode_outcomes(r["correct"], r["n"])
        assert bits.mean() == pytest.approx(by_step[r["step"]][f"eval/{r['split']}/accuracy"])
    # samples.jsonl: the first 3 greedy completions of each split at each evaluation
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 2 * 3
    assert all(
        {"step", "node", "split", "prompt", "completion", "reward"} <= r.keys() for r in samples
    )
    assert [r["prompt"] for r in samples[:3]] != [r["prompt"] for r in samples[3:6]]  # test, ood
    assert "## Samples at the last evaluation" in report
    assert report.count("| xs | 3 |") == 6  # the last evaluation: 3 samples x 2 splits


def test_existing_run_dir_needs_overwrite(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    res = runner.invoke(app, ["run", _config(tmp_path), "--out", str(out)])
    assert res.exit_code == 2 and "--overwrite" in res.output


def test_bad_config_is_a_clean_error(tmp_path):
    res = runner.invoke(
        app,
        [
            "run",
            _config(tmp_path),
            "--set",
            "nodes.0.loss.method=ppo",
            "--out",
            str(tmp_path / "r"),
        ],
    )
    assert res.exit_code == 2
    assert "nodes.0.loss.method" in res.output and "Traceback" not in res.output


def test_missing_config_file(tmp_path):
    res = runner.invoke(app, ["run", str(tmp_path / "none.yaml")])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_missing_model_path_is_a_clean_error(tmp_path):
    res = runner.invoke(
        app,
        [
            "run",
            _config(tmp_path),
            "--set",
            "nodes.0.model={path: /no/such/model}",
            "--set",
            "nodes.0.warm_start=null",
            "--out",
            str(tmp_path / "r"),
        ],
    )
    assert res.exit_code == 2, res.output
    assert "/no/such/model" in res.output and "Traceback" not in res.output


def test_report_and_compare(tmp_path):
    out = tmp_path / "run"
    assert runner.invoke(app, ["run", _config(tmp_path, steps=1), "--out", str(out)]).exit_code == 0
    (out / "report.md").unlink()
    res = runner.invoke(app, ["report", str(out)])
    assert res.exit_code == 0 and (out / "report.md").exists()
    res = runner.invoke(app, ["compare", str(out), str(out), "--out", str(tmp_path / "c.png")])
    assert res.exit_code == 0 and (tmp_path / "c.png").exists()
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 2 and "run directory" in res.output


def test_missing_data_file_is_a_clean_error(tmp_path):
    res = runner.invoke(
        app,
        [
            "run",
            _config(tmp_path),
            "--set",
            f"task={{kind: gsm8k, train_file: {tmp_path}/none.jsonl, test_file: {tmp_path}/t.jsonl}}",
            "--set",
            "nodes.0.warm_start=null",
            "--out",
            str(tmp_path / "r"),
        ],
    )
    assert res.exit_code == 2, res.output
    assert "none.jsonl" in res.output and "train_file" in res.output
    assert "Traceback" not in res.output


# ---- the run directory (issue 22, item 5) ------------------------------------------------------


def _victim(tmp_path):
    """A directory that ftis did not create, holding a file someone cares about."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    return victim


def test_overwrite_refuses_a_directory_ftis_did_not_create(tmp_path):
    victim = _victim(tmp_path)
    res = runner.invoke(app, ["run", _config(tmp_path), "--out", str(victim), "--overwrite"])
    assert res.exit_code == 2, res.output
    assert "not created by ftis" in res.output and "Traceback" not in res.output
    assert (victim / "thesis.tex").read_text() == "years of work"


def test_symlinked_run_directories_are_refused_for_what_they_are(tmp_path):
    """Issue 57: --overwrite through a symlink to a real ftis run directory was refused as 'not
    created by ftis'; a dangling --out symlink with a bare 'File exists'. Each names the link."""
    from ftis import rundir

    real = tmp_path / "real-run"
    real.mkdir()
    rundir.mark(real)
    (real / "metrics.jsonl").write_text("{}\n")
    link = tmp_path / "link"
    link.symlink_to(real)
    res = runner.invoke(app, ["run", _config(tmp_path), "--out", str(link), "--overwrite"])
    assert res.exit_code == 2 and "is a symlink (to" in res.output, res.output
    assert (real / "metrics.jsonl").exists()
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    res = runner.invoke(app, ["run", _config(tmp_path), "--out", str(dangling)])
    assert res.exit_code == 2 and "which does not exist" in " ".join(res.output.split()), res.output


def test_a_run_name_that_is_a_path_is_refused_before_anything_is_touched(tmp_path, monkeypatch):
    victim = _victim(tmp_path)
    monkeypatch.chdir(tmp_path / "victim")
    for name in (str(victim), "../victim", "..", "a/b", ""):
        res = runner.invoke(
            app, ["run", _config(tmp_path), "--set", f"name={name!r}", "--overwrite"]
        )
        assert res.exit_code == 2, (name, res.output)
        assert "name" in res.output and "one folder name" in res.output, res.output
    assert sorted(p.name for p in victim.iterdir()) == ["thesis.tex"]


def test_overwrite_replaces_a_run_directory_ftis_created(tmp_path, monkeypatch):
    import ftis.launch

    seen = []
    monkeypatch.setattr(
        ftis.launch,
        "run_local",
        lambda cfg, d, **kw: seen.append(sorted(p.name for p in d.iterdir())),
    )
    monkeypatch.setattr("ftis.cli.runs._finish", lambda d: None)
    out = tmp_path / "run"
    assert runner.invoke(app, ["run", _config(tmp_path), "--out", str(out)]).exit_code == 0
    assert (out / ".ftis-run").is_file()
    (out / "metrics.jsonl").write_text("{}\n")
    res = runner.invoke(app, ["run", _config(tmp_path), "--out", str(out), "--overwrite"])
    assert res.exit_code == 0, res.output
    assert seen[-1] == [".ftis-lock", ".ftis-run", "config.yaml"]  # the old rows are gone


def test_a_second_run_on_a_locked_directory_is_refused(tmp_path, monkeypatch):
    from ftis import rundir

    out = tmp_path / "run"
    rundir.mark(out)
    (out / "config.yaml").write_text(yaml.safe_dump(tiny_run_config()))
    from ftis.config import RunConfig

    cfg = RunConfig.model_validate(tiny_run_config())
    monkeypatch.setattr("ftis.cli.runs._resumable_config", lambda d, o: cfg)
    with rundir.locked(out):  # a run in progress (flock: per open file, so also in-process)
        for args in (["--resume", str(out)], [_config(tmp_path), "--out", str(out), "--overwrite"]):
            res = runner.invoke(app, ["run", *args])
            assert res.exit_code == 2, res.output
            assert "in use by another ftis run" in res.output, res.output
    assert (out / "config.yaml").is_file()


def test_a_stop_before_any_checkpoint_says_there_is_nothing_to_resume(tmp_path, monkeypatch):
    """SIGTERM during the warm start: the launcher raises KeyboardInterrupt before any node
    checkpointed; the message must not offer a --resume that would be refused."""
    import ftis.launch

    def stopped(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(ftis.launch, "run_local", stopped)
    out = tmp_path / "run"
    res = runner.invoke(app, ["run", _config(tmp_path), "--out", str(out)])
    assert res.exit_code == 130, res.output
    assert "nothing to resume" in res.output and "--overwrite" in res.output
    assert "--resume" not in res.output
    res = runner.invoke(app, ["run", "--resume", str(out)])
    assert res.exit_code == 2 and "has no checkpoints" in res.output


# ---- every user error is one clear line (issue 22, item 6) -------------------------------------


def _one_clean_line(res, *needles):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "error:" in res.output, res.output
    for n in needles:
        assert n in res.output, (n, res.output)


def test_out_naming_an_existing_file(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    res = runner.invoke(app, ["run", _config(tmp_path), "--out", str(f)])
    _one_clean_line(res, "is a file")
    res = runner.invoke(app, ["run", _config(tmp_path), "--out", str(f / "sub")])
    _one_clean_line(res, "is a file")
    assert f.read_text() == "keep me"


def test_a_config_path_that_is_a_directory_or_not_utf8(tmp_path):
    _one_clean_line(runner.invoke(app, ["run", str(tmp_path)]), "is a directory")
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"name: caf\xe9\n")
    _one_clean_line(runner.invoke(app, ["run", str(bad)]), "not UTF-8", "save it as UTF-8")


def test_tensorboard_without_the_package_fails_before_the_run(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name)
    )
    out = tmp_path / "r"
    res = runner.invoke(
        app, ["run", _config(tmp_path), "--set", "log.tensorboard=true", "--out", str(out)]
    )
    _one_clean_line(res, "log.tensorboard", "pip install 'ftis[tracking]'")
    assert not out.exists()  # refused before the run directory, the model or any worker


def test_a_bad_model_path_is_refused_by_the_launcher_before_any_worker(tmp_path, monkeypatch):
    import ftis.launch.multi

    def no_workers(*a, **k):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(ftis.launch.multi, "run_multi", no_workers)
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        "ftis-tests/no-such-model": "not in the local Hugging Face cache",
        str(empty): "has no config.json",
        "a/b/c": "does not exist as a local directory",
        "bad repo id!": "not a Hugging Face Hub id",
    }
    for path, why in cases.items():
        res = runner.invoke(
            app,
            [
                "run",
                _config(tmp_path),
                "--set",
                f"nodes.0.model={{path: '{path}'}}",
                "--set",
                "nodes.0.warm_start=null",
                "--out",
                str(tmp_path / "r"),
            ],
        )
        _one_clean_line(res, "nodes.0.model.path", why)


def test_an_algorithms_missing_package_names_the_extra_before_the_run(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    missing = {"flwr", "hivemind"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name)
    )
    for sets, extra in (
        (["algorithm.kind=fgrpo"], "ftis[federated]"),
        (["algorithm.kind=swarm", "algorithm.backend=hivemind"], "ftis[swarm]"),
    ):
        out = tmp_path / extra
        args = [a for s in sets for a in ("--set", s)]
        res = runner.invoke(app, ["run", _config(tmp_path), *args, "--out", str(out)])
        _one_clean_line(res, f"pip install '{extra}'", "algorithm.kind")
        assert not out.exists()


def test_presets_lists_each_presets_tokenizer():
    result = runner.invoke(app, ["presets"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines() if "│" in line}
    assert "│ bpe " in rows["qwen2-bpe"] and "│ bpe " in rows["llama-bpe"]
    assert "│ char " in rows["llama-m"]

"""Multi-process runs over gloo on loopback: the collaboration path end to end."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from ftis.cli import app
from ftis.models.loading import ModelConfig, build_model
from ftis.models.tokenizer import char_tokenizer
from tests.conftest import tiny_run_config

runner = CliRunner()
VOLATILE = ("time/", "train/step_seconds", "train/elapsed_seconds", "exchange/seconds", "memory/")


def _nodes(*specs):
    return [
        {"name": name, "model": model, "warm_start": {"steps": 30, "batch_size": 32, "lr": 0.003}}
        for name, model in specs
    ]


def _run(tmp_path, data, name="run"):
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(data))
    out = tmp_path / name
    res = runner.invoke(app, ["run", str(cfg), "--out", str(out)])
    return res, out


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _stable(row):
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def test_two_different_models_collaborate(tmp_path):
    data = tiny_run_config(steps=3)
    data["nodes"] = _nodes(("a", {"preset": "llama-xs"}), ("b", {"preset": "qwen2-s"}))
    res, out = _run(tmp_path, data)
    assert res.exit_code == 0, res.output
    rows = _rows(out)
    for node in ("a", "b"):
        mine = [r for r in rows if r["node"] == node]
        assert [r["step"] for r in mine] == [0, 1, 2, 3]
        trained = mine[1:]
        assert all("reward/peers" in r and "reward/own" in r for r in trained)
        # Vertical sharing: 2 of the 4 prompts are the peer's, G = 4 completions each.
        assert all(r["exchange/sequences_received"] == 8 for r in trained)
        assert all(0 < r["exchange/bytes_per_token"] <= 8 for r in trained)
        assert all(r["exchange/rejected"] == 0 for r in trained)
    report = (out / "report.md").read_text()
    assert "| a |" in report and "| b |" in report
    # both node processes append to the run's evals.jsonl: one line per node, evaluation, split
    evals = [json.loads(line) for line in (out / "evals.jsonl").read_text().splitlines()]
    for node in ("a", "b"):
        mine = [(r["step"], r["split"]) for r in evals if r["node"] == node]
        assert sorted(mine) == sorted((s, sp) for s in (0, 2, 3) for sp in ("test", "ood"))


def test_three_nodes_with_lora_run_to_the_end(tmp_path):
    data = tiny_run_config(steps=2, prompts_per_step=3)
    data["nodes"] = _nodes(
        ("x", {"preset": "llama-xs"}),
        ("q", {"preset": "qwen2-s"}),
        ("l", {"preset": "llama-xs", "lora": {"r": 4, "alpha": 8}}),
    )
    data["sharing"] = {"scheme": "horizontal"}
    res, out = _run(tmp_path, data)
    assert res.exit_code == 0, res.output
    rows = _rows(out)
    assert {r["node"] for r in rows if r["step"] == 2} == {"x", "q", "l"}
    for name in ("x", "q", "l"):
        assert (out / "nodes" / name / "latest").exists()
    # Horizontal: every node samples its share (2, 1, 1 of G = 4) of every prompt.
    step1 = {r["node"]: r for r in rows if r["step"] == 1}
    assert step1["x"]["exchange/sequences_received"] == 3 * (1 + 1)
    assert step1["q"]["exchange/sequences_received"] == 3 * (2 + 1)


def test_peers_with_different_tokenizers_that_cannot_be_bridged_are_refused(tmp_path):
    # another tokenizer takes the bridged path (docs/math.md §16), which a loss that needs the
    # sender's per-token probabilities (ReCo) cannot take: refused, naming the node and why
    path = tmp_path / "other-model"
    build_model(ModelConfig(preset="llama-xs")).save_pretrained(path)
    tok = char_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(path)
    data = tiny_run_config(steps=1)
    data["nodes"] = _nodes(("a", {"preset": "llama-xs"}))
    data["nodes"].append({"name": "b", "model": {"path": str(path)}, "loss": {"method": "f-reco"}})
    res, _ = _run(tmp_path, data)
    assert res.exit_code == 2
    assert "different tokenizers" in res.output and "Traceback" not in res.output
    assert "node b: its loss method has no bridged form" in res.output


def test_peers_with_different_tokenizers_take_the_bridged_path(tmp_path):
    """A character-tokenizer Llama and a BPE Qwen2 (issue 23): every received sample is
    re-tokenized, rows count them, and both nodes train to the end."""
    data = tiny_run_config(steps=2)
    data["nodes"] = _nodes(("a", {"preset": "llama-xs"}), ("b", {"preset": "qwen2-bpe"}))
    res, out = _run(tmp_path, data)
    assert res.exit_code == 0, res.output
    rows = _rows(out)
    for node in ("a", "b"):
        trained = [r for r in rows if r["node"] == node and r["step"] > 0]
        assert [r["step"] for r in trained] == [1, 2]
        # vertical sharing: 2 of the 4 prompts are the peer's, G = 4 each, all bridged
        assert all(r["bridge/samples"] + r["bridge/rejected"] == 8 for r in trained)
        assert all(r["exchange/rejected"] == 0 for r in trained)
        # a mean over the bridged sequences the update ran, absent where none ran
        assert all(
            (r["bridge/mean_weight"] >= 0)
            if r["bridge/weighted"]
            else "bridge/mean_weight" not in r
            for r in trained
        )
    log_a = (out / "logs" / "a.log").read_text()
    assert "a <-> b: bridged path" in log_a


def test_identical_models_with_vertical_sharing_equal_one_node_sampling_everything(tmp_path):
    """Two copies of one model that split a step's prompts (vertical sharing) train on exactly
    the samples one node sampling every prompt would draw (the sampling noise is keyed by
    step and prompt), so both copies take the same steps as that single node: equal losses,
    rewards and evaluations at every step."""
    data = tiny_run_config(steps=3)
    data["nodes"] = _nodes(("p", {"preset": "llama-xs"}), ("q", {"preset": "llama-xs"}))
    res, out = _run(tmp_path, data, "pair")
    assert res.exit_code == 0, res.output
    single = tiny_run_config(steps=3)
    single["nodes"] = _nodes(("p", {"preset": "llama-xs"}))
    res, out1 = _run(tmp_path, single, "single")
    assert res.exit_code == 0, res.output
    keep = (
        "loss/loss",
        "loss/filtered_frac",
        "loss/is_weight_mean",
        "loss/active_frac",
        "reward/mean",
        "eval/",
    )
    pair, one = _rows(out), _rows(out1)
    for step in range(4):
        want = {k: v for k, v in one[step].items() if k.startswith(keep)}
        assert want
        for node in ("p", "q"):
            (got,) = [r for r in pair if r["step"] == step and r["node"] == node]
            for k, v in want.items():
                assert got[k] == pytest.approx(v, abs=1e-5), (step, node, k)


def test_one_distributed_node_equals_the_single_node_trainer(tmp_path):
    data = tiny_run_config(steps=2)
    res, local = _run(tmp_path, data, "local")
    assert res.exit_code == 0, res.output
    dist_out = tmp_path / "dist"
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            "-m",
            "ftis.launch.worker",
            str(tmp_path / "local.yaml"),
            "--out",
            str(dist_out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = [_stable(r) for r in _rows(local)]
    b = [_stable(r) for r in _rows(dist_out)]
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], abs=1e-6), k


@pytest.mark.chaos_case("F-TIS", "kill one (hard exit, no goodbye), resume")
def test_a_lost_node_does_not_stop_the_others_and_resumes_alone(tmp_path):
    """Node c dies hard at the start of step 2 (no goodbye: the launcher marks it gone). a and b
    notice, carry on with each other, finish and write the report; the run exits 1 naming c.
    `--resume` then continues c alone from its checkpoint: every node ends with each step's row
    exactly once."""
    data = tiny_run_config(steps=4)
    data["nodes"] = _nodes(
        ("a", {"preset": "llama-xs"}), ("b", {"preset": "llama-xs"}), ("c", {"preset": "llama-xs"})
    )
    data["testing"] = {"crash_at_step": {data["nodes"][2]["name"]: 2}}
    data["checkpoint"] = {"every": 1}
    data["exchange"] = {"timeout_s": 120}  # the launcher's mark, not the timeout, ends the wait
    res, out = _run(tmp_path, data)
    assert res.exit_code == 1, res.output
    assert "without c" in res.output and "exit code 17" in res.output
    rows = _rows(out)
    steps = {n: [r["step"] for r in rows if r["node"] == n] for n in "abc"}
    assert steps == {"a": [0, 1, 2, 3, 4], "b": [0, 1, 2, 3, 4], "c": [0, 1]}
    # prompts per step dealt a: 2, b: 1, c: 1 (G = 4): a hears from b and c, then from b only
    by = {(r["node"], r["step"]): r for r in rows}
    assert by["a", 1]["exchange/sequences_received"] == 8 and by["a", 1]["exchange/peers"] == 2
    for s in (2, 3, 4):
        assert by["a", s]["exchange/sequences_received"] == 4
        assert by["b", s]["exchange/sequences_received"] == 8
        assert by["a", s]["exchange/lost_peers"] == by["b", s]["exchange/lost_peers"] == 1
    report = (out / "report.md").read_text()
    assert "| a |" in report and "| b |" in report
    assert "lost peer 2 at step 2" in (out / "logs" / "a.log").read_text()

    res = runner.invoke(app, ["run", "--resume", str(out), "--set", "testing.crash_at_step={}"])
    assert res.exit_code == 0, res.output
    rows = _rows(out)
    for n in "abc":
        assert [r["step"] for r in rows if r["node"] == n] == [0, 1, 2, 3, 4], n
    resumed = [r for r in rows if r["node"] == "c" and r["step"] >= 2]
    assert all("exchange/peers" not in r or r["exchange/peers"] == 0 for r in resumed)


@pytest.mark.long
def test_ctrl_c_checkpoints_every_node(tmp_path):
    """Ctrl-C to `ftis run`: the parent forwards it, every node ends its step, writes a
    checkpoint and exits; the run exits 130 and says how to resume. Each node's rows are exactly
    the steps its checkpoint holds (resume itself: the lost-node test above)."""
    import signal
    import time

    # far more steps than the test waits for (40 could all run before the signal on a busy
    # machine), and no stop for want of a training signal
    data = tiny_run_config(steps=1000, max_steps_without_signal=0)
    data["nodes"] = _nodes(("a", {"preset": "llama-xs"}), ("b", {"preset": "llama-xs"}))
    data["eval"]["every"] = 0
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    parent = subprocess.Popen(
        [sys.executable, "-m", "ftis.cli", "run", str(cfg), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            states = []
            for n in ("a", "b"):
                try:
                    states.append(json.loads((out / ".status" / f"{n}.json").read_text()))
                except (OSError, json.JSONDecodeError):
                    states.append({})
            if all(s.get("event") == "step" and s.get("step", 0) >= 2 for s in states):
                break
            assert parent.poll() is None, parent.communicate()[0]
            time.sleep(0.2)
        parent.send_signal(signal.SIGINT)
        output, _ = parent.communicate(timeout=120)
    finally:
        if parent.poll() is None:
            parent.kill()
    assert parent.returncode == 130, output
    assert "ftis run --resume" in output
    rows = _rows(out)
    for n in ("a", "b"):
        ckpt = (out / "nodes" / n / "latest").read_text().strip()
        last = int(ckpt.removeprefix("step-"))
        assert 2 <= last < 1000  # stopped by the signal, not at the end
        assert [r["step"] for r in rows if r["node"] == n] == list(range(last + 1)), n


class _FakeMembership:
    def __init__(self, values):
        self.values = values

    def gather(self, value, *, timeout_s=None):
        return self.values


def test_group_checks_name_what_differs():
    from ftis.config import RunConfig
    from ftis.exchange.group import GroupMismatchError, check_group
    from ftis.launch.worker import shared_settings_digest

    data = tiny_run_config()
    data["nodes"] = _nodes(("a", {"preset": "llama-xs"}), ("b", {"preset": "llama-xs"}))
    cfg = RunConfig.model_validate(data)
    d = shared_settings_digest(cfg)

    def check(values):
        kw = {"names": cfg.rank_names, "fingerprint": "t", "settings_digest": d}
        return check_group(_FakeMembership(values), **kw)

    assert check([f"t:{d}:1", f"t:{d}:5"]) == [1, 5]
    with pytest.raises(GroupMismatchError, match="different shared settings"):
        check([f"t:{d}:1", "t:other:1"])
    # different tokenizers: bridged when both can (docs/math.md §16), else refused naming who
    assert check([f"t:{d}:1", f"u:{d}:1"]) == [1, 1]
    with pytest.raises(GroupMismatchError, match="b use tokenizer u.*node b: its algorithm"):
        check([f"t:{d}:1", f"u!algorithm:{d}:1"])
    with pytest.raises(GroupMismatchError, match="different version of ftis"):
        check([f"t:{d}:1", "garbage"])
    # the algorithm is a shared setting too
    other = RunConfig.model_validate({**data, "sharing": {"scheme": "horizontal"}})
    assert shared_settings_digest(other) != d


def test_worker_errors_are_clean(tmp_path, monkeypatch):
    from ftis.launch.worker import main

    data = tiny_run_config()
    data["nodes"] = _nodes(("a", {"preset": "llama-xs"}), ("b", {"preset": "llama-xs"}))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(data))
    for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main([str(cfg), "--out", str(tmp_path / "r")]) == 2
    err = (tmp_path / "r" / "logs" / "rank0.error").read_text()
    assert "declares 2 ranks (a, b) but 3 processes" in err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([str(cfg), "--out", str(tmp_path / "r")]) == 2
    err = (tmp_path / "r" / "logs" / "rank0.error").read_text()
    assert "MASTER_ADDR, MASTER_PORT not set" in err


def test_a_node_that_cannot_start_fails_the_run_with_its_reason(tmp_path):
    """One node's model cannot be loaded: it exits before the group forms, its peer is told so
    and exits too (no timeout), and the error names the node and the path. (A path that does
    not exist is refused by the launcher before any worker starts: tests/test_cli.py; this
    one passes that check, a directory with a config.json, and fails in the worker.)"""
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    data = tiny_run_config(steps=1)
    data["nodes"] = _nodes(("a", {"preset": "llama-xs"}))
    data["nodes"].append({"name": "b", "model": {"path": str(broken)}})
    res, _ = _run(tmp_path, data)
    assert res.exit_code == 2, res.output
    assert "b: cannot load" in res.output and "broken-model" in res.output
    assert "Traceback" not in res.output


def test_hacpo_trains_on_joint_groups_and_logs_its_mechanisms(tmp_path):
    data = tiny_run_config(steps=2, prompts_per_step=2)
    data["nodes"] = _nodes(("a", {"preset": "llama-xs"}), ("b", {"preset": "qwen2-s"}))
    for n in data["nodes"]:
        n["loss"] = {"method": "hacpo"}
    data["sharing"] = {"scheme": "joint"}
    data["train"].update(update_epochs=2, mini_batches=2)
    res, out = _run(tmp_path, data)
    assert res.exit_code == 0, res.output
    rows = _rows(out)
    for node in ("a", "b"):
        trained = [r for r in rows if r["node"] == node and r["step"] > 0]
        assert len(trained) == 2
        for r in trained:
            # joint groups: the peer answered both prompts with its own G = 4
            assert r["exchange/sequences_received"] == 2 * 4
            # 2 epochs x 2 mini-batches, or none in a round without signal (all rewards equal)
            assert r["train/optimizer_steps"] == (0 if r.get("train/no_signal") else 4)
            assert 0.0 <= r["hacpo/capability"] <= 1.0
            assert 0.1 <= r["hacpo/discrepancy"] <= 10.0
            assert r["hacpo/irregular_sequences"] == 0
            # each node's capability is what the other sees as its peer's (one verifier)
        other = "b" if node == "a" else "a"
        for r in trained:
            peer_row = next(x for x in rows if x["node"] == other and x["step"] == r["step"])
            assert r["hacpo/peer_capability"] == peer_row["hacpo/capability"]
            # per pair, under the peer's name: its capability, weight and discrepancy
            assert r[f"hacpo/capability/{other}"] == peer_row["hacpo/capability"]
            assert 0.1 <= r[f"hacpo/weight/{other}"] <= 10.0
            assert r[f"hacpo/discrepancy/{other}"] == pytest.approx(r["hacpo/discrepancy"])

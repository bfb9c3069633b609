"""The algorithm seam: the node shell runs any registered algorithm, with evaluation, metric rows,
checkpoints and exact resume, without knowing its name; and the shell's guarantees (lost
transport, lonely groups) hold for the F-TIS algorithm."""

from __future__ import annotations

import json
import struct
from typing import Any, Literal

import pytest
import torch
import yaml

from ftis.algos import ALGORITHMS, AlgorithmConfig, register_algorithm
from ftis.algos.base import NodeContext
from ftis.config import ConfigError, RunConfig, load_config
from ftis.exchange.transport import TransportLost, TransportStats
from ftis.train.checkpoint import load_latest_checkpoint
from ftis.train.loop import train_node
from tests.conftest import tiny_run_config


class NudgeConfig(AlgorithmConfig):
    """A trivial algorithm: each step adds `scale * step` to one bias-free weight and counts."""

    kind: Literal["nudge"] = "nudge"
    scale: float = 1e-3


class Nudge:
    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.weight = next(p for p in ctx.node.model.parameters() if p.requires_grad)
        self.calls = 0
        self.noise_sum = 0.0

    def step(self, step: int) -> dict[str, float]:
        with self.ctx.timer("nudge"), torch.no_grad():
            self.weight.add_(self.ctx.cfg.algorithm.scale * step)
        self.calls += 1
        # The shell restores torch's RNG on resume: a draw here must continue the same stream.
        self.noise_sum += float(torch.rand(()))
        return {"nudge/calls": float(self.calls), "nudge/noise_sum": self.noise_sum}

    def evaluate(self, step: int) -> dict[str, float]:
        return {"eval/accuracy": float(self.weight.detach().sum())}

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "noise_sum": self.noise_sum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.noise_sum = state["calls"], state["noise_sum"]


@pytest.fixture
def nudge():
    register_algorithm("nudge", NudgeConfig, Nudge)
    yield
    ALGORITHMS.pop("nudge")


def _cfg(steps: int, **extra) -> RunConfig:
    data = tiny_run_config(steps=steps)
    data["algorithm"] = {"kind": "nudge", "scale": 0.01}
    data["eval"]["every"] = 1
    data["checkpoint"] = {"every": 1, "keep": 3}
    data.update(extra)
    return RunConfig.model_validate(data)


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_second_algorithm_runs_through_the_shell_and_resumes_exactly(nudge, tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    train_node(_cfg(4), rank=0, run_dir=whole)
    rows = _rows(whole)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[-1]["nudge/calls"] == 4 and "time/nudge" in rows[-1]
    assert {"eval/accuracy", "train/step_seconds", "memory/peak_rss_mb"} <= set(rows[-1])
    # each step moved the weight by 0.01 * step: accuracy (the weight's sum) rises
    assert rows[4]["eval/accuracy"] > rows[0]["eval/accuracy"]

    # the same run in two halves: stop after step 2, then resume to step 4
    res = train_node(_cfg(2), rank=0, run_dir=part)
    assert res.last_step == 2 and not res.interrupted
    train_node(_cfg(4), rank=0, run_dir=part, resume=True)
    resumed = _rows(part)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    for a, b in zip(rows, resumed):
        for k in ("nudge/calls", "nudge/noise_sum", "eval/accuracy"):
            if k in a:
                assert a[k] == pytest.approx(b[k], abs=1e-6), (a["step"], k)
    _, state = load_latest_checkpoint(_node_for(_cfg(4)), part / "nodes" / "xs")
    assert state["algorithm"] == {
        "calls": 4,
        "noise_sum": pytest.approx(rows[-1]["nudge/noise_sum"]),
    }


def _node_for(cfg: RunConfig):
    from ftis.train.node import build_node

    return build_node(cfg.nodes[0], rank=0, task_cfg=cfg.task)


def test_algorithm_config_is_validated_by_its_registered_class(nudge):
    with pytest.raises(ConfigError, match="algorithm: scale"):
        load_config(None, ["algorithm.kind=nudge", "algorithm.scale=oops"])
    with pytest.raises(ConfigError, match="unknown algorithm kind 'nope'; choose one of: .*ftis"):
        load_config(None, ["algorithm.kind=nope"])
    cfg = load_config(None, ["algorithm.kind=nudge"])
    assert cfg.model_dump()["algorithm"] == {"kind": "nudge", "scale": 1e-3}


class _LostAfter:
    """A transport of a two-rank world whose peer never answers, and that is lost at step
    `lost_at` (as when the store's host dies)."""

    def __init__(self, rank: int, lost_at: int | None = None) -> None:
        self.rank, self.world_size, self.lost_at = rank, 2, lost_at
        self.stats = TransportStats()

    def exchange(self, round_, payload, *, max_bytes):
        if round_ == self.lost_at:
            raise TransportLost("store gone; resume with ftis run --resume RUN_DIR")
        self.stats.bytes_sent += len(payload)
        return {}

    def ready(self):
        pass

    def close(self):
        pass


def _two_nodes(**train) -> RunConfig:
    data = tiny_run_config(**train)
    data["nodes"].append({**data["nodes"][0], "name": "ys"})
    return RunConfig.model_validate(data)


def test_a_lost_transport_checkpoints_the_last_step_and_raises(tmp_path):
    cfg = _two_nodes(steps=4)
    with pytest.raises(TransportLost, match="--resume"):
        train_node(cfg, rank=0, run_dir=tmp_path, transport=_LostAfter(0, lost_at=3))
    assert [r["step"] for r in _rows(tmp_path)] == [0, 1, 2]
    assert (tmp_path / "nodes" / "xs" / "latest").read_text().strip() == "step-000002"


def test_horizontal_sharing_survives_a_lost_peer_with_single_completion_shares(tmp_path):
    """G = 3 over 2 nodes: rank 1 samples one completion of every group. With its peer lost,
    every group it holds has one sequence (no baseline); such groups are skipped and counted,
    the node trains on."""
    cfg = _two_nodes(steps=2, group_size=3)
    cfg.sharing.scheme = "horizontal"
    res = train_node(cfg, rank=1, run_dir=tmp_path, transport=_LostAfter(1))
    assert res.last_step == 2
    rows = [r for r in _rows(tmp_path) if r["step"] > 0]
    assert all(r["train/skipped_groups"] == 4 for r in rows)  # prompts_per_step = 4
    assert all(r["exchange/bytes_sent"] > 0 for r in rows)


# ------------------------------------------------------------------ a rank that is not a node
# Registered at import, so worker processes that import this module ($FTIS_PLUGINS) know it.


class TallyConfig(AlgorithmConfig):
    """Nodes send a number each step; a server rank sums them and sends the sum back."""

    kind: Literal["tally"] = "tally"

    def service_ranks(self, run) -> list[str]:
        return ["server"]


def _number(x: float) -> bytes:
    return struct.pack("<d", x)


class Tally:
    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx

    def step(self, step: int) -> dict[str, float]:
        t = self.ctx.transport
        t.exchange(2 * step - 1, _number(step * (self.ctx.rank + 1)), max_bytes=8)
        got = t.exchange(2 * step, b"", max_bytes=8)
        server = self.ctx.cfg.rank_names.index("server")
        return {"tally/sum": struct.unpack("<d", got[server])[0]}

    def evaluate(self, step: int) -> dict[str, float]:
        return {"eval/accuracy": 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def serve_tally(ctx) -> None:
    for step in range(1, ctx.cfg.train.steps + 1):
        got = ctx.transport.exchange(2 * step - 1, b"", max_bytes=8)
        total = sum(struct.unpack("<d", b)[0] for b in got.values() if b)
        ctx.transport.exchange(2 * step, _number(total), max_bytes=8)
        ctx.logger.log(step, {"tally/sum": total, "tally/clients": float(len(got))})


register_algorithm("tally", TallyConfig, Tally, service=serve_tally)


@pytest.mark.long
def test_a_service_rank_runs_beside_the_nodes(tmp_path, monkeypatch):
    """Two nodes and a server (a rank that trains nothing) run as three processes; the server's
    rows carry `node: server`, and the handshake accepts a rank without a tokenizer."""
    from typer.testing import CliRunner

    from ftis.cli import app

    monkeypatch.setenv("FTIS_PLUGINS", __name__)
    data = tiny_run_config(steps=2)
    data["nodes"].append({**data["nodes"][0], "name": "ys"})
    data["algorithm"] = {"kind": "tally"}
    cfg = tmp_path / "tally.yaml"
    cfg.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", str(cfg), "--out", str(out)])
    logs = "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in (out / "logs").glob("*.log"))
    assert res.exit_code == 0, res.output + logs
    rows = _rows(out)
    by = {(r["node"], r["step"]): r for r in rows}
    # step s: node xs sends s, node ys sends 2s
    for s in (1, 2):
        assert by[("server", s)]["tally/sum"] == 3 * s and by[("server", s)]["tally/clients"] == 2
        assert by[("xs", s)]["tally/sum"] == by[("ys", s)]["tally/sum"] == 3 * s
    assert by[("xs", 2)]["exchange/bytes_sent"] == 8  # the shell counts the transport's bytes

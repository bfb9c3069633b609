"""FGRPO without Flower: the config section, the delta payload checks and codec, the server's
aggregator, and one client's local round (docs/fgrpo.md). The Flower side (strategy, apps,
simulation) is tested in tests/test_fgrpo_flower.py."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import yaml

from ftis.algos.fgrpo.aggregator import Aggregator, ClientReport
from ftis.algos.fgrpo.config import FGRPOConfig
from ftis.config import ConfigError, RunConfig, load_config
from ftis.exchange.deltas import DeltaCodec, check_delta
from ftis.exchange.wire import PayloadError
from tests.conftest import tiny_run_config


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models: one thread is as fast, and far faster on a busy machine (as in the clients'
    workers and run_federated)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fgrpo_run_config(steps: int = 2, **algorithm) -> dict:
    """Three llama-xs clients (a: addition, b: subtraction with 0/10 rewards, c: both), 2 local
    steps per round, tiny eval. The run's task (the warm start's) is tiny_run_config's, so the
    warm start is shared with the other tests through the session's cache."""
    cfg = tiny_run_config(steps=steps)
    node = cfg["nodes"][0]
    cfg["nodes"] = [
        {**copy.deepcopy(node), "name": name, "loss": {"method": "vis"}, "optim": {"lr": 1e-3}}
        for name in ("a", "b", "c")
    ]
    cfg["eval"] = {"every": 1, "size": 16, "pass_samples": 0}
    cfg["algorithm"] = {
        "kind": "fgrpo",
        "local_steps": 2,
        "performance_size": 8,
        "clients": {  # no ood split: half the evaluation time
            "a": {"task": {"ops": {"+": 1.0}, "ood": {}}},
            "b": {"task": {"ops": {"-": 1.0}, "ood": {}}, "reward_scale": 10.0},
            "c": {"task": {"ops": {"+": 1.0, "-": 1.0}, "ood": {}}},
        },
        **algorithm,
    }
    return cfg


# ---- config --------------------------------------------------------------------------------


def test_config_reads_the_embedded_fgrpo_yaml() -> None:
    cfg = load_config("configs/fgrpo.yaml")
    assert isinstance(cfg.algorithm, FGRPOConfig)
    assert cfg.rank_names == [n.name for n in cfg.nodes] + ["server"]
    scales = {n: cfg.algorithm.client_spec(n).reward_scale for n in (x.name for x in cfg.nodes)}
    assert len(cfg.nodes) >= 3 and max(scales.values()) / min(scales.values()) == 10
    mixes = {str(cfg.algorithm.client_task(cfg, n.name)["ops"]) for n in cfg.nodes}
    assert len(mixes) == len(cfg.nodes)  # non-IID: every client its own task mix


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["nodes"][0].update(name="server"), "named 'server'"),
        (lambda c: c["algorithm"]["clients"].update(zz={}), "unknown nodes"),
        (lambda c: c["algorithm"].update(clients_per_round=4), "exceeds"),
        (lambda c: c["nodes"][1].update(model={"preset": "llama-s"}), "same model"),
        (
            lambda c: c["algorithm"]["clients"]["a"].update(task={"ops": {"/": 1.0}}),
            "clients.a.task",
        ),
        (lambda c: c["algorithm"]["clients"]["a"].update(reward_scale=0), "reward_scale"),
        (lambda c: c.update(testing={"adversary": {"a": "duplicate"}}), "adversary"),
        (lambda c: c.update(defence={"plausibility": True}), "remove the defence section"),
    ],
)
def test_config_errors_name_the_field(change, message, tmp_path) -> None:
    data = fgrpo_run_config()
    change(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


# ---- delta payloads ------------------------------------------------------------------------


REF = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}


def test_check_delta_accepts_and_converts() -> None:
    out = check_delta({"w": np.ones((2, 3), np.float64), "b": torch.ones(3)}, REF)
    assert out["w"].dtype == torch.float32 and float(out["w"].sum()) == 6.0


@pytest.mark.parametrize(
    ("delta", "message"),
    [
        ({"w": np.ones((2, 3), np.float32)}, "missing"),
        ({"w": np.ones((2, 3)), "b": np.ones(3), "x": np.ones(1)}, "unexpected"),
        ({"w": np.ones((3, 3)), "b": np.ones(3)}, "shape"),
        ({"w": np.ones((2, 3), np.int64), "b": np.ones(3)}, "floating"),
        ({"w": np.full((2, 3), np.nan), "b": np.ones(3)}, "non-finite"),
        ({"w": np.ones((2, 3)), "b": np.array([1.0, np.inf, 0.0])}, "non-finite"),
        ({"w": "not an array", "b": np.ones(3)}, "not an array"),
        ([np.ones((2, 3)), np.ones(3)], "must map"),
    ],
)
def test_check_delta_rejects_bad_payloads(delta, message) -> None:
    with pytest.raises(PayloadError, match=message):
        check_delta(delta, REF)


def test_delta_codec_round_trip_and_garbage() -> None:
    codec = DeltaCodec(REF)
    delta = {"w": torch.arange(6.0).view(2, 3), "b": torch.tensor([1.0, -2.0, 0.5])}
    back = codec.decode(codec.encode(delta))
    assert all(torch.equal(back[k], delta[k]) for k in delta)
    for data in (b"", b"\x00" * 64, b"garbage" * 10):
        with pytest.raises(PayloadError):
            codec.decode(data)
    with pytest.raises(PayloadError, match="shape"):
        codec.decode(codec.encode({"w": torch.zeros(2, 2), "b": torch.zeros(3)}))
    with pytest.raises(PayloadError, match="exceeds"):
        DeltaCodec(REF, max_bytes=10).decode(codec.encode(delta))


# ---- the server's aggregator ---------------------------------------------------------------


def _report(name: str, value: float, perf: float, n: int = 8) -> ClientReport:
    return ClientReport(name, {"w": torch.full((2,), value)}, perf, n)


HISTORY = {"baseline": "ema", "gain": "relative", "no_gain": "weights"}  # the rule before §9.4


def test_aggregator_relative_gain_round_by_hand() -> None:
    """The history-baseline option (EMA, contract gain, step taken whatever the gains).
    Round 1: no baselines -> gains 0 -> equal weights: theta = 0 + 1 * (1 + 3) / 2 = 2;
    baselines become P. Round 2 (eta_s 1, tau 1, EMA 0.5): a improves 0.5 -> 0.75 (gain 0.5),
    b stays at 2 (gain 0): w = softmax(0.5, 0) = (0.6225, 0.3775); theta += 0.6225 * 1 + 0.3775
    * 3; baselines 0.625 and 2."""
    agg = Aggregator({"w": torch.zeros(2)}, FGRPOConfig(baseline_momentum=0.5, **HISTORY))
    out = agg.aggregate([_report("b", 3.0, 2.0), _report("a", 1.0, 0.5)])
    assert out.weights == pytest.approx({"a": 0.5, "b": 0.5}, abs=1e-12)
    assert out.baselines == {"a": None, "b": None}
    assert torch.allclose(agg.params["w"], torch.full((2,), 2.0))
    assert agg.baselines == {"a": 0.5, "b": 2.0}
    out = agg.aggregate([_report("a", 1.0, 0.75), _report("b", 3.0, 2.0)])
    wa = 1 / (1 + math.exp(-0.5))
    assert out.gains == pytest.approx({"a": 0.5, "b": 0.0}, abs=1e-12)
    assert out.weights["a"] == pytest.approx(wa, abs=1e-12)
    expected = 2.0 + wa * 1.0 + (1 - wa) * 3.0
    assert torch.allclose(agg.params["w"], torch.full((2,), expected), atol=1e-6)
    assert agg.baselines == pytest.approx({"a": 0.625, "b": 2.0})
    assert out.update_norm == pytest.approx(math.sqrt(2) * (wa + 3 * (1 - wa)), abs=1e-5)
    # state round trip (the server checkpoint)
    agg2 = Aggregator({"w": torch.zeros(2)}, FGRPOConfig())
    agg2.load_state_dict(agg.state_dict())
    assert agg2.baselines == agg.baselines and agg2.counts == {"a": 2, "b": 2}


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        ("fedavg", {"a": 0.25, "b": 0.75}),
        ("uniform", {"a": 0.5, "b": 0.5}),
        ("reward", {"a": 0.2, "b": 0.8}),
    ],
)
def test_aggregator_other_rules(rule, expected) -> None:
    """n = (8, 24) -> fedavg (1/4, 3/4); performance (0.5, 2) -> reward (0.2, 0.8); server_lr 0.5
    halves the step."""
    agg = Aggregator({"w": torch.zeros(2)}, FGRPOConfig(aggregation=rule, server_lr=0.5))
    out = agg.aggregate([_report("a", 1.0, 0.5, n=8), _report("b", 3.0, 2.0, n=24)])
    assert out.weights == pytest.approx(expected, abs=1e-12)
    step = expected["a"] * 1.0 + expected["b"] * 3.0
    assert torch.allclose(agg.params["w"], torch.full((2,), 0.5 * step), atol=1e-6)


def _pre(name: str, value: float, before: float, after: float, n: int = 8) -> ClientReport:
    return ClientReport(name, {"w": torch.full((2,), value)}, after, n, performance_before=before)


def test_aggregator_default_bounds_a_client_starting_from_zero() -> None:
    """The default rule (docs/math.md §9.4). a: 0 -> 1/64 (a 0/1 task, 64 held-out problems),
    b: 0.5 -> 0.625 (+25%). Gains (1/64) / 0.1 = 0.15625 and 0.25: w = softmax = (e^0.15625,
    e^0.25) / sum = (0.47660, 0.52340); the old rule gave a ~1 and b ~0. The baselines are the
    reports' own pre-round scores: a history of a's past scores (none kept) changes nothing."""
    agg = Aggregator({"w": torch.zeros(2)}, FGRPOConfig())
    out = agg.aggregate([_pre("a", 1.0, 0.0, 1 / 64), _pre("b", 3.0, 0.5, 0.625)])
    wa = math.exp(0.15625) / (math.exp(0.15625) + math.exp(0.25))
    assert out.gains == pytest.approx({"a": 0.15625, "b": 0.25}, abs=1e-12)
    assert out.weights == pytest.approx({"a": wa, "b": 1 - wa}, abs=1e-12)
    assert out.baselines == {"a": 0.0, "b": 0.5} and out.new_baselines == {}
    assert torch.allclose(agg.params["w"], torch.full((2,), wa + 3 * (1 - wa)), atol=1e-6)
    assert agg.baselines == {} and not out.no_positive_gain and not out.skipped
    # the contract's gain (1e-8 floor) collapses onto a: its weight is 1 to 12 digits
    old = Aggregator({"w": torch.zeros(2)}, FGRPOConfig(gain="relative"))
    out = old.aggregate([_pre("a", 1.0, 0.0, 1 / 64), _pre("b", 3.0, 0.5, 0.625)])
    assert out.weights["a"] == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(ValueError, match="performance before local training"):
        agg.aggregate([_report("a", 1.0, 0.5)])


@pytest.mark.parametrize(
    ("rule", "expected", "theta"),
    [
        ("fedavg", {"a": 0.25, "b": 0.75}, 0.25 * 1 + 0.75 * 3),
        ("skip", {"a": 0.0, "b": 0.0}, 0.0),
        # softmax(0, -0.5): e^0 / (1 + e^-0.5) = 0.62246
        ("weights", {"a": 1 / (1 + math.exp(-0.5)), "b": 1 - 1 / (1 + math.exp(-0.5))}, None),
    ],
)
def test_aggregator_when_no_gain_is_positive(rule, expected, theta) -> None:
    """a stays at 0.5 (gain 0), b drops 0.6 -> 0.3 (gain -0.5); n = (8, 24)."""
    agg = Aggregator({"w": torch.zeros(2)}, FGRPOConfig(no_gain=rule))
    out = agg.aggregate([_pre("a", 1.0, 0.5, 0.5), _pre("b", 3.0, 0.6, 0.3, n=24)])
    assert out.weights == pytest.approx(expected, abs=1e-12)
    assert out.no_positive_gain and out.skipped == (rule == "skip")
    if theta is None:
        theta = expected["a"] * 1 + expected["b"] * 3
    assert torch.allclose(agg.params["w"], torch.full((2,), theta), atol=1e-6)
    assert out.update_norm == pytest.approx(math.sqrt(2) * theta, abs=1e-5)


def test_aggregator_without_reports_changes_nothing() -> None:
    agg = Aggregator({"w": torch.ones(2)}, FGRPOConfig())
    out = agg.aggregate([])
    assert out.weights == {} and torch.equal(agg.params["w"], torch.ones(2))


# ---- one client's round --------------------------------------------------------------------


def test_local_client_round_is_deterministic_and_reports_a_delta() -> None:
    """Two rounds from the same global parameters give the same delta (fresh optimizer, keyed
    randomness), the delta is theta_k - theta over the trainable parameters, the performance is
    on the scaled reward, and n = E x prompts x G."""
    from ftis.algos.fgrpo.client import LocalClient, load_params, trainable_params

    cfg = RunConfig.model_validate(fgrpo_run_config())
    client = LocalClient(cfg, 1)  # client b: subtraction, reward scale 10
    theta = trainable_params(client.node.model)
    r1 = client.train_round(theta, 1)
    r2 = client.train_round(theta, 1)
    assert set(r1.delta) == set(theta)
    assert all(torch.equal(r1.delta[k], r2.delta[k]) for k in theta)
    assert r1.performance == r2.performance
    assert r1.num_examples == 2 * 4 * 4
    after = trainable_params(client.node.model)
    assert all(torch.allclose(after[k], theta[k] + r1.delta[k], atol=1e-6) for k in theta)
    # The performance signals are the held-out scores (x10: b's scale) of the model after and
    # of the global model before local training (the pre-round baseline), each equal to the
    # unscaled held-out accuracy of that model times 10.
    from ftis.algos.fgrpo.client import HeldOutBatch, ScaledTask

    plain = LocalClient(cfg, 1)
    plain.held_out = HeldOutBatch(ScaledTask(client.task, 1.0), 8)
    for params, value in ((theta, r1.performance_before), (after, r1.performance)):
        load_params(plain.node.model, params)
        assert value == 10.0 * plain._performance(1)
    assert r1.metrics["fgrpo/performance_before"] == r1.performance_before
    m = client.evaluate(theta, 0)
    assert m["eval/size"] == 16 and (16 * m["eval/accuracy"]).is_integer()

"""RandOpt and CoRP (docs/randopt.md): bit-identical perturbations across processes, candidates
applied from a stored copy, both algorithms through the node shell (rows, direction file, exact
resume), a collaborative population that ends with the same weights on every party, and
malformed or non-finite reward vectors rejected and counted."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import subprocess
import sys
import threading
import zlib

import pytest
import torch
import yaml

from ftis.algos.randopt.perturb import Perturber, load_direction, rebuild, weights_sha256
from ftis.config import ConfigError, RunConfig, load_config
from ftis.core.population import seeded_noise
from ftis.exchange.population import payload_size
from ftis.exchange.transport import TransportStats
from ftis.models.config import LoraConfig
from ftis.models.loading import ModelConfig, attach_lora, build_model
from ftis.train.loop import SimulatedCrash, train_node
from tests.conftest import tiny_run_config

VOLATILE = ("time/", "train/step_seconds", "train/elapsed_seconds", "memory/", "population/perturb")


def _cfg(kind: str = "corp", steps: int | None = None, **algo) -> dict:
    """A population run of seconds: llama-xs, 6 members scored 3 per step on 8 problems."""
    data = tiny_run_config()
    a = {"kind": kind, "population": 6, "per_step": 3, "sigmas": [0.002, 0.01]}
    a.update({"support_size": 8, "top_k": 3})
    if kind == "corp":
        a.update({"probe_size": 8, "quantiles": [0.5], "betas": [10.0], "alphas": [1.0, 2.0]})
    a.update(algo)
    data["algorithm"] = a
    stage0 = math.ceil(a["population"] / a["per_step"])
    data["train"]["steps"] = steps or stage0 + (kind == "corp")
    data["eval"] = {"every": 0, "size": 16, "pass_samples": 0}
    return data


def _rows(run_dir, node: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if node is None or r["node"] == node]


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


# ---------------------------------------------------------------- perturbations from seeds

_REBUILD = """
import hashlib, json, sys
import torch
from ftis.algos.randopt.perturb import rebuild, weights_sha256
from ftis.core.population import seeded_noise

def model():
    # torch only (fast to import): embeddings, a norm, linear layers; weights set from float64
    # draws, so the base is the same on every kernel too (torch's float32 init may not be)
    m = torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 33)
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(torch.float32))
    return m

print(torch.backends.cpu.get_cpu_capability())
noise = b"".join(e.numpy().tobytes() for e in seeded_noise(123, [(4096,), (7,), (33, 16)]))
print(hashlib.sha256(noise).hexdigest())
stages = json.loads(sys.argv[1])
for stream in ("independent", "shared"):
    m = model()
    rebuild(m, stages, stream=stream)
    print(weights_sha256(m))
"""

STAGES = [[[123, 0.01, 0.6], [2**31 - 2, 0.002, -0.4]], [[7, 0.005, 1.5]]]


def _kernels() -> list[str]:
    """The CPU kernels torch can use here: default always, AVX2 where the CPU has it."""
    capability = torch.backends.cpu.get_cpu_capability()
    return ["default"] if capability in ("DEFAULT", "NO AVX") else ["default", "avx2"]


def test_perturbations_are_the_same_bits_on_every_cpu_kernel():
    """Fresh interpreters with torch's default and AVX2 kernels (ATEN_CPU_CAPABILITY; the float32
    randn of the two differs in 1569 of 4096 numbers) and different thread counts draw the same
    noise bytes and rebuild the same direction on the same base weights, for both noise streams:
    the same sha256, bit for bit, as this process."""
    kernels = _kernels()
    if len(kernels) < 2:
        pytest.skip("this CPU has no AVX2: only one kernel to compare")
    outputs = []
    for kernel, threads in (("default", "1"), ("avx2", "2"), ("avx2", "1")):
        env = {**os.environ, "OMP_NUM_THREADS": threads, "ATEN_CPU_CAPABILITY": kernel}
        out = subprocess.run(
            [sys.executable, "-c", _REBUILD, json.dumps(STAGES)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        lines = out.stdout.split()
        assert lines[0] == kernel.upper()  # the kernel really was the one asked for
        outputs.append(lines[1:])
    scope: dict = {}
    exec(_REBUILD.split("print(torch.backends")[0], scope)  # the same model() here
    noise = b"".join(e.numpy().tobytes() for e in seeded_noise(123, [(4096,), (7,), (33, 16)]))
    here = [hashlib.sha256(noise).hexdigest()]
    for stream in ("independent", "shared"):
        m = scope["model"]()
        rebuild(m, STAGES, stream=stream)
        here.append(weights_sha256(m))
    assert outputs[0] == outputs[1] == outputs[2] == here
    assert here[1] != here[2] != weights_sha256(scope["model"]())


def test_float32_randn_differs_between_kernels_so_the_test_above_can_fail():
    """The reproduction behind the float64 draw: torch's own float32 randn, same seed, default
    against AVX2 kernel, differs (if a torch release ever makes them agree, this says so)."""
    if len(_kernels()) < 2:
        pytest.skip("this CPU has no AVX2: only one kernel to compare")
    script = (
        "import hashlib, torch; g = torch.Generator().manual_seed(7); "
        "print(hashlib.sha256(torch.randn(4096, generator=g).numpy().tobytes()).hexdigest())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "ATEN_CPU_CAPABILITY": kernel},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout.strip()
        for kernel in ("default", "avx2")
    }
    assert len(digests) == 2


def test_candidates_are_applied_from_a_stored_copy_and_restored_exactly():
    model = build_model(ModelConfig(preset="llama-xs"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    p = Perturber(model)
    for seed in range(5):
        p.apply([(seed, 0.05, 1.0)])
    p.apply([(1, 0.05, 1.0)])
    once = weights_sha256(model)
    p.restore()
    assert all(torch.equal(before[n], q) for n, q in model.named_parameters())
    p.apply([(1, 0.05, 1.0)])  # a candidate does not depend on what was applied before
    assert weights_sha256(model) == once


def test_lora_nodes_perturb_their_adapters_only():
    model = attach_lora(build_model(ModelConfig(preset="llama-xs")), LoraConfig(r=4, alpha=8))
    frozen = {n: q.detach().clone() for n, q in model.named_parameters() if not q.requires_grad}
    adapters = {n: q.detach().clone() for n, q in model.named_parameters() if q.requires_grad}
    p = Perturber(model)
    assert [n for n, _ in p.named] == sorted(adapters) and all("lora_" in n for n in adapters)
    p.apply([(3, 0.1, 1.0)])
    named = dict(model.named_parameters())
    assert all(torch.equal(named[n], v) for n, v in frozen.items())
    assert all(not torch.equal(named[n], v) for n, v in adapters.items())
    p.restore()
    assert all(torch.equal(named[n], v) for n, v in adapters.items())


# ---------------------------------------------------------------- through the node shell


def test_corp_runs_through_the_shell_and_its_saved_direction_rebuilds_the_checkpoint(tmp_path):
    cfg = RunConfig.model_validate(_cfg(validation_gate=False))  # always applied
    res = train_node(cfg, rank=0, run_dir=tmp_path)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[3]
    assert res.first_eval["eval/accuracy"] == rows[0]["eval/accuracy"]
    for r in rows[1:3]:
        assert r["population/scored"] == 3 and r["population/perturbations_per_second"] > 0
        assert 0 <= r["reward/mean"] <= 1 and "time/score" in r
    assert rows[1]["train/forward_tokens"] > 0
    totals = [r["train/forward_tokens_total"] for r in rows[1:]]
    assert totals == sorted(totals) and totals[-1] == sum(
        r["train/forward_tokens"] for r in rows[1:]
    )
    last = rows[3]
    assert last["corp/alpha"] in (1.0, 2.0) and last["corp/q"] == 0.5
    assert {"eval/randopt/vote_accuracy", "eval/randopt/best_accuracy"} <= set(last)
    sha = last["population/weights_sha256"]

    node_dir = tmp_path / "nodes" / "xs"
    stages, meta = load_direction(node_dir / "corp-direction.json")
    assert meta["weights_sha256"] == sha and len(stages) == 1 and stages[0]
    assert all(t[2] > 0 for t in stages[0])  # softmax weights times a positive alpha
    # The ordinary checkpoint holds exactly theta_0 + the saved direction.
    from ftis.train.checkpoint import load_latest_checkpoint
    from ftis.train.node import build_node

    node = build_node(cfg.nodes[0], rank=0, task_cfg=cfg.task)
    assert weights_sha256(node.model) == meta["base_sha256"]
    rebuild(node.model, stages, stream=meta["stream"])
    assert weights_sha256(node.model) == sha
    fresh = build_node(cfg.nodes[0], rank=0, task_cfg=cfg.task)
    load_latest_checkpoint(fresh, node_dir)
    assert weights_sha256(fresh.model) == sha


@pytest.mark.parametrize(("candidate", "applied"), [(0.5, True), (0.25, False), (0.1, False)])
def test_corp_applies_its_candidate_only_if_it_beats_the_base_on_validation(
    tmp_path, monkeypatch, candidate, applied
):
    """The validation gate (docs/math.md §10.4). Rewards are scripted: on the probe split every
    candidate scores 0.75 against the base's 0.5 (the best is always chosen), on the held-out
    validation split the base scores 0.25 and every candidate `candidate`. Applied only when
    strictly better (0.5); at 0.25 (a tie) or 0.1 the base model is kept: its weights are
    theta_0 bit for bit, the saved direction's stage is empty and rebuilds theta_0."""
    from ftis.algos.randopt import algorithm as alg

    def scripted(self, ps):
        at_base = weights_sha256(self.node.model) == self.base_sha
        if ps is self.validation:
            return (0.25 if at_base else candidate), 1, 0
        if ps is self.probe:
            return (0.5 if at_base else 0.75), 1, 0
        return 0.0, 1, 0  # the support set (stage 0)

    monkeypatch.setattr(alg.PopulationAlgorithm, "_mean_reward", scripted)
    cfg = RunConfig.model_validate(_cfg())
    train_node(cfg, rank=0, run_dir=tmp_path)
    last = _rows(tmp_path)[3]
    assert last["corp/probe_reward"] == 0.75 and last["corp/probe_base"] == 0.5
    assert (last["corp/validation_base"], last["corp/validation_reward"]) == (0.25, candidate)
    assert last["corp/applied"] == float(applied)
    stages, meta = load_direction(tmp_path / "nodes" / "xs" / "corp-direction.json")
    assert meta["choice"]["applied"] is applied and len(stages) == 1
    assert bool(stages[0]) is applied
    assert (last["population/weights_sha256"] == meta["base_sha256"]) is not applied
    from ftis.train.node import build_node

    node = build_node(cfg.nodes[0], rank=0, task_cfg=cfg.task)
    rebuild(node.model, stages, stream=meta["stream"])
    assert weights_sha256(node.model) == last["population/weights_sha256"]


def test_randopt_answers_with_the_top_k_majority_vote(tmp_path):
    cfg = RunConfig.model_validate(_cfg("randopt"))
    train_node(cfg, rank=0, run_dir=tmp_path)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/randopt/k" not in rows[0]  # step 0: the base model itself
    last = rows[2]
    assert last["eval/randopt/k"] == 3 and "eval/randopt/best_accuracy" in last
    assert {"eval/accuracy", "eval/test/accuracy", "eval/ood/accuracy"} <= set(last)
    assert len(last["population/ensemble_sha256"]) == 64
    doc = json.loads((tmp_path / "nodes" / "xs" / "population.json").read_text())
    assert len(doc["members"]) == 6 and all(m["pooled"] is not None for m in doc["members"])
    # the weights are untouched: RandOpt never moves theta_0
    assert doc["base_sha256"] == weights_sha256(_built(cfg).model)


def _built(cfg: RunConfig):
    from ftis.train.node import build_node

    return build_node(cfg.nodes[0], rank=0, task_cfg=cfg.task)


def test_a_crashed_corp_run_resumes_exactly(tmp_path):
    data = _cfg(population=9)  # 3 scoring steps + consolidation
    data["checkpoint"] = {"every": 1, "keep": 5}
    whole, part = tmp_path / "whole", tmp_path / "part"
    train_node(RunConfig.model_validate(data), rank=0, run_dir=whole)
    crashing = {**data, "testing": {"crash_at_step": {"xs": 3}}}
    with pytest.raises(SimulatedCrash):
        train_node(RunConfig.model_validate(crashing), rank=0, run_dir=part)
    train_node(RunConfig.model_validate(data), rank=0, run_dir=part, resume=True)
    a, b = _rows(whole), _rows(part)
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert _stable(x) == _stable(y), x["step"]


# ---------------------------------------------------------------- collaboration


class _Hub:
    """An in-process meeting point: every rank posts its payload of a round and waits for all."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.cond = threading.Condition()
        self.posts: dict[tuple[int, int], bytes] = {}


class _HubTransport:
    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank, self.world_size = hub, rank, hub.n
        self.stats = TransportStats()

    def exchange(self, round_, payload, *, max_bytes):
        h = self.hub
        with h.cond:
            h.posts[(round_, self.rank)] = payload
            h.cond.notify_all()
            assert h.cond.wait_for(
                lambda: all((round_, p) in h.posts for p in range(h.n)), timeout=300
            )
        self.stats.bytes_sent += len(payload)
        got = {p: h.posts[(round_, p)] for p in range(h.n) if p != self.rank}
        self.stats.bytes_received += sum(len(d) for d in got.values())
        return {p: d if len(d) <= max_bytes else None for p, d in got.items()}

    def ready(self):
        pass

    def close(self):
        pass


def test_two_parties_with_private_task_mixes_pool_rewards_and_end_with_the_same_weights(
    tmp_path, monkeypatch
):
    data = _cfg(node_tasks={"ys": {"min_digits": 2}})
    data["nodes"].append({**data["nodes"][0], "name": "ys"})
    cfg = RunConfig.model_validate(data)
    _built(cfg)  # warm start once, before the threads (it seeds torch's global RNG)
    # transformers' model loading is not thread-safe: the two threads build their nodes in turn
    from ftis.train import loop
    from ftis.train.node import build_node

    lock = threading.Lock()

    def build_in_turn(*args, **kwargs):
        with lock:
            return build_node(*args, **kwargs)

    monkeypatch.setattr(loop, "build_node", build_in_turn)
    hub = _Hub(2)
    errors: list[BaseException] = []

    def run(rank):
        try:
            train_node(cfg, rank=rank, run_dir=tmp_path, transport=_HubTransport(hub, rank))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    xs, ys = _rows(tmp_path, "xs"), _rows(tmp_path, "ys")
    for s in (1, 2):
        assert xs[s]["population/contributors"] == ys[s]["population/contributors"] == 2
        assert xs[s]["reward/pooled_mean"] == ys[s]["reward/pooled_mean"]
        assert xs[s]["exchange/bytes_sent"] == payload_size(3)  # 3 rewards: 76 bytes
    assert xs[3]["population/weights_sha256"] == ys[3]["population/weights_sha256"]
    assert xs[3]["corp/leader"] == ys[3]["corp/leader"] == 0
    px = json.loads((tmp_path / "nodes" / "xs" / "population.json").read_text())
    py = json.loads((tmp_path / "nodes" / "ys" / "population.json").read_text())
    assert px["members"] == py["members"]
    # private support sets: each party scored its own problems of its own task mix (the tiny
    # model's rewards may all be 0, so the sets themselves are compared, not the rewards)
    from ftis.algos.randopt.scoring import private_sets
    from ftis.tasks import build_task

    node = _built(cfg)
    a = cfg.algorithm
    sets = [
        private_sets(
            build_task(a.node_task(cfg, n)), node, seed=a.seed, name=n, support=8, probe=8
        )[0]
        for n in ("xs", "ys")
    ]
    questions = [{str(p) for p in ps.problems} for ps in sets]
    assert len(questions[0]) == len(questions[1]) == 8 and not questions[0] & questions[1]


class _ScriptedPeer:
    """Rank 0's view of a world of two whose peer (rank 1) sends what `script[round]` makes of
    rank 0's own payload; rounds without an entry: the peer is silent (lost)."""

    rank, world_size = 0, 2

    def __init__(self, script) -> None:
        self.script = script
        self.stats = TransportStats()

    def exchange(self, round_, payload, *, max_bytes):
        make = self.script.get(round_)
        return {} if make is None else {1: make(payload)}

    def ready(self):
        pass

    def close(self):
        pass


_HEADER = struct.Struct("<4sBBHQIII16sI")


def _forged(payload: bytes, *, values=None, base=None) -> bytes:
    """Rank 0's payload with other values or base digest, resealed with a valid checksum."""
    fields = list(_HEADER.unpack_from(payload))
    n = fields[6]
    old = struct.unpack_from(f"<{n}d", payload, _HEADER.size)
    if base is not None:
        fields[8] = base
    body = _HEADER.pack(*fields) + struct.pack(f"<{n}d", *(values or old))
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.chaos_case("CoRP", "malformed reward vectors")
def test_malformed_and_non_finite_reward_vectors_are_rejected_counted_and_left_out(tmp_path):
    cfg = RunConfig.model_validate(_cfg("randopt", population=9))
    script = {
        1: lambda p: _forged(p, values=[0.5, float("nan"), 0.5]),
        2: lambda p: _forged(p, base=bytes(16)),
        3: lambda p: _forged(p, values=[1.0, 1.0, 1.0]),
    }
    train_node(cfg, rank=0, run_dir=tmp_path, transport=_ScriptedPeer(script))
    rows = _rows(tmp_path)
    assert [r["population/rejected"] for r in rows[1:]] == [1, 1, 0]
    assert [r["population/contributors"] for r in rows[1:]] == [1, 1, 2]
    assert rows[3]["population/rejected_total"] == 2
    members = json.loads((tmp_path / "nodes" / "xs" / "population.json").read_text())["members"]
    for i, m in enumerate(members):
        own = m["by_rank"]["0"]
        if i < 6:  # rounds 1 and 2: the peer was rejected, its rewards left out
            assert m["by_rank"].get("1") is None and m["pooled"] == own
        else:  # round 3: 8 own problems at `own`, 8 of the peer's at 1.0
            assert m["pooled"] == pytest.approx((own + 1.0) / 2, abs=1e-12)


def test_population_configs_say_what_is_wrong():
    with pytest.raises(ValueError, match="set train.steps=3"):
        RunConfig.model_validate(_cfg(steps=5))
    two = _cfg()
    two["nodes"].append({**two["nodes"][0], "name": "ys", "model": {"preset": "qwen2-s"}})
    with pytest.raises(ValueError, match="same model"):
        RunConfig.model_validate(two)
    with pytest.raises(ValueError, match="node_tasks names unknown nodes"):
        RunConfig.model_validate(_cfg(node_tasks={"nobody": {}}))
    with pytest.raises(ValueError, match="sigmas"):
        RunConfig.model_validate(_cfg(sigmas=[0.0]))
    with pytest.raises(ValueError, match="top_k"):
        RunConfig.model_validate(_cfg(top_k=7))
    with pytest.raises(ConfigError, match="algorithm: quantiles"):
        load_config(None, ["algorithm.kind=corp", "algorithm.quantiles=[1.5]"])


@pytest.mark.chaos_case("CoRP", "kill one (hard exit, no goodbye)")
@pytest.mark.slow
def test_a_lost_party_is_left_out_and_the_others_still_agree(tmp_path):
    """Three processes over the store transport; c dies at the start of step 2. a and b pool
    without it from then on, consolidate, and end with the same weights; the run exits 1."""
    from typer.testing import CliRunner

    from ftis.cli import app

    data = _cfg()
    data["nodes"] = [{**data["nodes"][0], "name": n} for n in "abc"]
    data["algorithm"]["node_tasks"] = {"b": {"min_digits": 2}}
    data["testing"] = {"crash_at_step": {"c": 2}}
    data["exchange"] = {"timeout_s": 120}
    path = tmp_path / "pop.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", str(path), "--out", str(out)])
    assert res.exit_code == 1, res.output
    rows = _rows(out)
    by = {(r["node"], r["step"]): r for r in rows}
    for n in "ab":
        assert by[n, 1]["population/contributors"] == 3
        assert by[n, 2]["population/contributors"] == by[n, 3]["population/contributors"] == 2
    assert by["a", 3]["population/weights_sha256"] == by["b", 3]["population/weights_sha256"]
    assert ("c", 2) not in by


def test_a_party_whose_noise_differs_is_refused_at_the_first_exchange(
    tmp_path, monkeypatch, caplog
):
    """Run 1: an honest peer (rank 1 sends rank 0's own digest) is pooled. Run 2: rank 0 draws
    its noise with torch's float32 randn (what another CPU kernel would give: other bits from
    the same seeds); the peer's honest digest no longer matches rank 0's digest of its rebuilt
    weights, so rank 0 refuses it in every round with an error naming the cause."""
    import ftis.core.population as population

    cfg = RunConfig.model_validate(_cfg("randopt", population=6))
    honest: list[bytes] = []

    def echo(p: bytes) -> bytes:
        honest.append(_HEADER.unpack_from(p)[8])
        return p

    train_node(cfg, rank=0, run_dir=tmp_path / "a", transport=_ScriptedPeer({1: echo, 2: echo}))
    assert [r["population/rejected"] for r in _rows(tmp_path / "a")[1:]] == [0, 0]

    def float32_noise(seed, shapes, *, stream="independent"):
        g = torch.Generator().manual_seed(seed)
        for shape in shapes:
            if stream == "shared":
                g.manual_seed(seed)
            yield torch.randn(tuple(shape), generator=g, dtype=torch.float32)

    monkeypatch.setattr(population, "seeded_noise", float32_noise)
    peer = {r: (lambda p: _forged(p, base=honest[0])) for r in (1, 2)}
    train_node(cfg, rank=0, run_dir=tmp_path / "b", transport=_ScriptedPeer(peer))
    rows = _rows(tmp_path / "b")
    assert [r["population/rejected"] for r in rows[1:]] == [1, 1]
    assert [r["population/contributors"] for r in rows[1:]] == [1, 1]
    assert "rebuilds other weights from the same seeds" in caplog.text

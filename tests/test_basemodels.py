"""Shipped base models (ftis.basemodels): used in place of a local warm start, refused when their
bytes do not match the manifest, and the same step-0 numbers under different CPU kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ftis.basemodels as basemodels
import ftis.warmstart as warmstart_mod
from ftis.basemodels import ShippedBaseError, find_shipped, sha256_file, shipped_bases, verify
from ftis.models.loading import ModelConfig, build_model
from ftis.models.saving import save_model
from ftis.models.tokenizer import char_tokenizer
from ftis.study.bases import build, default_sources, referenced_warm_starts
from ftis.tasks import ArithmeticTaskConfig
from ftis.warmstart import WarmStartConfig, base_key, cache_key, warm_start

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"

MODEL = ModelConfig(preset="llama-xs")
WS = WarmStartConfig(steps=2, batch_size=4)
TASK = ArithmeticTaskConfig(test_size=8)


def _fake_root(tmp_path: Path) -> Path:
    """A package root holding one shipped base for (MODEL, WS, TASK): a random-init llama-xs
    (not what the warm start would train, so that a copy is told from a training)."""
    root = tmp_path / "shipped"
    key = base_key(MODEL, WS, TASK)
    entry = root / f"llama-xs-{key}"
    torch.manual_seed(123)
    save_model(build_model(ModelConfig(preset="llama-xs", init_seed=123)), entry)
    char_tokenizer().save_pretrained(entry)
    files = {f.name: sha256_file(f) for f in sorted(entry.iterdir())}
    info = {
        "key": key,
        "files": files,
        "warm_start": WS.model_dump(mode="json"),
        "task": TASK.model_dump(mode="json"),
        "used_by": ["a.yaml"],
    }
    manifest = {"format": 1, "entries": {entry.name: info}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    root = _fake_root(tmp_path)
    monkeypatch.setattr(basemodels, "ROOT", root)
    monkeypatch.setenv("FTIS_CACHE", str(tmp_path / "cache"))
    return root


def _no_training(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("trained locally although a shipped base exists")

    monkeypatch.setattr(warmstart_mod, "_train_and_cache", fail)


def test_base_key_leaves_out_torch_version_and_device_only():
    assert base_key(MODEL, WS, TASK) == base_key(
        MODEL.model_copy(update={"device": "cpu"}), WS, TASK
    )
    assert base_key(MODEL, WS, TASK) != base_key(MODEL, WS.model_copy(update={"seed": 1}), TASK)
    assert base_key(MODEL, WS, TASK) != base_key(
        MODEL.model_copy(update={"init_seed": 1}), WS, TASK
    )
    assert base_key(MODEL, WS, TASK) != base_key(MODEL, WS, TASK.model_copy(update={"seed": 1}))
    # the local cache key still tells devices (and torch versions) apart
    assert cache_key(MODEL, WS, TASK) != cache_key(
        MODEL.model_copy(update={"device": "cpu"}), WS, TASK
    )


def test_shipped_base_is_copied_into_the_cache_without_training(shipped, monkeypatch):
    _no_training(monkeypatch)
    entry = find_shipped(base_key(MODEL, WS, TASK))
    path = warm_start(MODEL, WS, TASK)
    assert path.name == f"llama-xs-{cache_key(MODEL, WS, TASK)}"  # where callers expect it
    for f, digest in entry.files.items():
        assert sha256_file(path / f) == digest
    assert json.loads((path / "meta.json").read_text())["shipped"] == entry.name
    assert warm_start(MODEL, WS, TASK) == path  # then a cache hit


def test_a_locally_trained_entry_is_replaced_by_the_shipped_base(shipped, monkeypatch):
    entry = find_shipped(base_key(MODEL, WS, TASK))
    local = warm_start(MODEL, WS, TASK, use_shipped=False)  # trained here (2 steps)
    assert "shipped" not in json.loads((local / "meta.json").read_text())
    assert sha256_file(local / "model.safetensors") != entry.files["model.safetensors"]
    _no_training(monkeypatch)
    path = warm_start(MODEL, WS, TASK)
    assert path == local
    assert sha256_file(path / "model.safetensors") == entry.files["model.safetensors"]


def test_build_trains_here_even_over_a_shipped_copy(shipped):
    path = warm_start(MODEL, WS, TASK)  # the shipped copy
    rebuilt = warm_start(MODEL, WS, TASK, use_shipped=False)
    assert rebuilt == path
    meta = json.loads((rebuilt / "meta.json").read_text())
    assert "shipped" not in meta and meta["steps"] == WS.steps


def test_a_shipped_base_whose_bytes_differ_from_the_manifest_is_refused(shipped, monkeypatch):
    _no_training(monkeypatch)
    entry = find_shipped(base_key(MODEL, WS, TASK))
    weights = entry.path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    with pytest.raises(ShippedBaseError, match=r"model\.safetensors has sha256 .*reinstall ftis"):
        warm_start(MODEL, WS, TASK)
    weights.unlink()
    with pytest.raises(ShippedBaseError, match=r"model\.safetensors is missing"):
        warm_start(MODEL, WS, TASK)


def test_build_writes_entries_the_lookup_finds(tmp_path, monkeypatch):
    monkeypatch.setenv("FTIS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    uses = referenced_warm_starts([], embedded_default=False)
    assert uses == {}
    from ftis.study.bases import WarmStartUse

    key = base_key(MODEL, WS, TASK)
    built = build({key: WarmStartUse(MODEL, WS, TASK, {"a.yaml"})}, out=out)
    assert built == [f"llama-xs-{key}"]
    (entry,) = shipped_bases(out)
    verify(entry)
    assert entry.key == key and entry.info["used_by"] == ["a.yaml"]
    assert entry.info["built_with"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(entry.files) >= {"config.json", "model.safetensors", "tokenizer.json"}

    # Built again from another config: the shipped bits stay, the new user is recorded.
    weights = entry.path / "model.safetensors"
    before = weights.read_bytes()
    _no_training(monkeypatch)
    assert build({key: WarmStartUse(MODEL, WS, TASK, {"b.yaml"})}, out=out) == []
    (entry,) = shipped_bases(out)
    assert entry.info["used_by"] == ["a.yaml", "b.yaml"] and weights.read_bytes() == before
    # Built from every committed source: exactly the configs that use it now (a.yaml no longer)
    build({key: WarmStartUse(MODEL, WS, TASK, {"c.yaml"})}, out=out, every_source=True)
    (entry,) = shipped_bases(out)
    assert entry.info["used_by"] == ["c.yaml"] and weights.read_bytes() == before
    # A damaged copy is not kept: it is built again (here from the local cache, no training).
    weights.write_bytes(before[:-1])
    assert build({key: WarmStartUse(MODEL, WS, TASK, {"b.yaml"})}, out=out) == [f"llama-xs-{key}"]
    verify(shipped_bases(out)[0])


def test_every_committed_warm_start_is_shipped_and_intact():
    """The embedded default, configs/ and studies/: a config whose warm start changes (or a new
    task field that changes every key) needs `ftis basemodels build` and a check of the
    documented step-0 numbers."""
    uses = referenced_warm_starts(default_sources(REPO), relative_to=REPO)
    missing = []
    for key, use in uses.items():
        entry = find_shipped(key)
        if entry is None:
            missing.append(f"{use.model.preset}-{key} ({', '.join(sorted(use.sources))})")
        else:
            verify(entry)
    assert not missing, "not shipped; run `ftis basemodels build`: " + "; ".join(missing)


STEP0 = textwrap.dedent(
    """
    import hashlib, json, sys, types, torch
    from ftis.config import EvalConfig, load_config
    from ftis.models.loading import ModelConfig, build_model, load_tokenizer
    from ftis.rollout.sampler import left_pad, sample
    from ftis.tasks import build_task
    from ftis.train.evaluate import evaluate
    from ftis.warmstart import warm_start

    cfg = load_config(None)  # the embedded default's small node, from its shipped base
    node_cfg = cfg.nodes[0]
    model_cfg = ModelConfig(path=str(warm_start(node_cfg.model, node_cfg.warm_start, cfg.task)))
    model, tok = build_model(model_cfg), load_tokenizer(model_cfg)
    task = build_task(cfg.task)
    node = types.SimpleNamespace(model=model, tokenizer=tok)
    ev = EvalConfig(size=48, pass_samples=4, pass_k=[1, 4], pass_problems=12)
    metrics = evaluate(node, task, ev, cfg.train, seed=0)
    ds = task.split("test")
    prompts = [task.prompt_ids(ds[j], tok) for j in range(8)]
    s = sample(model, prompts, num_samples=4, max_new_tokens=8, eos_id=tok.eos_token_id,
               pad_id=tok.pad_token_id, temperature=1.0, generator=torch.Generator().manual_seed(0))
    ids, mask = left_pad(prompts, tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    digest = lambda t: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
    print(json.dumps({
        "capability": torch.backends.cpu.get_cpu_capability(),
        "weights": digest(torch.cat([p.detach().flatten() for p in model.parameters()])),
        "metrics": metrics,
        "completions": digest(s.completion_ids),
        "logits": digest(logits),
    }))
    """
)


def test_step0_eval_of_a_shipped_base_is_identical_under_default_and_avx2_kernels(tmp_path):
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no AVX2 kernels to compare with the default ones")
    procs = {}
    for cap in ("default", "avx2"):
        env = {
            **os.environ,
            "ATEN_CPU_CAPABILITY": cap,
            "PYTHONPATH": str(SRC),
            "OMP_NUM_THREADS": "1",
            "FTIS_CACHE": str(tmp_path / cap),
        }
        procs[cap] = subprocess.Popen(
            [sys.executable, "-c", STEP0], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
    out = {}
    for cap, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr.decode()[-2000:]
        out[cap] = json.loads(stdout.decode().strip().splitlines()[-1])
    assert out["default"]["capability"] == "DEFAULT" and out["avx2"]["capability"] == "AVX2"
    # The kernels really differ (the logits differ in their last bits) ...
    assert out["default"]["logits"] != out["avx2"]["logits"]
    # ... yet the weights, the step-0 accuracies, pass@k and the sampled completions agree.
    assert out["default"]["weights"] == out["avx2"]["weights"]
    assert out["default"]["metrics"] == out["avx2"]["metrics"]
    assert out["default"]["completions"] == out["avx2"]["completions"]


def test_cli_lists_shipped_bases_and_fails_on_a_damaged_one(shipped):
    from typer.testing import CliRunner

    from ftis.cli import app

    entry = find_shipped(base_key(MODEL, WS, TASK))
    ok = CliRunner().invoke(app, ["basemodels", "list"], env={"COLUMNS": "250"})
    assert ok.exit_code == 0, ok.output
    assert entry.name in ok.output and "MISMATCH" not in ok.output
    (entry.path / "config.json").write_text("{}")
    bad = CliRunner().invoke(app, ["basemodels", "list"], env={"COLUMNS": "250"})
    assert bad.exit_code == 1
    assert "MISMATCH" in bad.output and "config.json has sha256" in bad.output


def test_a_warm_start_that_is_not_shipped_is_trained_here_and_says_so_once(shipped, caplog):
    other = WS.model_copy(update={"steps": 1})
    assert find_shipped(base_key(MODEL, other, TASK)) is None
    with caplog.at_level("INFO", logger="ftis.warmstart"):
        path = warm_start(MODEL, other, TASK)
        assert warm_start(MODEL, other, TASK) == path
    notes = [r for r in caplog.records if "is not shipped with ftis" in r.getMessage()]
    assert len(notes) == 1 and "specific to this CPU" in notes[0].getMessage()
    assert "shipped" not in json.loads((path / "meta.json").read_text())

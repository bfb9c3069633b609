"""Checkpoints: complete round trips (weights, optimizer, python/torch/CUDA RNGs, algorithm
state), safe loading (no code runs), checksums with fallback to the newest checkpoint that
verifies, and version 1 checkpoints (docs/RELIABILITY.md)."""

from __future__ import annotations

import json
import logging
import os
import random
import time
from pathlib import Path

import pytest
import torch

from ftis.train import checkpoint as ckpt_mod
from tests.conftest import tiny_node


def _touch(path: str) -> None:
    Path(path).write_text("pwned")


class _Evil:
    """Unpickling this runs `_touch(marker)`: what a hostile trainer_state.pt could do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (_touch, (self.marker,))


def _trained_node():
    """A tiny node after one optimizer step, so that weights and Adam state are non-trivial."""
    node = tiny_node()
    ids = torch.tensor([[1, 2, 3, 4]])
    node.model(ids, labels=ids).loss.backward()
    node.optimizer.step()
    node.optimizer.zero_grad()
    return node


def _params(node) -> list[torch.Tensor]:
    return [p.detach().clone() for p in node.model.parameters()]


def _same(a: list[torch.Tensor], b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _bump(node) -> None:
    with torch.no_grad():
        for p in node.model.parameters():
            p.add_(1.0)


def _flip_bytes(path: Path, n: int = 16) -> None:
    """Corrupt the last `n` bytes of a file (tensor data, for a .safetensors)."""
    data = bytearray(path.read_bytes())
    for i in range(len(data) - n, len(data)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _weights_file(ckpt: Path) -> Path:
    (path,) = sorted((ckpt / "model").glob("*.safetensors"))
    return path


def _rehash(ckpt: Path, rel: str) -> None:
    """Record the current sha256 of `rel` in meta.json (a well-formed but hostile checkpoint)."""
    meta = json.loads((ckpt / "meta.json").read_text())
    if "checksums" in meta:
        meta["checksums"][rel] = ckpt_mod._sha256(ckpt / rel)
        (ckpt / "meta.json").write_text(json.dumps(meta))


def _age(ckpt: Path, seconds: float = 60.0) -> None:
    """Set every file's mtime into the past (as for a checkpoint written before a restart)."""
    past = time.time() - seconds
    for p in ckpt.rglob("*"):
        os.utime(p, (past, past))


def test_round_trip_restores_weights_optimizer_rngs_and_algorithm_state(tmp_path):
    node = _trained_node()
    algo = {"ema": torch.arange(3.0), "n": 3, "name": "f-tis", "hist": [1.5, (2, "x")]}
    random.seed(1)
    torch.manual_seed(2)
    ckpt = ckpt_mod.save_checkpoint(
        node, tmp_path, 7, keep=2, counters={"generated_tokens_total": 11}, algorithm_state=algo
    )
    weights, optim = _params(node), node.optimizer.state_dict()
    draws = (random.random(), torch.rand(4))
    fresh = tiny_node()
    _bump(fresh)
    random.seed(99)
    torch.manual_seed(99)
    state = ckpt_mod.load_checkpoint(fresh, ckpt)
    assert state["step"] == 7 and state["counters"] == {"generated_tokens_total": 11.0}
    assert _same(weights, fresh.model.parameters())
    loaded = fresh.optimizer.state_dict()["state"]
    for k, v in optim["state"].items():
        assert all(torch.equal(v[n], loaded[k][n]) for n in ("exp_avg", "exp_avg_sq", "step"))
    assert random.random() == draws[0] and torch.equal(torch.rand(4), draws[1])
    assert torch.equal(state["algorithm"].pop("ema"), algo["ema"])
    assert state["algorithm"] == {"n": 3, "name": "f-tis", "hist": [1.5, (2, "x")]}
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["version"] == 2 and "trainer_state.pt" in meta["checksums"]


def test_algorithm_state_must_be_plain_data(tmp_path):
    node = tiny_node()
    with pytest.raises(TypeError, match=r"algorithm_state\['bad'\]\[1\] is a builtins.object"):
        ckpt_mod.save_checkpoint(node, tmp_path, 1, keep=2, algorithm_state={"bad": [1, object()]})
    assert not list(tmp_path.glob("step-*"))


def test_cuda_rng_states_round_trip(tmp_path, monkeypatch):
    """Faked CUDA on a CPU-only machine: the device RNG states are saved and restored."""
    saved = [torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([4, 5], dtype=torch.uint8)]
    restored: list = []
    node, fresh = tiny_node(), tiny_node()  # built on the CPU before CUDA is faked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in saved])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    ckpt = ckpt_mod.save_checkpoint(node, tmp_path, 1, keep=2)
    ckpt_mod.load_checkpoint(fresh, ckpt)
    assert len(restored) == 2 and all(map(torch.equal, restored, saved))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_rng_round_trips_on_a_gpu(tmp_path):
    node = tiny_node()
    torch.cuda.manual_seed_all(3)
    ckpt = ckpt_mod.save_checkpoint(node, tmp_path, 1, keep=2)
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(4)
    ckpt_mod.load_checkpoint(tiny_node(), ckpt)
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def test_a_hostile_trainer_state_runs_no_code(tmp_path):
    marker = tmp_path / "marker"
    ckpt = ckpt_mod.save_checkpoint(tiny_node(), tmp_path / "n", 1, keep=2)
    torch.save({"version": 1, "step": 1, "payload": _Evil(marker)}, ckpt / "trainer_state.pt")
    _rehash(ckpt, "trainer_state.pt")  # checksums are integrity, not authenticity
    with pytest.raises(Exception) as err:
        ckpt_mod.load_checkpoint(tiny_node(), ckpt)
    assert not marker.exists(), "unpickling trainer_state.pt ran code"
    assert err.type is ckpt_mod.CheckpointError
    assert str(ckpt / "trainer_state.pt") in str(err.value)


def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    node = tiny_node()
    ckpt_mod.save_checkpoint(node, tmp_path, 1, keep=2)
    weights = _params(node)
    _bump(node)
    bad = _weights_file(ckpt_mod.save_checkpoint(node, tmp_path, 2, keep=2))
    _flip_bytes(bad)
    with caplog.at_level(logging.WARNING, logger=ckpt_mod.__name__):
        assert ckpt_mod.checkpoint_step(tmp_path) == 1
        assert ckpt_mod.latest_checkpoint(tmp_path).name == "step-000001"
        fresh = tiny_node()
        path, state = ckpt_mod.load_latest_checkpoint(fresh, tmp_path)
    assert path.name == "step-000001" and state["step"] == 1
    assert _same(weights, fresh.model.parameters())
    assert str(bad) in caplog.text and "sha256 mismatch" in caplog.text
    with pytest.raises(ckpt_mod.CheckpointError, match=bad.name):
        ckpt_mod.load_checkpoint(tiny_node(), bad.parent.parent)


def test_pruning_after_a_fallback_resume_keeps_the_checkpoint_resumed_from(tmp_path):
    """Issue 22: steps 10 (good) and 20 (damaged) exist; the run resumes from 10 and saves 15
    with keep=1. The damaged 20 must not count: 15 stays (and 10 goes as the older one); with
    keep=2 both 10 and 15 stay. Before the fix the newest directory names were kept, 20 among
    them, so the one just written (keep=1) or the one resumed from (keep=2) was deleted."""
    node = tiny_node()
    ckpt_mod.save_checkpoint(node, tmp_path, 10, keep=2)
    _flip_bytes(_weights_file(ckpt_mod.save_checkpoint(node, tmp_path, 20, keep=2)))
    assert ckpt_mod.checkpoint_step(tmp_path) == 10  # the fallback a resume takes
    ckpt_mod.save_checkpoint(node, tmp_path, 15, keep=2)
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == ["step-000010", "step-000015", "step-000020"]
    ckpt_mod.save_checkpoint(node, tmp_path, 16, keep=1)
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == ["step-000016", "step-000020"]
    assert ckpt_mod.checkpoint_step(tmp_path) == 16
    ckpt_mod.save_checkpoint(node, tmp_path, 20, keep=1)  # reaching its step replaces it
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000020"]
    assert ckpt_mod.checkpoint_step(tmp_path) == 20


def test_when_no_checkpoint_verifies_the_error_names_every_bad_file(tmp_path):
    node = tiny_node()
    first = _weights_file(ckpt_mod.save_checkpoint(node, tmp_path, 1, keep=2))
    second = ckpt_mod.save_checkpoint(node, tmp_path, 2, keep=2)
    _flip_bytes(first)
    gone = next(p for p in (second / "model").iterdir() if p.suffix == ".json")
    gone.unlink()
    for call in (ckpt_mod.checkpoint_step, ckpt_mod.latest_checkpoint):
        with pytest.raises(ckpt_mod.CheckpointError) as err:
            call(tmp_path)
        assert str(first) in str(err.value) and f"{gone}: missing" in str(err.value)
    with pytest.raises(ckpt_mod.CheckpointError, match="no usable checkpoint"):
        ckpt_mod.load_latest_checkpoint(tiny_node(), tmp_path)


def test_no_checkpoint_at_all_is_none(tmp_path):
    assert ckpt_mod.load_latest_checkpoint(tiny_node(), tmp_path) is None
    assert ckpt_mod.checkpoint_step(tmp_path) is None


def test_verification_is_cached_until_a_file_changes(tmp_path, monkeypatch):
    ckpt = ckpt_mod.save_checkpoint(tiny_node(), tmp_path, 1, keep=2)
    _age(ckpt)
    assert ckpt_mod.verify_checkpoint(ckpt) == []
    hashed = []
    real = ckpt_mod._sha256
    monkeypatch.setattr(ckpt_mod, "_sha256", lambda p: hashed.append(p) or real(p))
    assert ckpt_mod.verify_checkpoint(ckpt) == [] and hashed == []
    _flip_bytes(_weights_file(ckpt))
    assert "sha256 mismatch" in ckpt_mod.verify_checkpoint(ckpt)[0] and hashed


def test_version_1_checkpoints_still_load(tmp_path, caplog):
    node = tiny_node()
    ckpt = ckpt_mod.save_checkpoint(node, tmp_path, 3, keep=2)
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    state.pop("algorithm")
    torch.save({**state, "version": 1}, ckpt / "trainer_state.pt")
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["checksums"]
    (ckpt / "meta.json").write_text(json.dumps({**meta, "version": 1}))
    with caplog.at_level(logging.DEBUG, logger=ckpt_mod.__name__):
        assert ckpt_mod.checkpoint_step(tmp_path) == 3
        path, loaded = ckpt_mod.load_latest_checkpoint(tiny_node(), tmp_path)
    assert path.name == "step-000003" and loaded["step"] == 3 and loaded["algorithm"] == {}
    assert "without checksums" in caplog.text


def test_an_unknown_version_is_refused_with_its_file(tmp_path):
    ckpt = ckpt_mod.save_checkpoint(tiny_node(), tmp_path, 1, keep=2)
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "version": 9}))
    with pytest.raises(ckpt_mod.CheckpointError, match=r"meta.json: checkpoint version 9"):
        ckpt_mod.checkpoint_step(tmp_path)


def test_checksum_entries_cannot_point_outside_the_checkpoint(tmp_path):
    ckpt = ckpt_mod.save_checkpoint(tiny_node(), tmp_path / "n", 1, keep=2)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["checksums"]["../../outside"] = "0" * 64
    (ckpt / "meta.json").write_text(json.dumps(meta))
    assert ckpt_mod.verify_checkpoint(ckpt) == [
        f"{ckpt / 'meta.json'}: bad checksum entry '../../outside'"
    ]

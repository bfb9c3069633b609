"""The bf16 sampler (`train.sampler_dtype: bfloat16`, issue 38): a bf16 copy of the node's model
that always holds its current weights, log-probs recorded from what it actually sampled, the
mismatch against the f32 trainer reported in the rows, and training that still runs."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from typer.testing import CliRunner

from ftis.cli import app
from ftis.models.logprobs import completion_logprobs
from ftis.models.precision import SamplerCopy
from ftis.rollout.sampler import left_pad, sample
from tests.conftest import tiny_node, tiny_run_config


def test_the_copy_is_bf16_and_follows_every_change_of_the_weights():
    node = tiny_node()
    model = node.model
    copy = SamplerCopy(torch.bfloat16)
    first = copy.synced(model)
    assert {p.dtype for p in first.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in first.parameters())
    # buffers keep their dtype: RoPE's inverse frequencies stay f32 (in bf16 every angle
    # would carry an error growing with the position)
    buffers = dict(model.named_buffers())
    assert buffers, "the preset has no buffer to check"
    for name, b in first.named_buffers():
        assert b.dtype == buffers[name].dtype, name
    w = next(model.parameters())
    with torch.no_grad():
        w.add_(0.5)  # as an optimizer step, gossip averaging or a perturbation would
    again = copy.synced(model)
    assert again is first  # one copy, refreshed in place
    assert torch.equal(next(again.parameters()), w.detach().to(torch.bfloat16))
    assert node.sampling_model("float32") is model
    assert node.sampling_model("bfloat16") is not model


def test_recorded_logprobs_are_the_bf16_models_own():
    """What the sampler records is the log-prob of each drawn token under the bf16 model (a full
    forward pass of the copy gives them back), not the f32 model's: the gap is the mismatch."""
    node = tiny_node()
    bf16 = node.sampling_model("bfloat16")
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    out = sample(
        bf16,
        prompts,
        num_samples=3,
        max_new_tokens=5,
        eos_id=-1,
        pad_id=0,
        temperature=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(3)], 0)
    mask = torch.ones_like(out.completion_ids)
    with torch.no_grad():
        again = completion_logprobs(
            bf16,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=out.completion_ids,
            completion_mask=mask,
        )
        f32 = completion_logprobs(
            node.model,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=out.completion_ids,
            completion_mask=mask,
        )
    assert (out.logprobs - again).abs().max() < 0.05  # bf16 forward vs bf16 decode steps
    assert (out.logprobs - f32).abs().max() > 0  # another model: the mismatch TIS corrects


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_with_the_bf16_sampler_reports_its_mismatch(tmp_path, dtype):
    data = tiny_run_config(steps=3, prompts_per_step=8, sampler_dtype=dtype)
    data["nodes"][0]["warm_start"]["steps"] = 150  # enough skill for groups with a signal
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] >= 1 and r.get("train/optimizer_steps")]
    assert trained, "no optimizer step ran"
    k3 = [r["rollout/mismatch_k3"] for r in trained if "rollout/mismatch_k3" in r]
    if dtype == "float32":
        assert k3 == []  # no copy, nothing to report
    else:
        assert len(k3) == len(trained)
        assert all(0 < v < 1 for v in k3), k3  # bf16 rounding: small, never zero

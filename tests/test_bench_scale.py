"""The realistic-scale bench pieces (bench/scale.py, bench/scale_report.py) on tiny shapes, run
in-process: no timing is asserted, only that each measurement produces well-formed figures and
that the FLOP counts match hand-derived values."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import scale
from bench.scale_report import scale_section, scale_summary_rows
from ftis.models.loading import ModelConfig, build_model, count_parameters

TINY = dict(preset="llama-xs", prompts=2, group=2, micro_batch=2, length=4, steps=1, warmup=1)


def test_realistic_presets_have_at_least_20m_parameters():
    for name in ("llama-20m", "qwen2-25m"):
        total = count_parameters(build_model(ModelConfig(preset=name)))[1]
        assert total >= 20e6, name


def test_forward_flops_count_two_per_weight_per_token():
    # llama-xs: d = 64, 4 heads (hd 16), 2 kv heads, intermediate 192, 2 layers, V = 102.
    # Per layer: q 64*64 + k, v 2*64*32 + o 64*64 + gate, up 2*64*192 + down 192*64
    # = 4096 + 4096 + 4096 + 24576 + 12288 = 49152 weights; 2 layers: 98304.
    per_token = 2 * 98304
    assert scale.forward_flops("llama-xs", tokens=1, logits=0, attended=0) == per_token
    # One logit row: 2 * d * V = 2 * 64 * 102; one (query, key) pair: 4 * d per layer.
    assert scale.forward_flops("llama-xs", tokens=0, logits=1, attended=0) == 2 * 64 * 102
    assert scale.forward_flops("llama-xs", tokens=0, logits=0, attended=1) == 4 * 64 * 2
    # The layer weights counted are the model's own linear weights (without the embedding).
    model = build_model(ModelConfig(preset="llama-xs"))
    linear = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lm_head" not in name
    )
    assert 2 * linear == per_token


def test_update_flops_are_three_forward_passes():
    fwd = scale.forward_flops("llama-xs", tokens=3, logits=1, attended=6) + scale.forward_flops(
        "llama-xs", tokens=2 * 1, logits=2 * 1, attended=2 * 4
    )
    # one prompt of 3 tokens, two completions of 2 tokens: the completion pass runs 1 token per
    # row attending to 3 prompt positions + itself
    assert scale.update_flops("llama-xs", [3], 2, 2) == pytest.approx(3 * fwd)


def test_peak_rss_is_read_from_this_process():
    assert 10 < scale.peak_rss_mb() < 1e6


def test_ftis_step_worker_reports_phases_and_flops():
    r = scale.ftis_step(dict(TINY))
    for k in ("step", "sample", "score", "update", "step_cpu", "update_cpu"):
        assert len(r[k]) == 1 and r[k][0] > 0, k
    assert r["update_flops"] > r["sample_flops"] > 0


@pytest.mark.parametrize("method", scale.ROLLOUTS)
def test_rollout_worker_every_method(method, monkeypatch):
    import ftis.rollout.sampler as sampler_mod

    # the ablations replace the sampler's cache factory or decode step in their (child)
    # process: undo that here
    monkeypatch.setattr(sampler_mod, "preallocated_cache", sampler_mod.preallocated_cache)
    monkeypatch.setattr(sampler_mod, "decode_step", sampler_mod.decode_step)
    r = scale.rollout(dict(TINY, method=method, reps=1))
    assert len(r["s"]) == 1 and len(r["cpu_s"]) == 1


def test_matmul_peak_and_profile_workers():
    r = scale.matmul_peak(dict(preset="llama-xs", update_tokens=8, decode_rows=4, reps=1))
    assert r["update_peak_flops"] > 0 and r["decode_peak_flops"] > 0
    assert r["update_floor_s"] > 0 and r["decode_floor_s"] > 0
    assert r["decode_streamed_floor_s"] > 0 and "decode_attention_floor_s" not in r
    r = scale.matmul_peak(
        dict(preset="llama-xs", update_tokens=8, decode_rows=4, reps=1, context=5)
    )
    assert r["decode_attention_floor_s"] > 0
    p = scale.profile(dict(TINY, length=3))
    for phase in ("sample", "update"):
        q = p[phase]
        assert q["top_ops"] and 0 <= q["matmul_share"] <= 1.5
        assert q["outside_ops_share"] >= 0


def _fake_results() -> dict:
    s: dict = {
        "config": {
            "preset": "llama-20m", "prompts": 8, "group": 8, "micro_batch": 16,
            "lengths": [64], "rounds": 1, "warmup": 1, "steps": 1, "profile_length": 64,
        },
        "params_m": 23.3, "load_before": 1.0, "load_after": 1.5,
    }  # fmt: skip
    p = "len64_"
    for k in (
        "ftis_step_cpu_s", "ftis_sample_cpu_s", "ftis_score_cpu_s", "ftis_update_cpu_s",
        "trl_step_cpu_s", "trl_step_time_ratio", "trl_step_time_ratio_wall",
        "ftis_step_peak_rss_mb", "trl_step_peak_rss_mb", "matmul_peak_flops",
        "matmul_decode_peak_flops", "update_flops_per_s", "update_mfu", "update_matmul_floor_s",
        "sample_flops_per_s", "sample_mfu", "sample_mfu_decode_shapes", "sample_matmul_floor_s",
        "rollout_ftis_cpu_s", "rollout_hf_one_pass_cpu_s", "rollout_hf_two_pass_cpu_s",
        "rollout_time_ratio_one_pass", "rollout_time_ratio_two_pass",
        "rollout_ftis_tokens_per_s", "rollout_hf_one_pass_tokens_per_s",
        "rollout_time_ratio_one_pass_wall",
    ):  # fmt: skip
        s[p + k] = 0.5
    op = {"op": "aten::mm", "calls": 3, "s": 0.1, "share": 0.5}
    phase = dict(s=1.0, top_ops=[op], matmul_share=0.5, attention_share=0.1,
                 other_ops_share=0.2, outside_ops_share=0.2)  # fmt: skip
    s["profile"] = {"sample": phase, "update": phase}
    return s


def test_report_renders_every_figure_from_the_results():
    s = _fake_results()
    rows = scale_summary_rows(s)
    text = "\n".join(scale_section(s))
    assert len(rows) == 3 and all(r.startswith("| ") for r in rows)
    assert "## g. Realistic scale" in text and "## h. Hot spots" in text
    assert "`aten::mm`" in text and "**50%**" in text


def test_report_renders_the_floor_multiples_and_the_bf16_pair():
    s = _fake_results()
    p = "len64_"
    for k in ("rollout_floor_multiple", "update_floor_multiple", "step_floor_multiple"):
        s[p + k] = 1.25
    for k in (
        "bf16_ftis_step_cpu_s", "bf16_ftis_sample_cpu_s", "bf16_ftis_update_cpu_s",
        "bf16_trl_step_cpu_s", "trl_step_time_ratio_bf16", "bf16_step_floor_multiple",
        "bf16_update_matmul_floor_s", "bf16_sample_matmul_floor_s", "bf16_matmul_peak_flops",
    ):  # fmt: skip
        s[p + k] = 0.5
    rows = scale_summary_rows(s)
    assert len(rows) == 6
    assert "| 1.25x | <= 1.25 |" in rows[3] and "| 1.25x | <= 1.15 |" in rows[4]
    assert "both bf16" in rows[5] and "| 0.500 |" in rows[5]
    text = "\n".join(scale_section(s))
    assert "1.25x / 1.25x / 1.25x" in text and "ratio **0.500**" in text


def test_report_renders_the_streamed_floor_and_the_forward_ablation():
    s = _fake_results()
    p = "len64_"
    for k in ("rollout_floor_multiple", "update_floor_multiple", "step_floor_multiple"):
        s[p + k] = 1.25
    s[p + "sample_matmul_floor_s"], s[p + "rollout_ftis_cpu_s"] = 2.0, 4.0
    s[p + "sample_streamed_floor_s"], s[p + "rollout_streamed_floor_multiple"] = 3.0, 4 / 3
    s[p + "sample_attention_floor_s"], s[p + "rollout_decode_floor_multiple"] = 0.5, 4 / 3.5
    s[p + "rollout_ftis_forward_cpu_s"], s[p + "rollout_time_ratio_forward_step"] = 4.4, 0.909
    rows = scale_summary_rows(s)
    assert "against the streamed floor, weights read from memory every step: 1.33x" in rows[3]
    assert "plus attention's floor over the KV cache: 1.14x" in rows[3]
    text = "\n".join(scale_section(s))
    assert "| 4.40 |" in text and "| 0.909 |" in text
    assert "4.00 / 2.00 / 3.00 / 0.50" in text and "| 1.33x / 1.14x |" in text
    # (3 - 2) / 4 of the rollout is the weights' trip through memory, 0.5 / 4 attention
    assert "(25% of the rollout's time is that trip" in text and "0.50 s (12%)" in text
    assert "the remaining 0.50 s (12%) is everything else: norms" in text

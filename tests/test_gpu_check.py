"""scripts/gpu_check.py in its CPU dry-run mode: the GPU check's code path on a tiny shape."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def test_gpu_check_dry_run_prints_every_figure(capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--dry-run", "--length", "4", "--steps", "2"])
    for key in (
        "rollout_ftis_tokens_per_s",
        "rollout_hf_one_pass_tokens_per_s",
        "rollout_time_ratio_one_pass",
        "ftis_step_s",
        "peak_memory_mb",
    ):
        assert res[key] > 0, key
    assert res["device"] == "cpu" and res["dry_run"]
    assert '"ftis_step_s"' in capsys.readouterr().out.splitlines()[-1]
    # the real shape is Qwen2.5-0.5B's
    assert mod.QWEN25_05B["hidden_size"] == 896 and mod.QWEN25_05B["vocab_size"] == 151936

"""`ftis bench --quick --json` runs and emits the summary keys (no timing is asserted). The
realistic-scale section runs its tiny configuration here (FTIS_BENCH_SCALE=tiny: the same code
at llama-xs shapes), which keeps this test at about a minute; tests/test_bench_scale.py tests its
workers, and `ftis bench --quick` itself runs the 23M-parameter configuration."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.long
def test_quick_bench_emits_the_summary_keys(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ftis.cli", "bench", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "FTIS_BENCH_SCALE": "tiny"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("trl_step_time_ratio", "rollout_time_ratio", "bytes_per_token"):
        assert isinstance(summary[key], float) and summary[key] > 0, key
    assert summary["bytes_per_token"] <= 8
    for key in ("scale_trl_step_time_ratio", "scale_rollout_time_ratio_one_pass"):
        assert isinstance(summary[key], float) and summary[key] > 0, key
    assert 0 < summary["scale_update_mfu"] <= 1.5  # a fraction of the measured matmul peak
    # each phase's time over its own matmul floor (same run): more than the floor, whatever the
    # machine (the floor leaves out attention, norms, sampling and Python)
    keys = (
        "scale_rollout_floor_multiple",
        "scale_rollout_streamed_floor_multiple",
        "scale_rollout_decode_floor_multiple",
    )
    for key in (*keys, "scale_step_floor_multiple"):
        assert isinstance(summary[key], float) and summary[key] > 1, key
    assert isinstance(summary["scale_trl_step_time_ratio_bf16"], float)
    assert summary["scale_trl_step_time_ratio_bf16"] > 0
    assert summary["cpu_bf16_units"] is None or isinstance(summary["cpu_bf16_units"], str)

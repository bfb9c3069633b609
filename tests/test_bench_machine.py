"""bench.json and BENCHMARKS.md name the code and the machine behind their numbers: the ftis
commit, the CPU model and the instruction set torch's kernels use (issue 21 item 4, issue 26
item 4). The benchmarks themselves are replaced by the committed figures, so `bench.run.main`
writes its files in a second."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import bench.run as bench_run  # noqa: E402
from bench.common import cpu_bf16_units, cpu_model  # noqa: E402


def test_cpu_model_is_the_first_model_name_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\n"
        "model name\t:  AMD EPYC   7B13 64-Core Processor \n\n"
        "processor\t: 1\nmodel name\t: another\n"
    )
    assert cpu_model(info) == "AMD EPYC 7B13 64-Core Processor"
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n")
    assert cpu_model(arm) is None
    assert cpu_model(tmp_path / "missing") is None


def test_bf16_units_are_read_from_the_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n")
    assert cpu_bf16_units(info) == "avx512_bf16"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512_bf16 amx_bf16 amx_tile\n")
    assert cpu_bf16_units(info) == "amx_bf16 avx512_bf16"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    assert cpu_bf16_units(info) == "none"
    info.write_text("processor\t: 0\n")
    assert cpu_bf16_units(info) is None
    assert cpu_bf16_units(tmp_path / "missing") is None


@pytest.mark.long
def test_the_recorded_instruction_set_is_the_one_torch_was_told_to_use() -> None:
    code = "from bench.common import environment; print(environment()['cpu_capability'])"
    for forced, expected in (("default", "DEFAULT"), ("avx2", "AVX2")):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
            cwd=REPO,
            env={**os.environ, "ATEN_CPU_CAPABILITY": forced},
        ).stdout.split()
        if expected == "AVX2" and out[-1] == "DEFAULT":  # a CPU without AVX2 falls back
            continue
        assert out[-1] == expected


def test_bench_json_and_markdown_record_commit_and_machine(tmp_path: Path, monkeypatch) -> None:
    committed = json.loads((REPO / "docs" / "results" / "bench.json").read_text())
    monkeypatch.setattr(bench_run, "bench_model", lambda quick: ("llama-m", "unused"))
    for part, module in (
        ("trl", bench_run.trl_step),
        ("rollout", bench_run.rollout),
        ("wire", bench_run.wire),
        ("scaling", bench_run.scaling),
        ("profile", bench_run.profile),
        ("scale", bench_run.scale),
    ):
        monkeypatch.setattr(module, "run", lambda *a, _part=part: committed[_part])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    try:
        bench_run.main(quick=False, out=tmp_path / "BENCHMARKS.md", threads=1)
    finally:
        torch.set_num_threads(threads)

    env = json.loads((tmp_path / "results" / "bench.json").read_text())["env"]
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert env["commit"] in (head, head + "+dirty")
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["cpu_model"] == cpu_model()  # the machine's own line (None off Linux)
    header = (tmp_path / "BENCHMARKS.md").read_text().splitlines()[2]
    assert f"ftis commit `{env['commit']}`" in header
    assert f"torch's {env['cpu_capability']} kernels" in header
    assert env["cpu_bf16_units"] == cpu_bf16_units()
    if env["cpu_model"]:
        assert f"Machine: {env['cpu_model']}, " in header
    flat = bench_run.flat_summary(json.loads((tmp_path / "results" / "bench.json").read_text()))
    keys = ("commit", "cpu_model", "cpu_capability", "cpu_bf16_units")
    assert {k: flat[k] for k in keys} == {k: env[k] for k in keys}


def test_results_from_before_the_machine_was_recorded_say_so() -> None:
    committed = json.loads((REPO / "docs" / "results" / "bench.json").read_text())
    machine = ("cpu_model", "cpu_capability", "cpu_bf16_units")  # what older runs lack
    env = {k: v for k, v in committed["env"].items() if k not in machine}
    header = bench_run.markdown({**committed, "env": {**env, "commit": None}}).splitlines()[2]
    assert "ftis commit not recorded" in header
    assert "CPU model not recorded" in header
    assert "torch's instruction set not recorded" in header
    assert "bf16 matmul units not recorded" in header

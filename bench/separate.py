"""The benchmarks that run on their own (each its own command, page and .json under
docs/results/), summarised in docs/BENCHMARKS.md from their .json files: a figure, the target it
answers, and the page, with the commit that measured it. A page whose .json is missing is
listed with the command that makes it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def _bf16(r: dict) -> list[tuple[str, str, str]]:
    out = []
    for row in r["rows"]:
        if row["threads"] != 1:
            continue
        target = "<= 0.55" if row["model"].startswith("SmolLM2") else "<= 0.6"
        out.append(
            (
                f"rollout time, bf16 sampler / f32 sampler, {row['model']} (1 thread; "
                f"`generate` bf16 / f32: {row['generate_ratio']:.3f})",
                f"{row['ftis_ratio']:.3f}",
                target,
            )
        )
    for s in r.get("skipped", []):
        out.append((f"rollout time, bf16 / f32 sampler, {s['model']}", f"skipped: {s['why']}", "-"))
    return out


def _trl(r: dict) -> list[tuple[str, str, str]]:
    return [
        (
            f"training step, ftis / TRL GRPOTrainer, SmolLM2-135M-Instruct ({r['best_ftis']} / "
            f"{r['best_trl']}, {r['threads']} threads; both f32: {r['ratio_f32']:.3f})",
            f"{r['ratio']:.3f}",
            "<= 0.5",
        )
    ]


def _jobs(r: dict) -> list[tuple[str, str, str]]:
    same = "identical results" if not r["differ"] else f"{len(r['differ'])} runs differ"
    return [
        (
            f"`ftis sweep --jobs 2` speed-up over `--jobs 1`, first {len(r['runs'])} runs of "
            f"`{r['study']}` ({same})",
            f"{r['speedup']:.2f}x"
            + (
                f" (ceiling estimated from `--jobs 1`'s run times: {r['ceiling']:.2f}x)"
                if "ceiling" in r
                else ""
            ),
            ">= 1.6x, identical",
        )
    ]


def _wire(r: dict) -> list[tuple[str, str, str]]:
    row = r["rows"][0]
    return [
        (
            f"wire bytes per completion token, `compact`, SmolLM2's vocabulary of {row['vocab']} "
            f"({row['batch']})",
            f"{row['compact']['bytes_per_token']:.2f}",
            "-",
        )
    ]


def _update(r: dict) -> list[tuple[str, str, str]]:
    v = r["variants"]
    base = v["f32"]["plain"]["update"]
    auto = v["bf16 autocast"]["plain"]["update"] / base
    return [
        (
            "update time, bf16 `compute_mode: cast_weights` / f32, SmolLM2-135M-Instruct "
            f"({r['threads']} thread, no profiler; bf16 autocast / f32: {auto:.3f})",
            f"{v['bf16 cast_weights']['plain']['update'] / base:.3f}",
            "<= 0.5",
        )
    ]


def _vllm(r: dict) -> list[tuple[str, str, str]]:
    out = []
    for row in r["rows"]:
        v = row["variants"]["vllm bf16"]
        shape = f"{row['prompts']} x {row['samples']} x {row['new']}" + (
            ", reasoning-gym prompts, EOS" if row["natural"] else ", to length"
        )
        out.append(
            (
                f"rollout time, ftis bf16 sampler / vLLM bf16 engine, SmolLM2-135M ({shape}; "
                f"vLLM at {v['seconds'] / row['floor_s']:.1f}x its decode floor, push "
                f"{v['push_seconds']:.2f} s)",
                f"{row['speedup']:.2f}x",
                ">= 2x" if row["shape"] != "small" else "-",
            )
        )
    return out


# (page stem, the command that writes it, rows from its .json)
SEPARATE: tuple[tuple[str, str, Callable[[dict], list[tuple[str, str, str]]]], ...] = (
    ("bf16-sampler", "python -m bench.sampler_dtype", _bf16),
    ("trl-smollm2", "python -m bench.trl_real", _trl),
    ("sweep-jobs", "python -m bench.sweep_jobs", _jobs),
    ("wire-smollm2", "python -m bench.wire_real", _wire),
    ("update-profile", "python -m bench.update_profile", _update),
    ("vllm-engine", ".venv-vllm/bin/python -m bench.vllm_engine", _vllm),
)


def _commit(r: dict) -> str:
    return r.get("commit") or r.get("environment", {}).get("commit") or "not recorded"


def separate_section(results: Path = RESULTS) -> list[str]:
    lines = [
        "## Measured on their own",
        "",
        "Benchmarks that have a command and a page of their own, each measured in its own run "
        "(the commit and the machine are on its page); this table is read from their .json "
        "files when this page is written.",
        "",
        "| figure | value | target | page (commit) |",
        "|---|---|---|---|",
    ]
    for stem, command, rows in SEPARATE:
        path = results / f"{stem}.json"
        if not path.exists():
            lines.append(f"| `{command}` | not run yet | - | - |")
            continue
        r = json.loads(path.read_text())
        page = f"[{stem}.md](results/{stem}.md) (`{_commit(r)}`)"
        for figure, value, target in rows(r):
            lines.append(f"| {figure} | {value} | {target} | {page} |")
    return [*lines, ""]

"""Scaling on one machine and peak memory: real `ftis run` invocations, read back from
metrics.jsonl.

- scaling: 1, 2 and 4 nodes (llama-s each), vertical sharing, same prompts per node per step;
  per-node step time and the share of it spent in exchange (encode + communicate + decode;
  `comm` includes waiting for the slowest peer, reported separately).
- memory: peak RSS of a node process (`memory/peak_rss_mb`) for the default run and for a larger
  preset (llama-l).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from bench.common import median
from ftis.config import DEFAULT_CONFIG

WARM = {"steps": 150, "batch_size": 64, "lr": 0.002}


def _config(nodes: int, preset: str, steps: int, prompts_per_node: int = 8) -> dict:
    return {
        "name": f"scale-{nodes}",
        "task": {"kind": "arithmetic", "ops": {"+": 1.0}},
        "nodes": [
            {"name": f"n{i}", "model": {"preset": preset}, "warm_start": WARM} for i in range(nodes)
        ],
        "train": {
            "steps": steps,
            "prompts_per_step": prompts_per_node * nodes,
            "group_size": 8,
            "max_new_tokens": 8,
        },
        "eval": {"every": 0, "size": 16, "pass_samples": 0},
        "log": {"progress": False},
    }


def _run(cfg: dict, workdir: Path) -> list[dict]:
    path = workdir / f"{cfg['name']}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = workdir / cfg["name"]
    env = {**os.environ}
    subprocess.run(
        [sys.executable, "-m", "ftis.cli", "run", str(path), "--out", str(out), "--overwrite"],
        check=True,
        capture_output=True,
        env=env,
        timeout=1200,
    )
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


REALISTIC = {"preset": "llama-20m", "steps": 4, "prompts_per_node": 2, "max_new_tokens": 64}


def realistic_config(nodes: int, **over) -> dict:
    """The exchange at realistic scale: `llama-20m` nodes (random init, no warm start), 64 new
    tokens, vertical sharing. A random model's arithmetic rewards are all 0, and ftis skips
    zero-advantage groups under filter_mode "zero"; filter_mode "drop" runs every sequence
    through the update, so each step costs what it would with varied rewards."""
    r = {**REALISTIC, **over}
    cfg = _config(nodes, r["preset"], r["steps"], prompts_per_node=r["prompts_per_node"])
    cfg["name"] = f"realistic-{nodes}"
    cfg["train"]["max_new_tokens"] = r["max_new_tokens"]
    for node in cfg["nodes"]:
        node.pop("warm_start")
        node["loss"] = {"filter_mode": "drop"}
    return cfg


def realistic_exchange(work: Path, **over) -> dict[str, float]:
    """Exchange share of step time at 2 and 4 realistic nodes (steps after the first)."""
    out: dict[str, float] = {}
    for n in (2, 4):
        rows = [r for r in _run(realistic_config(n, **over), work) if r["step"] >= 2]
        step_s = median([r["train/step_seconds"] for r in rows])
        out[f"realistic_{n}_step_s"] = step_s
        out[f"realistic_{n}_exchange_share"] = (
            median([r["exchange/seconds"] for r in rows]) / step_s
        )
        out[f"realistic_{n}_codec_share"] = (
            median(
                [
                    r.get("exchange/encode_seconds", 0) + r.get("exchange/decode_seconds", 0)
                    for r in rows
                ]
            )
            / step_s
        )
        out[f"realistic_{n}_peak_rss_mb"] = max(r["memory/peak_rss_mb"] for r in rows)
    return out


def run(quick: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    steps = 6 if quick else 20
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for n in (1, 2) if quick else (1, 2, 4):
            rows = [r for r in _run(_config(n, "llama-s", steps), work) if r["step"] >= 2]
            step_s = median([r["train/step_seconds"] for r in rows])
            out[f"scaling_{n}_step_s"] = step_s
            if n > 1:
                codec = median(
                    [
                        r.get("exchange/encode_seconds", 0) + r.get("exchange/decode_seconds", 0)
                        for r in rows
                    ]
                )
                comm = median([r.get("exchange/comm_seconds", 0) for r in rows])
                total = median([r["exchange/seconds"] for r in rows])
                out[f"scaling_{n}_exchange_share"] = total / step_s
                out[f"scaling_{n}_codec_share"] = codec / step_s
                out[f"scaling_{n}_comm_incl_wait_share"] = comm / step_s
            out[f"scaling_{n}_peak_rss_mb"] = max(r["memory/peak_rss_mb"] for r in rows)
        if not quick:
            out.update(realistic_exchange(work))
            default = yaml.safe_load(DEFAULT_CONFIG.read_text())
            default.update(
                name="default-mem",
                train={**default["train"], "steps": 5},
                eval={"every": 0, "size": 16, "pass_samples": 0},
                log={"progress": False},
            )
            rows = _run(default, work)
            for node in {r["node"] for r in rows}:
                out[f"memory_default_{node}_peak_rss_mb"] = max(
                    r["memory/peak_rss_mb"] for r in rows if r["node"] == node and r["step"] > 0
                )
            rows = _run(_config(1, "llama-l", 5), work)
            out["memory_llama-l_peak_rss_mb"] = max(
                r["memory/peak_rss_mb"] for r in rows if r["step"] > 0
            )
    return out

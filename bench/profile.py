"""Where the embedded default's time goes: one `ftis run` of the default config (warm-start
cache warm), per node and phase, from the `time/*` metrics of its metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run(quick: bool) -> dict[str, float]:
    steps = 10 if quick else 60
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "default"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "ftis.cli",
                "run",
                "--out",
                str(out),
                "--set",
                "log.progress=false",
                "--set",
                f"train.steps={steps}",
            ],
            check=True,
            capture_output=True,
            timeout=1800,
        )
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result: dict[str, float] = {"profile_steps": float(steps)}
    for node in sorted({r["node"] for r in rows}):
        for r in rows:
            if r["node"] != node or r["step"] == 0:
                continue
            for k, v in r.items():
                if k.startswith("time/") and v is not None:
                    key = f"profile_{node}_{k[5:]}_s"
                    result[key] = result.get(key, 0.0) + float(v)
    return result

"""A node's progress for the launcher's progress bar (the launcher reads these files; a worker
process, or a swarm peer, writes them)."""

from __future__ import annotations

import json
import os
from pathlib import Path


class StatusFile:
    """Progress of this node for the launcher's progress bar: a small JSON file replaced
    atomically at RUN_DIR/.status/<node>.json."""

    def __init__(self, run_dir: Path, node: str) -> None:
        self.path = run_dir / ".status" / f"{node}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.last: dict[str, float] = {}

    def __call__(self, event: str, **info) -> None:
        if event == "warm" and info["step"] % 10 and info["step"] != info["total"]:
            return
        state = {"event": event, "step": info["step"], "total": info["total"]}
        if event == "warm":
            state["loss"] = info["loss"]
        else:
            m = info["metrics"]
            self.last.update({k: m[k] for k in ("reward/mean", "eval/accuracy") if k in m})
            state.update(self.last)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.path)

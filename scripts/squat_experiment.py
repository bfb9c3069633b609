"""Subkey squatting against a hivemind swarm, measured (issue 57 item 1).

Runs a swarm config twice, side by side on this machine: once alone, once while an outsider
(a DHT node without the swarm's secret, joined from the run's bootstrap address in
RUN_DIR/swarm-peers.txt) publishes junk under peer 0's subkey for the members key and every
round key, with an expiry 350 s ahead, again every few seconds until the run ends. Prints each
run's wall time, the peers' mean samples received per round (swarm/samples_received) and the
forged records they counted, and the ratios the issue bounds (duration <= 1.5x, samples within
10%):

    python scripts/squat_experiment.py                       # configs/swarm-hivemind.yaml
    python scripts/squat_experiment.py --out /tmp/squat --config configs/swarm-hivemind.yaml
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def squat(run_dir: Path, name: str, rounds: int, stop: threading.Event, counts: dict) -> None:
    from ftis.exchange.dht import DHTBoard

    # the squatter's own DHT node cannot parse the swarm's tagged records it is handed while
    # it routes; asyncio reports each such task: noise of the attacker, not of the run
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    peers = run_dir / "swarm-peers.txt"
    while not peers.exists() and not stop.is_set():
        time.sleep(0.2)
    if stop.is_set():
        return
    maddrs = [line for line in peers.read_text().split() if line]
    board = DHTBoard(maddrs, max_value_bytes=200_000, max_peers=8)  # no secret
    prefix = f"ftis-swarm:{name}"
    try:
        while not stop.is_set():
            now = board.now()
            for key in [f"{prefix}:members"] + [f"{prefix}:round:{r}" for r in range(rounds + 2)]:
                board.publish(key, 0, b"junk" * 16, now + 350)
                counts["published"] = counts.get("published", 0) + 1
            stop.wait(5.0)
    finally:
        board.close()


def one_run(config: Path, out: Path, *, attacked: bool) -> dict:
    cfg = yaml.safe_load(config.read_text())
    stop, counts = threading.Event(), {}
    attacker = None
    if attacked:
        attacker = threading.Thread(
            target=squat, args=(out, cfg["name"], cfg["train"]["steps"], stop, counts), daemon=True
        )
        attacker.start()
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "ftis.cli", "run", str(config), "--out", str(out), "--overwrite"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    stop.set()
    if attacker is not None:
        attacker.join(30)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    trained = [r for r in rows if "swarm/samples_received" in r]
    per_peer = {}
    for r in trained:
        per_peer.setdefault(r["node"], []).append(r["swarm/samples_received"])
    return {
        "attacked": attacked,
        "exit": proc.returncode,
        "seconds": seconds,
        "samples_per_round": statistics.fmean(r["swarm/samples_received"] for r in trained),
        "per_peer": {n: statistics.fmean(v) for n, v in sorted(per_peer.items())},
        "forged_total": sum(max((r.get("swarm/forged_total", 0) for r in rows if r["node"] == n),
                                default=0) for n in per_peer),
        "squatter_records": counts.get("published", 0),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "swarm-hivemind.yaml")
    ap.add_argument("--out", type=Path, default=Path("/tmp/ftis-squat"))
    args = ap.parse_args()
    quiet = one_run(args.config, args.out / "quiet", attacked=False)
    attacked = one_run(args.config, args.out / "squatted", attacked=True)
    for r in (quiet, attacked):
        print(json.dumps(r))
    print(
        f"duration squatted / quiet: {attacked['seconds'] / quiet['seconds']:.2f} (bound 1.5); "
        f"samples per round squatted / quiet: "
        f"{attacked['samples_per_round'] / max(quiet['samples_per_round'], 1e-9):.3f} "
        "(bound: within 10%)"
    )


if __name__ == "__main__":
    main()

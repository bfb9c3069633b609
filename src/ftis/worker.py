"""One node of a collaborative run: the process torch's launcher starts once per node.

    torchrun --nproc-per-node 2 -m ftis.worker CONFIG --out RUN_DIR         # one machine
    torchrun --nnodes 2 --node-rank R --nproc-per-node 1 \\
             --master-addr HOST --master-port 29500 -m ftis.worker CONFIG --out RUN_DIR

RANK picks the node (`nodes[RANK]` in the config). Before any warm start, the group checks that
every peer has the same tokenizer and the same shared settings (task, train, sharing), since
token ids and prompt indices are exchanged as they are.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import warnings
from pathlib import Path

import torch

from ftis.config import ConfigError, RunConfig, load_config
from ftis.exchange.distributed import (
    DistributedExchange,
    gather_strings,
    init_process_group_from_env,
)
from ftis.models.loading import ModelLoadError, load_tokenizer, tokenizer_fingerprint
from ftis.tasks import TaskDataError
from ftis.train.loop import train_node

log = logging.getLogger("ftis.worker")


class GroupMismatchError(ValueError):
    """Peers disagree on something they must share (tokenizer, task, schedule)."""


USER_ERRORS = (ConfigError, ModelLoadError, TaskDataError, GroupMismatchError)


def shared_settings_digest(cfg: RunConfig) -> str:
    """Digest of what every peer must agree on: the task (prompt indices), the step schedule and
    the sharing scheme. Node-specific settings (model, optimizer, loss) may differ."""
    shared = {k: cfg.model_dump(mode="json")[k] for k in ("task", "train", "sharing")}
    shared["nodes"] = [n.name for n in cfg.nodes]
    return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


def check_group(cfg: RunConfig, rank: int, fingerprint: str) -> None:
    """Raise GroupMismatchError, on every rank alike, if peers' tokenizers or settings differ."""
    mine = f"{fingerprint}:{shared_settings_digest(cfg)}"
    everyone = gather_strings(mine)
    names = [n.name for n in cfg.nodes]
    toks = [s.split(":")[0] for s in everyone]
    if len(set(toks)) > 1:
        groups = {}
        for name, t in zip(names, toks):
            groups.setdefault(t, []).append(name)
        detail = "; ".join(f"{', '.join(v)} use tokenizer {k}" for k, v in groups.items())
        raise GroupMismatchError(
            f"peers must share one tokenizer (token ids are exchanged as they are), but {detail}. "
            "Give every node a model with the same tokenizer."
        )
    settings = [s.split(":")[1] for s in everyone]
    if len(set(settings)) > 1:
        raise GroupMismatchError(
            "peers were started with different task/train/sharing settings (digests "
            f"{dict(zip(names, settings))}); start every node from the same config file"
        )


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ftis.worker", description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s",
    )
    for noisy in ("transformers", "peft", "torch", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    run_dir: Path = args.out
    run_dir.mkdir(parents=True, exist_ok=True)
    error_file = run_dir / "logs" / f"rank{rank}.error"
    try:
        cfg = load_config(args.config, args.overrides)
        if world != len(cfg.nodes):
            raise ConfigError(
                f"the config declares {len(cfg.nodes)} nodes but {world} processes were started; "
                f"start exactly one process per node (--nproc-per-node {len(cfg.nodes)})"
            )
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        init_process_group_from_env(cfg.exchange.timeout_s)
        node_cfg = cfg.nodes[rank]
        check_group(cfg, rank, tokenizer_fingerprint(load_tokenizer(node_cfg.model)))

        def make_exchange(node):
            return DistributedExchange(
                rank,
                world,
                vocab_size=int(node.model.get_input_embeddings().num_embeddings),
                max_tokens=cfg.train.max_new_tokens,
                pad_id=node.tokenizer.pad_token_id,
                logprob_format=cfg.exchange.logprob_format,
                timeout_s=cfg.exchange.timeout_s,
            )

        train_node(
            cfg,
            rank=rank,
            exchange_factory=make_exchange,
            run_dir=run_dir,
            progress=StatusFile(run_dir, node_cfg.name),
        )
    except USER_ERRORS as e:
        error_file.parent.mkdir(parents=True, exist_ok=True)
        error_file.write_text(str(e))
        log.error("%s", e)
        return 2
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

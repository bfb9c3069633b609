"""Which client a Flower node runs, and its answer to the server's identify query (the stable
name server state, rows and checkpoints are keyed by). No model code here: a deployed node answers
the query in a fresh process, which then need not import transformers.

    simulation   node i gets `partition-id` i from Flower: client cfg.nodes[i]
    deployed     the SuperNode's node config names it: --node-config "client='add'"
"""

from __future__ import annotations

from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict

from ftis.algos.federated.records import CLIENT_KEY, CONFIG
from ftis.config import RunConfig

PARTITION_KEY = "partition-id"  # Flower's simulation gives node i partition i: client cfg.nodes[i]
CLIENT_NODE_KEY = "client"  # a deployed SuperNode names its client in its node config


def client_rank(cfg: RunConfig, context: Context) -> int:
    """The node's client: the one its node config names (`client`, deployed SuperNodes), else
    `cfg.nodes[partition-id]` (Flower's simulation engine)."""
    names = [n.name for n in cfg.nodes]
    if CLIENT_NODE_KEY in context.node_config:
        name = str(context.node_config[CLIENT_NODE_KEY])
        if name not in names:
            raise RuntimeError(
                f"this SuperNode's node config names client {name!r}, which the run config "
                f"does not have (its clients: {', '.join(names)})"
            )
        return names.index(name)
    try:
        rank = int(context.node_config[PARTITION_KEY])
    except (KeyError, TypeError, ValueError):
        raise RuntimeError(
            f"this Flower node has neither {CLIENT_NODE_KEY!r} nor {PARTITION_KEY!r} in its node "
            f"config: start a deployed SuperNode with --node-config \"{CLIENT_NODE_KEY}='NAME'\" "
            "(NAME one of the run's clients), or run it through ftis (Flower's simulation "
            "engine), which gives node i the client cfg.nodes[i]"
        ) from None
    if not 0 <= rank < len(cfg.nodes):
        raise RuntimeError(f"partition {rank} has no client (there are {len(cfg.nodes)})")
    return rank


def reply(msg: Message, name: str, **records: Any) -> Message:
    """A client's reply to `msg`: `records`, and its name (the server checks it)."""
    content = RecordDict({CONFIG: ConfigRecord({CLIENT_KEY: name}), **records})
    return Message(content, reply_to=msg)


def identify_reply(cfg: RunConfig, msg: Message, context: Context) -> Message:
    """The answer to the server's identify query: the node's client name."""
    return reply(msg, cfg.nodes[client_rank(cfg, context)].name)

"""Forming a group: every rank must agree on what it shares with its peers before any round.

Prompt indices are exchanged as they are, so peers must share the settings that decide which
prompts a round uses. Token ids are exchanged as they are between peers on one tokenizer (the
exact path); a pair on different tokenizers exchanges text instead (the bridged path, docs/math.md
§16), when both can: the handshake says which path each pair takes and why, and refuses only a
pair that cannot be bridged, naming the node and the reason. It gathers one short string per
rank through the group's `Membership` and fails the same way on every rank.
"""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger(__name__)

# Why a rank cannot take the bridged path; sent after its fingerprint as "FINGERPRINT!CODE".
BRIDGE_BLOCKERS = {
    "algorithm": "its algorithm exchanges token ids and has no bridged path",
    "method": "its loss method has no bridged form (it needs the sender's per-token "
    "probabilities: reco, f-reco)",
    "decode": "its tokenizer cannot decode the text it produced (decode(encode(text)) != text)",
}


class GroupMismatchError(ValueError):
    """Peers disagree on something they must share (tokenizer, task, schedule)."""


class _Gathers(Protocol):
    def gather(self, value: str, *, timeout_s: float | None = None) -> list[str]: ...


def check_group(
    membership: _Gathers,
    *,
    names: list[str],
    fingerprint: str,
    settings_digest: str,
    first_step: int = 1,
    timeout_s: float = 120.0,
    bridge_blocker: str | None = None,
    tokenizers_out: list[str] | None = None,
) -> list[int]:
    """Form the group: raise GroupMismatchError, on every rank alike, if shared-settings digests
    differ or two peers' tokenizers differ and one of them cannot take the bridged path; return
    every rank's first round (they differ after some resumes). `names` names the ranks in
    messages (a node's name, or its role). `bridge_blocker`: why this rank cannot bridge (a key
    of BRIDGE_BLOCKERS), None when it can. Each pair's path is logged (`pair_paths`).
    `tokenizers_out`: when given, filled with every rank's fingerprint ("" for no model)."""
    if bridge_blocker is not None and bridge_blocker not in BRIDGE_BLOCKERS:
        raise ValueError(f"unknown bridge blocker {bridge_blocker!r}")
    if fingerprint and bridge_blocker:
        fingerprint = f"{fingerprint}!{bridge_blocker}"
    mine = f"{fingerprint}:{settings_digest}:{first_step}"
    everyone = membership.gather(mine, timeout_s=timeout_s)
    parts = [s.split(":") for s in everyone]
    if any(len(p) != 3 or not p[2].isdigit() for p in parts):
        raise GroupMismatchError(
            "a peer runs a different version of ftis (unreadable handshake); install the same "
            "version on every machine"
        )
    toks = [p[0].partition("!")[0] for p in parts]
    blockers = [p[0].partition("!")[2] or None for p in parts]
    if tokenizers_out is not None:
        tokenizers_out[:] = toks
    if len({t for t in toks if t}) > 1:  # ranks without a model (a server) send ""
        blocked = [(name, b) for name, t, b in zip(names, toks, blockers) if t and b is not None]
        if blocked:
            groups: dict[str, list[str]] = {}
            for name, t in zip(names, toks):
                if t:
                    groups.setdefault(t, []).append(name)
            detail = "; ".join(f"{', '.join(v)} use tokenizer {k}" for k, v in groups.items())
            why = "; ".join(
                f"node {name}: {BRIDGE_BLOCKERS.get(b, 'an unknown reason ' + repr(b))}"
                for name, b in blocked
            )
            raise GroupMismatchError(
                f"peers on different tokenizers ({detail}) must exchange text (the bridged "
                f"path, docs/math.md §16), but {why}. Give every node a model with the same "
                "tokenizer, or fix what blocks the bridged path."
            )
        for line in pair_paths(names, toks):
            log.info("%s", line)
    settings = [p[1] for p in parts]
    if len(set(settings)) > 1:
        raise GroupMismatchError(
            "peers were started with different shared settings (task, train, sharing, "
            f"algorithm; digests {dict(zip(names, settings))}); start every node from the same "
            "config file"
        )
    return [int(p[2]) for p in parts]


def pair_paths(names: list[str], fingerprints: list[str]) -> list[str]:
    """One line per pair of ranks with a model: which path their samples take and why."""
    out = []
    ranks = [i for i, t in enumerate(fingerprints) if t]
    for a in ranks:
        for b in ranks:
            if a < b:
                ta, tb = fingerprints[a], fingerprints[b]
                if ta == tb:
                    out.append(
                        f"{names[a]} <-> {names[b]}: exact path (one tokenizer, {ta}: token "
                        "ids and per-token log-probs)"
                    )
                else:
                    out.append(
                        f"{names[a]} <-> {names[b]}: bridged path (tokenizers {ta} != {tb}: "
                        "text, re-tokenized, sequence-level weights; docs/math.md §16)"
                    )
    return out

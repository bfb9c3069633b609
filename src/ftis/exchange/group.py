"""Forming a group: every rank must agree on what it shares with its peers before any round.

Token ids and prompt indices are exchanged as they are, so peers must share a tokenizer and the
settings that decide which prompts a round uses. The handshake gathers one short string per rank
through the group's `Membership` and fails the same way on every rank when they disagree.
"""

from __future__ import annotations

from typing import Protocol


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
) -> list[int]:
    """Form the group: raise GroupMismatchError, on every rank alike, if peers' tokenizer
    fingerprints or shared-settings digests differ; return every rank's first round (they differ
    after some resumes). `names` names the ranks in messages (a node's name, or its role)."""
    mine = f"{fingerprint}:{settings_digest}:{first_step}"
    everyone = membership.gather(mine, timeout_s=timeout_s)
    parts = [s.split(":") for s in everyone]
    if any(len(p) != 3 or not p[2].isdigit() for p in parts):
        raise GroupMismatchError(
            "a peer runs a different version of ftis (unreadable handshake); install the same "
            "version on every machine"
        )
    toks = [p[0] for p in parts]
    if len({t for t in toks if t}) > 1:  # ranks without a model (a server) send ""
        groups: dict[str, list[str]] = {}
        for name, t in zip(names, toks):
            if t:
                groups.setdefault(t, []).append(name)
        detail = "; ".join(f"{', '.join(v)} use tokenizer {k}" for k, v in groups.items())
        raise GroupMismatchError(
            f"peers must share one tokenizer (token ids are exchanged as they are), but {detail}. "
            "Give every node a model with the same tokenizer."
        )
    settings = [p[1] for p in parts]
    if len(set(settings)) > 1:
        raise GroupMismatchError(
            "peers were started with different shared settings (task, train, sharing, "
            f"algorithm; digests {dict(zip(names, settings))}); start every node from the same "
            "config file"
        )
    return [int(p[2]) for p in parts]

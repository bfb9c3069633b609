"""Preference pairs and the JSONL files they come in (docs/dpo.md, "Data").

One pair: a prompt, the response a user preferred (`chosen`) and the one they did not
(`rejected`). The prompt is plain text or a chat conversation (a list of `{role, content}`
messages, roles system/user/assistant); a response is text, or a one-message assistant list.

Files are JSON lines in one of three layouts (`format`):

    ftis     {"prompt": ..., "chosen": ..., "rejected": ...}          (extra fields are ignored)
    hh-rlhf  {"chosen": "\\n\\nHuman: ...\\n\\nAssistant: ...", "rejected": "..."}  (Anthropic HH-RLHF:
             two whole transcripts that differ in the last assistant turn)
    shp      {"history": ..., "human_ref_A": ..., "human_ref_B": ..., "labels": 1 | 0}
             (Stanford SHP: labels 1 = A preferred)

Every row is checked; a bad one raises `PreferenceDataError` naming the file, the line and the
field, so that `ftis run` can stop with a config error before any process starts. This module
imports no model code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftis.tasks.base import TaskDataError

FORMATS = ("ftis", "hh-rlhf", "shp")
ROLES = ("system", "user", "assistant")
_HUMAN, _ASSISTANT = "\n\nHuman:", "\n\nAssistant:"
_TURN = re.compile(r"(\n\nHuman:|\n\nAssistant:)")

Message = tuple[str, str]  # (role, content)


class PreferenceDataError(TaskDataError):
    """A preference file or row is unusable; the message names the file, line and field."""


@dataclass(frozen=True)
class PreferencePair:
    """One preference: `prompt` (text, or a conversation of (role, content) messages),
    `chosen` and `rejected` responses (text), and where it came from (`source`, for errors)."""

    prompt: str | tuple[Message, ...]
    chosen: str
    rejected: str
    source: str = ""


class _FieldError(ValueError):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(problem)
        self.field = field


def fixture_path() -> Path:
    """The small preference file shipped with ftis (ftis layout, arithmetic prompts)."""
    return Path(__file__).parent / "data" / "preferences_tiny.jsonl"


def read_pairs(path: str | Path, *, format: str = "ftis") -> list[PreferencePair]:
    """Every pair of a JSONL file, checked row by row (blank lines are skipped)."""
    if format not in FORMATS:
        raise PreferenceDataError(
            f"unknown preference format {format!r}; choose one of: {', '.join(FORMATS)}"
        )
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise PreferenceDataError(
            f"cannot read preferences file {str(p)!r}: {e.strerror or e}; give an existing "
            "JSONL file (one JSON object per line)"
        ) from e
    except UnicodeDecodeError as e:
        raise PreferenceDataError(f"preferences file {str(p)!r} is not UTF-8 text ({e})") from e
    pairs = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"preferences file {str(p)!r}, line {lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PreferenceDataError(f"{where}: not valid JSON ({e.msg})") from None
        try:
            pairs.append(pair_from_row(row, format=format, source=f"{p.name}:{lineno}"))
        except _FieldError as e:
            raise PreferenceDataError(f"{where}: field {e.field!r}: {e}") from None
    if not pairs:
        raise PreferenceDataError(f"preferences file {str(p)!r} holds no pairs")
    return pairs


def pair_from_row(row: Any, *, format: str = "ftis", source: str = "") -> PreferencePair:
    """One row (a parsed JSON object) in `format` as a pair; raises _FieldError (a ValueError
    whose `field` names the culprit) when it does not fit."""
    if not isinstance(row, dict):
        raise _FieldError("<row>", f"must be a JSON object, got {type(row).__name__}")
    if format == "hh-rlhf":
        pair = from_hh_rlhf(row)
    elif format == "shp":
        pair = from_shp(row)
    else:
        pair = PreferencePair(
            prompt=_prompt(_required(row, "prompt"), "prompt"),
            chosen=_response(_required(row, "chosen"), "chosen"),
            rejected=_response(_required(row, "rejected"), "rejected"),
        )
    if pair.chosen == pair.rejected:
        raise _FieldError("rejected", "is identical to chosen: the pair states no preference")
    return PreferencePair(pair.prompt, pair.chosen, pair.rejected, source)


def _required(row: dict, field: str) -> Any:
    if field not in row:
        raise _FieldError(field, "is missing")
    return row[field]


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _FieldError(field, f"must be a non-empty string (got {_short(value)})")
    return value


def _prompt(value: Any, field: str) -> str | tuple[Message, ...]:
    if isinstance(value, list):
        return _messages(value, field)
    if not isinstance(value, str) or not value.strip():
        raise _FieldError(
            field, f"must be a non-empty string or a list of chat messages (got {_short(value)})"
        )
    return value


def _messages(value: list, field: str) -> tuple[Message, ...]:
    if not value:
        raise _FieldError(field, "is an empty conversation")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or "role" not in m:
            raise _FieldError(f"{field}[{k}]", f"must be {{role, content}} (got {_short(m)})")
        if m["role"] not in ROLES:
            raise _FieldError(
                f"{field}[{k}].role", f"must be one of {', '.join(ROLES)} (got {m['role']!r})"
            )
        content = m.get("content")
        if not isinstance(content, str):
            raise _FieldError(f"{field}[{k}].content", f"must be a string (got {_short(content)})")
        out.append((m["role"], content))
    return tuple(out)


def _response(value: Any, field: str) -> str:
    """A response: text, or a chat list whose single message is the assistant's."""
    if isinstance(value, list):
        msgs = _messages(value, field)
        if len(msgs) != 1 or msgs[0][0] != "assistant":
            raise _FieldError(field, "as a chat list must hold exactly one assistant message")
        value = msgs[0][1]
    return _text(value, field)


def _short(value: Any) -> str:
    s = json.dumps(value) if not isinstance(value, str) else repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


# ------------------------------------------------------------------------------- converters


def from_hh_rlhf(row: dict) -> PreferencePair:
    """Anthropic HH-RLHF: two transcripts "\\n\\nHuman: ...\\n\\nAssistant: ..." that share every
    turn but the last assistant one. The shared turns become the chat prompt."""
    chosen_conv, chosen = _split_transcript(_text(_required(row, "chosen"), "chosen"), "chosen")
    rejected_conv, rejected = _split_transcript(
        _text(_required(row, "rejected"), "rejected"), "rejected"
    )
    if chosen_conv != rejected_conv:
        raise _FieldError(
            "rejected", "its conversation before the last Assistant turn differs from chosen's"
        )
    return PreferencePair(prompt=chosen_conv, chosen=chosen, rejected=rejected)


def _split_transcript(text: str, field: str) -> tuple[tuple[Message, ...], str]:
    cut = text.rfind(_ASSISTANT)
    if cut < 0:
        raise _FieldError(field, "has no '\\n\\nAssistant:' turn")
    response = text[cut + len(_ASSISTANT) :].strip()
    if not response:
        raise _FieldError(field, "ends with an empty Assistant turn")
    parts = _TURN.split(text[:cut])  # [before, marker, content, marker, content, ...]
    if parts[0].strip():
        raise _FieldError(field, "must start with a '\\n\\nHuman:' turn")
    roles = {_HUMAN: "user", _ASSISTANT: "assistant"}
    messages = [(roles[m], c.strip()) for m, c in zip(parts[1::2], parts[2::2])]
    if not messages or messages[0][0] != "user":
        raise _FieldError(field, "must start with a '\\n\\nHuman:' turn")
    return tuple(messages), response


def from_shp(row: dict) -> PreferencePair:
    """Stanford SHP: `history` (the post), two replies `human_ref_A` / `human_ref_B`, and
    `labels` (1: A is preferred, 0: B is)."""
    history = _text(_required(row, "history"), "history")
    a = _text(_required(row, "human_ref_A"), "human_ref_A")
    b = _text(_required(row, "human_ref_B"), "human_ref_B")
    label = _required(row, "labels")
    if label not in (0, 1) or isinstance(label, bool):
        raise _FieldError("labels", f"must be 1 (A preferred) or 0 (B preferred), got {label!r}")
    chosen, rejected = (a, b) if label == 1 else (b, a)
    return PreferencePair(prompt=history, chosen=chosen, rejected=rejected)


def render_plain(conversation: tuple[Message, ...]) -> str:
    """A conversation as HH-RLHF-style text ending with the assistant's cue, for tokenizers
    without a chat template (the tiny presets' character tokenizer)."""
    names = {"system": "System", "user": "Human", "assistant": "Assistant"}
    return "".join(f"\n\n{names[r]}: {c}" for r, c in conversation) + _ASSISTANT

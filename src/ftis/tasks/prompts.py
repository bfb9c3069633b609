"""Prompt datasets of one's own: rows with a `prompt` string or a `messages` chat, scored by a
configured reward (docs/tasks.md, "Your own prompts").

Sources: a local .jsonl/.json/.parquet/.csv file, a local dataset directory (one written by
`datasets`' `save_to_disk`, or a folder of data files that `datasets.load_dataset` reads) given as
a path or as `hf:///abs/dir[:CONFIG[:SPLIT]]`, or `hf://REPO[:CONFIG[:SPLIT]]` (needs a network).

Choices where nothing else decides:
- a `messages` row is formatted with the node's tokenizer's chat template when it has one (per
  model: two nodes with different templates see the same conversation in their own format),
  else as "role: content" lines followed by "assistant: ";
- a `prompt` row is one user message (after `system_prompt` when set);
- the reward's `prompt` argument is the prompt string, or the "role: content" lines of the
  messages; every column of the row is in its `fields`;
- without `test_file`, a `test_fraction` of the rows (at least one) is held out, chosen by
  `split_seed` from the file's order: the same rows on every run and every machine.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from ftis.tasks.base import (
    Problem,
    TaskConfigBase,
    TaskDataError,
    as_id_list,
    plain_prompt_ids,
)
from ftis.tasks.gsm8k import (
    HF_SCHEME,
    Records,
    chat_template_field,
    chat_template_in_use,
    hub_spec_parts,
    import_datasets,
    read_records,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class PromptsTaskConfig(TaskConfigBase):
    """Your own prompts: a dataset with a `prompt` or a `messages` column, and your reward."""

    kind: Literal["prompts"] = Field(default="prompts", description="Task selector.")
    default_reward: ClassVar[str | None] = None  # the reward must be configured
    no_warmstart_field: ClassVar[str | None] = (
        "the prompts task has no supervised target: set task.warmstart_field to a column "
        "holding completions in the format your reward expects, or remove warm_start"
    )

    train_file: str = Field(
        description="Rows: a .jsonl/.json/.parquet/.csv file, a local dataset directory (a path "
        "or hf:///abs/dir[:CONFIG[:SPLIT]]), or hf://REPO[:CONFIG[:SPLIT]]."
    )
    test_file: str | None = Field(
        None, description="Held-out rows, same forms; null = hold out test_fraction of train_file."
    )
    test_fraction: float = Field(
        0.1, gt=0, lt=1, description="Share of train_file's rows held out when test_file is null."
    )
    test_size: int | None = Field(
        None, ge=1, description="Keep at most this many held-out rows (their first ones)."
    )
    split_seed: int = Field(0, description="Seed of the held-out rows' choice (test_fraction).")
    prompt_field: str = Field("prompt", description="Column holding a prompt string.")
    messages_field: str = Field(
        "messages", description="Column holding a chat: a list of {role, content}."
    )
    system_prompt: str | None = Field(
        None, description="System message put before each `prompt` row's question (not `messages`)."
    )
    use_chat_template: bool | None = chat_template_field("plain 'role: content' text")
    warmstart_field: str | None = Field(
        None,
        description="Column holding a completion in the format your reward wants; a warm start "
        "trains on it (a warm start without it is refused).",
    )
    skip_bad_rows: bool = Field(
        False,
        description="Skip and count malformed rows (a line that is not JSON, a row without a "
        "prompt, an empty or non-string prompt, a bad chat) instead of stopping at the first; "
        "the count is logged and in the report.",
    )

    @field_validator("train_file", "test_file", mode="before")
    @classmethod
    def _path_to_str(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @model_validator(mode="after")
    def _check(self) -> PromptsTaskConfig:
        if not self.train_file.strip():
            raise ValueError("train_file is empty: give a .jsonl/.parquet/.csv path or a directory")
        return self


SKIP_HINT = "; fix the row, or set task.skip_bad_rows: true to skip and count such rows"


def load_rows(spec: str, *, field: str, default_split: str) -> list[dict[str, Any]]:
    """The rows of a file, a local dataset directory or hf://...; `field` names the config field
    in errors."""
    return read_rows(spec, field=field, default_split=default_split).records


def read_rows(spec: str, *, field: str, default_split: str, skip_bad: bool = False) -> Records:
    """`load_rows` with where each row is (FILE:LINE of a .jsonl or .csv file, 1-based file
    lines; FILE record N / row N otherwise) and, with `skip_bad`, the lines that could not be
    read. A UTF-8 BOM is accepted."""
    if spec.startswith(HF_SCHEME) or Path(spec).is_dir():
        rows = _load_dataset(spec, field=field, default_split=default_split)
        return Records(rows, [f"{spec} row {i}" for i in range(1, len(rows) + 1)])
    if Path(spec).suffix.lower() == ".csv":
        path = Path(spec)
        if not path.is_file():
            raise TaskDataError(f"{field}: file not found: {spec!r} (from {os.getcwd()!r})")
        out = Records([], [])
        try:
            with path.open(encoding="utf-8-sig", newline="") as f:
                reader = csv.DictReader(f)
                start = 2  # the header is line 1
                for row in reader:
                    out.records.append(dict(row))
                    out.where.append(f"{path}:{start}")
                    start = reader.line_num + 1
        except UnicodeDecodeError as e:
            raise TaskDataError(f"{field}: {path} is not valid UTF-8: {e}") from e
        except csv.Error as e:
            raise TaskDataError(f"{field}: {path}:{reader.line_num} is not valid CSV: {e}") from e
        return out
    return read_records(
        spec, field=field, default_split=default_split, skip_bad=skip_bad, hint=SKIP_HINT
    )


def _load_dataset(spec: str, *, field: str, default_split: str) -> list[dict[str, Any]]:
    body = spec[len(HF_SCHEME) :] if spec.startswith(HF_SCHEME) else spec
    parsed = hub_spec_parts(body, default_split)
    if parsed is None or not parsed[0]:
        raise TaskDataError(f"{field}={spec!r}: write it as hf:///abs/dir[:CONFIG[:SPLIT]]")
    where, config, split = parsed
    datasets = import_datasets(
        f"{field}={spec!r} needs the `datasets` package: pip install 'ftis[datasets]', or "
        "save the rows as .jsonl/.parquet/.csv"
    )
    try:
        if Path(where).is_dir() and any(
            (Path(where) / f).is_file() for f in ("dataset_dict.json", "state.json")
        ):
            ds = datasets.load_from_disk(where)  # written by save_to_disk
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise TaskDataError(
                        f"{field}={spec!r}: no split {split!r}; it has {sorted(ds)} (give one as "
                        "hf:///dir::SPLIT)"
                    )
                ds = ds[split]
        else:
            ds = datasets.load_dataset(where, config, split=split)
    except TaskDataError:
        raise
    except Exception as e:
        raise TaskDataError(
            f"{field}={spec!r}: could not load {where!r} (config {config!r}, split {split!r}): {e}"
        ) from e
    return [dict(r) for r in ds]


def plain_chat(messages: Sequence[Mapping[str, Any]]) -> str:
    """A chat as "role: content" lines: the prompt of a model without a chat template."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


class PromptsTask:
    """Rows of prompts or chats; implements ``ftis.tasks.base.Task`` except the reward, which
    is configured (``build_task`` supplies it)."""

    name = "prompts"

    def __init__(self, cfg: PromptsTaskConfig | Mapping[str, Any]) -> None:
        raw = cfg if isinstance(cfg, Mapping) else cfg.model_dump()
        self.cfg = PromptsTaskConfig.model_validate(raw)
        c = self.cfg
        skip = c.skip_bad_rows
        train = read_rows(c.train_file, field="train_file", default_split="train", skip_bad=skip)
        skipped = list(train.skipped)
        rows, where = train.records, train.where
        if c.test_file is not None:
            test = read_rows(c.test_file, field="test_file", default_split="test", skip_bad=skip)
            skipped += test.skipped
            test_rows, test_where = test.records, test.where
        else:
            order = list(range(len(rows)))
            random.Random(c.split_seed).shuffle(order)
            n_test = max(1, math.ceil(c.test_fraction * len(rows)))
            if len(rows) - n_test < 1:
                raise TaskDataError(
                    f"train_file: {c.train_file!r} has {len(rows)} rows, too few to hold out "
                    f"test_fraction={c.test_fraction}; add rows or give a test_file"
                )
            held = set(order[:n_test])
            test_rows = [r for i, r in enumerate(rows) if i in held]
            test_where = [w for i, w in enumerate(where) if i in held]
            rows = [r for i, r in enumerate(rows) if i not in held]
            where = [w for i, w in enumerate(where) if i not in held]
        if c.test_size is not None:
            test_rows, test_where = test_rows[: c.test_size], test_where[: c.test_size]
        train_problems = self._problems(rows, where, "train_file", skipped)
        test_field = "test_file" if c.test_file else "train_file"
        self._splits = {
            "train": train_problems,
            "test": self._problems(test_rows, test_where, test_field, skipped),
        }
        self.skipped_rows = len(skipped)
        if skipped:
            shown = "; ".join(skipped[:3]) + ("; ..." if len(skipped) > 3 else "")
            logger.warning(
                "prompts task: skipped %d malformed row(s) (task.skip_bad_rows): %s",
                len(skipped),
                shown,
            )
        self.eval_splits: tuple[str, ...] = ("test",)
        logger.info("prompts task: %s", {k: len(v) for k, v in self._splits.items()})

    def _problems(
        self, rows: list[Any], where: list[str], field: str, skipped: list[str]
    ) -> tuple[Problem, ...]:
        """The problems of `rows` (`where[i]` says where row i is, for errors); a malformed row
        is one error, or (skip_bad_rows) skipped with its reason appended to `skipped`."""
        out: list[Problem] = []
        for row, at in zip(rows, where):
            why = self._row_error(row, field)
            if why is not None:
                if not self.cfg.skip_bad_rows:
                    raise TaskDataError(f"{field}: {at}: {why}{SKIP_HINT}")
                skipped.append(f"{at}: {why}")
                continue
            out.append(
                Problem(len(out), self._question(row), str(row.get("answer", "")), dict(row))
            )
        if not out:
            raise TaskDataError(
                f"{field}: no rows" + (" left after skipping the malformed ones" if rows else "")
            )
        return tuple(out)

    def _row_error(self, row: Any, field: str) -> str | None:
        """Why `row` cannot be a problem (None when it can)."""
        c = self.cfg
        if not isinstance(row, Mapping):
            return f"the row is not an object: {row!r:.80}"
        messages = row.get(c.messages_field)
        if messages is not None:
            if (
                not isinstance(messages, list)
                or not messages
                or not all(
                    isinstance(m, Mapping) and "role" in m and "content" in m for m in messages
                )
            ):
                return f"{c.messages_field!r} must be a non-empty list of {{role, content}} objects"
        elif row.get(c.prompt_field) is not None:
            prompt = row[c.prompt_field]
            if not isinstance(prompt, str):
                return (
                    f"{c.prompt_field!r} is a {type(prompt).__name__} ({prompt!r:.40}), not a "
                    "string"
                )
            if not prompt.strip():
                return f"{c.prompt_field!r} is empty"
        else:
            return (
                f"the row has neither {c.prompt_field!r} nor {c.messages_field!r} (columns: "
                f"{sorted(map(str, row))}); set prompt_field or messages_field"
            )
        if field == "train_file" and c.warmstart_field and row.get(c.warmstart_field) is None:
            return (
                f"the row has no {c.warmstart_field!r} (warmstart_field); add it to every row "
                "or unset warmstart_field"
            )
        return None

    def _question(self, row: Mapping[str, Any]) -> str:
        messages = row.get(self.cfg.messages_field)
        if messages is not None:
            return plain_chat(messages)
        return row[self.cfg.prompt_field]

    def split(self, name: str) -> Sequence[Problem]:
        if name not in self._splits:
            raise ValueError(f"prompts task has no split {name!r}; use one of {list(self._splits)}")
        return self._splits[name]

    def messages(self, problem: Problem) -> list[dict[str, Any]]:
        """The chat of a problem: its `messages`, or [system?, user: prompt]."""
        got = problem.fields.get(self.cfg.messages_field)
        if got is not None:
            return [dict(m) for m in got]
        out = (
            []
            if self.cfg.system_prompt is None
            else [{"role": "system", "content": self.cfg.system_prompt}]
        )
        return out + [{"role": "user", "content": problem.question}]

    def row_chat(self, problem: Problem) -> list[dict[str, Any]] | None:
        """The row's chat (its `messages` column) when the row is one, else None: a batched
        reward gets it as the prompt and the completion as [{"role": "assistant", "content":
        ...}], TRL's conversational form."""
        got = problem.fields.get(self.cfg.messages_field)
        return None if got is None else [dict(m) for m in got]

    def uses_chat_template(self, tokenizer: PreTrainedTokenizerBase) -> bool:
        return chat_template_in_use(self.cfg.use_chat_template, tokenizer)

    def prompt_ids(self, problem: Problem, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """The chat through the tokenizer's template (ending in the assistant turn) when used,
        else its "role: content" lines and "assistant: " as plain text."""
        messages = self.messages(problem)
        if self.uses_chat_template(tokenizer):
            out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return as_id_list(out)
        return plain_prompt_ids(tokenizer, plain_chat(messages) + "\nassistant: ")

    def reward(self, problem: Problem, completion: str) -> float:
        raise ValueError(
            "the prompts task has no built-in reward: set task.reward (e.g. my_rewards:score)"
        )

    def warmstart_target(self, problem: Problem) -> str:
        """The row's `warmstart_field` (the warm start trains on it)."""
        if self.cfg.warmstart_field is None:
            raise ValueError(self.cfg.warm_start_refusal())
        return str(problem.fields[self.cfg.warmstart_field])

"""GSM8K-style word problems from local files (JSONL / Parquet) or the Hub, with the paper's reward.

ftis-method.md section 8: chat-template prompt with a system prompt asking for
``<think> ... </think><answer> ... </answer>``; reward 1 only when the completion is exactly one
think block followed by exactly one answer block, ends with ``</answer>``, and the answer verifies
against the gold answer with math-verify; else 0.

Choices where the paper is silent (docs/tasks.md, "GSM8K and MATH" gives the whole format):
- format: the stripped completion must *start* with ``<think>`` and only whitespace may separate
  ``</think>`` from ``<answer>`` (the usual ``^<think>.*</think>\\s*<answer>.*</answer>$``);
  each of the four tags must occur exactly once.
- gold: the text after the last "####" with commas removed; records without "####" (MATH-style)
  use the whole answer, stripped.
- answers longer than ``MAX_ANSWER_CHARS`` score 0 without being parsed (math-verify can be slow on
  long garbage).
- warm-start target: ``<think> solution </think><answer> gold </answer>`` (``warmstart_target``),
  so a warm-started model learns the very format the reward asks for.
- eval caps (``test_size``, ``ood_size``) keep the first n records of the file, in file order.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as _field
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from ftis.tasks.base import Problem, TaskConfigBase, TaskDataError, as_id_list, plain_prompt_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = (
    "You solve math word problems. First reason step by step inside <think> </think> tags. "
    "Then give only the final answer inside <answer> </answer> tags, for example "
    "<think> 3 bags of 4 apples is 3*4 = 12 apples </think><answer> 12 </answer>"
)
PLAIN_PROMPT = "{system_prompt}\n\nQuestion: {question}\nAnswer: "
FIXTURE_SCHEME = "fixture:"  # "fixture:gsm8k_tiny_train.jsonl" -> a file shipped in ftis/tasks/data
HF_SCHEME = "hf://"  # "hf://openai/gsm8k:main:train" -> datasets.load_dataset(repo, config, split)
MAX_ANSWER_CHARS = 1_000
MATH_VERIFY_TIMEOUT_S = 5
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


# --------------------------------------------------------------------------------------- config


class GSM8KTaskConfig(TaskConfigBase):
    """GSM8K-style task: train/test files of question + reasoned answer, optional MATH-style OOD."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["gsm8k"] = Field(default="gsm8k", description="Task selector.")
    default_reward: ClassVar[str | None] = "builtin:gsm8k"
    # the warm start's target format (`GSM8KTask.warmstart_target`); part of its cache key
    warmstart_target_format: ClassVar[str] = "think-answer-1"
    train_file: str = Field(
        description="Train problems: a .jsonl/.json/.parquet path, 'fixture:NAME' for a file "
        "shipped with ftis, or 'hf://REPO[:CONFIG[:SPLIT]]' (needs `datasets` and a network)."
    )
    test_file: str = Field(description="In-distribution test problems; same forms as train_file.")
    ood_file: str | None = Field(
        default=None,
        description="Optional out-of-distribution problems, MATH-500 style ('problem', 'answer').",
    )
    test_size: int | None = Field(
        default=None, description="Keep at most this many test problems (first in file order)."
    )
    ood_size: int | None = Field(
        default=None, description="Keep at most this many OOD problems (first in file order)."
    )
    system_prompt: str = Field(
        default=DEFAULT_SYSTEM_PROMPT,
        description="System message asking for <think> ... </think><answer> ... </answer>.",
    )
    question_field: str = Field(
        default="question", description="Record field holding the question (train and test)."
    )
    answer_field: str = Field(
        default="answer",
        description="Record field holding the answer; gold = text after the last '####', no commas.",
    )
    ood_question_field: str = Field(
        default="problem", description="Record field holding the question in ood_file."
    )
    ood_answer_field: str = Field(
        default="answer", description="Record field holding the (final) answer in ood_file."
    )
    use_chat_template: bool | None = Field(
        default=None,
        description="Format prompts with the tokenizer's chat template; null = when it has one, "
        "false = always the plain-text prompt, true = require a template.",
    )

    @field_validator("train_file", "test_file", "ood_file", mode="before")
    @classmethod
    def _path_to_str(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("train_file", "test_file", "ood_file")
    @classmethod
    def _check_path(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.strip():
            raise ValueError("is empty: give a .jsonl/.parquet path, 'fixture:NAME' or 'hf://REPO'")
        if value.startswith(HF_SCHEME) and not value[len(HF_SCHEME) :].split(":")[0]:
            raise ValueError(f"{value!r} names no dataset: write it as hf://REPO[:CONFIG[:SPLIT]]")
        return value

    @field_validator("test_size", "ood_size")
    @classmethod
    def _check_size(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"is {value}: use a positive number, or null to keep every record")
        return value

    @field_validator("question_field", "answer_field", "ood_question_field", "ood_answer_field")
    @classmethod
    def _check_field(cls, value: str) -> str:
        if not value:
            raise ValueError("is empty: give the record's field name, e.g. 'question'")
        return value

    @model_validator(mode="after")
    def _check_ood(self) -> GSM8KTaskConfig:
        if self.ood_size is not None and self.ood_file is None:
            raise ValueError("ood_size is set but ood_file is not: set ood_file or drop ood_size")
        return self


# ------------------------------------------------------------------------------------------ data


def fixture_path(name: str) -> Path:
    """Path of a data file shipped in ``ftis/tasks/data`` (e.g. "gsm8k_tiny_train.jsonl")."""
    data = files("ftis.tasks").joinpath("data")
    path = Path(str(data.joinpath(name)))
    if not path.is_file():
        shipped = sorted(p.name for p in Path(str(data)).glob("*.jsonl"))
        raise TaskDataError(f"no fixture named {name!r}; shipped fixtures: {shipped}")
    return path


def gold_answer(answer: Any) -> str:
    """Gold answer of a record: after the last "####" with commas removed, else the whole text."""
    text = str(answer)
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    return text.strip()


def load_records(spec: str, *, field: str, default_split: str) -> list[dict[str, Any]]:
    """Read the records of ``spec`` (see ``GSM8KTaskConfig.train_file``); ``field`` names the
    config field in error messages."""
    return read_records(spec, field=field, default_split=default_split).records


@dataclass
class Records:
    """What `read_records` read: the records, where each one is in its source (``FILE:LINE``
    of a .jsonl file, 1-based; ``FILE record N`` of a .json list, ``FILE row N`` of a parquet
    file or a dataset, 1-based), and the reasons of the lines skipped (``skip_bad``)."""

    records: list[Any]
    where: list[str]
    skipped: list[str] = _field(default_factory=list)


def read_records(
    spec: str, *, field: str, default_split: str, skip_bad: bool = False, hint: str = ""
) -> Records:
    """`load_records` with where each record is; a .jsonl line that is not valid UTF-8 or JSON
    is skipped (its reason kept) when `skip_bad`, else one error naming its line (`hint`
    appended). A UTF-8 BOM at the start of a .jsonl/.json file is accepted."""
    if spec.startswith(HF_SCHEME):
        rows = _load_hub(spec, field=field, default_split=default_split)
        return Records(rows, [f"{spec} row {i}" for i in range(1, len(rows) + 1)])
    path = (
        fixture_path(spec[len(FIXTURE_SCHEME) :]) if spec.startswith(FIXTURE_SCHEME) else Path(spec)
    )
    if not path.is_file():
        raise TaskDataError(
            f"{field}: file not found: {str(path)!r} (resolved from the working directory "
            f"{os.getcwd()!r}); fix the path, or use 'fixture:NAME' for a shipped file"
        )
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        out = Records([], [])
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                why = None
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    why = f"is not valid UTF-8 ({e.reason} at byte {e.start})"
                else:
                    if not line.strip():
                        continue
                    try:
                        out.records.append(json.loads(line))
                        out.where.append(f"{path}:{lineno}")
                        continue
                    except json.JSONDecodeError as e:
                        why = f"is not valid JSON: {e}"
                if not skip_bad:
                    raise TaskDataError(f"{field}: {path}:{lineno} {why}{hint}")
                out.skipped.append(f"{path}:{lineno} {why}")
        return out
    if suffix == ".json":
        try:
            records = json.loads(path.read_text(encoding="utf-8-sig"))
        except UnicodeDecodeError as e:
            raise TaskDataError(f"{field}: {path} is not valid UTF-8: {e}") from e
        except json.JSONDecodeError as e:
            raise TaskDataError(f"{field}: {path} is not valid JSON: {e}") from e
        if not isinstance(records, list):
            raise TaskDataError(f"{field}: {path} must hold a JSON list of records")
        return Records(records, [f"{path} record {i}" for i in range(1, len(records) + 1)])
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise TaskDataError(
                f"{field}: reading {path} needs pyarrow: pip install 'ftis[parquet]' "
                "(or convert the file to .jsonl)"
            ) from e
        records = pq.read_table(path).to_pylist()
        return Records(records, [f"{path} row {i}" for i in range(1, len(records) + 1)])
    raise TaskDataError(f"{field}: {path} has suffix {suffix!r}; use .jsonl, .json or .parquet")


def hub_spec_parts(body: str, default_split: str) -> tuple[str, str | None, str] | None:
    """`WHERE[:CONFIG[:SPLIT]]` (what follows hf://) -> (where, config or None, split or
    `default_split`); None when it has more parts."""
    parts = body.split(":")
    if len(parts) > 3:
        return None
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else default_split
    return parts[0], config, split


def import_datasets(missing: str) -> Any:
    """The `datasets` package; TaskDataError(`missing`) when it is not installed."""
    try:
        import datasets
    except ImportError as e:
        raise TaskDataError(missing) from e
    return datasets


def _load_hub(spec: str, *, field: str, default_split: str) -> list[dict[str, Any]]:
    parsed = hub_spec_parts(spec[len(HF_SCHEME) :], default_split)
    if parsed is None:
        raise TaskDataError(f"{field}={spec!r}: write it as hf://REPO[:CONFIG[:SPLIT]]")
    repo, config, split = parsed
    datasets = import_datasets(
        f"{field}={spec!r} loads from the Hugging Face Hub, which needs the `datasets` package "
        "and a network (pip install datasets); or save the split as .jsonl/.parquet and point "
        f"{field} at the file"
    )
    try:
        ds = datasets.load_dataset(repo, config, split=split)
    except Exception as e:
        raise TaskDataError(
            f"{field}={spec!r}: could not load {repo!r} (config {config!r}, split {split!r}) from "
            f"the Hub: {e}"
        ) from e
    logger.info("loaded %d records from the Hub: %s", len(ds), spec)
    return [dict(r) for r in ds]


def _problems(
    records: list[Any],
    *,
    spec: str,
    field: str,
    question_field: str,
    answer_field: str,
    fields_from: str,
    limit: int | None,
) -> tuple[Problem, ...]:
    if not records:
        raise TaskDataError(f"{field}: {spec!r} holds no records")
    problems = []
    for i, record in enumerate(records[:limit]):
        if not isinstance(record, Mapping):
            raise TaskDataError(f"{field}: record {i} of {spec!r} is not an object: {record!r:.80}")
        for key, cfg_field in (
            (question_field, f"{fields_from}question_field"),
            (answer_field, f"{fields_from}answer_field"),
        ):
            if record.get(key) is None:
                raise TaskDataError(
                    f"{field}: record {i} of {spec!r} has no field {key!r} (fields: "
                    f"{sorted(record)}); set {cfg_field} to the field that holds it"
                )
        rest = {k: v for k, v in record.items() if k not in (question_field, answer_field)}
        fields = {**rest, "solution": str(record[answer_field])}
        problems.append(
            Problem(i, str(record[question_field]), gold_answer(record[answer_field]), fields)
        )
    if limit is not None and len(records) < limit:
        logger.warning(
            "%s: %s has %d records, fewer than the cap %d", field, spec, len(records), limit
        )
    return tuple(problems)


# ---------------------------------------------------------------------------------------- reward


def extract_answer(completion: str) -> str | None:
    """Content of the answer block when the completion is well formed, else None.

    Well formed: after stripping whitespace it starts with ``<think>``, ends with ``</answer>``,
    each of the four tags occurs exactly once, and only whitespace lies between ``</think>`` and
    ``<answer>``.
    """
    if not isinstance(completion, str):
        return None
    text = completion.strip()
    if not (text.startswith("<think>") and text.endswith("</answer>")):
        return None
    if any(text.count(tag) != 1 for tag in _TAGS):
        return None
    think_end, answer_start = text.index("</think>"), text.index("<answer>")
    if answer_start < think_end or text[think_end + len("</think>") : answer_start].strip():
        return None
    return text[answer_start + len("<answer>") : -len("</answer>")].strip()


_PLAIN_NUMBER_WITH_COMMAS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")


def _normalise(text: str) -> str:
    """Cheap canonical form for the exact-match fast path: no '$', thousands commas, final '.'."""
    text = text.strip().strip("$").strip().rstrip(".").strip()
    if _PLAIN_NUMBER_WITH_COMMAS.fullmatch(text):
        text = text.replace(",", "")
    return text


def _as_latex(text: str) -> str:
    """Put bare math in $...$ so math-verify's LaTeX extraction sees it (it then parses
    "\\frac{1}{2}", "x^2+1", "5\\sqrt{2}" and plain numbers alike)."""
    text = text.strip()
    if text.count("$") >= 2 or "\\boxed" in text:
        return text
    return f"${text.replace('$', '')}$"


def _timeout() -> int | None:
    # math-verify times out with signal.alarm, which only works in the main thread.
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int | None) -> tuple[Any, ...]:
    from math_verify import parse

    return tuple(parse(_as_latex(gold), parsing_timeout=timeout))


def answer_matches(answer: str, gold: str) -> bool:
    """True when ``answer`` equals ``gold`` (fast path) or math-verify proves them equivalent.

    Never raises: any error inside math-verify counts as a mismatch.
    """
    if not answer or len(answer) > MAX_ANSWER_CHARS:
        return False
    if _normalise(answer) == _normalise(gold):
        return True
    try:
        from math_verify import parse, verify

        timeout = _timeout()
        gold_parsed = _parse_gold(gold, timeout)
        if not gold_parsed:
            return False
        parsed = parse(_as_latex(answer), parsing_timeout=timeout)
        return bool(parsed) and bool(verify(list(gold_parsed), parsed, timeout_seconds=timeout))
    except Exception:  # math-verify/sympy can raise on odd input; a crash must not stop training
        logger.debug("math-verify failed on answer %r vs gold %r", answer[:80], gold, exc_info=True)
        return False


# ------------------------------------------------------------------------------------------ task


class GSM8KTask:
    """GSM8K-style task; implements ``ftis.tasks.base.Task``. Files are read once, here."""

    name = "gsm8k"

    def __init__(self, cfg: GSM8KTaskConfig | Mapping[str, Any]) -> None:
        self.cfg = GSM8KTaskConfig.model_validate(cfg if isinstance(cfg, Mapping) else dict(cfg))
        c = self.cfg
        self._splits: dict[str, tuple[Problem, ...]] = {
            "train": self._load("train_file", c.train_file, "train", None, ""),
            "test": self._load("test_file", c.test_file, "test", c.test_size, ""),
        }
        if c.ood_file is not None:
            self._splits["ood"] = self._load("ood_file", c.ood_file, "test", c.ood_size, "ood_")
        self.eval_splits: tuple[str, ...] = tuple(s for s in ("test", "ood") if s in self._splits)
        logger.info("gsm8k task: %s", {k: len(v) for k, v in self._splits.items()})

    def _load(
        self, field: str, spec: str, default_split: str, limit: int | None, prefix: str
    ) -> tuple[Problem, ...]:
        records = load_records(spec, field=field, default_split=default_split)
        return _problems(
            records,
            spec=spec,
            field=field,
            question_field=getattr(self.cfg, f"{prefix}question_field"),
            answer_field=getattr(self.cfg, f"{prefix}answer_field"),
            fields_from=prefix,
            limit=limit,
        )

    def split(self, name: str) -> Sequence[Problem]:
        if name not in self._splits:
            raise ValueError(f"gsm8k task has no split {name!r}; use one of {list(self._splits)}")
        return self._splits[name]

    def uses_chat_template(self, tokenizer: PreTrainedTokenizerBase) -> bool:
        return chat_template_in_use(self.cfg.use_chat_template, tokenizer)

    def prompt_ids(self, problem: Problem, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """Chat template (system + user, generation prompt) when used, else ``PLAIN_PROMPT``."""
        if self.uses_chat_template(tokenizer):
            return chat_prompt_ids(tokenizer, self.cfg.system_prompt, problem.question)
        text = PLAIN_PROMPT.format(system_prompt=self.cfg.system_prompt, question=problem.question)
        return plain_prompt_ids(tokenizer, text)

    def reward(self, problem: Problem, completion: str) -> float:
        answer = extract_answer(completion)
        return 1.0 if answer is not None and answer_matches(answer, problem.answer) else 0.0

    def warmstart_target(self, problem: Problem) -> str:
        """Supervised warm-start completion in the reward's full format: the record's worked
        solution (the text before '####', calculator annotations '<<...>>' removed, whitespace
        collapsed) in the think block, the gold answer in the answer block."""
        return warmstart_target(problem.fields.get("solution", ""), problem.answer)

    def extract_answer(self, completion: str) -> str | None:
        """The answer block of a well-formed completion in a cheap canonical form (no '$',
        thousands commas or final '.'), else None; eval counts distinct answers with it."""
        answer = extract_answer(completion)
        return None if answer is None else _normalise(answer)


_CALCULATOR = re.compile(r"<<[^<>]*>>")


def warmstart_target(solution: str, gold: str) -> str:
    """`<think> reasoning </think><answer> gold </answer>`: the reasoning is `solution` before
    its last '####' (all of it when there is none and it is not just the gold answer),
    without GSM8K's calculator annotations; the reward's own format (docs/tasks.md)."""
    text = str(solution)
    reasoning = text.rsplit("####", 1)[0] if "####" in text else text
    reasoning = " ".join(_CALCULATOR.sub("", reasoning).split())
    if reasoning == gold.strip() or any(tag in reasoning for tag in _TAGS):
        reasoning = ""
    think = f"<think> {reasoning} </think>" if reasoning else "<think> </think>"
    return f"{think}<answer> {gold} </answer>"


def chat_template_in_use(setting: bool | None, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether a task renders its prompts through the tokenizer's chat template: `setting` is
    the task's `use_chat_template` (None: when the tokenizer has one); true without a template
    is an error."""
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if setting is True and not has_template:
        raise ValueError(
            "task.use_chat_template is true but the tokenizer has no chat template: set it to "
            "null (auto) or false, or use a tokenizer with a template"
        )
    return has_template and setting is not False


def chat_template_field(plain: str) -> Any:
    """A task config's `use_chat_template` field; `plain` is what the prompt is without one."""
    return Field(
        None,
        description="null = the tokenizer's chat template when it has one, false = always the "
        f"{plain}, true = require a template.",
    )


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, system: str, question: str) -> list[int]:
    """Token ids of [system, user] through the chat template, ending in the assistant turn.

    Templates that reject a system role (they raise a Jinja error) get the system prompt as the
    first paragraph of the user message instead.
    """
    from jinja2.exceptions import TemplateError

    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except TemplateError:
        merged = [{"role": "user", "content": f"{system}\n\n{question}"}]
        out = tokenizer.apply_chat_template(merged, add_generation_prompt=True, tokenize=True)
    return as_id_list(out)

"""GSM8K-style task: loading (jsonl, parquet, fixtures), gold extraction, prompts, the reward."""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from pydantic import ValidationError
from transformers import BatchEncoding

from ftis.models.tokenizer import char_tokenizer
from ftis.tasks import (
    GSM8KTask,
    GSM8KTaskConfig,
    Problem,
    Task,
    TaskDataError,
    build_task,
    extract_answer,
    fixture_path,
    gold_answer,
)
from ftis.tasks.base import as_id_list
from ftis.tasks.gsm8k import PLAIN_PROMPT

TRAIN, TEST, MATH = "gsm8k_tiny_train.jsonl", "gsm8k_tiny_test.jsonl", "math_tiny.jsonl"
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _cfg(**kw) -> GSM8KTaskConfig:
    base = {"train_file": fixture_path(TRAIN), "test_file": fixture_path(TEST)}
    return GSM8KTaskConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def task() -> GSM8KTask:
    return GSM8KTask(_cfg(ood_file=f"fixture:{MATH}"))


def _read(name: str) -> list[dict]:
    return [json.loads(line) for line in fixture_path(name).read_text().splitlines()]


def _done(answer: str, think: str = "some steps") -> str:
    return f"<think>{think}</think><answer>{answer}</answer>"


class TestLoading:
    def test_fixtures(self, task):
        assert isinstance(task, Task)
        assert [len(task.split(s)) for s in ("train", "test", "ood")] == [24, 8, 8]
        assert task.eval_splits == ("test", "ood")
        first = task.split("train")[0]
        assert first.index == 0
        assert first.question == _read(TRAIN)[0]["question"]
        assert first.answer == "18"
        assert task.split("ood")[0].answer == "\\frac{1}{2}"

    def test_fixture_arithmetic_is_right(self):
        # The reasoning's <<expr=value>> annotations and the #### golds must be correct.
        for name in (TRAIN, TEST):
            for record in _read(name):
                for expr, value in re.findall(r"<<([^=]+)=([^>]+)>>", record["answer"]):
                    assert eval(expr) == pytest.approx(float(value)), (name, expr)
                float(gold_answer(record["answer"]))

    def test_no_ood_file(self):
        task = GSM8KTask(_cfg())
        assert task.eval_splits == ("test",)
        with pytest.raises(ValueError, match="no split 'ood'"):
            task.split("ood")

    def test_gold_answer(self):
        assert gold_answer("3*4=<<3*4=12>>12\n#### 12") == "12"
        assert gold_answer("so\n#### 1,315 ") == "1315"
        assert gold_answer("a #### 1 #### -7") == "-7"
        assert gold_answer(" \\frac{1}{2} ") == "\\frac{1}{2}"
        assert gold_answer(42) == "42"
        by_question = {p.question: p.answer for p in GSM8KTask(_cfg()).split("train")}
        assert "1315" in by_question.values() and "-7" in by_question.values()

    def test_parquet_equals_jsonl(self, tmp_path):
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        records = _read(TEST)
        path = tmp_path / "test.parquet"
        pq.write_table(pa.Table.from_pylist(records), path)
        from_parquet = GSM8KTask(_cfg(test_file=str(path)))
        assert from_parquet.split("test") == GSM8KTask(_cfg()).split("test")

    def test_custom_fields_and_caps(self, tmp_path):
        path = tmp_path / "q.jsonl"
        rows = [{"q": f"What is {i}+1?", "a": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(5)]
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
        task = GSM8KTask(
            _cfg(train_file=path, test_file=path, question_field="q", answer_field="a", test_size=2)
        )
        assert len(task.split("train")) == 5
        assert task.split("test") == (
            Problem(0, "What is 0+1?", "1"),
            Problem(1, "What is 1+1?", "2"),
        )

    def test_ood_size_caps(self):
        task = GSM8KTask(_cfg(ood_file=f"fixture:{MATH}", ood_size=3))
        assert len(task.split("ood")) == 3

    def test_build_task_from_dict(self):
        task = build_task(
            {"kind": "gsm8k", "train_file": f"fixture:{TRAIN}", "test_file": f"fixture:{TEST}"}
        )
        assert isinstance(task.task, GSM8KTask)  # wrapped with its configured reward


class TestDataErrors:
    def test_missing_file_names_path_and_field(self, tmp_path):
        missing = tmp_path / "nope.jsonl"
        with pytest.raises(TaskDataError) as err:
            GSM8KTask(_cfg(test_file=missing))
        assert "test_file" in str(err.value) and str(missing) in str(err.value)

    def test_missing_record_field_names_config_field(self):
        with pytest.raises(TaskDataError, match="ood_question_field"):
            GSM8KTask(_cfg(ood_file=fixture_path(MATH), ood_question_field="question"))
        with pytest.raises(TaskDataError, match=r"train_file: .*'problem'.*set question_field"):
            GSM8KTask(_cfg(question_field="problem"))

    def test_bad_json_names_the_line(self, tmp_path):
        path = tmp_path / "bad.jsonl"
        path.write_text('{"question": "q", "answer": "#### 1"}\n{oops\n')
        with pytest.raises(TaskDataError, match=r"train_file: .*bad.jsonl:2"):
            GSM8KTask(_cfg(train_file=path))

    def test_empty_file_and_bad_suffix(self, tmp_path):
        empty = tmp_path / "empty.jsonl"
        empty.write_text("")
        with pytest.raises(TaskDataError, match="no records"):
            GSM8KTask(_cfg(train_file=empty))
        csv = tmp_path / "data.csv"
        csv.write_text("question,answer\n")
        with pytest.raises(TaskDataError, match=r"\.jsonl"):
            GSM8KTask(_cfg(train_file=csv))

    def test_unknown_fixture(self):
        with pytest.raises(TaskDataError, match=TRAIN):
            fixture_path("nope.jsonl")

    def test_hub_without_datasets_is_a_clear_error(self, monkeypatch):
        # Make `import datasets` fail as it does where the package is not installed.
        monkeypatch.setitem(sys.modules, "datasets", None)
        with pytest.raises(TaskDataError, match=r"train_file=.*`datasets`"):
            GSM8KTask(_cfg(train_file="hf://openai/gsm8k:main:train"))

    @pytest.mark.parametrize(
        ("kwargs", "field"),
        [
            ({"test_size": 0}, "test_size"),
            ({"ood_size": 5}, "ood_size"),
            ({"train_file": ""}, "train_file"),
            ({"test_file": "hf://"}, "test_file"),
            ({"question_field": ""}, "question_field"),
            ({"use_chat_template": "maybe"}, "use_chat_template"),
            ({"system": "hi"}, "system"),
        ],
    )
    def test_bad_configs_name_the_field(self, kwargs, field):
        with pytest.raises(ValidationError) as err:
            _cfg(**kwargs)
        assert field in str(err.value)


class TestReward:
    p = Problem(0, "q", "18")
    half = Problem(0, "q", "\\frac{1}{2}")

    @pytest.mark.parametrize(
        "completion",
        [
            _done("18"),
            "\n  " + _done(" 18 ", think="\n6*3=18\n") + "\n\n",
            "<think>x</think>\n<answer>18</answer>",
            _done("18.0"),
            _done("$18$"),
            _done("\\boxed{18}"),
        ],
    )
    def test_correct(self, completion):
        assert GSM8KTask.reward(None, self.p, completion) == 1.0  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        "completion",
        [
            _done("17"),
            "<answer>18</answer>",  # no think block
            "<think>a</think><answer>18</answer><answer>18</answer>",  # two answer blocks
            "<think>a</think><think>b</think><answer>18</answer>",  # two think blocks
            _done("18") + " So the answer is 18.",  # text after </answer>
            "The answer: " + _done("18"),  # text before <think>
            "<think>a</think> so <answer>18</answer>",  # text between the blocks
            "<answer>18</answer><think>a</think>",  # wrong order
            "<think>a<answer>18</answer></think><answer>18</answer>",  # nested
            "<think>a</think><answer>18",  # unclosed
            _done(""),
            "",
            "18",
            "<think></think></answer><answer>",
            "\x00\ufffd<<<>>>" * 50,
            _done("1" * 5000),  # absurdly long answer
            _done("\\frac{"),  # malformed LaTeX
        ],
    )
    def test_wrong_or_malformed(self, completion):
        assert GSM8KTask.reward(None, self.p, completion) == 0.0  # type: ignore[arg-type]

    def test_latex_equivalence(self):
        reward = GSM8KTask.reward
        assert reward(None, self.half, _done("0.5")) == 1.0  # type: ignore[arg-type]
        assert reward(None, self.half, _done("1/2")) == 1.0  # type: ignore[arg-type]
        assert reward(None, self.half, _done("\\dfrac{1}{2}")) == 1.0  # type: ignore[arg-type]
        assert reward(None, self.half, _done("0.25")) == 0.0  # type: ignore[arg-type]
        root = Problem(0, "q", "5\\sqrt{2}")
        assert reward(None, root, _done("\\sqrt{50}")) == 1.0  # type: ignore[arg-type]

    def test_numbers(self):
        reward = GSM8KTask.reward
        big = Problem(0, "q", gold_answer("#### 1,315"))
        assert reward(None, big, _done("1,315")) == 1.0  # type: ignore[arg-type]
        assert reward(None, big, _done("$1315")) == 1.0  # type: ignore[arg-type]
        neg = Problem(0, "q", "-7")
        assert reward(None, neg, _done("-7")) == 1.0  # type: ignore[arg-type]
        assert reward(None, neg, _done("7")) == 0.0  # type: ignore[arg-type]

    def test_non_string_completion(self):
        assert extract_answer(None) is None  # type: ignore[arg-type]

    def test_math_verify_errors_give_zero(self, monkeypatch):
        import math_verify

        def boom(*args, **kwargs):
            raise RuntimeError("sympy exploded")

        monkeypatch.setattr(math_verify, "verify", boom)
        assert GSM8KTask.reward(None, self.half, _done("0.5")) == 0.0  # type: ignore[arg-type]
        # The exact-match fast path does not need math-verify.
        assert GSM8KTask.reward(None, self.half, _done("\\frac{1}{2}")) == 1.0  # type: ignore[arg-type]

    def test_works_off_the_main_thread(self):
        # math-verify's signal-based timeout only works in the main thread; the reward must not care.
        with ThreadPoolExecutor(2) as pool:
            rewards = list(
                pool.map(lambda a: GSM8KTask.reward(None, self.half, _done(a)), ["0.5", "2"])
            )  # type: ignore[arg-type]
        assert rewards == [1.0, 0.0]


class TestPrompt:
    def test_plain_prompt_without_template(self, task):
        tok = char_tokenizer()
        p = task.split("test")[0]
        ids = task.prompt_ids(p, tok)
        text = PLAIN_PROMPT.format(system_prompt=task.cfg.system_prompt, question=p.question)
        assert ids == [tok.bos_token_id, *tok.encode(text, add_special_tokens=False)]
        assert text.endswith(f"Question: {p.question}\nAnswer: ")
        assert "<think>" in text and "<answer>" in text

    def test_chat_template(self, task):
        tok = char_tokenizer()
        tok.chat_template = TEMPLATE
        p = task.split("test")[0]
        ids = task.prompt_ids(p, tok)
        assert isinstance(ids, list) and all(type(i) is int for i in ids)
        expected = f"<|system|>{task.cfg.system_prompt}\n<|user|>{p.question}\n<|assistant|>"
        assert ids == tok.encode(expected, add_special_tokens=False)

        plain = GSM8KTask(_cfg(use_chat_template=False))
        assert tok.decode(plain.prompt_ids(p, tok)[1:]).startswith(task.cfg.system_prompt[:20])

    def test_template_without_system_role(self, task):
        tok = char_tokenizer()
        tok.chat_template = (
            "{% for m in messages %}{% if m['role'] == 'system' %}"
            "{{ raise_exception('System role not supported') }}{% endif %}"
            "<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"
        )
        p = task.split("test")[0]
        expected = f"<|user|>{task.cfg.system_prompt}\n\n{p.question}<|assistant|>"
        assert task.prompt_ids(p, tok) == tok.encode(expected, add_special_tokens=False)

    def test_template_required_but_missing(self):
        task = GSM8KTask(_cfg(use_chat_template=True))
        with pytest.raises(ValueError, match="use_chat_template"):
            task.prompt_ids(task.split("test")[0], char_tokenizer())

    @pytest.mark.parametrize(
        "encoded",
        [
            [5, 6, 7],
            (5, 6, 7),
            {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]},
            BatchEncoding({"input_ids": [5, 6, 7]}),
            BatchEncoding({"input_ids": [[5, 6, 7]]}),
            torch.tensor([[5, 6, 7]]),
            [[5, 6, 7]],
        ],
    )
    def test_as_id_list(self, encoded):
        assert as_id_list(encoded) == [5, 6, 7]

    def test_as_id_list_rejects_a_batch(self):
        with pytest.raises(ValueError, match="batch of 2"):
            as_id_list([[1], [2]])

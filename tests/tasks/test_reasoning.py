"""The embedded reasoning task: determinism, held-out partition, traces, verifier, OOD splits,
the warm start's pre-training mix, and the warm-start cache key."""

from __future__ import annotations

import re

import pytest
from pydantic import TypeAdapter, ValidationError

from ftis.models.config import ModelConfig
from ftis.models.tokenizer import char_tokenizer
from ftis.tasks import (
    Problem,
    ReasoningTask,
    ReasoningTaskConfig,
    Task,
    TaskConfig,
    build_task,
)
from ftis.tasks.arithmetic import TRAIN_SIZE, is_heldout
from ftis.tasks.reasoning import extract_answer, parse_question, solution

N = 2000  # train indices scanned


@pytest.fixture(scope="module")
def task() -> ReasoningTask:
    return ReasoningTask()


def _digits(question: str) -> tuple[str, list[int]]:
    """(skill, digit count of each multi-digit operand), read independently of the module."""
    if "*" in question:
        a, m = question[:-1].split("*")
        assert len(m) == 1
        return "mul", [len(a)]
    if "/" in question:
        a, m = question[:-1].split("/")
        assert len(m) == 1
        return "div", [len(a)]
    if "-" in question:
        return "sub", [len(x) for x in question[:-1].split("-")]
    return "add", [len(x) for x in question[:-1].split("+")]


class TestDeterminism:
    def test_golden_values_pin_the_generator(self, task):
        # Fixed values: a change of RNG derivation breaks index-based prompt sharing.
        train = task.split("train")
        assert train[0] == Problem(0, "21*9=", "189")
        assert train[1] == Problem(1, "14+84=", "98")
        assert task.warmstart_split()[0] == Problem(0, "236+192=", "428")
        assert task.split("test")[0] == Problem(0, "407+141=", "548")
        assert task.split("ood")[0] == Problem(0, "8169*6=", "49014")

    def test_same_seed_same_problems(self, task):
        other = ReasoningTask(ReasoningTaskConfig())
        for i in [0, 1, 17, 12345, 10**8, TRAIN_SIZE - 1]:
            assert other.split("train")[i] == task.split("train")[i]
        assert other.split("test") == task.split("test")
        assert other.split("ood") == task.split("ood")
        assert other.warmstart_split()[:50] == task.warmstart_split()[:50]

    def test_seed_changes_every_split(self, task):
        other = ReasoningTask(ReasoningTaskConfig(seed=1))
        assert other.split("train")[:50] != task.split("train")[:50]
        assert other.split("test") != task.split("test")
        assert other.split("ood") != task.split("ood")
        assert other.warmstart_split()[:50] != task.warmstart_split()[:50]

    def test_train_is_an_index_addressable_virtual_sequence(self, task):
        train = task.split("train")
        assert len(train) == TRAIN_SIZE
        assert train[-1] == train[TRAIN_SIZE - 1]
        assert [p.index for p in train[5:8]] == [5, 6, 7]
        assert train[42] in train
        with pytest.raises(IndexError):
            train[TRAIN_SIZE]

    def test_is_a_task_and_registered(self, task):
        assert isinstance(task, Task)
        built = build_task({"kind": "reasoning", "seed": 0})
        assert isinstance(built, Task) and isinstance(built.task, ReasoningTask)
        assert built.split("train")[3] == task.split("train")[3]
        cfg = TypeAdapter(TaskConfig).validate_python({"kind": "reasoning"})
        assert isinstance(cfg, ReasoningTaskConfig)


class TestPartition:
    def test_train_never_holds_an_eval_question(self, task):
        train = {p.question for p in task.split("train")[:N]}
        assert not any(is_heldout(q) for q in train)
        for split in task.eval_splits:
            assert train.isdisjoint(p.question for p in task.split(split))
        pre = {p.question for p in task.warmstart_split()[:N]}
        assert not any(is_heldout(q) for q in pre)

    def test_eval_splits_are_distinct_held_out_problems(self, task):
        assert task.eval_splits == ("test", "ood")
        for name in task.eval_splits:
            problems = task.split(name)
            assert len(problems) == 256
            assert len({p.question for p in problems}) == 256
            assert [p.index for p in problems] == list(range(256))
            assert all(is_heldout(p.question) for p in problems)

    def test_small_space_is_filled_exactly(self):
        # 1-digit "mul" has 9 x 8 questions: take every held-out one.
        heldout = [f"{a}*{m}=" for a in range(1, 10) for m in range(2, 10)]
        heldout = [q for q in heldout if is_heldout(q)]
        cfg = ReasoningTaskConfig(
            skills={"mul": 1.0}, min_digits=1, max_digits=1, test_size=len(heldout), ood={}
        )
        task = ReasoningTask(cfg)
        assert sorted(p.question for p in task.split("test")) == sorted(heldout)
        with pytest.raises(ValidationError, match="held-out problems available"):
            ReasoningTaskConfig(
                skills={"mul": 1.0}, min_digits=1, max_digits=1, test_size=len(heldout) + 1
            )


class TestTraces:
    def test_worked_examples(self):
        assert solution("457+386=") == "7+6=13,5+8+1=14,4+3+1=8#843"
        assert solution("12+34+56=") == "2+4+6=12,1+3+5+1=10#102"
        assert solution("347*6=") == "7*6=42,4*6+4=28,3*6+2=20#2082"
        assert solution("99*9=") == "9*9=81,9*9+8=89#891"
        assert parse_question("347*6=") == ("mul", [347, 6])
        with pytest.raises(ValueError, match="not a reasoning question"):
            parse_question("3-4=")

    def test_every_trace_ends_in_the_exact_answer(self, task):
        problems = task.split("train")[:N] + list(task.split("ood"))
        for p in problems:
            text = solution(p.question)
            assert p.answer == str(eval(p.question[:-1]))  # independent oracle
            assert extract_answer(text) == p.answer
            assert task.reward(p, text) == 1.0
            steps = text.split("#")[0].split(",")
            assert len(steps) == max(_digits(p.question)[1])  # one step per column

    def test_completion_lengths_fit_the_char_tokenizer(self, task):
        tok = char_tokenizer()
        for p in task.split("train")[:200] + list(task.split("ood"))[:50]:
            text = solution(p.question)
            ids = tok.encode(text, add_special_tokens=False)
            assert tok.unk_token_id not in ids
            assert tok.decode(ids) == text
            assert 8 <= len(ids) <= 48


class TestVerifier:
    P = Problem(0, "457+386=", "843")

    @pytest.mark.parametrize(
        "completion",
        [
            "7+6=13,5+8+1=14,4+3+1=8#843",
            " 7+6=13,5+8+1=14,4+3+1=8#843\n",  # surrounding whitespace is ignored
            "7+6=99#843",  # steps are checked for syntax only, like the paper's tags
        ],
    )
    def test_right(self, task, completion):
        assert task.reward(self.P, completion) == 1.0

    @pytest.mark.parametrize(
        "completion",
        [
            "843",  # right answer, no trace
            "#843",  # empty trace
            "7+6=13,5+8+1=14,4+3+1=8",  # no answer
            "7+6=13,5+8+1=14,4+3+1=8#843#843",  # two answers
            "7+6=13;5+8+1=14;4+3+1=8#843",  # wrong separator
            "7+6=13,,4+3+1=8#843",  # empty step
            "7+6=13,5+8+1=14,4+3+1=8#843.",  # trailing junk
            "7+6=13,5+8+1=14,4+3+1=8# 843",  # space inside
            "7+6=13,5+8+1,4+3+1=8#843",  # a step without '='
            "the answer is 7+6=13#843",  # prose
        ],
    )
    def test_right_answer_wrong_format_gets_zero(self, task, completion):
        assert task.reward(self.P, completion) == 0.0

    @pytest.mark.parametrize(
        "completion",
        ["7+6=13,5+8+1=14,4+3+1=8#842", "7+6=13,5+8+1=14,4+3+1=8#0843", "1+1=2#-843", ""],
    )
    def test_wrong_answer_gets_zero(self, task, completion):
        assert task.reward(self.P, completion) == 0.0


class TestDistribution:
    def test_train_matches_config(self, task):
        skills = {"add": 0, "mul": 0}
        for p in task.split("train")[:N]:
            skill, digits = _digits(p.question)
            skills[skill] += 1
            assert all(2 <= d <= 3 for d in digits)
            assert skill == "mul" or len(digits) == 2
        assert 0.45 < skills["add"] / N < 0.55

    def test_ood_split_has_one_more_digit_per_skill(self, task):
        seen = set()
        for p in task.split("ood"):
            skill, digits = _digits(p.question)
            seen.add(skill)
            assert digits == [4] * len(digits)  # train max_digits is 3: never in train
        assert seen == {"add", "mul"}

    def test_per_skill_digits_and_variants(self):
        cfg = ReasoningTaskConfig(
            max_digits={"add": 4, "mul": 2},
            ood={
                "mul+1": {"skills": {"mul": 1.0}, "extra_digits": 1, "size": 30},
                "add3": {"skills": {"add": 1.0}, "terms": 3, "size": 30},
            },
        )
        task = ReasoningTask(cfg)
        assert task.eval_splits == ("test", "mul+1", "add3")
        for p in task.split("train")[:500]:
            skill, digits = _digits(p.question)
            assert max(digits) <= (4 if skill == "add" else 2)
        assert all(_digits(p.question) == ("mul", [3]) for p in task.split("mul+1"))
        assert all(len(_digits(p.question)[1]) == 3 for p in task.split("add3"))

    def test_subtraction_traces_borrow_and_end_in_the_difference(self):
        assert solution("457-386=") == "7-6=1,15-8=7,4-3-1=0#71"
        assert solution("500-499=") == "10-9=1,10-9-1=0,5-4-1=0#1"
        assert solution("91-19=") == "11-9=2,9-1-1=7#72"
        assert solution("77-77=") == "7-7=0,7-7=0#0"
        assert parse_question("457-386=") == ("sub", [457, 386])
        for bad in ("3-4=", "100-99="):  # the larger first; the same number of digits
            with pytest.raises(ValueError, match="not a reasoning question"):
                parse_question(bad)
        task = ReasoningTask(ReasoningTaskConfig(skills={"sub": 1.0}, min_digits=2, max_digits=4))
        for p in task.split("train")[:N] + list(task.split("test")) + list(task.split("ood")):
            text = solution(p.question)
            skill, digits = _digits(p.question)
            assert skill == "sub" and digits[0] == digits[1]
            assert int(p.answer) == eval(p.question[:-1]) >= 0  # independent oracle
            assert extract_answer(text) == p.answer and task.reward(p, text) == 1.0
            assert len(text.split("#")[0].split(",")) == digits[0]  # one step per column
            assert len(text) + 1 <= 64  # trace + EOS fit the generation budget used for mul

    def test_division_traces_long_division_and_end_in_the_quotient(self):
        assert solution("852/4=") == "8/4=2,5/4=1,12/4=3#213"
        assert solution("347/6=") == "3/6=0,34/6=5,47/6=7#57"  # leading zero dropped
        assert solution("100/7=") == "1/7=0,10/7=1,30/7=4#14"
        assert solution("7/8=") == "7/8=0#0"
        assert parse_question("852/4=") == ("div", [852, 4])
        for bad in ("85/1=", "85/10=", "85/0="):  # one divisor digit, 2-9
            with pytest.raises(ValueError, match="not a reasoning question"):
                parse_question(bad)
        task = ReasoningTask(ReasoningTaskConfig(skills={"div": 1.0}, min_digits=2, max_digits=4))
        for p in task.split("train")[:N] + list(task.split("test")) + list(task.split("ood")):
            text = solution(p.question)
            skill, digits = _digits(p.question)
            a, m = (int(x) for x in p.question[:-1].split("/"))
            assert skill == "div" and 2 <= m <= 9
            assert int(p.answer) == a // m  # independent oracle
            assert extract_answer(text) == p.answer and task.reward(p, text) == 1.0
            assert len(text.split("#")[0].split(",")) == digits[0]  # one step per digit
            # each step: the remainder so far times 10 plus the next digit, over m
            rest = 0
            for step, digit in zip(text.split("#")[0].split(","), str(a), strict=True):
                lhs, value = step.split("=")
                assert lhs == f"{10 * rest + int(digit)}/{m}"
                assert int(value) == (10 * rest + int(digit)) // m
                rest = (10 * rest + int(digit)) % m

    def test_a_fourth_skill_leaves_the_earlier_skills_draws_unchanged(self):
        # SKILLS order: a config without div draws exactly what it drew before div existed
        three = ReasoningTask(ReasoningTaskConfig(skills={"add": 1.0, "mul": 1.0, "sub": 1.0}))
        with_div = ReasoningTask(
            ReasoningTaskConfig(skills={"add": 1.0, "mul": 1.0, "sub": 1.0, "div": 0.0})
        )
        assert [p.question for p in three.split("train")[:200]] == [
            p.question for p in with_div.split("train")[:200]
        ]
        four = ReasoningTask(
            ReasoningTaskConfig(
                skills={"add": 1.0, "mul": 1.0, "sub": 1.0, "div": 1.0},
                ood={"div": {"skills": {"div": 1.0}, "size": 64}},
            )
        )
        assert {_digits(p.question)[0] for p in four.split("train")[:400]} == {
            "add",
            "mul",
            "sub",
            "div",
        }
        heldout = list(four.split("div"))
        assert len(heldout) == 64 and all(_digits(p.question)[0] == "div" for p in heldout)
        assert all(is_heldout(p.question) for p in heldout)
        assert not any(is_heldout(p.question) for p in four.split("train")[:400])

    def test_three_skills_and_a_small_subtraction_space(self):
        task = ReasoningTask(
            ReasoningTaskConfig(
                skills={"add": 1.0, "mul": 1.0, "sub": 1.0},
                ood={"sub": {"skills": {"sub": 1.0}, "size": 64}},
            )
        )
        kinds = {_digits(p.question)[0] for p in task.split("train")[:300]}
        assert kinds == {"add", "mul", "sub"}
        assert all(_digits(p.question)[0] == "sub" for p in task.split("sub"))
        # 1-digit subtraction: 45 pairs a >= b; every held-out one is taken
        heldout = [f"{a}-{b}=" for a in range(1, 10) for b in range(1, a + 1)]
        heldout = [q for q in heldout if is_heldout(q)]
        cfg = ReasoningTaskConfig(
            skills={"sub": 1.0}, min_digits=1, max_digits=1, test_size=len(heldout), ood={}
        )
        assert sorted(p.question for p in ReasoningTask(cfg).split("test")) == sorted(heldout)

    def test_skill_weights_select_skills(self):
        task = ReasoningTask(ReasoningTaskConfig(skills={"add": 0.0, "mul": 1.0}))
        assert all("*" in p.question for p in task.split("train")[:300])
        assert all("*" in p.question for p in task.split("test"))

    def test_warmstart_split_adds_longer_problems_at_the_configured_rate(self, task):
        pre = task.warmstart_split()[:N]
        longer = [p for p in pre if max(_digits(p.question)[1]) == 4]
        assert all(max(_digits(p.question)[1]) in (2, 3, 4) for p in pre)
        assert 0.07 < len(longer) / N < 0.13  # pretrain_fraction = 0.1
        none = ReasoningTask(ReasoningTaskConfig(pretrain_fraction=0.0)).warmstart_split()
        assert all(max(_digits(p.question)[1]) <= 3 for p in none[:500])
        ReasoningTaskConfig(max_digits=8, pretrain_fraction=0.0, ood={})  # nothing longer needed

    @pytest.mark.parametrize(
        ("cfg", "match"),
        [
            ({"skills": {"pow": 1.0}}, "unknown skill"),
            ({"skills": {"add": 0.0, "mul": 0.0}}, "all zero"),
            ({"max_digits": {"add": 3}}, "missing"),
            ({"min_digits": 4, "max_digits": 3}, "need 1 <= min_digits"),
            ({"terms": 5}, "2 to 4 addends"),
            ({"ood": {"x": {"extra_digits": 1, "max_digits": 5}}}, "not both"),
            ({"ood": {"test": {"terms": 3}}}, "not allowed"),
            ({"max_digits": 8}, "at most 8"),
        ],
    )
    def test_bad_configs_name_the_problem(self, cfg, match):
        with pytest.raises(ValidationError, match=match):
            ReasoningTaskConfig(**cfg)


class TestWarmStart:
    def test_cache_key_covers_the_task_config(self):
        from ftis.warmstart import WarmStartConfig, cache_key

        model, ws = ModelConfig(preset="llama-xs"), WarmStartConfig(steps=10)
        base = ReasoningTaskConfig()
        keys = {
            cache_key(model, ws, cfg)
            for cfg in [
                base,
                ReasoningTaskConfig(seed=1),
                ReasoningTaskConfig(max_digits=4),
                ReasoningTaskConfig(skills={"add": 1.0}),
                ReasoningTaskConfig(pretrain_fraction=0.2),
                ReasoningTaskConfig(terms=3),
            ]
        }
        assert len(keys) == 6
        assert cache_key(model, ws, base) == cache_key(model, ws, ReasoningTaskConfig())
        mixed = ws.model_copy(update={"mix": {"add": 0.9, "mul": 0.1}})
        assert cache_key(model, mixed, base) not in keys

    def test_mix_reweights_skills_and_targets_are_traces(self):
        from ftis.warmstart import WarmStartConfig, warmstart_target, warmstart_task

        ws = WarmStartConfig(steps=1, mix={"add": 0.0, "mul": 1.0})
        task = warmstart_task(ReasoningTaskConfig(), ws)
        pre = task.warmstart_split()[:200]
        assert all("*" in p.question for p in pre)
        assert warmstart_target(task, pre[0]) == solution(pre[0].question)
        with pytest.raises(ValidationError, match="unknown skill"):
            warmstart_task(ReasoningTaskConfig(), WarmStartConfig(steps=1, mix={"+": 1.0}))

    def test_prompt_is_bos_and_question(self, task):
        tok = char_tokenizer()
        p = task.split("train")[0]
        ids = task.prompt_ids(p, tok)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids[1:]) == p.question
        assert re.fullmatch(r"\d+[+*]\d+(\+\d+)*=", p.question)

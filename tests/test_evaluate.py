"""Evaluation metrics from samples: distinct final answers per problem, next to pass@k."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ftis.config import EvalConfig, TrainConfig
from ftis.tasks import ArithmeticTask, Problem, ReasoningTask
from ftis.tasks.gsm8k import GSM8KTask
from ftis.train import evaluate as ev


def test_distinct_answers_by_hand():
    rows = [
        ["12", "12", "13", None],  # 2 distinct; a malformed sample is no answer
        ["7", "7", "7", "7"],  # 1: the concentrated case
        [None, None, None, None],  # 0: nothing well formed
        ["1", "2", "3", "4"],  # 4: every sample different
    ]
    assert ev.distinct_answers(rows) == pytest.approx((2 + 1 + 0 + 4) / 4)
    assert ev.distinct_answers([]) == 0.0


def test_tasks_expose_their_answers():
    assert ReasoningTask().extract_answer("7+1=8,0+4=4,4+1=5#548") == "548"
    assert ReasoningTask().extract_answer("7+1=8,0+4=4,4+1=5 548") is None
    assert ArithmeticTask().extract_answer(" 68\n") == "68"
    assert ArithmeticTask().extract_answer("  ") is None
    gsm = GSM8KTask.__new__(GSM8KTask)  # extract_answer reads no files
    assert gsm.extract_answer("<think>x</think> <answer>$1,000.</answer>") == "1000"
    assert gsm.extract_answer("<answer>3</answer>") is None
    assert ev.answer_extractor(ReasoningTask()) is not None


class _Task:
    """Three test problems; the reward is the exact answer; optional answer extraction."""

    name = "fake"
    eval_splits = ("test",)

    def __init__(self, extract: bool) -> None:
        self._problems = [Problem(i, f"q{i}", str(i)) for i in range(3)]
        if extract:
            self.extract_answer = lambda text: text.strip() or None

    def split(self, name):
        return self._problems

    def prompt_ids(self, problem, tokenizer):
        return [problem.index]

    def reward(self, problem, completion):
        return 1.0 if completion.strip() == problem.answer else 0.0


def _tokenizer() -> SimpleNamespace:
    """EOS and pad 0; decode writes each id as "<id>"."""
    decode = lambda ids, skip_special_tokens: "".join(f"<{i}>" for i in ids)  # noqa: E731
    return SimpleNamespace(eos_token_id=0, pad_token_id=0, decode=decode)


# the pass@k samples of problems 0, 1, 2 (4 each): distinct answers 3, 1, 0 -> mean 4/3;
# correct 1, 4, 0 -> pass@1 = (1/4 + 1 + 0) / 3
PASS_TEXTS = {0: ["0", "5", "6", "5"], 1: ["1", "1", "1", "1"], 2: ["", " ", "", ""]}


@pytest.fixture
def fake_sampling(monkeypatch):
    def sample(model, prompts, *, num_samples, **_):
        texts = [
            t for (index,) in prompts for t in (PASS_TEXTS[index] if num_samples > 1 else ["0"])
        ]
        return SimpleNamespace(completion_ids=texts, lengths=None)

    monkeypatch.setattr(ev, "sample", sample)
    monkeypatch.setattr(ev, "decode_for_reward", lambda tok, ids, lengths: list(ids))


@pytest.mark.parametrize("extract", [True, False])
def test_evaluate_logs_distinct_answers_from_the_pass_samples(fake_sampling, extract):
    node = SimpleNamespace(model=None, tokenizer=_tokenizer())
    cfg = EvalConfig(size=3, pass_samples=4, pass_k=[1, 4], pass_problems=3, batch_size=8)
    m = ev.evaluate(node, _Task(extract), cfg, TrainConfig(), seed=0)
    assert m["eval/test/accuracy"] == pytest.approx(1 / 3)  # greedy "0" is right for problem 0
    assert m["eval/pass@1"] == pytest.approx((1 / 4 + 1) / 3)
    assert m["eval/pass@4"] == pytest.approx(2 / 3)
    if extract:
        assert m["eval/test/distinct_answers"] == pytest.approx(4 / 3)
    else:  # a task without extract_answer: no metric, nothing else changes
        assert not any("distinct" in k for k in m)


def test_a_real_run_logs_distinct_answers(tmp_path):
    import json

    from ftis.config import RunConfig
    from ftis.train.loop import train_node
    from tests.conftest import tiny_run_config

    data = tiny_run_config(steps=1)
    data["eval"] = {"every": 0, "size": 8, "pass_samples": 4, "pass_k": [1, 4], "pass_problems": 4}
    train_node(RunConfig.model_validate(data), rank=0, run_dir=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/pass@4" in r]
    assert len(evals) == 2  # step 0 and the end
    assert all(0.0 <= r["eval/test/distinct_answers"] <= 4.0 for r in evals)


def test_evaluate_hands_per_problem_outcomes_to_the_collector(fake_sampling):
    # greedy completion is "0" for every problem: right for problem 0 only (answers "0","1","2")
    # the prompt text is the prompt ids decoded with every special token (here: "<id>")
    node = SimpleNamespace(model=None, tokenizer=_tokenizer())
    cfg = EvalConfig(size=3, pass_samples=0, batch_size=8)
    metrics, outcomes = ev.evaluate_detailed(node, _Task(False), cfg, TrainConfig(), seed=0)
    assert [o.split for o in outcomes] == ["test"]
    assert outcomes[0].correct == [1, 0, 0]
    assert outcomes[0].samples == [("<0>", "0", 1.0), ("<1>", "0", 0.0), ("<2>", "0", 0.0)]
    assert outcomes[0].questions == ["q0", "q1", "q2"]
    assert metrics["eval/test/accuracy"] == pytest.approx(1 / 3)
    # evaluate returns the same metrics, and the outcomes only go where a collector listens
    assert ev.evaluate(node, _Task(False), cfg, TrainConfig(), seed=0) == metrics
    with ev.collect_outcomes() as got:
        assert ev.evaluate(node, _Task(False), cfg, TrainConfig(), seed=0) == metrics
    assert got == outcomes
    with ev.collect_outcomes() as again:
        pass
    assert again == []  # the earlier block's outcomes do not leak into a later one


def test_eval_logger_writes_one_line_per_split_and_sample(tmp_path):
    import json

    from ftis.train.metrics import EvalLogger

    logger = EvalLogger(tmp_path, "n")
    logger.log(0, [])  # an evaluation without task outcomes (e.g. preference accuracy only)
    assert not (tmp_path / "evals.jsonl").exists() and not (tmp_path / "samples.jsonl").exists()
    logger.log(
        4,
        [ev.SplitOutcome("test", [1, 0, 1], [("<0>", "0", 1.0), ("<1>", "7", 0.0)], ["q0", "q1"])],
    )
    logger.close()
    evals = [json.loads(x) for x in (tmp_path / "evals.jsonl").read_text().splitlines()]
    # outcomes 1,0,1 -> byte 0b10100000 = 0xa0
    assert evals == [{"step": 4, "node": "n", "split": "test", "n": 3, "correct": "a0"}]
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples == [
        {
            "step": 4,
            "node": "n",
            "split": "test",
            "prompt": "<0>",
            "question": "q0",
            "completion": "0",
            "reward": 1.0,
        },
        {
            "step": 4,
            "node": "n",
            "split": "test",
            "prompt": "<1>",
            "question": "q1",
            "completion": "7",
            "reward": 0.0,
        },
    ]

"""Preference data: JSONL layouts and their errors, the HH-RLHF and SHP converters, pairs made
from the embedded benchmark, and the token layout DPO scores."""

from __future__ import annotations

import json
import random

import pytest

from ftis.models.tokenizer import char_tokenizer
from ftis.preferences import (
    PreferenceDataError,
    fixture_path,
    from_hh_rlhf,
    from_shp,
    read_pairs,
    render_plain,
)
from ftis.preferences.embedded import corrupt, heldout_problems, pairs_for, train_problems
from ftis.preferences.tokens import collate, tokenize_pairs
from ftis.tasks import build_task


def _write(tmp_path, rows, name="p.jsonl") -> str:
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_the_shipped_fixture_reads_with_text_and_chat_prompts():
    pairs = read_pairs(fixture_path())
    assert len(pairs) == 12
    assert pairs[0].prompt == "12+35=" and pairs[0].chosen == "47" and pairs[0].rejected == "46"
    chat = pairs[9]  # system + user prompt, one-message assistant responses
    assert chat.prompt == (("system", "Answer briefly."), ("user", "What is 9*6?"))
    assert (chat.chosen, chat.rejected) == ("54", "56")
    assert pairs[0].source == "preferences_tiny.jsonl:1"


@pytest.mark.parametrize(
    ("row", "where"),
    [
        ('{"prompt": "1+1=", "chosen": "2"', "line 2: not valid JSON"),
        ({"prompt": "1+1=", "chosen": "2"}, "line 2: field 'rejected': is missing"),
        ({"prompt": "1+1=", "chosen": 2, "rejected": "3"}, "line 2: field 'chosen': must be a"),
        ({"prompt": "", "chosen": "2", "rejected": "3"}, "line 2: field 'prompt': must be a"),
        (
            {"prompt": "1+1=", "chosen": "2", "rejected": "2"},
            "line 2: field 'rejected': is identical",
        ),
        (
            {"prompt": [{"role": "bot", "content": "hi"}], "chosen": "a", "rejected": "b"},
            "line 2: field 'prompt[0].role': must be one of",
        ),
        (["not", "an", "object"], "line 2: field '<row>': must be a JSON object"),
    ],
)
def test_a_malformed_row_names_file_line_and_field(tmp_path, row, where):
    path = _write(tmp_path, [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}, row])
    with pytest.raises(PreferenceDataError) as e:
        read_pairs(path)
    assert str(e.value).startswith(f"preferences file {path!r}, {where}")


def test_missing_and_empty_files_are_errors(tmp_path):
    with pytest.raises(PreferenceDataError, match="cannot read"):
        read_pairs(tmp_path / "nope.jsonl")
    with pytest.raises(PreferenceDataError, match="holds no pairs"):
        read_pairs(_write(tmp_path, [""], "empty.jsonl"))
    with pytest.raises(PreferenceDataError, match="unknown preference format"):
        read_pairs(fixture_path(), format="csv")


def test_hh_rlhf_transcripts_become_a_chat_prompt_and_two_responses():
    row = {
        "chosen": "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: What is 2+2?"
        "\n\nAssistant: It is 4.",
        "rejected": "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: What is 2+2?"
        "\n\nAssistant: It is 5.",
    }
    pair = from_hh_rlhf(row)
    assert pair.prompt == (("user", "Hi there"), ("assistant", "Hello!"), ("user", "What is 2+2?"))
    assert (pair.chosen, pair.rejected) == ("It is 4.", "It is 5.")
    # for a tokenizer without a chat template the prompt is rendered back as HH-RLHF text
    assert render_plain(pair.prompt) == (
        "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: What is 2+2?\n\nAssistant:"
    )
    bad = dict(row, rejected="\n\nHuman: Something else\n\nAssistant: It is 5.")
    with pytest.raises(ValueError, match="differs from chosen"):
        from_hh_rlhf(bad)


def test_shp_labels_pick_the_chosen_reply(tmp_path):
    row = {"history": "Best pet?", "human_ref_A": "A cat.", "human_ref_B": "A rock.", "labels": 1}
    assert (from_shp(row).chosen, from_shp(row).rejected) == ("A cat.", "A rock.")
    row0 = dict(row, labels=0)
    assert (from_shp(row0).chosen, from_shp(row0).rejected) == ("A rock.", "A cat.")
    path = _write(tmp_path, [row, dict(row, labels=2)], "shp.jsonl")
    with pytest.raises(PreferenceDataError, match="line 2: field 'labels'"):
        read_pairs(path, format="shp")


def test_made_up_mistakes_by_hand():
    rng = random.Random(0)
    q, c = "457+386=", "7+6=13,5+8+1=14,4+3+1=8#843"
    assert corrupt(q, c, "carry", rng, traced=True) == "7+6=13,5+8=13,4+3=7#733"
    assert corrupt(q, c, "truncate", rng, traced=True) == "7+6=13,5+8+1=14"
    step = corrupt(q, c, "step", rng, traced=True)
    assert step != c and step.count(",") == 2
    answer = corrupt(q, c, "answer", rng, traced=True)
    assert answer.startswith("7+6=13,5+8+1=14,4+3+1=8#") and answer != c
    # no carry in 11+22: the mistake does not apply
    assert corrupt("11+22=", "1+2=3,1+2=3#33", "carry", rng, traced=True) is None
    assert corrupt("347*6=", "7*6=42,4*6+4=28,3*6+2=20#2082", "carry", rng, traced=True) == (
        "7*6=42,4*6=24,3*6=18#1842"
    )


def test_embedded_pairs_are_verified_deterministic_and_differ_between_agents():
    base = {"kind": "reasoning", "min_digits": 2, "max_digits": 2, "test_size": 32, "ood": {}}
    add = build_task({**base, "skills": {"add": 1.0}})
    mul = build_task({**base, "skills": {"mul": 1.0}})
    probs = train_problems(add, 16, seed=0, salt="a")
    own = ["garbage"] * 8 + [add.warmstart_target(p) for p in probs[8:]]  # right = not usable
    pairs = pairs_for(add, probs, corruptions={"own": 1.0}, seed=0, salt="a", own=own)
    for p, pair in zip(probs, pairs):
        assert add.reward(p, pair.chosen) == 1.0 and add.reward(p, pair.rejected) == 0.0
    assert [pair.rejected for pair in pairs[:8]] == ["garbage"] * 8
    assert all(":answer:" in pair.source for pair in pairs[8:])  # own was right: fall back
    again = pairs_for(add, probs, corruptions={"own": 1.0}, seed=0, salt="a", own=own)
    assert again == pairs
    other = train_problems(add, 16, seed=0, salt="b")
    assert {p.question for p in other} != {p.question for p in probs}
    assert all(
        "*" in p.prompt
        for p in pairs_for(mul, heldout_problems(mul, 8), corruptions={"answer": 1}, seed=0)
    )
    arith = build_task({"kind": "arithmetic"})
    (pair,) = pairs_for(arith, heldout_problems(arith, 1), corruptions={"carry": 1.0}, seed=0)
    assert arith.reward(heldout_problems(arith, 1)[0], pair.rejected) == 0.0  # fell back to answer
    with pytest.raises(ValueError, match="held-out"):
        heldout_problems(mul, 10_000)


def test_tokens_and_batch_layout_by_hand():
    tok = char_tokenizer()
    bos, eos, pad = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    from ftis.preferences.data import PreferencePair

    data = tokenize_pairs(
        [PreferencePair("1+2=", "3", "45"), PreferencePair("10+20=", "30", "4")],
        tok,
        max_length=8,
        max_prompt_length=6,
    )
    ids = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert data.prompts == [[bos, *ids("1+2=")], ids("10+20=")]  # cut to its last 6 tokens
    assert data.chosen == [[*ids("3"), eos], [*ids("30")]]  # 8 - 6 = 2 tokens of room: no EOS
    assert data.rejected[0] == [*ids("45"), eos]
    b = collate(data, [0, 1], pad_id=pad)
    assert b.num_pairs == 2 and b.prompt_ids.shape == (4, 6) and b.completion_ids.shape == (4, 3)
    # rows: chosen 0, chosen 1, rejected 0, rejected 1; prompts left-, responses right-padded
    assert b.prompt_ids[0].tolist() == [pad, bos, *ids("1+2=")]
    assert b.completion_ids[2].tolist() == [*ids("45"), eos]
    assert b.completion_mask.sum(1).tolist() == [2, 2, 3, 2]
    # include_prompt: all prompt tokens but the first are scored too
    bp = collate(data, [0], pad_id=pad, include_prompt=True)
    assert bp.prompt_ids.tolist() == [[bos], [bos]]
    assert bp.completion_ids[0].tolist() == [*ids("1+2=3"), eos, pad]  # padded to "1+2=45"
    assert bp.completion_mask.sum(1).tolist() == [6, 7]


def test_a_forgotten_borrow_is_a_subtraction_corruption():
    """sub (issue 35): the `carry` mistake forgets every borrow; a difference without a
    borrow has none to forget."""
    import random

    from ftis.preferences.embedded import corrupt
    from ftis.tasks.reasoning import solution

    wrong = corrupt("457-386=", solution("457-386="), "carry", random.Random(0), traced=True)
    assert wrong == "7-6=1,5-8=7,4-3=1#171"
    assert corrupt("77-35=", solution("77-35="), "carry", random.Random(0), traced=True) is None


def test_a_forgotten_remainder_is_a_division_corruption():
    """div (issue 35): the `carry` mistake divides every digit on its own (each remainder
    forgotten); a quotient without remainders has none to forget; a wrong step's answer is
    spelled as a quotient (its digits in order)."""
    import random

    from ftis.preferences.embedded import corrupt
    from ftis.tasks.reasoning import ReasoningTask, solution

    task = ReasoningTask()
    wrong = corrupt("852/4=", solution("852/4="), "carry", random.Random(0), traced=True)
    assert wrong == "8/4=2,5/4=1,2/4=0#210"
    assert corrupt("842/2=", solution("842/2="), "carry", random.Random(0), traced=True) is None
    step = corrupt("852/4=", solution("852/4="), "step", random.Random(1), traced=True)
    trace, _, answer = step.rpartition("#")
    assert answer == str(int("".join(s.split("=")[1] for s in trace.split(","))))
    problem = type("P", (), {"answer": "213"})()
    assert task.reward(problem, step) == 0.0 and task.reward(problem, wrong) == 0.0

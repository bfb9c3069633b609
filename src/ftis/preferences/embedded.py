"""Preference pairs made from the embedded benchmark (docs/dpo.md, "Data"): for one problem, a
verified-correct response (chosen) and a verified-wrong one (rejected).

Chosen: the task's reference completion (the reasoning task's worked trace and answer, the
arithmetic task's answer), checked with the task's own verifier (reward 1). Rejected: a wrong
response of one kind (`CORRUPTIONS`), checked to get reward 0:

    own       the starting model's own greedy answer, when it is wrong (the mistakes this model
              actually makes: the pairs DPO learns most from)
    answer    the trace is right, one digit of the final answer is wrong
    carry     every carry is forgotten (a classic mistake: 457+386 -> 7+6=13,5+8=13,4+3=7#733)
    step      one step's value is off by 1-3, and the answer follows the wrong value
    truncate  the trace stops early, without '#' and an answer (malformed)

A kind that does not apply to a problem (the model answered it right; a problem without carries;
the arithmetic task has no trace, so only own and answer apply) falls back to the next kind in
`CORRUPTIONS` order. Different agents get different preference distributions (non-IID) through
their own task overrides (skills, digits) and their own mix of mistakes. Everything is a pure
function of (task config, seed, index) and, for `own`, of the starting model's greedy answers,
which any process rebuilds from the same starting weights.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence

from ftis.preferences.data import PreferencePair
from ftis.tasks.base import Problem, Task
from ftis.tasks.reasoning import answer_of, parse_question

CORRUPTIONS = ("own", "answer", "carry", "step", "truncate")
TRACE_TASKS = ("reasoning",)
SUPPORTED_TASKS = ("reasoning", "arithmetic")


def _rng(*key: object) -> random.Random:
    digest = hashlib.blake2b(":".join(map(str, key)).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def _steps(trace: str) -> list[tuple[str, int]]:
    """'7+6=13,5+8+1=14' -> [('7+6', 13), ('5+8+1', 14)]."""
    out = []
    for step in trace.split(","):
        lhs, _, value = step.rpartition("=")
        out.append((lhs, int(value)))
    return out


def _join(steps: Sequence[tuple[str, int]], answer: str | None) -> str:
    trace = ",".join(f"{lhs}={v}" for lhs, v in steps)
    return trace if answer is None else f"{trace}#{answer}"


def _wrong_digit(answer: str, rng: random.Random) -> str:
    body, sign = (answer[1:], "-") if answer.startswith("-") else (answer, "")
    k = rng.randrange(len(body))
    choices = [
        d for d in "0123456789" if d != body[k] and not (k == 0 and d == "0" and len(body) > 1)
    ]
    return sign + body[:k] + rng.choice(choices) + body[k + 1 :]


def corrupt(
    question: str, chosen: str, kind: str, rng: random.Random, *, traced: bool
) -> str | None:
    """`chosen` (the correct response to `question`) with one mistake of `kind`, or None when
    that mistake does not apply (a problem without carries has no forgotten carry; an
    answer-only task has no trace)."""
    if kind not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {kind!r}; choose one of: {', '.join(CORRUPTIONS)}")
    if kind == "own":  # given by the caller: the model's own answers
        return None
    if not traced:
        return _wrong_digit(chosen, rng) if kind == "answer" else None
    trace, _, answer = chosen.rpartition("#")
    steps = _steps(trace)
    if kind == "answer":
        return f"{trace}#{_wrong_digit(answer, rng)}"
    if kind == "truncate":
        return _join(steps[: max(1, len(steps) - 1)], None)
    if kind == "step":
        k = rng.randrange(len(steps))
        lhs, v = steps[k]
        d = rng.randint(1, 3)
        wrong = v - d if v - d >= 0 and rng.random() < 0.5 else v + d
        steps = [*steps[:k], (lhs, wrong), *steps[k + 1 :]]
        return _join(steps, answer_of(parse_question(question)[0], [v for _, v in steps]))
    # carry: the column steps computed as if every carry (borrow, remainder) were 0
    skill, operands = parse_question(question)
    width = len(str(operands[0]))
    digits = [[(x // 10**k) % 10 for k in range(width)] for x in operands]
    if skill == "add":
        forgot = [
            ("+".join(str(d[k]) for d in digits), sum(d[k] for d in digits)) for k in range(width)
        ]
    elif skill == "sub":  # every borrow forgotten: each column's digit difference, mod 10
        forgot = [
            (f"{digits[0][k]}-{digits[1][k]}", (digits[0][k] - digits[1][k]) % 10)
            for k in range(width)
        ]
    elif skill == "div":  # every remainder forgotten: each digit divided on its own
        m = operands[1]
        forgot = [(f"{d}/{m}", int(d) // m) for d in str(operands[0])]
    else:
        m = operands[1]
        forgot = [(f"{digits[0][k]}*{m}", digits[0][k] * m) for k in range(width)]
    out = _join(forgot, answer_of(skill, [v for _, v in forgot]))
    return None if out == chosen else out


def pairs_for(
    task: Task,
    problems: Sequence[Problem],
    *,
    corruptions: Mapping[str, float],
    seed: int,
    salt: str = "",
    own: Sequence[str] | None = None,
) -> list[PreferencePair]:
    """One pair per problem: the verified reference response and a verified-wrong one whose
    kind is drawn from the `corruptions` weights (seeded by seed, salt and the problem's index;
    a kind that does not apply falls back to the next one in CORRUPTIONS order). `own`: the
    model's own (greedy) completion of each problem, for the kind `own`."""
    if own is not None and len(own) != len(problems):
        raise ValueError(f"{len(own)} own answers for {len(problems)} problems")
    kinds = [k for k, w in corruptions.items() if w > 0]
    if not kinds:
        raise ValueError("corruptions: give at least one kind a positive weight")
    traced = task.name in TRACE_TASKS
    target = getattr(task, "warmstart_target", None)
    out = []
    for i, p in enumerate(problems):
        chosen = target(p) if (traced and target is not None) else p.answer
        if task.reward(p, chosen) != 1.0:
            raise ValueError(
                f"the reference response {chosen!r} to {p.question!r} fails its verifier"
            )
        rng = _rng("ftis-prefs", seed, salt, p.index)
        first = rng.choices(kinds, weights=[corruptions[k] for k in kinds])[0]
        order = [first] + [k for k in CORRUPTIONS if k != first]
        for kind in order:
            if kind == "own":
                rejected = own[i].strip() if own is not None else None
                rejected = rejected or None  # an empty answer says nothing to prefer against
            else:
                rejected = corrupt(p.question, chosen, kind, rng, traced=traced)
            if rejected is not None and task.reward(p, rejected) == 0.0:
                break
        else:  # pragma: no cover - 'answer' always applies
            raise ValueError(f"no wrong response could be made for {p.question!r}")
        out.append(PreferencePair(p.question, chosen, rejected, source=f"{salt}:{kind}:{p.index}"))
    return out


def train_problems(task: Task, count: int, *, seed: int, salt: str) -> list[Problem]:
    """`count` problems of the task's (virtual) train split, from an offset keyed by seed and
    salt (an agent's name), so agents with the same task mix still get different problems."""
    split = task.split("train")
    start = _rng("ftis-prefs-offset", seed, salt).randrange(max(1, len(split) - count))
    return [split[start + i] for i in range(count)]


def heldout_problems(task: Task, count: int) -> list[Problem]:
    """The first `count` problems of the task's in-distribution held-out split."""
    split = task.split(task.eval_splits[0])
    if count > len(split):
        raise ValueError(
            f"{count} held-out pairs asked, but the task's {task.eval_splits[0]!r} split has "
            f"{len(split)} problems: raise its size (task.test_size) or ask for fewer"
        )
    return [split[i] for i in range(count)]

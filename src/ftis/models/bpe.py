"""A byte-level BPE tokenizer trained deterministically on the embedded tasks' own text.

The second embedded tokenizer (issue 23): presets that use it (``*-bpe``) cannot exchange token
ids with presets on the character tokenizer, so a run that pairs them takes the bridged path
of the sample exchange (docs/math.md §16).

Numbers: a pre-tokenizer splits every number into its last digit and the digits before it, and
BPE merges within those pieces, so "198" is "19" "8" (three characters, two tokens) and "407"
is "40" "7", while a one- or two-digit number is spelled digit by digit. The two tokenizations
of an answer thus really differ (any answer of three or more digits), yet a number's last digit
always stands alone, as in the character tokenizer: a 1-2-digit addition's sum is the tens
count (0-19, one token) then the units digit. A first version let BPE merge whole digit runs,
so that most sums up to 120 were one token each: a tiny model must then learn a 100 x 100
lookup table. Same warm-start recipe (configs/cross-tokenizer.yaml's qwen2-bpe node, trained on
one machine, greedy accuracy on the config's 256 test problems): 20.7% with whole runs merged,
68.8% with this split; the character Llama of that config starts at 69.9%.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ftis.models.tokenizer import SPECIAL_TOKENS, as_fast_tokenizer

VOCAB_SIZE = 384  # 4 specials + 256 byte symbols + 124 merges
CORPUS_SEED = 0
CORPUS_PER_SOURCE = 4000
# a number's digits but the last (a lookahead keeps the last digit out), then any single digit
NUMBER_PIECES = r"\d+(?=\d)|\d"


def training_corpus() -> list[str]:
    """The fixed training text: train problems with their answers from the embedded arithmetic
    task (two operand ranges, all three operations) and the embedded reasoning task, each made
    from seed `CORPUS_SEED`. Pure function of the task generators' code."""
    from ftis.tasks.arithmetic import ArithmeticTask

    texts: list[str] = []
    for cfg in (
        {"seed": CORPUS_SEED},
        {
            "seed": CORPUS_SEED,
            "ops": {"+": 1.0, "-": 1.0, "*": 1.0},
            "min_digits": 2,
            "max_digits": 3,
            "terms": 3,
            "ood": {},
        },
    ):
        train = ArithmeticTask(cfg).split("train")
        texts += [p.question + p.answer for p in train[:CORPUS_PER_SOURCE]]
    from ftis.tasks.reasoning import ReasoningTask

    train = ReasoningTask({"seed": CORPUS_SEED}).split("train")
    texts += [p.question + p.answer for p in train[: CORPUS_PER_SOURCE // 4]]
    return texts


def _train_backend() -> Tokenizer:
    backend = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # Numbers split into (digits before the last, last digit), then GPT-2-style byte-level
    # pre-tokenisation: every byte is a symbol (any UTF-8 text encodes, nothing is unknown).
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(NUMBER_PIECES), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(training_corpus(), trainer=trainer, length=None)
    return backend


@lru_cache(maxsize=1)
def _backend_json() -> str:
    return _train_backend().to_str()


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level BPE as a Hugging Face fast tokenizer: ids 0-3 are <pad> <bos> <eos> <unk>
    (as in the character tokenizer), then the 256 byte symbols and the merges. Trained once per
    process (a fraction of a second), then rebuilt from its JSON."""
    return as_fast_tokenizer(Tokenizer.from_str(_backend_json()))


def bpe_digest() -> str:
    """sha256 (first 16 hex digits) of the trained vocabulary and merges: identical on every
    machine and every run (a test pins it)."""
    model = json.loads(_backend_json())["model"]
    payload = json.dumps({"vocab": model["vocab"], "merges": model["merges"]}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]

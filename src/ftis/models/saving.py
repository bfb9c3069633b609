"""What a saved model directory is to ftis: its tokenizer exactly as `tokenizer.json` says
(`as_saved`), the parts of a tokenizer's pipeline that decide its ids (`pipeline`), and
`save_model`, which writes on every rank. Below both the loader (`ftis.models.loading`) and the
GGUF conversion (`ftis.models.real`), which write and read such directories.
"""

from __future__ import annotations

import json
import logging
import os

import torch
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ftis.models.sources import ModelLoadError

log = logging.getLogger(__name__)


# The parts of a tokenizers pipeline that decide how text becomes ids and ids become text.
PIPELINE = ("normalizer", "pre_tokenizer", "model", "post_processor", "decoder", "added_tokens")


def pipeline(backend_json: str) -> dict:
    spec = json.loads(backend_json)
    return {k: spec.get(k) for k in PIPELINE}


def as_saved(tok: PreTrainedTokenizerBase, path: str) -> PreTrainedTokenizerBase:
    """`tok` if it tokenizes as the `tokenizer.json` saved in `path`, else that file as it is.

    transformers 5 builds some model types' tokenizers (qwen2 among them) from the vocabulary
    and merges alone, with the model type's own pre-tokenizer, whatever `tokenizer.json` says:
    a directory written by `save_pretrained` from another pipeline (ftis's embedded tokenizers,
    a user's own) would come back encoding other ids. The saved file is what the weights were
    trained with, so it wins, with a warning.
    """
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file) or not getattr(tok, "is_fast", False):
        return tok
    with open(file, encoding="utf-8") as f:
        saved = pipeline(f.read())
    if pipeline(tok.backend_tokenizer.to_str()) == saved:
        return tok
    differ = [k for k in PIPELINE if pipeline(tok.backend_tokenizer.to_str())[k] != saved[k]]
    log.warning(
        "%s: transformers' AutoTokenizer built a %s whose %s differ from the saved "
        "tokenizer.json; using tokenizer.json as saved (load it the same way elsewhere: "
        "PreTrainedTokenizerFast.from_pretrained(dir))",
        path,
        type(tok).__name__,
        ", ".join(differ),
    )
    exact = PreTrainedTokenizerFast.from_pretrained(path)
    if pipeline(exact.backend_tokenizer.to_str()) != saved:
        raise ModelLoadError(
            f"cannot load the tokenizer saved in {path} as it was saved: transformers changes "
            f"its {', '.join(differ)}; re-save it with save_pretrained from the tokenizer the "
            "model was trained with"
        )
    return exact


def save_model(model: torch.nn.Module, path) -> None:
    """`save_pretrained` that writes on every rank.

    transformers >= 5 treats an initialised torch.distributed group as one model sharded over
    ranks and writes only on rank 0. In ftis every rank is a different model (the group only
    exchanges samples), so each rank must write its own files.
    """
    targets = [model]
    if hasattr(model, "get_base_model"):  # peft: the adapter save may consult the base model
        targets.append(model.get_base_model())
    for m in targets:
        if hasattr(m, "should_save_on_this_rank"):
            m.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        model.save_pretrained(path)
    finally:
        for m in targets:
            m.__dict__.pop("should_save_on_this_rank", None)

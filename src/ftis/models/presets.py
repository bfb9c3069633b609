"""Named tiny presets of real transformers architectures (Llama, Qwen2), built in-process.

Sizes are chosen for a 2-core CPU: the embedded task trains them in seconds to minutes.
Most presets use the character tokenizer (ftis.models.tokenizer); the ``*-bpe`` presets use the
byte-level BPE trained on the embedded tasks (ftis.models.bpe). Peers on one tokenizer exchange
token ids as they are; a pair on different tokenizers takes the sample exchange's bridged path
(docs/math.md §16).

The table is plain data, importable without transformers (run configs validate against it);
only `preset_config` imports transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Preset:
    arch: str  # "llama" | "qwen2"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int = 512
    tokenizer: str = "char"  # "char" (ftis.models.tokenizer) | "bpe" (ftis.models.bpe)


TOKENIZERS: tuple[str, ...] = ("char", "bpe")

PRESETS: dict[str, Preset] = {
    "llama-xs": Preset("llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=192),
    "llama-s": Preset("llama", layers=3, hidden=96, heads=4, kv_heads=2, intermediate=256),
    "llama-m": Preset("llama", layers=4, hidden=128, heads=4, kv_heads=4, intermediate=384),
    "llama-l": Preset("llama", layers=6, hidden=192, heads=6, kv_heads=3, intermediate=512),
    # 0.20M: llama-xs's width with llama-m's depth; the small node of the reasoning study's size
    # pairing (llama-m has 4.3x its parameters)
    "llama-xs-deep": Preset("llama", layers=4, hidden=64, heads=4, kv_heads=2, intermediate=192),
    "qwen2-s": Preset("qwen2", layers=3, hidden=96, heads=4, kv_heads=2, intermediate=256),
    "qwen2-m": Preset("qwen2", layers=4, hidden=128, heads=4, kv_heads=2, intermediate=384),
    # Byte-level BPE (ftis.models.bpe, 384 tokens): the shapes of qwen2-s and llama-m on the
    # second embedded tokenizer, to pair with a character-tokenizer preset (issue 23); llama-bpe
    # differs from llama-m in its tokenizer only (and so in its embedding rows).
    "qwen2-bpe": Preset(
        "qwen2", layers=3, hidden=96, heads=4, kv_heads=2, intermediate=256, tokenizer="bpe"
    ),
    "llama-bpe": Preset(
        "llama", layers=4, hidden=128, heads=4, kv_heads=4, intermediate=384, tokenizer="bpe"
    ),
    # Realistic-scale presets for the benchmarks (bench/scale.py): 23M / 25M parameters, nearly
    # all in the transformer body (the character vocabulary makes the LM head negligible), so
    # compute, not per-call overhead, sets the pace. Too slow to warm-start on 2 cores: random init.
    "llama-20m": Preset(
        "llama", layers=8, hidden=512, heads=8, kv_heads=4, intermediate=1376, max_positions=1024
    ),
    "qwen2-25m": Preset(
        "qwen2", layers=8, hidden=512, heads=8, kv_heads=2, intermediate=1600, max_positions=1024
    ),
}


def preset_tokenizer(name: str):
    """The embedded tokenizer of a named preset (a PreTrainedTokenizerFast)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    if PRESETS[name].tokenizer == "bpe":
        from ftis.models.bpe import bpe_tokenizer

        return bpe_tokenizer()
    from ftis.models.tokenizer import char_tokenizer

    return char_tokenizer()


def preset_config(name: str) -> PretrainedConfig:
    """The transformers config of a named preset, with its tokenizer's size and special ids."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    from transformers import LlamaConfig, Qwen2Config

    p = PRESETS[name]
    tok = preset_tokenizer(name)
    common = dict(
        vocab_size=len(tok),
        hidden_size=p.hidden,
        intermediate_size=p.intermediate,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        max_position_embeddings=p.max_positions,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )
    if p.arch == "llama":
        return LlamaConfig(**common)
    return Qwen2Config(**common, use_sliding_window=False)

"""Build or load a node's model and tokenizer: a tiny preset, or any Hugging Face causal LM.

The config classes live in ftis.models.config (no transformers import) and are re-exported here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ftis.models.config import LoraConfig, ModelConfig
from ftis.models.presets import preset_config, preset_tokenizer
from ftis.models.real import resolve_model_dir
from ftis.models.saving import as_saved, pipeline
from ftis.models.sources import ModelLoadError, source_field

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The node's tokenizer: a preset's embedded one, or the one saved with `model.path` (or
    converted from `model.gguf` / `model.name`: `ftis.models.real.resolve_model_dir`),
    encoding exactly as saved (`as_saved`). Its EOS and pad tokens are the model's own."""
    if cfg.preset is not None:
        return preset_tokenizer(cfg.preset)

    path = resolve_model_dir(cfg)
    field = source_field(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        if os.path.isdir(path):
            tok = as_saved(tok, path)
    except (OSError, ValueError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise _load_error(cfg, path, e, "the tokenizer", "a tokenizer") from e
    if tok.eos_token_id is None:
        raise ModelLoadError(
            f"{field}: the tokenizer has no EOS token, so ftis cannot tell where a completion "
            "ends; give a model whose tokenizer sets eos_token (save_pretrained after "
            "tokenizer.eos_token = ...)"
        )
    if tok.pad_token_id is None:
        # Padding is never read as a token: completions end where their lengths say, so a
        # real EOS is still trained on and counted when pad and EOS are one id.
        log.info(
            "%s: the tokenizer has no pad token; padding with its EOS token %r (id %d)",
            field,
            tok.eos_token,
            tok.eos_token_id,
        )
        tok.pad_token = tok.eos_token
    if cfg.path is None and getattr(tok, "chat_template", None) is None:
        _warn_no_chat_template(field)
    tok.padding_side = "left"
    return tok


_warned_templates: set[str] = set()


def _warn_no_chat_template(field: str) -> None:
    if field in _warned_templates:
        return
    _warned_templates.add(field)
    log.warning(
        "%s: the tokenizer has no chat template; a task that formats prompts as chat "
        "(task.use_chat_template null, the default) gives this model plain text instead, which "
        "an instruct model may answer poorly. Use a GGUF with tokenizer.chat_template, or set "
        "task.use_chat_template: false to say plain text is meant.",
        field,
    )


def resolve_device(spec: str) -> torch.device:
    """'auto' -> cuda:LOCAL_RANK when CUDA is available (one GPU per node process), else cpu."""
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ModelLoadError(
            "model.device is 'cuda' but CUDA is not available here; use 'auto' or 'cpu'"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def build_model(cfg: ModelConfig) -> PreTrainedModel:
    """The base model (no adapters), in train mode, on `cfg.device`."""
    dtype = DTYPES[cfg.dtype]
    device = resolve_device(cfg.device)
    if device.type == "cpu" and cfg.dtype == "float16":
        raise ModelLoadError(
            "model.dtype float16 is not supported on the CPU (model.device resolved to the CPU: "
            "no GPU here); use model.dtype float32 with model.compute_dtype bfloat16"
        )
    if (
        device.type == "cuda"
        and "bfloat16" in (cfg.dtype, cfg.compute_dtype)
        and not torch.cuda.is_bf16_supported()
    ):
        raise ModelLoadError(
            f"model.dtype/compute_dtype bfloat16: the GPU {torch.cuda.get_device_name(device)} "
            "does not support bf16; use float32 (or model.dtype float16 on this GPU)"
        )
    if cfg.preset is not None:
        torch.manual_seed(cfg.init_seed)
        model = AutoModelForCausalLM.from_config(preset_config(cfg.preset), dtype=dtype)
    else:
        path = resolve_model_dir(cfg)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except (OSError, ValueError) as e:
            raise _load_error(cfg, path, e, "the model", "a causal LM") from e
    model.generation_config.pad_token_id = model.config.pad_token_id
    return model.to(device)


def _load_error(
    cfg: ModelConfig, path: object, e: Exception, ours: str, theirs: str
) -> ModelLoadError:
    """Why `from_pretrained` failed: on ftis's own conversion in the cache (`ours`: "the
    tokenizer"), or on the model.path a user gave (`theirs`: "a tokenizer")."""

    if cfg.path is None:  # ftis's own conversion in the cache
        return ModelLoadError(
            f"cannot load {ours} converted from {source_field(cfg)} in {path}: {e}. Delete that "
            "directory to convert the model again."
        )
    return ModelLoadError(
        f"cannot load {theirs} from model.path={cfg.path!r}: {e}. Give a local directory "
        "written by save_pretrained, or a Hub name on a machine with network access."
    )


def attach_lora(model: PreTrainedModel, lora: LoraConfig) -> torch.nn.Module:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_cfg)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    """Stable digest of a tokenizer: its vocabulary and special ids, and (for a fast tokenizer)
    the pipeline that turns text into ids (normalizer, pre-tokenizer, model with its merges,
    post-processor, decoder). Peers exchange token ids as they are only when it agrees: two
    tokenizers with one vocabulary but another pre-tokenizer give other ids for the same text."""
    h = hashlib.sha256()
    for token, idx in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{token}\n".encode())
    h.update(f"eos={tok.eos_token_id} pad={tok.pad_token_id}".encode())
    if getattr(tok, "is_fast", False):
        parts = pipeline(tok.backend_tokenizer.to_str())
        h.update(json.dumps(parts, sort_keys=True).encode())
    return h.hexdigest()[:16]

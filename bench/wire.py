"""Wire cost per completion token and codec throughput.

Layouts compared on the same batches:
- `naive`: int32 ids + fp32 log-probs of the real tokens (the paper's 8 B/token), no header;
- `authors`: the layout of the F-TIS authors' code as described in shared/spec/ftis-method.md §7:
  int64 prompt+completion ids padded to the batch's widths, an int64 attention mask of the same
  shape, fp32 log-probs over the padded completion width;
- ftis's own format, exact (`f32`) and `compact` (16-bit fixed-point log-probs for small vocabs),
  and `compact` + zlib.
"""

from __future__ import annotations

import time

import torch

from bench.common import TASK, median
from ftis.exchange import decode_rollouts, encode_rollouts
from ftis.exchange.wire import logprob_max_error, resolve_logprob_format
from ftis.models.loading import ModelConfig, build_model, load_tokenizer
from ftis.rollout.sampler import sample
from ftis.rollout.types import RolloutBatch
from ftis.tasks import build_task


def embedded_batch(model_path: str) -> tuple[RolloutBatch, int, int]:
    """A real step's batch from the embedded task (16 prompts x 8): (batch, vocab, prompt width)."""
    cfg = ModelConfig(path=model_path)
    model, tok = build_model(cfg), load_tokenizer(cfg)
    task = build_task(TASK)
    train = task.split("train")
    prompts = [task.prompt_ids(train[i], tok) for i in range(16)]
    s = sample(
        model,
        prompts,
        num_samples=8,
        max_new_tokens=8,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    return sampled_batch(s, 8), int(model.config.vocab_size), int(s.prompt_ids.shape[1])


def sampled_batch(s, group_size: int) -> RolloutBatch:
    """The RolloutBatch of a `sample` result whose prompts each got `group_size` completions."""
    n = s.completion_ids.shape[0]
    return RolloutBatch(
        prompt_index=torch.arange(n // group_size).repeat_interleave(group_size),
        generator=torch.zeros(n, dtype=torch.long),
        completion_ids=s.completion_ids,
        lengths=s.lengths,
        sampler_logprobs=s.logprobs,
    )


def long_batch(n: int = 64, mean_len: int = 200, vocab: int = 151936, prompt_width: int = 120):
    """A GSM8K-like batch: long completions from a Qwen-size vocabulary (synthetic values)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(mean_len // 2, mean_len * 3 // 2, (n,), generator=g)
    t = int(lengths.max())
    ids = torch.randint(0, vocab, (n, t), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    lp = torch.where(mask, -torch.rand((n, t), generator=g).pow(4) * 6, torch.zeros(()))
    ids = torch.where(mask, ids, torch.zeros((), dtype=torch.long))
    batch = RolloutBatch(
        prompt_index=torch.arange(n // 8).repeat_interleave(8),
        generator=torch.zeros(n, dtype=torch.long),
        completion_ids=ids,
        lengths=lengths,
        sampler_logprobs=lp,
    )
    return batch, vocab, prompt_width


def _authors_bytes(batch: RolloutBatch, prompt_width: int) -> int:
    n, t = batch.completion_ids.shape
    return n * (prompt_width + t) * 8 * 2 + n * t * 4


def _throughput(batch, vocab, fmt, compress, reps):
    enc, dec = [], []
    data = b""
    for _ in range(reps):
        t0 = time.perf_counter()
        data = encode_rollouts(batch, logprob_format=fmt, vocab_size=vocab, compress=compress)
        t1 = time.perf_counter()
        decode_rollouts(
            data,
            vocab_size=vocab,
            max_tokens=batch.completion_ids.shape[1],
            max_sequences=batch.num_sequences,
        )
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    return data, batch.num_tokens / median(enc), batch.num_tokens / median(dec)


def run(quick: bool, model_path: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, (batch, vocab, pw) in {
        "embedded": embedded_batch(model_path),
        "long": long_batch(),
    }.items():
        tokens = batch.num_tokens
        out[f"wire_{name}_tokens"] = float(tokens)
        out[f"wire_{name}_naive_bpt"] = 8.0
        out[f"wire_{name}_authors_bpt"] = _authors_bytes(batch, pw) / tokens
        for fmt, compress in (("f32", False), ("compact", False), ("compact", True)):
            key = fmt + ("_zlib" if compress else "")
            data, enc_tps, dec_tps = _throughput(batch, vocab, fmt, compress, 3 if quick else 15)
            out[f"wire_{name}_{key}_bpt"] = len(data) / tokens
            # The error actually made on this batch, against the documented bound.
            back = decode_rollouts(data, vocab_size=vocab, max_tokens=batch.completion_ids.shape[1])
            mask = batch.mask
            out[f"wire_{name}_{key}_max_err"] = float(
                (back.sampler_logprobs[mask] - batch.sampler_logprobs[mask]).abs().max()
            )
            out[f"wire_{name}_{key}_format"] = resolve_logprob_format(fmt, vocab)
            out[f"wire_{name}_{key}_bound"] = logprob_max_error(fmt, vocab)
            out[f"wire_{name}_{key}_encode_tok_per_s"] = enc_tps
            out[f"wire_{name}_{key}_decode_tok_per_s"] = dec_tps
    out["bytes_per_token"] = out["wire_embedded_compact_bpt"]
    out["f32_bytes_per_token"] = out["wire_embedded_f32_bpt"]
    for name in ("embedded", "long"):  # the documented bound holds on both batches
        for key in ("f32", "compact", "compact_zlib"):
            err, bound = out[f"wire_{name}_{key}_max_err"], out[f"wire_{name}_{key}_bound"]
            if err > bound:
                raise AssertionError(f"wire {name} {key}: error {err} above its bound {bound}")
    return out

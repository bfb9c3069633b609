"""Which model a node trains: the config classes only, importable without transformers or peft.

Run configs (``ftis.config``) are read by light tools, so they import these from here;
``ftis.models.loading`` builds and loads what they describe (and re-exports them).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ftis.models.presets import PRESETS


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
    """Which model a node trains. Exactly one of `preset` and `path`."""

    model_config = ConfigDict(extra="forbid")
    preset: str | None = Field(None, description=f"Tiny preset, one of: {', '.join(PRESETS)}.")
    path: str | None = Field(
        None, description="Local directory or Hugging Face Hub name of a causal LM."
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
    init_seed: int = Field(0, description="Seed of a preset's random initialisation.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where the node's model lives: 'auto' = this process's GPU (cuda:LOCAL_RANK) "
        "when CUDA is available, else the CPU.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.preset is None) == (self.path is None):
            raise ValueError(
                "give exactly one of model.preset (a tiny built-in model) and model.path "
                "(a Hugging Face causal LM)"
            )
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError(
                "model.dtype float16 is not supported on the CPU (half-precision matmuls there "
                "are slow and training without loss scaling underflows); use model.dtype "
                "float32 with model.compute_dtype bfloat16, or run on a GPU"
            )
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(
                f"unknown preset {self.preset!r}; choose one of: {', '.join(sorted(PRESETS))}"
            )
        return self

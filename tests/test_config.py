from pathlib import Path

import pytest
import yaml

from ftis.config import DEFAULT_CONFIG, ConfigError, RunConfig, apply_overrides, load_config
from tests.conftest import tiny_run_config


def _write(tmp_path, data) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_default_config_is_valid():
    cfg = load_config()
    assert cfg.nodes and cfg.nodes[0].loss.method == "f-tis"
    assert cfg.train.group_size >= 2


def test_overrides_parse_yaml_values_and_list_indices():
    cfg = load_config(
        None,
        [
            "train.steps=7",
            "nodes.0.loss.method=tis",
            "eval.pass_k=[1, 2]",
            "nodes.0.model.lora={r: 4}",
        ],
    )
    assert cfg.train.steps == 7
    assert cfg.nodes[0].loss.method == "tis"
    assert cfg.eval.pass_k == [1, 2]
    assert cfg.nodes[0].model.lora is not None and cfg.nodes[0].model.lora.r == 4


@pytest.mark.parametrize(
    ("override", "field", "hint"),
    [
        ("nodes.0.loss.method=ppo", "nodes.0.loss.method", "choose one of: nois, vis, tis, f-nois"),
        ("train.group_size=1", "train.group_size", "greater than or equal to 2"),
        ("nodes.0.model.preset=llama-huge", "nodes.0.model", "unknown preset 'llama-huge'"),
        ("train.stepz=3", "train.stepz", "did you mean train.steps?"),
        ("nodes.0.name=a/b", "nodes.0.name", "must be 1-64 letters"),
        ("eval.pass_k=[16]", "eval", "between 1 and eval.pass_samples"),
        # checked when the config is read, not after every node's warm start
        ("exchange.logprob_format=bogus", "exchange.logprob_format", "use 'f32' (exact)"),
        ("exchange.on_store_lost=maybe", "exchange.on_store_lost", "'stop' or 'continue'"),
        ("algorithm.kind=ppo", "algorithm", "unknown algorithm kind 'ppo'; choose one of"),
        ("testing.crash_at_step.nobody=2", "testing.crash_at_step", "names unknown nodes"),
    ],
)
def test_bad_values_name_the_field(override, field, hint):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert field in str(e.value) and hint in str(e.value)


def test_missing_data_file_is_named(tmp_path):
    data = tiny_run_config()
    data["task"] = {
        "kind": "gsm8k",
        "train_file": str(tmp_path / "missing.jsonl"),
        "test_file": str(tmp_path / "missing.jsonl"),
    }
    from ftis.tasks import TaskDataError, build_task

    cfg = load_config(_write(tmp_path, data))
    with pytest.raises(TaskDataError, match="missing.jsonl"):
        build_task(cfg.task).split("train")


def test_duplicate_node_names(tmp_path):
    data = tiny_run_config()
    data["nodes"] = data["nodes"] * 2
    with pytest.raises(ConfigError, match="node names must be unique; repeated: xs"):
        load_config(_write(tmp_path, data))


@pytest.mark.parametrize(
    ("item", "hint"),
    [
        ("train.steps", "expected KEY=VALUE"),
        ("train..steps=1", "is not a dotted key"),
        ("nodes.5.name=x", "out of range"),
        ("train.steps=[1", "not valid YAML"),
    ],
)
def test_bad_overrides(item, hint):
    with pytest.raises(ConfigError, match=hint):
        apply_overrides(yaml.safe_load(DEFAULT_CONFIG.read_text()), [item])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(bad)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config()
    again = RunConfig.model_validate(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json"))))
    assert again == cfg


def test_config_import_skips_transformers_and_peft():
    """Light tools (validation, studies, report) read configs; that must not pull in
    transformers, and validating every shipped config must not import the trainer, the
    launcher or the systems' algorithms (issue 54: config.py validates without the trainer)."""
    import subprocess
    import sys

    code = (
        "import sys, glob, ftis.config; "
        "heavy = [m for m in ('transformers', 'peft') if m in sys.modules]; "
        "assert not heavy, f'import ftis.config imported {heavy}'; "
        "[ftis.config.load_config(p) for p in sorted(glob.glob('configs/*.yaml'))]; "
        "above = sorted(m for m in sys.modules if m.startswith(('ftis.train', 'ftis.launch')) "
        "or m.endswith('.algorithm') or m in ('transformers', 'peft')); "
        "assert not above, f'validating the configs imported {above}'"
    )
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stderr


def test_switching_the_algorithm_kind_drops_the_other_kinds_fields():
    """`--set algorithm.kind=dpo` on the gossip config (as docs/dpo.md shows) drops its graph
    fields; a field the new kind lacks, given explicitly, is still an error."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs/gossip-dpo.yaml", ["algorithm.kind=dpo"])
    assert cfg.algorithm.kind == "dpo" and not hasattr(cfg.algorithm, "topology")
    with pytest.raises(ConfigError, match="topology"):
        load_config(
            root / "configs/gossip-dpo.yaml", ["algorithm.kind=dpo", "algorithm.topology=ring"]
        )
    with pytest.raises(ConfigError, match="topology"):  # no kind override: nothing is dropped
        load_config(root / "configs/gossip-dpo.yaml", ["algorithm.topology=moon"])


@pytest.mark.parametrize("name", ["/some/dir", "../../x", "..", ".", "a/b", "a\\b", "", " x"])
def test_a_run_name_is_one_path_component(name):
    with pytest.raises(ConfigError, match=r"(?s)name:.*one folder name"):
        load_config(None, [f"name={name!r}"])


def test_ordinary_run_names_are_accepted():
    for name in ("ftis", "paper-grid.seed_1", "run 2"):
        assert load_config(None, [f"name={name!r}"]).name == name


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.step=3", "unknown field 'train.step': did you mean train.steps?"),
        ("eval.evry=2", "unknown field 'eval.evry': did you mean eval.every?"),
        ("nodes.0.model.pth=x", "did you mean nodes.0.model.path?"),
        ("task.max_digit=2", "did you mean task.max_digits?"),
        ("algorithm.kindd=ftis", "did you mean algorithm.kind?"),
        ("zzz=1", "unknown field 'zzz'; valid fields here: algorithm, checkpoint"),
    ],
)
def test_a_misspelt_key_suggests_the_nearest_valid_one(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert expected in str(err.value)


def test_config_files_that_are_not_yaml_text(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(tmp_path / "latin1.yaml")

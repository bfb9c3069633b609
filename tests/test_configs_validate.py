"""Every config the project ships validates against the schema as it is (a renamed field or a
new check cannot leave a documented config broken)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftis.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(
    p.relative_to(ROOT).as_posix()
    for folder in ("configs", "studies", "examples")
    for p in (ROOT / folder).rglob("*.yaml")
    if folder == "configs" or p.parent.name.endswith("-configs") or p.name == "config.yaml"
)


@pytest.mark.parametrize("path", SHIPPED)
def test_a_shipped_config_validates(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # examples name their files from the repository root
    if path.startswith("examples/verifiers-env"):
        pytest.importorskip("verifiers", reason="needs pip install 'ftis[verifiers]'")
    load_config(ROOT / path, [])

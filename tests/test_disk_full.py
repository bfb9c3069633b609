"""A full disk is a clear line and a resumable stop, not a traceback per node (issue 37).

The run directory sits on a small tmpfs (root only: skipped with the reason otherwise) that
fills up after the first checkpoint; the run ends with exit 1 and one line that says so and how to
continue, no traceback in any node's log, no half-written checkpoint; once the disk has room,
`--resume` finishes the run."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from tests.test_chaos import _ftis
from tests.test_stop_protocol import FTIS


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1300k", "tmpfs", str(mnt)], capture_output=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.long
@pytest.mark.chaos_case("F-TIS", "disk full")
def test_a_full_disk_stops_with_one_line_and_resumes(small_disk, tmp_path):
    data = _ftis(3)
    data["checkpoint"] = {"every": 1}
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(data))
    out = small_disk / "run"
    res = subprocess.run(
        [FTIS, "run", str(config), "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    said = res.stdout + res.stderr
    assert res.returncode == 1, said[-3000:]
    assert "no space left on device" in said and f"ftis run --resume {out}" in said, said[-3000:]
    assert "Traceback" not in said
    for log in (out / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    for node in ("a", "b"):  # nothing half-written
        assert not list((out / "nodes" / node).glob(".tmp-*"))
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    res = subprocess.run(
        [FTIS, "run", "--resume", str(out)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert (out / "report.md").exists()

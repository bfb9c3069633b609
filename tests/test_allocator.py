"""ftis.train.allocator: glibc's mmap and trim thresholds are raised once per process (so a real
model's large update buffers are reused rather than faulted in afresh), never off glibc, and
not at all with FTIS_MALLOC_KEEP=0."""

from __future__ import annotations

import ctypes

from ftis.train import allocator


class _FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

        def mallopt(param, value):
            self.calls.append((param, value))
            return 1

        self.mallopt = mallopt


def test_thresholds_are_raised_once_per_process(monkeypatch):
    fake = _FakeLibc()
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.delenv("FTIS_MALLOC_KEEP", raising=False)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    assert allocator.keep_large_blocks() is True
    assert allocator.keep_large_blocks() is True
    assert fake.calls == [
        (allocator.M_MMAP_THRESHOLD, allocator.MMAP_THRESHOLD),
        (allocator.M_TRIM_THRESHOLD, allocator.TRIM_THRESHOLD),
    ]


def test_opt_out_and_no_glibc_leave_malloc_alone(monkeypatch):
    fake = _FakeLibc()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setenv("FTIS_MALLOC_KEEP", "0")
    assert allocator.keep_large_blocks() is False
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.delenv("FTIS_MALLOC_KEEP")

    class NoMallopt:
        pass

    monkeypatch.setattr(ctypes, "CDLL", lambda name: NoMallopt())
    assert allocator.keep_large_blocks() is False
    assert fake.calls == []


def test_the_real_glibc_accepts_the_settings():
    import platform

    import pytest

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    assert allocator.keep_large_blocks() is True

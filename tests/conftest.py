"""Shared fixtures: an isolated warm-start cache and tiny run configs."""

from __future__ import annotations

import signal

import pytest


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    # One cache for the whole session: tests that warm start the same tiny preset share it.
    mp = pytest.MonkeyPatch()
    mp.setenv("FTIS_CACHE", str(tmp_path_factory.mktemp("ftis-cache")))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    # A test that builds a library object which installs process-wide signal handlers (a
    # verifiers Environment does, in its __post_init__) must not leak them into the next test:
    # the stop-protocol tests check that ftis removes its own handlers when a run ends.
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        if handler is not None and signal.getsignal(s) is not handler:
            signal.signal(s, handler)


def tiny_run_config(**train) -> dict:
    """A run config that finishes in a few seconds: llama-xs, 30 warm-start steps, 3 RL steps."""
    return {
        "name": "tiny",
        "task": {
            "kind": "arithmetic",
            "ops": {"+": 1.0},
            "max_digits": 2,
            "test_size": 16,
            "ood": {"ood": {"terms": 3, "size": 16}},
        },
        "nodes": [
            {
                "name": "xs",
                "model": {"preset": "llama-xs"},
                "warm_start": {"steps": 30, "batch_size": 32, "lr": 0.003},
            }
        ],
        "train": {"steps": 3, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4, **train},
        "eval": {"every": 2, "size": 16, "pass_samples": 4, "pass_k": [1, 2], "pass_problems": 8},
        "log": {"progress": False},
    }


def tiny_node(method: str = "f-tis", *, lr: float | None = None, lora=None):
    """A llama-xs node (random init, char tokenizer) built in-process, for phase-level tests."""
    from ftis.config import LossConfig, NodeConfig, OptimConfig
    from ftis.models.loading import ModelConfig, build_model
    from ftis.models.tokenizer import char_tokenizer
    from ftis.train.node import Node, build_optimizer

    optim = OptimConfig() if lr is None else OptimConfig(lr=lr)
    cfg = NodeConfig(
        name="n",
        model=ModelConfig(preset="llama-xs", lora=lora),
        optim=optim,
        loss=LossConfig(method=method),
    )
    model = build_model(cfg.model)
    return Node(
        cfg=cfg,
        rank=0,
        model=model,
        tokenizer=char_tokenizer(),
        optimizer=build_optimizer(model, cfg.optim),
    )


# ---- the chaos suite (docs/RELIABILITY.md "Chaos suite", scripts/chaos_report.py) -------------

TRACEBACK = "Traceback (most recent call last)"
RESULTS_ENV = "FTIS_CHAOS_RESULTS"  # a JSONL file each chaos case appends its result to
ORPHAN_WAIT_S = 10.0  # how long a case's processes may take to go once the case has ended


def _tracebacks(root) -> int:
    """Python tracebacks in the logs a case left under `root` (node and peer logs, launcher
    output the chaos harness saved): each is a process that crashed instead of stopping."""
    from pathlib import Path

    n = 0
    for p in Path(root).rglob("*"):
        if p.suffix in (".log", ".out", ".error") and p.is_file():
            n += p.read_text(errors="replace").count(TRACEBACK)
    return n


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """For a test marked chaos_case(mode, case): record the mode and the case, and afterwards
    count its crashes (tracebacks in its logs) and orphans (processes it started, directly or
    not, still alive ORPHAN_WAIT_S after it ended) as the test's properties (in a junit
    xml), and, when $FTIS_CHAOS_RESULTS names a file, append the case's result to it as one
    JSON line (scripts/chaos_report.py reads it; a run cut short keeps the cases it ended). While the case runs this process is the child
    subreaper of its descendants, so a process whose parent died first is still found."""
    mark = item.get_closest_marker("chaos_case")
    if mark is None:
        yield
        return
    import contextlib
    import json
    import os
    import time

    from ftis.launch import stop

    item.user_properties += [
        ("chaos_mode", mark.args[0]),
        ("chaos_case", mark.args[1]),
        (
            "chaos_tier",
            next((m for m in ("chaos", "long") if item.get_closest_marker(m)), "default"),
        ),
    ]
    prctl = stop._prctl()
    if prctl is not None:
        prctl(stop._PR_SET_CHILD_SUBREAPER, 1)
    before = stop.descendants()
    t0 = time.monotonic()
    outcome = None
    try:
        outcome = yield
    finally:
        deadline = time.monotonic() + ORPHAN_WAIT_S
        while (left := stop.descendants() - before) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {p for p in left if stop.alive(p)}
        names = []
        for p in sorted(left):
            with contextlib.suppress(OSError):
                names.append(open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ")[:80])
        stop.end_processes(left)
        if prctl is not None:
            me = os.getpid()
            for pid, (state, ppid) in stop._processes().items():
                if ppid == me and state == "Z" and pid not in before:
                    with contextlib.suppress(ChildProcessError, OSError):
                        os.waitpid(pid, os.WNOHANG)
            prctl(stop._PR_SET_CHILD_SUBREAPER, 0)
        tmp = item.funcargs.get("tmp_path") if hasattr(item, "funcargs") else None
        item.user_properties += [
            ("chaos_orphans", len(left)),
            ("chaos_orphan_commands", "; ".join(n.decode(errors="replace") for n in names)),
            ("chaos_crashes", _tracebacks(tmp) if tmp is not None else 0),
            ("chaos_seconds", round(time.monotonic() - t0, 1)),
        ]
        if path := os.environ.get(RESULTS_ENV):  # one line per case, as it ends
            exc = outcome.excinfo if outcome is not None else None
            if exc is None:
                result = "held"
            elif issubclass(exc[0], pytest.skip.Exception):
                result = "skipped"
            else:
                result = "failed"
            with open(path, "a") as f:
                f.write(
                    json.dumps(
                        {"test": item.nodeid, "result": result, **dict(item.user_properties)}
                    )
                    + "\n"
                )

"""`ftis run` under a supervisor: runs whose process Ray may end without warning (Flower's
simulation engine) run in a child process, in a network namespace of its own where the machine
allows it, watched by this one."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from ftis.cli.common import (
    SUPERVISED_ENV,
    console,
)
from ftis.cli.resume import _resume_hint


def _needs_supervisor(cfg) -> bool:
    """Runs whose process Ray may end without warning: Flower's simulation engine makes this
    process Ray's driver, and Ray's core worker exits the driver (exit 1, no Python cleanup)
    when its raylet dies."""
    if not hasattr(cfg.algorithm, "simulation") or os.environ.get(SUPERVISED_ENV):
        return False
    try:  # a child can only share this process's output through real file descriptors
        sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return False  # e.g. typer's CliRunner: run in this process, as before
    return True


ISOLATED_ENV = "FTIS_NET_ISOLATED"  # set in a supervised run that has its own network namespace


def _can_isolate() -> bool:
    """Whether a supervised run can get a network namespace of its own (Linux with unshare(1)
    and user namespaces; FTIS_NET_ISOLATION=0 turns it off). Not when W&B is set to sync online,
    which needs the network."""
    import shutil
    import subprocess

    if os.environ.get("FTIS_NET_ISOLATION", "1") == "0" or shutil.which("unshare") is None:
        return False
    if os.environ.get("WANDB_MODE", "offline") not in ("offline", "disabled", "dryrun"):
        return False
    try:
        probe = subprocess.run(
            ["unshare", "--net", "--map-root-user", "true"], capture_output=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def loopback_up() -> None:
    """Bring up the loopback interface of this (new, empty) network namespace."""
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, siocgifflags, req))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def _supervise(cfg, run_dir: Path, args: list[str]) -> int:
    """Run this same command in a child process (its own process group: a signal reaches it
    once, passed on by this one; its own network namespace with only loopback where the
    machine allows it, `_can_isolate`) and, if it ends without ftis ending it (Ray's core
    worker killed its driver), say so with how to continue, and end whatever it left behind."""
    import signal
    import subprocess
    import tempfile

    from ftis.launch.stop import die_with_parent, reaping_orphans

    fd, status_name = tempfile.mkstemp(prefix="ftis-run-status-")
    os.close(fd)
    status = Path(status_name)
    status.unlink()
    entry = "import sys; from ftis.cli import main; sys.argv[0] = 'ftis'; main()"
    cmd = [sys.executable, "-c", entry, *args]
    env = {**os.environ, SUPERVISED_ENV: status_name}
    if _can_isolate():
        # a network namespace of its own, with only loopback: Ray's servers listen on every
        # interface, and there no other host can reach them
        entry = (
            "import sys; from ftis.cli import main; from ftis.cli.supervisor import loopback_up; loopback_up(); "
            "sys.argv[0] = 'ftis'; main()"
        )
        cmd = ["unshare", "--net", "--map-root-user", "--", sys.executable, "-c", entry, *args]
        env[ISOLATED_ENV] = "1"
    dies = die_with_parent()

    def preexec() -> None:
        os.setpgrp()
        if dies is not None:
            dies()

    with reaping_orphans(what="Ray"):
        child = subprocess.Popen(cmd, env=env, preexec_fn=preexec)
        previous = {}

        def forward(signum, frame):
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, forward)
        try:
            code = child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if status.exists():
        status.unlink()
        return code
    console.print(
        f"[bold red]error:[/] the run's process ended abruptly (exit code {code}) without ftis "
        "ending it: under Flower's simulation this is Ray ending its driver, as Ray does when "
        f"its raylet dies (Ray's own lines above say why). {_resume_hint(cfg, run_dir)}",
        soft_wrap=True,
        highlight=False,
    )
    return 1

"""Children that die with their parent: every process the launcher starts (etcd, router,
workers, gateway) asks Linux to SIGKILL it when the launcher dies, however it dies (``kill -9``
included), so no orphan keeps holding a port and the next ``make serve`` just works."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` (None off Linux): in the child, between fork and
    exec, set PR_SET_PDEATHSIG to SIGKILL, then exit at once if the parent is already gone (it
    died between the fork and the prctl). The signal comes when the *thread* that started the
    child exits, so start children from a thread that lives as long as they should (the main
    thread)."""
    if sys.platform != "linux":
        return None
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


@dataclass(slots=True)
class Child:
    """One process of the local stack and where it logs."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    proc: subprocess.Popen | None = None
    address: str = ""
    metrics_port: int = 0  # 0: no metrics server

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


def launch(child: Child) -> None:
    """Start ``child`` (again), appending to its log, in a session of its own (a Ctrl-C aimed at
    the launcher does not hit it first) and dying with the launcher."""
    log = open(child.log_path, "ab")  # noqa: SIM115 - owned by the child process
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **child.env}
    child.proc = subprocess.Popen(
        child.argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )
    log.close()

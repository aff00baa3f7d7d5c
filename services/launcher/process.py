"""Children that die with their parent: every process the launcher starts (etcd, router,
workers, gateway) asks Linux to SIGKILL it when the launcher dies, however it dies (``kill -9``
included), so no orphan keeps holding a port and the next ``make serve`` just works."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# Run between the fork and the real program: set PR_SET_PDEATHSIG to SIGKILL, give up if the
# parent already died (between the fork and the prctl), then exec the command; the setting
# survives exec. Python code in the forked child itself (a ``preexec_fn``) is not safe while the
# parent has threads (gRPC's): it crashed children of a pytest process (issue 15's follow-up).
_PDEATHSIG = """import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:
    sys.exit(126)
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def die_with_parent(argv: list[str]) -> list[str]:
    """``argv`` wrapped so that the process is SIGKILLed when this one dies (Linux; elsewhere
    ``argv`` unchanged). The signal comes when the *thread* that started the child exits, so
    start children from a thread that lives as long as they should (the main thread)."""
    if sys.platform != "linux":
        return list(argv)
    return [sys.executable, "-S", "-c", _PDEATHSIG, str(os.getpid()), *argv]


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
    nice: int = 0  # CPU priority below the launcher's once it serves (`serving`)

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
        die_with_parent(child.argv),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    log.close()


def serving(child: Child) -> None:
    """``child`` printed READY: from now on it runs ``child.nice`` steps below the launcher's
    CPU priority (it started at full priority, so loading a model is not slowed)."""
    if child.nice and child.proc is not None:
        lower_priority(child.proc.pid, child.nice)


def lower_priority(pid: int, nice: int) -> None:
    """Run process ``pid`` ``nice`` steps below normal CPU priority (Linux; best effort): every
    thread's nice value (threads it starts later inherit their creator's) and, since it leads a
    session of its own, its scheduler autogroup's (with autogroups on, Linux shares the CPU
    between sessions first, so threads' nice values alone would not move it against the other
    processes)."""
    try:
        tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:  # not Linux, or the process is gone
        tasks = [pid]
    for task in tasks:
        with contextlib.suppress(OSError):  # a thread that just ended
            os.setpriority(os.PRIO_PROCESS, task, nice)
    # OSError: autogroups off, not Linux, or the process is gone.
    with contextlib.suppress(OSError), open(f"/proc/{pid}/autogroup", "w") as f:
        f.write(str(nice))

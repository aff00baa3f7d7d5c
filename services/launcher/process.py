"""Children that die with their parent: every process the launcher starts (etcd, router,
workers, gateway) asks Linux to SIGKILL it when the launcher dies, however it dies (``kill -9``
included), so no orphan keeps holding a port and the next ``make serve`` just works."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

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

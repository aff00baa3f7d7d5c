"""A supervisor's children die with it: after ``kill -9`` of ``tandem serve`` no process it
started (etcd, router, worker, gateway, each worker's engine process) survives, and the
gateway's port is free again, so the next ``make serve`` just works."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.launcher.etcd import free_port


def children_of(pid: int) -> dict[int, str]:
    """pid -> command line of the live processes whose parent is ``pid``."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[1]) == pid and fields[0] != "Z":
            out[int(entry.name)] = cmdline
    return out


def alive(pid: int) -> bool:
    """Still running (a zombie waiting for its new parent to reap it is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.timeout(300)
def test_kill_9_of_serve_leaves_no_child_and_frees_the_port(smol_dir, tmp_path) -> None:
    port = free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", "--model", str(smol_dir), "--port", str(port),
         "--run-dir", str(tmp_path), "--colocated", "1", "--kv-cache-mib", "64"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    lines: list[str] = []
    assert serve.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(serve.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while not any("Ctrl-C stops everything" in line for line in lines):
        assert serve.poll() is None, "".join(lines)
        assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)
    kids = children_of(serve.pid)
    started = " ".join(kids.values())
    for what in ("etcd", "services.router", "services.decode", "services.gateway"):
        assert what in started, kids
    # Each worker's engine runs in a process of its own (``engine.core.process``).
    engines = {p: c for w in kids for p, c in children_of(w).items() if "spawn_main" in c}
    assert engines, "no engine process under the workers"
    kids.update(engines)
    os.kill(serve.pid, signal.SIGKILL)
    serve.wait(10)
    t0 = time.monotonic()
    try:
        while any(alive(pid) for pid in kids):
            left = {pid: cmd for pid, cmd in kids.items() if alive(pid)}
            assert time.monotonic() - t0 < 15, f"still running 15 s after kill -9: {left}"
            time.sleep(0.2)
    finally:  # a failure leaves nothing behind either
        for pid in kids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    # The next `tandem serve` can listen here. Once in a full suite run the bind failed right
    # after every child was gone (the dead gateway's connections, or another test's process
    # taking the freed port as its ephemeral one): a few seconds of grace, and `ss` if it stays.
    t0 = time.monotonic()
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                break
            except OSError:
                if time.monotonic() - t0 > 10:
                    ss = ["ss", "-tanp"] if shutil.which("ss") else ["true"]
                    held = subprocess.run(ss, capture_output=True, text=True).stdout
                    lines = [x for x in held.splitlines() if f":{port} " in x]
                    raise AssertionError(f"port {port} still in use: {lines}") from None
        time.sleep(0.5)

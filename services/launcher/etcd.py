"""A real etcd server as a child process on loopback, for tests and the local launcher.

Production runs etcd from the chart; this module only exists so that tests and `make serve`
start the same binary the services talk to in production, never a fake.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from services.launcher import process

INSTALL_HINT = "install it with `apt-get install etcd-server` (Debian/Ubuntu) or put it on PATH"


@dataclass(frozen=True, slots=True)
class EtcdTLS:
    """Serve the client port over TLS with this certificate and key, and require client
    certificates signed by ``ca`` (etcd's ``--client-cert-auth``)."""

    cert: str
    key: str
    ca: str

    def ssl_context(self, client_cert: str = "", client_key: str = "") -> ssl.SSLContext:
        """A client context trusting ``ca``, presenting ``client_cert`` when given."""
        ctx = ssl.create_default_context(cafile=self.ca)
        if client_cert:
            ctx.load_cert_chain(client_cert, client_key)
        return ctx


class EtcdNotFoundError(RuntimeError):
    """The etcd server binary is not installed."""


class EtcdStartError(RuntimeError):
    """etcd exited or did not become healthy in time."""


def find_etcd_binary() -> str:
    """Path of the etcd server binary: $PATH first, then the Debian location."""
    found = shutil.which("etcd")
    if found:
        return found
    for candidate in ("/usr/bin/etcd", "/usr/local/bin/etcd"):
        if os.access(candidate, os.X_OK):
            return candidate
    raise EtcdNotFoundError(f"etcd server binary not found; {INSTALL_HINT}")


_handed: set[int] = set()  # ports this process handed out (never twice)


def _ephemeral_low() -> int:
    """The lowest port the kernel picks for outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, for a child to bind later.

    Picked below the kernel's ephemeral range: a port bound to 0 and released comes from that
    range, where any outgoing connection (gRPC, etcd, HTTP clients) may take it before the
    child binds it (seen: a gateway's metrics port taken, `Address already in use`). Below it
    only an explicit bind competes. Falls back to port 0 when nothing there binds."""
    low = _ephemeral_low()
    if low > 11000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(10000, low)
            if port in _handed:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _handed.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One etcd member on 127.0.0.1 with its own client and peer ports and data dir.

    Ports are chosen once, so `restart()` comes back on the same endpoint with the same data
    (keys, leases and revisions survive, as with a real etcd pod restart).

    With ``die_with_parent`` (Linux) etcd is killed when the thread that started it exits,
    so a killed test run leaves no etcd behind; start it from a long-lived thread.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        name: str = "tandem-etcd",
        host: str = "127.0.0.1",
        start_timeout: float = 20.0,
        die_with_parent: bool = True,
        tls: EtcdTLS | None = None,
    ) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if run_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tandem-etcd-")
            run_dir = self._tmp.name
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.run_dir / f"{name}.etcd"
        self.log_path = self.run_dir / f"{name}.log"
        self.name = name
        self.host = host
        self.start_timeout = start_timeout
        self.die_with_parent = die_with_parent and sys.platform == "linux"
        self.binary = find_etcd_binary()
        self.tls = tls
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        while self.peer_port == self.client_port:
            self.peer_port = free_port(host)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """Client endpoint as "host:port" (what the registry takes)."""
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _command(self) -> list[str]:
        return [
            self.binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            f"{self.name}={self.peer_url}",
            "--initial-cluster-state",
            "new",
            "--initial-cluster-token",
            f"{self.name}-{self.client_port}",
            *self._tls_flags(),
        ]

    def _tls_flags(self) -> list[str]:
        if self.tls is None:
            return []
        t = self.tls
        return ["--cert-file", t.cert, "--key-file", t.key, "--trusted-ca-file", t.ca,
                "--client-cert-auth"]  # fmt: skip

    def start(self) -> EtcdServer:
        """Start etcd and block until /health answers; raises EtcdStartError otherwise."""
        if self.is_running():
            return self
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in _reap)
        command = self._command()
        self._proc = subprocess.Popen(
            process.die_with_parent(command) if self.die_with_parent else command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C aimed at pytest does not hit etcd first
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        last_error = "no answer"
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise EtcdStartError(
                    f"etcd exited with code {self._proc.returncode}; log: {self.log_path}\n"
                    + self._log_tail()
                )
            try:
                ctx = self.tls.ssl_context(self.tls.cert, self.tls.key) if self.tls else None
                url = self.client_url + "/health"
                with urllib.request.urlopen(url, timeout=1.0, context=ctx) as r:
                    body = r.read().decode(errors="replace")
                if r.status == 200 and '"true"' in body:
                    return
                last_error = body
            except (urllib.error.URLError, OSError) as e:
                last_error = repr(e)
            time.sleep(0.05)
        raise EtcdStartError(
            f"etcd not healthy after {self.start_timeout:.0f} s ({last_error}); "
            f"log: {self.log_path}\n" + self._log_tail()
        )

    def _log_tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if etcd has not exited after `grace` seconds."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._reap()

    def kill(self) -> None:
        """SIGKILL, like a node dying (no clean shutdown, data dir left as is)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self._reap()

    def _reap(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self) -> EtcdServer:
        """Start again on the same ports and data dir (stops first if still running)."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop etcd and remove the temporary run dir if this object created one."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"EtcdServer({self.endpoint}, {state}, data_dir={self.data_dir})"

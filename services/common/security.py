"""Transport security of the internal services: mutual TLS between them (``services.common.tls``)
and TLS, client certificates and user/password authentication towards etcd.

Flags (each with a ``TANDEM_*`` fallback): ``--tls-cert/--tls-key/--tls-ca/--tls-server-name``
and ``--etcd-ca`` (``TANDEM_ETCD_CA``: talk TLS to etcd, trusting this CA), ``--etcd-cert`` and
``--etcd-key`` (client certificate, for etcd's ``--client-cert-auth``), ``--etcd-user`` and
``--etcd-password`` (etcd's own authentication; the password preferably from the environment).

Every etcd connection in a process is made by ``libkv.etcd_follow.EtcdConnection``; ``apply``
installs, once at start-up, the factory that builds its clients with these settings (libkv itself
stays free of TLS and of grpc).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aetcd
import grpc
from aetcd import rpc
from aetcd import watcher as aetcd_watcher

from libkv import etcd_follow
from services.common.tls import TLSFiles, add_tls_flags, tls_from_args


@dataclass(frozen=True, slots=True)
class EtcdSecurity:
    """How to reach etcd: TLS when ``ca`` is set, a client certificate when ``cert``/``key``
    are, etcd authentication when ``user`` is."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password: str = ""

    def __repr__(self) -> str:  # never print the password
        return f"EtcdSecurity(ca={self.ca!r}, cert={self.cert!r}, user={self.user!r})"


@dataclass(frozen=True, slots=True)
class Security:
    """A service's transport security (both parts optional)."""

    tls: TLSFiles | None = None
    etcd: EtcdSecurity | None = None


def add_security_flags(p: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    e = (os.environ if env is None else env).get
    add_tls_flags(p, env)
    p.add_argument("--etcd-ca", default=e("TANDEM_ETCD_CA", ""), help="TLS to etcd: CA bundle")
    p.add_argument("--etcd-cert", default=e("TANDEM_ETCD_CERT", ""), help="etcd client cert")
    p.add_argument("--etcd-key", default=e("TANDEM_ETCD_KEY", ""), help="etcd client key")
    p.add_argument("--etcd-user", default=e("TANDEM_ETCD_USER", ""))
    p.add_argument("--etcd-password", default=e("TANDEM_ETCD_PASSWORD", ""))


def security_from_args(args: argparse.Namespace) -> Security:
    """The parsed flags; ValueError when they are incomplete or name missing files."""
    etcd = EtcdSecurity(args.etcd_ca, args.etcd_cert, args.etcd_key, args.etcd_user,
                        args.etcd_password)  # fmt: skip
    if bool(etcd.cert) != bool(etcd.key):
        raise ValueError("an etcd client certificate needs both --etcd-cert and --etcd-key")
    if etcd.cert and not etcd.ca:
        raise ValueError("--etcd-cert needs --etcd-ca (TLS to etcd)")
    if bool(etcd.user) != bool(etcd.password):
        raise ValueError("etcd authentication needs both --etcd-user and --etcd-password")
    for path in (etcd.ca, etcd.cert, etcd.key):
        if path and not Path(path).is_file():
            raise ValueError(f"etcd TLS file not found: {path}")
    used = etcd.ca or etcd.user
    return Security(tls_from_args(args), etcd if used else None)


def apply(security: Security) -> None:
    """Make every etcd connection of this process use ``security.etcd`` (call once at start)."""
    sec = security.etcd
    if sec is None:
        etcd_follow.client_factory = aetcd.Client
        return

    def factory(**kw: Any) -> aetcd.Client:
        if not sec.ca:
            return aetcd.Client(username=sec.user or None, password=sec.password or None, **kw)
        return SecureEtcdClient(sec, **kw)

    etcd_follow.client_factory = factory


class SecureEtcdClient(aetcd.Client):
    """aetcd's client over a TLS channel (aetcd 1.0 only opens plaintext ones)."""

    def __init__(self, security: EtcdSecurity, **kw: Any) -> None:
        super().__init__(username=security.user or None, password=security.password or None,
                         **kw)  # fmt: skip
        ca = Path(security.ca).read_bytes()
        cert = Path(security.cert).read_bytes() if security.cert else None
        key = Path(security.key).read_bytes() if security.key else None
        self._credentials = grpc.ssl_channel_credentials(ca, private_key=key,
                                                         certificate_chain=cert)  # fmt: skip

    async def connect(self) -> None:
        """aetcd's connect with ``secure_channel`` in place of ``insecure_channel``."""
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = rpc.secure_channel(target, self._credentials,
                                              options=list(self._options.items()))  # fmt: skip
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password),
                    timeout=self._timeout,
                )
                self.metadata = (("token", resp.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd_watcher.Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False

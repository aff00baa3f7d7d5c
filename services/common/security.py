"""Transport security of the internal services: mutual TLS between them (``services.common.tls``)
and TLS, client certificates and user/password authentication towards etcd.

Options: ``--tls-cert/--tls-key/--tls-ca/--tls-server-name`` and ``--etcd-ca`` (talk TLS to
etcd, trusting this CA), ``--etcd-cert`` and
``--etcd-key`` (client certificate, for etcd's ``--client-cert-auth``), ``--etcd-user`` and
``--etcd-password`` (etcd's own authentication; the password preferably from the environment).

Every etcd connection in a process is made by ``libkv.cluster.etcd_follow.EtcdConnection``;
``apply`` installs, once at start-up, the factory that builds its clients with these settings
(libkv itself stays free of TLS and of grpc).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aetcd
import grpc
from aetcd import rpc
from aetcd import watcher as aetcd_watcher

from libkv.cluster import etcd_follow
from services.common.options import option
from services.common.tls import TLSFiles, TLSOptions

# What the services' --etcd (TANDEM_ETCD) endpoints were read from before one idiom.
ETCD_OLD_ENV = ("TANDEM_ETCD_ENDPOINTS", "ETCD_ENDPOINTS")


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
    """A service's transport security, both parts optional: mutual TLS towards the other
    services (``tls``) and how it reaches etcd (``etcd``)."""

    mtls: TLSOptions = TLSOptions()
    etcd_ca: str = option("", "talk TLS to etcd, trusting this CA bundle")
    etcd_cert: str = option("", "client certificate towards etcd (its --client-cert-auth)")
    etcd_key: str = option("", "private key of --etcd-cert")
    etcd_user: str = option("", "etcd user (etcd's own authentication)")
    etcd_password: str = option("", "password of --etcd-user", secret=True)

    @property
    def tls(self) -> TLSFiles | None:
        return self.mtls.files

    @property
    def etcd(self) -> EtcdSecurity | None:
        if not (self.etcd_ca or self.etcd_user):
            return None
        return EtcdSecurity(self.etcd_ca, self.etcd_cert, self.etcd_key, self.etcd_user,
                            self.etcd_password)  # fmt: skip

    def check(self) -> None:
        """ValueError when the flags are incomplete or name missing files."""
        self.mtls.check()
        if bool(self.etcd_cert) != bool(self.etcd_key):
            raise ValueError("an etcd client certificate needs both --etcd-cert and --etcd-key")
        if self.etcd_cert and not self.etcd_ca:
            raise ValueError("--etcd-cert needs --etcd-ca (TLS to etcd)")
        if bool(self.etcd_user) != bool(self.etcd_password):
            raise ValueError("etcd authentication needs both --etcd-user and --etcd-password")
        for path in (self.etcd_ca, self.etcd_cert, self.etcd_key):
            if path and not Path(path).is_file():
                raise ValueError(f"etcd TLS file not found: {path}")

    def __repr__(self) -> str:  # never print the password
        return f"Security(tls={self.tls!r}, etcd={self.etcd!r})"


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

"""Mutual TLS between Tandem services: one certificate, key and CA bundle per process.

With ``--tls-cert``, ``--tls-key`` and ``--tls-ca`` (``TANDEM_TLS_CERT``, ``TANDEM_TLS_KEY``,
``TANDEM_TLS_CA``) a service's gRPC server requires a client certificate signed by the CA, and
its channels to other services present its own certificate and trust only that CA. The same
certificate serves both directions, so it needs both the serverAuth and clientAuth uses (or no
extended key usage). Without the flags, servers and channels are plaintext (loopback only by
default). ``--tls-server-name`` (``TANDEM_TLS_SERVER_NAME``) overrides the name checked against
the peers' certificates when they are dialled by an address their certificate does not list.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """Paths of this process's certificate chain, its private key and the trusted CA bundle."""

    cert: str
    key: str
    ca: str
    server_name: str = ""

    def read(self) -> tuple[bytes, bytes, bytes]:
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), Path(self.ca).read_bytes()


def add_tls_flags(p: argparse.ArgumentParser, env: Any = None) -> None:
    """``--tls-cert/--tls-key/--tls-ca/--tls-server-name`` with ``TANDEM_TLS_*`` fallbacks."""
    e = (os.environ if env is None else env).get
    p.add_argument("--tls-cert", default=e("TANDEM_TLS_CERT", ""), help="PEM certificate chain")
    p.add_argument("--tls-key", default=e("TANDEM_TLS_KEY", ""), help="PEM private key")
    p.add_argument("--tls-ca", default=e("TANDEM_TLS_CA", ""), help="PEM CA bundle of peers")
    p.add_argument("--tls-server-name", default=e("TANDEM_TLS_SERVER_NAME", ""))


def tls_from_args(args: argparse.Namespace) -> TLSFiles | None:
    """TLSFiles when all three files are given, None when none is; ValueError otherwise."""
    given = (args.tls_cert, args.tls_key, args.tls_ca)
    if not any(given):
        return None
    if not all(given):
        raise ValueError("mutual TLS needs all of --tls-cert, --tls-key and --tls-ca")
    for path in given:
        if not Path(path).is_file():
            raise ValueError(f"TLS file not found: {path}")
    return TLSFiles(*given, server_name=args.tls_server_name)


def server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    """Server side of mutual TLS: present our certificate, require a client certificate."""
    cert, key, ca = tls.read()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )


def channel(
    address: str,
    tls: TLSFiles | None,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[Any] | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address``: mutual TLS with ``tls``, plaintext without."""
    opts = list(options)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)
    cert, key, ca = tls.read()
    creds = grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, creds, options=opts, interceptors=interceptors)

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

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.common.options import option


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """Paths of this process's certificate chain, its private key and the trusted CA bundle."""

    cert: str
    key: str
    ca: str
    server_name: str = ""

    def read(self) -> tuple[bytes, bytes, bytes]:
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), Path(self.ca).read_bytes()


@dataclass(frozen=True, slots=True)
class TLSOptions:
    """The mutual-TLS flags of a process (all three files, or none)."""

    tls_cert: str = option("", "PEM certificate chain of this process (mutual TLS)")
    tls_key: str = option("", "PEM private key of that certificate")
    tls_ca: str = option("", "PEM CA bundle that signs the peers' certificates")
    tls_server_name: str = option("", "name checked in the peers' certificates (default: host)")

    @property
    def files(self) -> TLSFiles | None:
        """TLSFiles when the three files are given, None when none is (see `check`)."""
        given = (self.tls_cert, self.tls_key, self.tls_ca)
        return TLSFiles(*given, server_name=self.tls_server_name) if all(given) else None

    def check(self) -> None:
        """ValueError when only some files are given or one is missing."""
        given = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(given) and not all(given):
            raise ValueError("mutual TLS needs all of --tls-cert, --tls-key and --tls-ca")
        for path in given:
            if path and not Path(path).is_file():
                raise ValueError(f"TLS file not found: {path}")


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

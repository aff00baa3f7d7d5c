"""The one way Tandem services dial each other (gateway -> router, router -> workers, decode ->
prefill): mutual TLS when configured, trace context on every call, 64 MiB messages, and HTTP/2
keepalive, so a peer that goes silent (a hung process, a vanished host, a cut link: the TCP
connection stays open but nothing answers) fails its calls with UNAVAILABLE within
``KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS`` instead of at the request's deadline; callers then
move the request as on any other worker failure. Servers accept these pings
(`services.common.grpc_server`)."""

from __future__ import annotations

import grpc

from services.common.tls import TLSFiles
from services.common.tls import channel as tls_channel
from services.observability.tracing import client_interceptors

MAX_MESSAGE_BYTES = 64 * 1024**2
KEEPALIVE_TIME_MS = 2_000  # a ping after this long without a frame from the peer
KEEPALIVE_TIMEOUT_MS = 2_000  # no answer to the ping by then: the connection is dead
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging under a long silent stream
    # What closes the connection when a ping goes unanswered in grpcio 1.85: with
    # keepalive_timeout_ms alone a call to a SIGSTOPped peer waited for its deadline.
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
]


def internal_channel(address: str, tls: TLSFiles | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to another Tandem service at ``address`` (see the module docstring)."""
    return tls_channel(address, tls, CHANNEL_OPTIONS, interceptors=client_interceptors())

"""Service-level errors that the gRPC error interceptor maps to status codes.

Service cores (`core.py`, which never import grpc) raise these; the one interceptor in
`services.common.grpc_server` turns them into statuses. Engine errors (`engine.errors`) are
mapped there too, so a core raises whichever of the two describes the failure.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base class of the errors below; the message becomes the gRPC status details."""


class Unavailable(ServiceError):
    """Transient: the service or a dependency cannot serve now; retry (UNAVAILABLE)."""


class FailedPrecondition(ServiceError):
    """Not in the state the call needs, e.g. a stale incarnation (FAILED_PRECONDITION)."""


# Trailers of a RESOURCE_EXHAUSTED status: when to retry, in milliseconds; the room left.
RETRY_AFTER_MS_KEY = "retry-after-ms"
ROOM_TOKENS_KEY = "room-tokens"


class ResourceExhausted(ServiceError):
    """Out of capacity (queue full, no KV blocks); retry later or elsewhere (RESOURCE_EXHAUSTED).

    ``retry_after_ms``, when known, travels as the ``retry-after-ms`` trailer of the status;
    ``room_tokens``, when known, as ``room-tokens``: the largest request (prompt plus every
    token its choices may generate) the refuser could still have admitted at that priority
    (`services.common.admission.RefusalMemory` uses it to refuse larger ones without a call)."""

    def __init__(
        self, message: str, retry_after_ms: int | None = None, room_tokens: int | None = None
    ) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms
        self.room_tokens = room_tokens


class KVTransferFailed(ServiceError):
    """A decode worker could not obtain a request's prefilled KV from its prefill worker
    (ABORTED): the router may prefill again on another worker and retry the decode."""


class DeadlineExceeded(ServiceError):
    """The work did not finish before its deadline (DEADLINE_EXCEEDED)."""


class PermissionDenied(ServiceError):
    """The caller is known but may not do this (PERMISSION_DENIED)."""


class Unauthenticated(ServiceError):
    """The caller's credentials are missing or invalid (UNAUTHENTICATED)."""

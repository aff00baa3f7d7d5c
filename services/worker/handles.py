"""The one builder of KV handles: where a request's KV is held on this worker, for a peer to
pull (a prefill's prompt, or a draining decode worker's moved request)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.core.messages import EngineInfo
from services.common.codec import KVHandle


def kv_handle(
    info: EngineInfo,
    worker_id: str,
    incarnation: str,
    address: str,
    block_ids: Sequence[int],
    num_tokens: int,
    lease_seconds: float,
    checksums: Sequence[int] = (),
    checksum_algorithm: str = "",
) -> KVHandle:
    """A handle on ``block_ids`` (holding ``num_tokens`` tokens' KV) of the engine ``info``
    describes, good for ``lease_seconds`` from now; ``checksums``: the sender's per block."""
    return KVHandle(
        worker_id=worker_id,
        incarnation=incarnation,
        address=address,
        block_ids=tuple(block_ids),
        num_tokens=num_tokens,
        block_size=info.block_size,
        block_bytes=info.layout.block_bytes,  # canonical: every KV head
        dtype=info.dtype,
        lease_expires_unix_ms=int((time.time() + lease_seconds) * 1000),
        block_checksums=tuple(checksums),
        checksum_algorithm=checksum_algorithm if checksums else "",
    )

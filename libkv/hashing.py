"""The prefix hash chain: one function, shared by every process that names KV blocks.

    h_0 = ROOT_HASH
    h_i = sha256(h_{i-1} || u32le(len(tokens)) || i64le(t_0) ... i64le(t_{n-1})
                 || u32le(len(extra)) || extra)[:16]

* sha256 from the standard library: fixed, seedless, identical in routers, prefill and decode
  workers on any machine (Python's ``hash`` is salted per process and must never be used).
* ``ROOT_HASH = sha256(b"tandem/kv/v1")[:16]``: changing the scheme means changing this seed.
* ``extra`` is the canonical encoding of the extra keys (tenant salt, adapter id, ...): blocks
  of different tenants hash differently, so tenants never share cache entries.
* 128-bit digests make accidental collisions negligible; the block pool still compares the
  stored tokens on every hit, so even a collision is never served.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
HASH_BYTES = 16
ROOT_HASH: BlockHash = hashlib.sha256(b"tandem/kv/v1").digest()[:HASH_BYTES]


def encode_extra_keys(tenant: str | None = None, adapter: str | None = None) -> bytes:
    """Canonical bytes of the extra keys mixed into every block hash of a request."""
    if not tenant and not adapter:
        return b""
    if "\x00" in (tenant or "") or "\x00" in (adapter or ""):
        raise ValueError("tenant and adapter names must not contain NUL characters")
    parts = [f"tenant={tenant or ''}", f"adapter={adapter or ''}"]
    return "\x00".join(parts).encode("utf-8")


def hash_block(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash of one full block given its parent's hash, its token ids and the extra keys."""
    h = hashlib.sha256(parent)
    h.update(struct.pack("<I", len(tokens)))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    return h.digest()[:HASH_BYTES]


def hash_prefix_blocks(
    tokens: Sequence[int], block_size: int, extra: bytes = b"", parent: BlockHash = ROOT_HASH
) -> list[BlockHash]:
    """Hashes of every *full* block of ``tokens`` (a trailing partial block gets none)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size], extra)
        hashes.append(parent)
    return hashes

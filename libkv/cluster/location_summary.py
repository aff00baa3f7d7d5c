"""Block locations as per-worker summaries: the etcd keys and their binary values.

A worker incarnation owns ``1 + RING`` keys, all under its member lease::

    /tandem/v1/locations/<worker_id>/<incarnation>/snapshot      the full set, at (epoch, seq)
    /tandem/v1/locations/<worker_id>/<incarnation>/delta/<slot>  changes since seq - 1

Each write of the publisher (``libkv.cluster.summary_publisher``) is one put of one of these keys: a
delta with sequence number ``seq`` goes to slot ``seq % RING``; a snapshot is written again
before the ring would wrap (and whenever it is cheaper than the deltas since the last one), so
the snapshot plus the deltas the ring holds after it always rebuild the current set. A router
reads them all at one revision and watches from the next (``libkv.cluster.summary_index``).

``epoch`` counts the leases the worker registered under: a new lease means the keys of the old
one are gone, and the worker starts over with a snapshot at ``seq`` 0 of a new epoch.

Entries are the first 8 bytes (little-endian u64) of prefix hashes of the shared chain
(``libkv.hashing``): a chain hash names its whole prefix. A false match of two 64-bit keys
costs at most a routing choice (the worker compares tokens before serving a hit).

Entries sit only at chain positions that are multiples of the worker's ``base`` granularity
(in blocks; 4 by default): a router probes only those positions of a prompt's chain.

Value: ``<BBIIHHII`` header (version, kind, epoch, seq, granularity, base, adds, removes), then
the added keys and the removed keys as u64 little-endian (a snapshot only adds).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from libkv.hashing import HASH_BYTES, BlockHash

LOCATIONS_PREFIX = "/tandem/v1/locations/"
RING = 8  # delta slots per worker incarnation
SNAPSHOT, DELTA = 0, 1
VERSION = 1
_HEADER = struct.Struct("<BBIIHHII")
_SNAPSHOT_NAME = "snapshot"
_DELTA_NAME = "delta"


def entry_key(block_hash: BlockHash) -> int:
    """The 64-bit entry of a prefix hash (its first 8 bytes, little-endian)."""
    return int.from_bytes(block_hash[:8], "little")


def chain_entries(hashes: Sequence[BlockHash]) -> array[int]:
    """`entry_key` of every hash of a chain, at once (a lookup's hot path)."""
    joined = b"".join(hashes)
    if len(joined) != HASH_BYTES * len(hashes):
        raise ValueError("chain hashes must be HASH_BYTES long")
    both = array("Q", joined)  # two u64 per hash: the entry is the first
    if sys.byteorder != "little":
        both.byteswap()
    return both[::2]


def holder_prefix(worker_id: str, incarnation: str = "") -> bytes:
    """Prefix of a worker's keys (of one incarnation when given)."""
    tail = f"{incarnation}/" if incarnation else ""
    return f"{LOCATIONS_PREFIX}{worker_id}/{tail}".encode()


def snapshot_key(worker_id: str, incarnation: str) -> bytes:
    return holder_prefix(worker_id, incarnation) + _SNAPSHOT_NAME.encode()


def delta_key(worker_id: str, incarnation: str, seq: int) -> bytes:
    return holder_prefix(worker_id, incarnation) + f"{_DELTA_NAME}/{seq % RING}".encode()


class SummaryKey(NamedTuple):
    """A parsed summary key: whose, and whether it is the snapshot (slot None) or a delta."""

    worker_id: str
    incarnation: str
    slot: int | None


def parse_summary_key(key: bytes) -> SummaryKey | None:
    """`SummaryKey` of a key under ``LOCATIONS_PREFIX``, or None when it is not one."""
    try:
        parts = key.decode().removeprefix(LOCATIONS_PREFIX).split("/")
    except UnicodeDecodeError:
        return None
    if len(parts) == 3 and parts[2] == _SNAPSHOT_NAME and parts[0] and parts[1]:
        return SummaryKey(parts[0], parts[1], None)
    if (
        len(parts) == 4
        and parts[2] == _DELTA_NAME
        and parts[0]
        and parts[1]
        and (parts[3].isdigit() and int(parts[3]) < RING)
    ):
        return SummaryKey(parts[0], parts[1], int(parts[3]))
    return None


@dataclass(frozen=True, slots=True)
class Summary:
    """One snapshot or delta of a worker's published entries."""

    kind: int  # SNAPSHOT or DELTA
    epoch: int
    seq: int
    granularity: int  # blocks between the fixed chain positions published (leaves aside)
    base: int  # every entry's position (depth in blocks) is a multiple of it
    added: tuple[int, ...] | list[int]
    removed: tuple[int, ...] | list[int] = ()

    def encode(self) -> bytes:
        header = _HEADER.pack(VERSION, self.kind, self.epoch, self.seq, self.granularity,
                              self.base, len(self.added), len(self.removed))  # fmt: skip
        return header + _u64(self.added).tobytes() + _u64(self.removed).tobytes()

    @classmethod
    def decode(cls, data: bytes) -> Summary | None:
        """The summary in ``data``, or None when it is not a well-formed one of this version."""
        if len(data) < _HEADER.size:
            return None
        version, kind, epoch, seq, gran, base, n_add, n_del = _HEADER.unpack_from(data)
        if version != VERSION or kind not in (SNAPSHOT, DELTA) or base < 1:
            return None
        if len(data) != _HEADER.size + 8 * (n_add + n_del):
            return None
        keys = array("Q")
        keys.frombytes(memoryview(data)[_HEADER.size :])
        if sys.byteorder != "little":
            keys.byteswap()
        values = keys.tolist()
        return cls(kind, epoch, seq, gran, base, values[:n_add], values[n_add:])


def encoded_size(entries: int) -> int:
    """Bytes of a summary value carrying ``entries`` keys."""
    return _HEADER.size + 8 * entries


def _u64(values: tuple[int, ...] | list[int]) -> array[int]:
    out = array("Q", values)
    if sys.byteorder != "little":
        out.byteswap()
    return out

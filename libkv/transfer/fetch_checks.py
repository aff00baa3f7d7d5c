"""What a checked CUDA IPC fetch leaves for `verify` (`libkv.transfer.CopySums`), kept apart
from the device work so it is tested on any machine: which of the sender's sums belong to the
fetched blocks, and per request the mismatch count the compare behind the copy found (or the
copy's sums, still to be compared when the handle carried none).

A `KVHandle` carries one sum per entry of ``block_ids`` (``block_checksums``, in that order).
A fetch moves a subset of those blocks (the decode worker skips the ones its prefix cache
holds: ``block_ids[skip:]``, with ``block_checksums[skip:]`` as the sums it expects). The
fetched blocks' sums are looked up by block id, which gives the decode worker's suffix for its
suffix and the right sums for any other subset, in any order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# engine.kv_checksum.WSUM64 (libkv imports no engine; a test holds the two equal): what a GPU
# pool sends, and what a GPU sender that names no function computed (`legacy_algorithm`).
WSUM64 = "wsum64"
MASK = (1 << 64) - 1
MAX_KEPT = 4096  # fetches whose result waits for `verify` (a fetch never verified ages out)


def sender_sums(source: object, src_blocks: Sequence[int]) -> tuple[int, ...] | None:
    """The sender's ``wsum64`` of each of ``src_blocks``, in their order, as unsigned ints,
    from ``source``'s ``block_checksums`` matched by block id; None when the handle carries
    none, names another function, has not one sum per block, gives one block two sums, or
    does not name a fetched block (the fetch then takes its sums for `verify` to compare)."""
    sums = tuple(getattr(source, "block_checksums", ()) or ())
    algorithm = getattr(source, "checksum_algorithm", "") or WSUM64  # only GPU pools meet here
    ids = tuple(getattr(source, "block_ids", ()))
    if not sums or algorithm != WSUM64 or len(sums) != len(ids):
        return None
    # The decode worker's fetch: a suffix of the handle's blocks, each named once, every sum
    # already a uint64 (as the proto carries them). Compared in C, no per-block Python work.
    k = len(ids) - len(src_blocks)
    if (
        k >= 0
        and ids[k:] == tuple(src_blocks)
        and len(set(ids)) == len(ids)
        and min(sums) >= 0
        and max(sums) <= MASK
    ):
        return sums[k:]
    by_id: dict[int, int] = {}
    for block, s in zip(ids, sums, strict=True):
        if by_id.setdefault(block, int(s) & MASK) != int(s) & MASK:
            return None
    try:
        return tuple(by_id[b] for b in src_blocks)
    except KeyError:
        return None


def signed64(values: Sequence[int]) -> list[int]:
    """Unsigned 64-bit sums as the int64 values with the same bits (what a tensor holds)."""
    return [v - (1 << 64) if v >> 63 else v for v in (int(x) & MASK for x in values)]


@dataclass(slots=True)
class Kept:
    """One request's last checked fetch: the copy's sums (on the device), how many blocks
    moved, and where the fetch compared them with the sender's, those sums and the count."""

    sums: Any  # torch.Tensor on the device; only ever compared, never read back
    blocks: int
    compared: tuple[int, ...] | None = None  # unsigned, in the fetch's order
    count: int | None = None  # blocks whose sum differed from ``compared``


class FetchChecks:
    """Per request, the `Kept` of its last checked fetch, until `take` (one answer each)."""

    def __init__(self, limit: int = MAX_KEPT) -> None:
        self.limit = limit
        self._kept: dict[str, Kept] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def drop(self, request_id: str) -> None:
        self._kept.pop(request_id, None)

    def keep(self, request_id: str, kept: Kept) -> None:
        self._kept.pop(request_id, None)  # a new fetch of the request: the newest, last out
        self._kept[request_id] = kept
        while len(self._kept) > self.limit:
            self._kept.pop(next(iter(self._kept)))

    def take(self, request_id: str, expected: Sequence[int]) -> int | Kept | None:
        """What `verify` answers for ``expected`` (the sender's sums in the fetch's order):
        the fetch's count where it compared the same sums; the `Kept` where the sums must be
        compared now (the fetch had none, or other ones); None where there is nothing to check
        here (no sums taken, or none expected). Raises ValueError when ``expected`` is not one
        sum per moved block. Always forgets the request."""
        kept = self._kept.pop(request_id, None)
        if kept is None or not expected:
            return None
        if len(expected) != kept.blocks:
            raise ValueError(f"{len(expected)} expected sums for {kept.blocks} moved blocks")
        if kept.count is not None and kept.compared is not None:
            want = tuple(expected)  # the handle's own sums, as a rule: equal as they are
            if want == kept.compared or tuple(int(e) & MASK for e in want) == kept.compared:
                return kept.count
        return kept

"""The pool's fresh (free, unhashed) blocks as maximal runs of consecutive block ids, so a
request's blocks can be handed out contiguously: a KV hand-off moves each run of blocks that
is consecutive on both sides as one copy / one descriptor (`libkv.transfer.block_runs`), and a
scattered table moves one block (2 MiB at the 8B shape) at a time.

Structure (all O(1) per change, no dependency)::

    starts:  run start -> run length        ends: run last id -> run start
    classes: [k] -> runs whose length is in [2**k, 2**(k+1)), insertion ordered

``add`` coalesces a freed id with the runs on either side. ``take(n, after)`` first extends
the run ending at ``after`` (a sequence growing into the ids right behind its last block),
then takes the front of the smallest size class whose every run holds what is left (a good
fit: big runs stay big for big requests), and only when no run is long enough, the front of a
run from the largest non-empty class, repeatedly. Each step costs O(number of classes) =
O(log num_blocks) and ends a run or the request, so a block costs O(log num_blocks) at most.
"""

from __future__ import annotations

from collections.abc import Iterator

# How many runs of the class just below the good fit are looked at for one long enough.
FIT_SCAN = 8


class FreeExtents:
    """Free block ids kept as maximal runs (no two runs adjacent: freed ids coalesce)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.size = 0
        self._starts: dict[int, int] = {}
        self._ends: dict[int, int] = {}
        self._classes: list[dict[int, None]] = [{} for _ in range(max(num_blocks, 1).bit_length())]

    # -- runs ---------------------------------------------------------------------------------
    def _insert(self, start: int, length: int) -> None:
        self._starts[start] = length
        self._ends[start + length - 1] = start
        self._classes[length.bit_length() - 1][start] = None

    def _delete(self, start: int) -> int:
        length = self._starts.pop(start)
        del self._ends[start + length - 1]
        del self._classes[length.bit_length() - 1][start]
        return length

    def add(self, block_id: int) -> None:
        """Return one id (not free now: the pool's block states guard that) to the free runs,
        merged with its neighbours."""
        start, length = block_id, 1
        left = self._ends.get(block_id - 1)
        if left is not None:
            start, length = left, self._delete(left) + 1
        if block_id + 1 in self._starts:
            length += self._delete(block_id + 1)
        self._insert(start, length)
        self.size += 1

    def _cut(self, start: int, n: int) -> list[int]:
        """Take the first ``min(n, length)`` ids of the run at ``start``."""
        length = self._delete(start)
        k = min(n, length)
        if k < length:
            self._insert(start + k, length - k)
        self.size -= k
        return list(range(start, start + k))

    def _pick(self, n: int) -> int:
        """The start of the run to take the next ids of ``n`` from (see the module doc)."""
        fit = (n - 1).bit_length()  # every run of class >= fit holds n
        for c in range(fit, len(self._classes)):
            if self._classes[c]:
                return next(iter(self._classes[c]))
        if fit > 0:
            for i, start in enumerate(self._classes[fit - 1]):
                if self._starts[start] >= n:
                    return start
                if i + 1 >= FIT_SCAN:
                    break
        for c in range(min(fit, len(self._classes)) - 1, -1, -1):  # none holds n: the longest
            if self._classes[c]:
                return next(iter(self._classes[c]))
        raise ValueError("no free blocks")

    def take(self, n: int, after: int | None = None) -> list[int]:
        """``n`` free ids (callers check ``size``): those right behind ``after`` first, in
        order, then as few runs as the good fit finds, each in ascending order."""
        if n > self.size:
            raise ValueError(f"asked for {n} ids, {self.size} free")
        out: list[int] = []
        if after is not None and after + 1 in self._starts:
            out += self._cut(after + 1, n)
        while len(out) < n:
            out += self._cut(self._pick(n - len(out)), n - len(out))
        return out

    # -- queries ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        for start in sorted(self._starts):
            yield from range(start, start + self._starts[start])

    def runs(self) -> list[tuple[int, int]]:
        """(start, length) of every free run, ascending."""
        return sorted(self._starts.items())

    def check(self) -> list[str]:
        """What is wrong with the bookkeeping ([] when nothing): sizes, classes, coalescing."""
        bad: list[str] = []
        runs = self.runs()
        if sum(n for _, n in runs) != self.size:
            bad.append("free run lengths do not add up to the free count")
        for (s0, n0), (s1, _) in zip(runs, runs[1:], strict=False):
            if s0 + n0 >= s1:
                bad.append(f"free runs at {s0} and {s1} overlap or touch")
        for s, n in runs:
            if self._ends.get(s + n - 1) != s or s not in self._classes[n.bit_length() - 1]:
                bad.append(f"free run at {s} is indexed wrongly")
            if s < 0 or s + n > self.num_blocks:
                bad.append(f"free run at {s} leaves the pool")
        if sum(len(c) for c in self._classes) != len(runs) or len(self._ends) != len(runs):
            bad.append("stale free-run index entries")
        return bad

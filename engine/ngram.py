"""N-gram (prompt-lookup) drafts for speculative decoding (numpy, no torch).

The draft of a sequence is what followed the latest earlier occurrence of its last ``n`` tokens
in its own history (prompt and output), trying ``n`` from ``max_n`` down to ``min_n``::

    history:  ... a b c X Y Z ... a b c        last 3 tokens "a b c" occurred before,
                        ^^^^^ draft              followed by "X Y Z": propose those

Each sequence's history is kept as a growing numpy buffer (only new tokens are appended per
step), so a proposal costs ``n`` vectorised comparisons over the history and no Python loop
over tokens. A buffer lives as long as its sequence (weak keys).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from engine.config import SpeculativeConfig
from engine.sequence import Sequence


class _History:
    """A sequence's tokens in an amortised-growth int64 buffer."""

    __slots__ = ("buf", "size")

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int64)
        self.size = 0

    def sync(self, seq: Sequence) -> np.ndarray:
        """The sequence's tokens, appending what was added since the last call."""
        n_prompt = len(seq.prompt_token_ids)
        total = n_prompt + len(seq.output_token_ids)
        if total > self.buf.shape[0]:
            grown = np.empty(max(total, 2 * self.buf.shape[0]), dtype=np.int64)
            grown[: self.size] = self.buf[: self.size]
            self.buf = grown
        if self.size < n_prompt:
            self.buf[self.size : n_prompt] = seq.prompt_token_ids[self.size :]
            self.size = n_prompt
        if self.size < total:
            self.buf[self.size : total] = seq.output_token_ids[self.size - n_prompt :]
            self.size = total
        return self.buf[:total]


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` of length in ``[min_n, max_n]``; [] when no such suffix occurred before."""
    size = tokens.shape[0]
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # Candidate starts s in [0, size - n - 1]: the match ends before the suffix begins to
        # be itself, and at least one token follows it.
        span = size - n
        hit = tokens[:span] == tokens[size - n]
        for j in range(1, n):
            hit &= tokens[j : span + j] == tokens[size - n + j]
        starts = np.flatnonzero(hit)
        if starts.size:
            after = int(starts[-1]) + n
            return tokens[after : after + k].tolist()
    return []


class Proposer(Protocol):
    """What the engine asks of a speculative method (n-gram here, ``engine.draft_model``)."""

    def propose_all(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Per decoding sequence, at most ``min(k, limit)`` draft tokens (possibly none)."""
        ...

    def retain(self, running: Iterable[Sequence]) -> None:
        """Forget the state of sequences no longer running."""
        ...


class NgramProposer:
    """Proposes drafts per sequence from its own history."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        if num_tokens < 1 or min_n < 1 or max_n < min_n:
            raise ValueError(f"bad n-gram proposer k={num_tokens} n in [{min_n}, {max_n}]")
        self.k, self.min_n, self.max_n = num_tokens, min_n, max_n
        self._histories: weakref.WeakKeyDictionary[Sequence, _History] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, spec: SpeculativeConfig) -> NgramProposer:
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        return cls(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """At most ``min(k, limit)`` draft tokens for ``seq`` (possibly none)."""
        k = min(self.k, limit)
        if k <= 0:
            return []
        hist = self._histories.get(seq)
        if hist is None:
            hist = self._histories[seq] = _History()
        return lookup(hist.sync(seq), self.min_n, self.max_n, k)

    def propose_all(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [self.propose(s, n) for s, n in zip(seqs, limits, strict=True)]

    def retain(self, running: Iterable[Sequence]) -> None:
        """Nothing to do: histories go with their sequences (weak keys)."""

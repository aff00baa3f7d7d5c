"""A request trace for the block-location simulator: shared system prompts and multi-turn chat.

Requests are hash chains of 16-token blocks. Each distinct prefix gets a random 128-bit id,
which is what the sha256 chain of ``libkv.hashing`` gives too (one hash per prefix), without
hashing millions of blocks in the simulator. A conversation picks one of ``system_prompts``
system prompts (Zipf popularity) and then takes turns; each turn's prompt is the previous one
plus the assistant's answer and a new user message. Conversations are picked at random among
``active`` open ones, so a conversation's next turn comes after about ``active`` other requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

BlockHash = bytes


@dataclass(frozen=True, slots=True)
class TraceConfig:
    system_prompts: int = 64
    system_blocks: tuple[int, int] = (32, 128)  # 512 to 2,048 tokens
    zipf: float = 1.0
    turns: tuple[int, int] = (1, 8)
    user_blocks: tuple[int, int] = (4, 32)  # new user message, 64 to 512 tokens
    answer_blocks: tuple[int, int] = (4, 16)  # the previous answer, prefilled with the next turn
    active: int = 1000  # open conversations
    seed: int = 0


@dataclass(slots=True)
class _Conversation:
    chain: list[BlockHash]
    turns_left: int
    started: bool = False


@dataclass(slots=True)
class Trace:
    """Draws requests (hash chains) one at a time; see the module docstring."""

    config: TraceConfig
    rng: random.Random = field(init=False)
    _systems: list[list[BlockHash]] = field(init=False)
    _weights: list[float] = field(init=False)
    _open: list[_Conversation] = field(init=False)

    def __post_init__(self) -> None:
        c = self.config
        self.rng = random.Random(c.seed)
        self._systems = [self._blocks(self.rng.randint(*c.system_blocks))
                         for _ in range(c.system_prompts)]  # fmt: skip
        self._weights = [1 / (k + 1) ** c.zipf for k in range(c.system_prompts)]
        self._open = [self._new() for _ in range(c.active)]

    def _blocks(self, n: int) -> list[BlockHash]:
        return [self.rng.randbytes(16) for _ in range(n)]

    def _new(self) -> _Conversation:
        system = self.rng.choices(self._systems, self._weights)[0]
        return _Conversation(list(system), self.rng.randint(*self.config.turns))

    def next(self) -> list[BlockHash]:
        """The next request's chain (the caller must not change it)."""
        c, k = self.config, self.rng.randrange(len(self._open))
        conv = self._open[k]
        if conv.started:
            conv.chain = conv.chain + self._blocks(self.rng.randint(*c.answer_blocks))
        conv.started = True
        conv.chain = conv.chain + self._blocks(self.rng.randint(*c.user_blocks))
        conv.turns_left -= 1
        chain = conv.chain
        if conv.turns_left <= 0:
            self._open[k] = self._new()
        return chain

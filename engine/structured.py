"""Grammar matchers and token bitmasks of the engine's constrained rows (llguidance).

One ``LLMatcher`` per constrained sequence follows its output: it consumes each sampled token
and, before the next one, fills a bitmask of the tokens that keep the output valid (one bit per
token, 32 tokens per int32 word). Filling runs on a helper thread while the forward pass runs
(llguidance releases the GIL; ``LLExecutor`` spreads the matchers of a batch over its own
threads), so a step waits for it only when it takes longer than the forward pass::

    main thread:   schedule | forward pass .................. | wait | sample | consume
    helper thread:          | fill masks ....|

Matchers hold no KV and no positions: prefix-cache hits, chunked prefill and preemption by
recomputation leave them alone (a preempted sequence keeps its output tokens, and its matcher
has consumed exactly those). A decode worker taking a request over from a prefill worker builds
a fresh matcher and replays the tokens produced so far.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine.grammar import GrammarSpec, InvalidGrammarError, llguidance_grammar


@dataclass(slots=True)
class MaskStats:
    """Time spent on bitmasks: filling them (helper thread) and waiting for them (the step)."""

    fills: int = 0
    fill_seconds: float = 0.0
    wait_seconds: float = 0.0


class GrammarRuntime:
    """Compiles grammars into matchers over one tokenizer and fills their bitmasks.

    The llguidance tokenizer (a scan of the vocabulary, ~0.2 s) is built on first use, so
    engines that never see a grammar never pay for it.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltok: Any = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None
        self.stats = MaskStats()

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._lltok is None:
                import llguidance

                self._lltok = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos
                )
                self._executor = llguidance.LLExecutor()
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
            return self._lltok

    def matcher(self, spec: GrammarSpec, replay: Sequence[int] = ()) -> Any:
        """A matcher for ``spec`` that has consumed ``replay`` (tokens already generated).

        Raises InvalidGrammarError for a grammar that does not compile or a replay it rejects.
        """
        import llguidance

        m = llguidance.LLMatcher(self._tokenizer(), llguidance_grammar(spec), log_level=0)
        if m.is_error():
            raise InvalidGrammarError(
                f"unsupported or invalid {spec.kind} grammar: {m.get_error()}"
            )
        if replay and not m.consume_tokens(list(replay)):
            raise InvalidGrammarError(
                f"the tokens so far do not match the grammar: {m.get_error()}"
            )
        return m

    def start_fill(self, matchers: Sequence[Any]) -> MaskJob | None:
        """Start filling one bitmask row per entry of ``matchers`` (None: unconstrained row, all
        bits set). Returns None when no row is constrained."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        self._tokenizer()
        assert self._pool is not None
        mask = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        return MaskJob(mask, self._pool.submit(self._fill, rows, mask), self.stats)

    def _fill(self, rows: list[tuple[Any, int]], mask: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self._executor.unsafe_compute_mask_ptr(rows, mask.data_ptr(), mask.shape[1] * 4, len(mask))
        self.stats.fills += 1
        self.stats.fill_seconds += time.perf_counter() - t0


class MaskJob:
    """A bitmask being filled on the helper thread."""

    def __init__(self, mask: torch.Tensor, future: Future, stats: MaskStats) -> None:
        self._mask = mask
        self._future = future
        self._stats = stats

    def result(self, device: torch.device) -> torch.Tensor:
        """The filled ``[rows, words]`` int32 bitmask on ``device`` (waits for the fill)."""
        t0 = time.perf_counter()
        self._future.result()
        self._stats.wait_seconds += time.perf_counter() - t0
        return self._mask.to(device, non_blocking=True)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[i, t] = -inf`` wherever bit ``t`` of row ``i`` of ``bitmask`` is 0.

    ``bitmask`` is ``[rows, words]`` int32 (bit ``t % 32`` of word ``t // 32``); tokens past the
    mask's width are masked too. Works on any device without compilation.
    """
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab].to(torch.bool)
    if allowed.shape[1] < vocab:
        logits[:, allowed.shape[1] :] = -float("inf")
        logits = logits[:, : allowed.shape[1]]
    logits.masked_fill_(~allowed, -float("inf"))

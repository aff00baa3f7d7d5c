"""The steps an engine's warm-up runs (``engine.warmup``): pure bookkeeping, no torch.

A step is a tuple of `WarmupSeq` (new tokens, length with them, whether it samples), as the
scheduler makes them. What a step's kernels are specialised on, and so which steps cover which
compiled variants:

- attention: its variant (``kernels.attention_variant``: the decode plan of a batch of
  single-token queries, which depends on the batch size; else the prefill plan, which depends
  on the longest query), over batch sizes 1 .. `WarmupLimits.max_decode_seqs` and longest
  queries 2 .. `WarmupLimits.max_chunk`: the smallest and the largest size of each variant;
- the skinny products (``kernels.linear`` up to `WarmupLimits.skinny_rows` rows, i.e.
  the model's ``KernelChoices.skinny_rows``: one compiled variant per power-of-two row
  bucket, and the LM head
  by the number of sampled rows): every token count and sampled-row count up to there;
- everything else (RMSNorm, SiLU, RoPE and the KV write, LoRA, more rows than that):
  only grid sizes change with the step, so any step compiles it;
- chunked prefill over a cached prefix, a chunk that samples nothing, and mixed steps (a
  prompt chunk with decodes), as the scheduler makes them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WarmupSeq:
    """One sequence of a warm-up step: ``num_new`` tokens computed, ``seq_len`` tokens of KV
    with them (a cached prefix before them when larger); ``samples``: its last row's logits
    are taken."""

    num_new: int
    seq_len: int
    samples: bool = True


WarmupStep = tuple[WarmupSeq, ...]


@dataclass(frozen=True, slots=True)
class WarmupLimits:
    """What bounds the steps of one model runner."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    skinny_rows: int  # token counts (and sampled rows) up to here take the skinny products

    @property
    def max_context(self) -> int:
        """Longest sequence a step may hold: the context limit, and what the pool holds."""
        return max(1, min(self.max_model_len, self.num_blocks * self.block_size))

    @property
    def max_decode_seqs(self) -> int:
        """Most sequences of a step of single-token queries."""
        return max(1, min(self.max_num_seqs, self.max_num_batched_tokens))

    @property
    def max_chunk(self) -> int:
        """Longest prompt chunk: the token budget, and a prompt leaves room for one token."""
        return max(1, min(self.max_num_batched_tokens, self.max_context - 1))


def representatives(values: Iterable[int], key: Callable[[int], Hashable]) -> list[int]:
    """The smallest and the largest value of each group of ``values`` with equal ``key``."""
    groups: dict[Hashable, tuple[int, int]] = {}
    for v in values:
        k = key(v)
        lo, hi = groups.get(k, (v, v))
        groups[k] = (min(lo, v), max(hi, v))
    return sorted({v for pair in groups.values() for v in pair})


def spread(n: int, longest: int) -> list[int]:
    """``n`` sequence lengths from 1 to ``longest``, evenly apart."""
    if n == 1:
        return [longest]
    return [1 + (i * (longest - 1)) // (n - 1) for i in range(n)]


def decode_sizes(limits: WarmupLimits, decode_key: Callable[[int], Hashable]) -> list[int]:
    """Batch sizes of the steps of single-token queries: every one up to ``skinny_rows``, and
    the smallest and largest of each attention variant."""
    top = limits.max_decode_seqs
    small = range(1, min(limits.skinny_rows, top) + 1)
    return sorted({*small, *representatives(range(1, top + 1), decode_key)})


def chunk_sizes(limits: WarmupLimits, prefill_key: Callable[[int], Hashable]) -> list[int]:
    """Prompt lengths of the prefill steps: the smallest and largest of each variant, and the
    token counts up to ``skinny_rows`` that no decode batch has (fewer sequences than that)."""
    ends = representatives(range(2, limits.max_chunk + 1), prefill_key)
    few = range(limits.max_decode_seqs + 1, min(limits.skinny_rows, limits.max_chunk) + 1)
    return sorted({*ends, *few})


def warmup_steps(
    limits: WarmupLimits,
    decode_key: Callable[[int], Hashable],
    prefill_key: Callable[[int], Hashable],
) -> list[WarmupStep]:
    """Every step the warm-up runs, decode batches first (see the module's note)."""
    return steps_of(limits, decode_sizes(limits, decode_key), chunk_sizes(limits, prefill_key))


def steps_of(limits: WarmupLimits, decodes: list[int], chunks: list[int]) -> list[WarmupStep]:
    """The warm-up's steps for decode batch sizes ``decodes`` and prompt lengths ``chunks``
    (both sorted): one step each, then a later chunk over a cached prefix and the mixed
    steps. The same sizes give the same steps on every rank (only ``limits`` else)."""
    longest = limits.max_context
    steps: list[WarmupStep] = []
    for b in decodes:
        steps.append(tuple(WarmupSeq(1, n) for n in spread(b, longest)))
    for q in chunks:  # a whole prompt in one step
        steps.append((WarmupSeq(q, q),))
    if chunks:
        q = min(chunks[-1], (longest - 1) // 2)
        if q >= 2:  # a later chunk of a long prompt, over its cached prefix; it samples nothing
            steps.append((WarmupSeq(q, longest - 1, samples=False),))
        steps.extend(_mixed(limits))
    return steps


def _mixed(limits: WarmupLimits) -> list[WarmupStep]:
    """A prompt chunk with one decode, and with as many decodes as the batch and the token
    budget take."""
    out: list[WarmupStep] = []
    budget, longest = limits.max_num_batched_tokens, limits.max_context
    most = min(limits.max_num_seqs - 1, budget - 2)
    for d in sorted({1, most}):
        if d < 1:
            continue
        q = min(budget - d, limits.max_chunk)
        decodes = tuple(WarmupSeq(1, n) for n in spread(d, longest))
        out.append((WarmupSeq(q, q), *decodes))
    return out


@dataclass(frozen=True, slots=True)
class WarmupReport:
    """What a runner's warm-up did: forward passes, wall time, and the new kernel
    specialisations it met (``compiles``), ``cached`` of them loaded from the on-disk cache."""

    passes: int
    seconds: float
    compiles: int
    cached: int

"""Which part of the model a tensor-parallel rank holds (no torch).

Megatron's split: QKV and gate/up are column-parallel (each rank computes its heads and its
slice of the intermediate size), O and down are row-parallel (each rank multiplies its slice of
the input and an all-reduce sums), the embedding and the LM head are vocab-parallel. KV heads
are split in contiguous ranges (``libkv.kv_layout``); each rank's query heads are the GQA groups
of its KV heads, and ranks that replicate one KV head (more ranks than KV heads) split its
group's query heads.

Sizes that do not divide are split as evenly as possible rather than refused: SmolLM2 (9 query
heads, 3 KV heads) at TP=2 gives one rank 1 KV head and 3 query heads, the other 2 and 6.
Nothing is padded, so the math is the unsharded model's and every KV head lives in exactly the
ranges `libkv.kv_layout` computes (a hand-off between TP sizes never meets padding). The price
is balance: a step waits for the rank with the most heads, so an uneven split is logged as a
warning; sizes that divide (vLLM's only choice) are what to deploy.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig
from engine.errors import UnsupportedModelError
from libkv.kv_layout import kv_heads_of_rank, split


@dataclass(frozen=True, slots=True)
class ModelShard:
    """The ranges rank ``rank`` of ``size`` holds; each ``(lo, hi)`` is half-open."""

    rank: int
    size: int
    heads: tuple[int, int]  # query heads
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]  # MLP rows of gate and up, columns of down
    vocab: tuple[int, int]  # embedding and LM-head rows
    vocab_rows: tuple[int, ...]  # every rank's number of vocab rows (for the logits gather)

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def vocab_width(self) -> int:
        """The widest rank's vocab rows: the logits all-gather pads every rank's to it."""
        return max(self.vocab_rows)

    @classmethod
    def of(cls, config: ModelConfig, size: int, rank: int) -> ModelShard:
        check_tp(config, size)
        c = config
        kv = kv_heads_of_rank(c.num_kv_heads, size, rank)
        group = c.num_heads // c.num_kv_heads
        if size <= c.num_kv_heads:
            heads = (kv[0] * group, kv[1] * group)
        else:  # ranks holding the same KV head split its group of query heads
            replicas = [r for r in range(size) if kv_heads_of_rank(c.num_kv_heads, size, r) == kv]
            lo, hi = split(group, len(replicas), replicas.index(rank))
            heads = (kv[0] * group + lo, kv[0] * group + hi)
        widths = [split(c.vocab_size, size, r) for r in range(size)]
        return cls(
            rank=rank,
            size=size,
            heads=heads,
            kv_heads=kv,
            intermediate=split(c.intermediate_size, size, rank),
            vocab=widths[rank],
            vocab_rows=tuple(hi - lo for lo, hi in widths),
        )


# LoRA under tensor parallelism, split as the base layer is: a column-parallel projection's
# rank computes rows of its output, so it keeps those rows of B ("out") and all of A; a
# row-parallel one (O, down) multiplies its columns of the input, so it keeps those columns of A
# ("in") and all of B, and its partial delta joins the layer's partial sum before the all-reduce.
LORA_SPLIT = {
    "q_proj": "out", "k_proj": "out", "v_proj": "out", "gate_proj": "out", "up_proj": "out",
    "o_proj": "in", "down_proj": "in",
}  # fmt: skip


def lora_slice(shard: ModelShard, module: str, head_dim: int) -> tuple[str, int, int]:
    """(``"in"`` or ``"out"``, lo, hi): the part of one projection's LoRA this rank holds,
    columns of A (``in``) or rows of B (``out``), half-open."""
    heads, kv, inter = shard.heads, shard.kv_heads, shard.intermediate
    lo, hi = {
        "q_proj": (heads[0] * head_dim, heads[1] * head_dim),
        "k_proj": (kv[0] * head_dim, kv[1] * head_dim),
        "v_proj": (kv[0] * head_dim, kv[1] * head_dim),
        "o_proj": (heads[0] * head_dim, heads[1] * head_dim),
        "gate_proj": inter,
        "up_proj": inter,
        "down_proj": inter,
    }[module]
    return LORA_SPLIT[module], lo, hi


def check_tp(config: ModelConfig, size: int) -> None:
    """Refuse a TP size the model cannot be split into (every rank needs a query head)."""
    c = config
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, not {size}")
    if c.num_heads % c.num_kv_heads:
        raise UnsupportedModelError(
            f"{c.num_heads} attention heads are not a multiple of {c.num_kv_heads} KV heads"
        )
    group = c.num_heads // c.num_kv_heads
    if size > c.num_kv_heads and group < -(-size // c.num_kv_heads):
        raise UnsupportedModelError(
            f"tensor_parallel_size {size} leaves a rank without a query head: the model has "
            f"{c.num_heads} attention heads in {c.num_kv_heads} KV groups (at most "
            f"{c.num_kv_heads * group} ranks, and a multiple of {c.num_kv_heads} above "
            f"{c.num_kv_heads} spreads the groups evenly)"
        )


def uneven(config: ModelConfig, size: int) -> str | None:
    """A description of what does not divide evenly at this TP size (None when all does)."""
    c = config
    shards = [ModelShard.of(c, size, r) for r in range(size)]
    counts = sorted({s.num_heads for s in shards})
    if len(counts) > 1:
        heads = "+".join(str(s.num_heads) for s in shards)
        return f"{c.num_heads} attention heads over {size} ranks split {heads}"
    if c.intermediate_size % size:
        return f"the MLP's {c.intermediate_size} rows over {size} ranks are uneven"
    return None

"""How large the KV pool of an engine on a CUDA device may be.

``gpu_memory_utilization`` (F) is the share of the device's *total* memory this engine may use,
as in vLLM: several engines on one device each take their own share, so two workers at 0.45
fit one GPU side by side whatever order they start in. Inside its share an engine spends::

    F x total  =  weights  +  activation peak  +  CUDA graphs  +  other CUDA memory  +  KV pool

- weights: what the loaded model holds (measured);
- activation peak: one forward pass of ``max_num_batched_tokens`` tokens plus the logits and
  sampling of ``max_num_seqs`` rows, measured by running it (``profile_peak``);
- CUDA graphs: the decode graphs' shared pool, estimated before capture (the captured logits
  of every batch size, twice with LoRA, plus one decode step's intermediates), and the mixed
  steps' piecewise graphs' (``engine.mixed_graphs``: about one piece's working set at the
  largest bucket), checked after it;
- other CUDA memory: what the device lost to this process outside PyTorch's allocator since
  the engine started (cuBLAS and Triton modules), measured from ``cudaMemGetInfo``. The CUDA
  context itself (about 0.5 GiB) comes on top of F, as in vLLM.

When the rest cannot hold the smallest useful pool (one sequence of ``max_model_len`` tokens),
the engine refuses to start with every number in the message (``InsufficientMemoryError``)
instead of running out of memory under load. Explicit ``num_kv_blocks`` / ``kv_cache_bytes``
are honoured, and refused the same way when they exceed the share.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import kernels
from engine import fp8
from engine.errors import InsufficientMemoryError
from engine.parallel.shard import ModelShard
from libkv.kv_layout import KVLayout

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelConfig
    from engine.model import DecoderModel

log = logging.getLogger(__name__)
GIB = 1024**3


@dataclass(frozen=True, slots=True)
class CudaStart:
    """The device as an engine found it, before loading anything."""

    free: int
    total: int
    reserved: int

    @classmethod
    def now(cls, device: torch.device) -> CudaStart:
        free, total = torch.cuda.mem_get_info(device)
        return cls(int(free), int(total), int(torch.cuda.memory_reserved(device)))


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """What a CUDA engine measured of its device (bytes)."""

    total: int
    free_at_start: int  # free device memory when the engine started (others included)
    weights: int
    activation_peak: int
    graphs: int  # estimated for the CUDA graphs' pool
    other: int  # non-PyTorch memory this process took since the start


@dataclass(frozen=True, slots=True)
class Reserve:
    """Room an engine's share keeps for a draft model loaded after it: the draft's weights, the
    pool of its CUDA graphs (``graph_bytes``) and its KV bytes per block (its pool has as many
    blocks as the target's)."""

    weight_bytes: int = 0
    block_bytes: int = 0
    graph_bytes: int = 0

    @classmethod
    def of(
        cls,
        draft: ModelConfig,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        block_size: int,
        quantize: bool,
        graph_sizes: list[int] | None = None,
        quantize_head: bool = False,
    ) -> Reserve:
        layout = KVLayout(
            num_layers=draft.num_layers,
            num_kv_heads=draft.num_kv_heads,
            head_dim=draft.head_dim,
            block_size=block_size,
            dtype=str(kv_dtype).removeprefix("torch."),
            element_size=kv_dtype.itemsize,
        )
        weights = weight_bytes(
            draft, dtype.itemsize, None, 1 if quantize else None, 1 if quantize_head else None
        )
        # A decode row's intermediates (float32 at most): the residual stream and a few
        # hidden-sized copies, QKV, gate/up; the logits are counted by the estimate.
        row = 4 * (4 * draft.hidden_size + 3 * draft.intermediate_size)
        graphs = graph_pool_estimate(graph_sizes or [], draft.vocab_size, row)
        return cls(weights, layout.block_bytes, graphs)


@dataclass(frozen=True, slots=True)
class KVPlan:
    """The pool size and how it was derived (logged at start, kept for stats)."""

    num_blocks: int
    block_bytes: int
    budget: int  # F x total
    memory: DeviceMemory | None = None  # None on CPU or when the size was given

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def describe(self) -> str:
        m = self.memory
        if m is None:
            return f"KV pool: {self.num_blocks} blocks ({_gib(self.pool_bytes)})"
        return (
            f"KV pool: {self.num_blocks} blocks ({_gib(self.pool_bytes)}) of a "
            f"{_gib(self.budget)} share of {_gib(m.total)} (weights {_gib(m.weights)}, "
            f"activations {_gib(m.activation_peak)}, CUDA graphs {_gib(m.graphs)}, "
            f"other {_gib(m.other)})"
        )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def plan_cuda(
    memory: DeviceMemory,
    utilization: float,
    block_bytes: int,
    block_size: int,
    min_tokens: int,
    num_kv_blocks: int | None = None,
    kv_cache_bytes: int | None = None,
) -> KVPlan:
    """The KV pool for one engine's share of a device; raises InsufficientMemoryError with
    the numbers when the pool would be smaller than ``min_tokens`` or larger than what is left
    (explicit sizes included), or when the share exceeds the memory free at the start."""
    budget = int(utilization * memory.total)
    used = memory.weights + memory.activation_peak + memory.graphs + memory.other
    left = budget - used
    need_blocks = -(-min_tokens // block_size) + 1
    where = (
        f"--gpu-memory-utilization {utilization:g} of {_gib(memory.total)} is {_gib(budget)}; "
        f"weights {_gib(memory.weights)} + activations {_gib(memory.activation_peak)} + CUDA "
        f"graphs {_gib(memory.graphs)} + other {_gib(memory.other)} = {_gib(used)}, leaving "
        f"{_gib(max(left, 0))} for the KV cache"
    )
    if budget > memory.free_at_start:
        raise InsufficientMemoryError(
            f"{where}, but only {_gib(memory.free_at_start)} of the device was free when this "
            "engine started (other processes hold the rest): lower --gpu-memory-utilization"
        )
    if num_kv_blocks is not None:
        blocks = num_kv_blocks
    elif kv_cache_bytes is not None:
        blocks = kv_cache_bytes // block_bytes
    else:
        blocks = max(left, 0) // block_bytes
    if blocks * block_bytes > left:
        raise InsufficientMemoryError(
            f"{where}; the requested pool of {blocks} blocks ({_gib(blocks * block_bytes)}) "
            "does not fit: lower --num-kv-blocks / --kv-cache-bytes or raise "
            "--gpu-memory-utilization"
        )
    if blocks < need_blocks:
        raise InsufficientMemoryError(
            f"{where}: {blocks} blocks of {block_size} tokens ({block_bytes} bytes each), but "
            f"one sequence of {min_tokens} tokens (max_model_len) needs {need_blocks}: raise "
            "--gpu-memory-utilization, lower --max-model-len, or give the worker a device of "
            "its own"
        )
    return KVPlan(blocks, block_bytes, budget, memory)


def weight_bytes(
    config: ModelConfig,
    element_size: int,
    shard: ModelShard | None = None,
    matrix_size: int | None = None,
    head_size: int | None = None,
) -> int:
    """Bytes of a model's weights (of one tensor-parallel ``shard``), from its config alone;
    ``matrix_size``: bytes per element of the layers' matrices where it differs (1 for FP8
    weights, whose row scales are counted); ``head_size``: the same for the LM head (1: an FP8
    head with its row scales, held apart from the embedding even when tied)."""
    c = config
    s = shard or ModelShard.of(c, 1, 0)
    heads, kv_heads = s.num_heads, s.num_kv_heads
    inter, vocab = s.intermediate[1] - s.intermediate[0], s.vocab[1] - s.vocab[0]
    attn = (heads + 2 * kv_heads) * c.head_dim * c.hidden_size
    attn += c.hidden_size * heads * c.head_dim
    mlp = 3 * inter * c.hidden_size
    rows = (heads + 2 * kv_heads) * c.head_dim + 2 * (c.hidden_size + inter)
    msize = element_size if matrix_size is None else matrix_size
    scales = 0 if msize == element_size else c.num_layers * rows * 4
    layers = c.num_layers * ((attn + mlp) * msize + 2 * c.hidden_size * element_size)
    table = vocab * c.hidden_size  # elements of the embedding, and of the LM head
    if head_size is None:  # the head in the model dtype: the embedding itself when tied
        embed, head = table * (1 if c.tie_word_embeddings else 2), 0
    else:  # a quantized head of its own, with a float32 scale per row
        embed, head = table, table * head_size + vocab * 4
    return layers + scales + head + (embed + c.hidden_size) * element_size


def check_weights_fit(start: CudaStart, weights: int, utilization: float) -> None:
    """Refuse before loading when the weights alone exceed the engine's share."""
    budget = int(utilization * start.total)
    if weights >= budget:
        raise InsufficientMemoryError(
            f"--gpu-memory-utilization {utilization:g} of {_gib(start.total)} is "
            f"{_gib(budget)}, less than the model's weights alone ({_gib(weights)}): raise "
            "--gpu-memory-utilization, or give the worker a device of its own"
        )


def plan_fixed(
    block_bytes: int, num_kv_blocks: int | None, kv_cache_bytes: int | None, default_bytes: int
) -> KVPlan:
    """The pool off CUDA: ``num_kv_blocks``, else ``kv_cache_bytes``, else ``default_bytes``."""
    if num_kv_blocks is not None:
        blocks = num_kv_blocks
    else:
        blocks = max((kv_cache_bytes or default_bytes) // block_bytes, 1)
    return KVPlan(blocks, block_bytes, blocks * block_bytes)


_SMALL_BLOCK = 1 << 20  # the caching allocator serves requests up to this from 2 MiB segments
_MID_BLOCK = 10 << 20  # and those up to this from 20 MiB ones; larger ones round to 2 MiB


def _pinned_bytes(size: int) -> int:
    """The most device memory one tensor that a captured graph keeps alive (its logits) can
    hold on to: the caching allocator's segment it is cut from, which cannot be given back
    while the tensor lives, even where the rest of it went to intermediates."""
    if size <= _SMALL_BLOCK:
        return 2 << 20
    if size <= _MID_BLOCK:
        return 20 << 20
    return -(-size // (2 << 20)) * (2 << 20)


def graph_pool_estimate(
    graph_sizes: list[int], vocab_size: int, step_peak_per_token: float, variants: int = 1
) -> int:
    """Bytes the decode graphs' shared pool will hold: each capture keeps its float32 logits
    (``[n, vocab]``; ``variants`` captures per size: 2 with LoRA, base and adapters), each
    counted with the allocator segment it may pin (``_pinned_bytes``: the small sizes' logits
    sit in segments that the captures' intermediates share, and stay there; counting their
    bytes alone set aside 0.19 GiB where an 8B model's LoRA graphs of 1 to 32 rows took 0.23
    GiB on an H100), and the pool also holds one step's intermediates at the largest size."""
    if not graph_sizes:
        return 0
    logits = variants * sum(_pinned_bytes(n * vocab_size * 4) for n in graph_sizes)
    return int(logits + step_peak_per_token * max(graph_sizes)) + 128 * 1024**2


def mixed_pool_estimate(sizes: list[int], step_peak_per_token: float) -> int:
    """Bytes the mixed steps' graphs' pool will hold (``engine.mixed_graphs``): no output
    stays owned, so about one step's working set at the largest bucket (the measured peak per
    token, which counts the logits too), doubled for what the allocator's segments strand."""
    if not sizes:
        return 0
    return int(2 * step_peak_per_token * max(sizes)) + 64 * 1024**2


def plan_for_cuda(
    start: CudaStart,
    model: DecoderModel,
    config: EngineConfig,
    block_bytes: int,
    max_len: int,
    graph_sizes: list[int],
    later_weights: int = 0,
    mixed_sizes: list[int] | None = None,
) -> KVPlan:
    """Measure the loaded weights, the activation peak and other CUDA memory of this process,
    then size the pool to the engine's share of the device. ``later_weights``: weights loaded
    after this plan that the share must hold too (a draft model's); ``mixed_sizes``: the
    buckets of the mixed steps' graphs."""
    device = torch.device("cuda", torch.cuda.current_device())
    weights = torch.cuda.memory_allocated(device) + later_weights
    tokens = config.max_num_batched_tokens
    kv_dtype = fp8.kv_dtype(config.kv_cache_dtype, model.w.embed.dtype, device)
    peak = profile_activations(
        model, config.block_size, tokens, max_len, config.max_num_seqs, device, kv_dtype
    )
    free_now, total = torch.cuda.mem_get_info(device)
    torch_grew = torch.cuda.memory_reserved(device) - start.reserved
    measured = DeviceMemory(
        total=int(total),
        free_at_start=start.free,
        weights=weights,
        activation_peak=peak,
        graphs=graph_pool_estimate(
            graph_sizes,
            model.config.vocab_size,
            peak / tokens,
            # base and LoRA captures; each again for spread lengths (an upper bound: not every
            # size's plan changes)
            (2 if config.enable_lora else 1) * (2 if config.decode_spread_graphs else 1),
        )
        + mixed_pool_estimate(mixed_sizes or [], peak / tokens),
        other=max(0, (start.free - int(free_now)) - torch_grew),
    )
    return plan_cuda(
        measured,
        config.gpu_memory_utilization,
        block_bytes,
        config.block_size,
        max_len,
        config.num_kv_blocks,
        config.kv_cache_bytes,
    )


@torch.inference_mode()
def profile_activations(
    model: DecoderModel,
    block_size: int,
    tokens: int,
    max_len: int,
    rows: int,
    device: torch.device,
    kv_dtype: torch.dtype | None = None,
) -> int:
    """Peak bytes allocated by one step of ``tokens`` new tokens (prefills of at most
    ``max_len`` tokens each) plus the logits of ``rows`` rows and a sampling sort of them, over
    a scratch KV cache of just those blocks (freed after)."""
    c, bs = model.config, block_size
    seq = min(tokens, max_len)
    lens = [seq] * (tokens // seq) + ([tokens % seq] if tokens % seq else [])
    per_seq = -(-seq // bs)
    cache = torch.empty(
        (len(lens) * per_seq, c.num_layers, 2, bs, model.num_kv_heads, c.head_dim),
        device=device,
        dtype=kv_dtype or model.w.embed.dtype,
    )
    offsets = torch.cat([torch.arange(n, device=device) for n in lens])
    first_block = torch.cat(
        [torch.full((n,), i * per_seq, device=device) for i, n in enumerate(lens)]
    )
    tables = torch.arange(len(lens) * per_seq, device=device).view(len(lens), per_seq)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    meta = kernels.AttentionMetadata(
        slot_blocks=first_block + offsets // bs,
        slot_offsets=offsets % bs,
        block_tables=tables,
        seq_lens=torch.tensor(lens, device=device),
        query_start_loc=torch.tensor(starts, device=device),
        max_query_len=max(lens),
        max_seq_len=max(lens),
        block_size=bs,
    )
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    hidden = model.forward(ids, offsets, cache, meta)
    logits = model.logits(hidden[: min(rows, tokens)])
    torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del cache, hidden, logits, meta
    torch.cuda.empty_cache()
    return int(peak)


def check_graphs(plan: KVPlan, used: int) -> None:
    """Warn when the captured graphs took more than was set aside for them."""
    if plan.memory is not None and used > plan.memory.graphs:
        log.warning(
            "CUDA graphs took %s, over the %s set aside for them", _gib(used),
            _gib(plan.memory.graphs),
        )  # fmt: skip

"""Engine warm-up: every Triton kernel specialisation the configured shapes can reach, met
while the engine is built, before the worker registers and says READY.

A Triton kernel is compiled the first time a process launches it with a new specialisation;
under serving load that compile stalls every stream of the batch (a decode worker spent 9% of
its samples in ``JITFunction._do_compile`` before this existed). The kernels' launch sites keep
the specialisations few: lengths, tile counts and block-table widths are runtime arguments that
are not specialised on (``do_not_specialize``), so what varies from step to step is the tile
plan of attention (``kernels.attention_variant``) and the row bucket of the skinny products.
`warm_up` runs one real forward pass per such variant (``engine.warmup_shapes`` lists them:
decode batches, whole prompts and chunks over a cached prefix, mixed steps), again with a LoRA
batch where LoRA is on, and the sampler's paths; the decode CUDA graphs, captured just before,
compiled the graphs' sizes already. FP8 weights or KV take their own kernels through the same
passes.

The passes run on the real KV pool, before the block pool's bookkeeping exists: they use
blocks 0 .. n of a pool no request has touched (every sequence of a step shares that one table),
and those blocks are zeroed again after, as the pool was allocated. No block is hashed, so
nothing of the warm-up is ever visible to a request. Under tensor parallelism every rank warms
its own runner at the end of its build, in the same order, like the graph capture (the passes'
collectives meet); a rank's process is ready once it has.

**Triton's on-disk cache.** Triton keeps every compiled variant in ``TRITON_CACHE_DIR``
(default ``$TRITON_HOME/.triton/cache``, i.e. ``~/.triton/cache``), keyed by the kernel's
source, the specialisation, the Triton version and the GPU. A restarted worker whose cache
directory survived (the same host user's home, or a volume mounted there in a container) loads
its kernels instead of compiling them: the warm-up then takes about as long as its forward
passes. Point ``TRITON_CACHE_DIR`` at a persistent, writable directory where the home is not;
the warm-up logs the directory, and warns when it cannot write there (every start would then
compile everything again).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import torch

import kernels
from engine.lora import LoRABatch
from engine.lora_config import LORA_MODULES
from engine.sampler import SamplingRow
from engine.sampling_params import SamplingParams
from engine.warmup_shapes import (
    WarmupLimits,
    WarmupReport,
    WarmupStep,
    chunk_sizes,
    decode_sizes,
    steps_of,
)
from kernels import compile_counter

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner, StepPlan
    from engine.parallel.comm import TPComm

log = logging.getLogger(__name__)


def warm_up(runner: ModelRunner, max_len: int) -> WarmupReport | None:
    """Run the warm-up passes of ``runner`` (context limit ``max_len``) and keep the report as
    ``runner.warmup``; None where nothing compiles (off CUDA, or without Triton: the CPU runs the
    PyTorch references). Whoever builds a runner runs this next, before it serves (every rank
    at the same point of its build: the passes' collectives meet)."""
    if runner.device.type != "cuda" or not kernels.use_triton(runner.kv_cache):
        return None
    counter = compile_counter.COUNTER
    before = counter.counts()
    start = time.perf_counter()
    with counter.warming():
        passes = run_passes(runner, max_len)
        torch.cuda.synchronize(runner.device)
    after = counter.counts()
    report = WarmupReport(passes, time.perf_counter() - start, after.total - before.total,
                          after.cached - before.cached)  # fmt: skip
    log.info("warm-up: %d forward passes in %.1f s, %d kernel specialisations compiled or "
             "loaded (%d from Triton's cache in %s)", report.passes, report.seconds,
             report.compiles, report.cached, _cache_note())  # fmt: skip
    if runner.comm.rank > 0:  # a tensor-parallel rank's process: its runner is all there is
        counter.mark_ready()
    runner.warmup = report
    return report


def run_passes(runner: ModelRunner, max_len: int) -> int:
    """The warm-up's forward passes and sampler calls on ``runner`` (any device), then its
    blocks zeroed again; returns the number of forward passes."""
    steps = runner_steps(runner, max_len)
    for step in steps:
        run_step(runner, step, with_lora=False)
    if runner.lora is not None:  # the same passes with every projection's LoRA deltas
        for step in steps:
            run_step(runner, step, with_lora=True)
    if runner.comm.rank == 0:
        sample_paths(runner)
    blocks = -(-_limits(runner, max_len).max_context // runner.config.block_size)
    runner.kv_pool[:blocks].zero_()  # as allocated: nothing of the warm-up stays
    return len(steps) * (2 if runner.lora is not None else 1)


def _limits(runner: ModelRunner, max_len: int) -> WarmupLimits:
    c = runner.config
    return WarmupLimits(c.max_num_seqs, c.max_num_batched_tokens, max_len, c.block_size,
                        runner.num_blocks, runner.model.choices.skinny_rows)  # fmt: skip


def runner_steps(runner: ModelRunner, max_len: int) -> list[WarmupStep]:
    """The steps of ``runner``'s warm-up, with its attention variants.

    Under tensor parallelism this is a collective. A rank's variants follow its shard of the
    heads, so ranks with uneven shards (9 heads over 2 ranks: 3 + 6) find different decode
    sizes; but every pass's all-reduces must meet, or the ranks wait on each other forever.
    So the ranks agree first and all run the union of their sizes."""
    heads, kv = runner.model.num_heads, runner.kv_cache

    def decode_key(b: int) -> object:
        return kernels.attention_variant(b, 1, heads, kv)

    def prefill_key(q: int) -> object:
        return kernels.attention_variant(1, q, heads, kv)

    limits = _limits(runner, max_len)
    decodes, chunks = decode_sizes(limits, decode_key), chunk_sizes(limits, prefill_key)
    if runner.comm.size > 1:
        decodes, chunks = agreed_sizes(runner.comm, limits, decodes, chunks, runner.device)
    return steps_of(limits, decodes, chunks)


def agreed_sizes(
    comm: TPComm, limits: WarmupLimits, decodes: list[int], chunks: list[int], device: torch.device
) -> tuple[list[int], list[int]]:
    """Every rank's decode batch sizes and prompt lengths together (sorted). One all-reduce of
    a mask sized by ``limits``, which every rank shares (its KV pool is the ranks' minimum)."""
    width = limits.max_decode_seqs + 1
    mask = torch.zeros(width + limits.max_chunk + 1, dtype=torch.int32, device=device)
    mask[decodes] = 1
    mask[[width + q for q in chunks]] = 1
    hit = comm.all_reduce(mask).nonzero().flatten().tolist()
    return [i for i in hit if i < width], [i - width for i in hit if i >= width]


def step_plan(step: WarmupStep, block_size: int, vocab_size: int) -> StepPlan:
    """The runner's input for ``step``: every sequence's table is blocks 0, 1, .. of the
    pool, so the slot of position ``p`` is ``p``; token ids are any valid ones."""
    from engine.model_runner import StepPlan

    plan = StepPlan([], [], [], [0], [], [], max(s.num_new for s in step), [])
    for s in step:
        lo = s.seq_len - s.num_new
        plan.token_ids.extend(p % vocab_size for p in range(lo, s.seq_len))
        plan.positions.extend(range(lo, s.seq_len))
        plan.slots.extend(range(lo, s.seq_len))
        plan.query_start.append(plan.query_start[-1] + s.num_new)
        plan.seq_lens.append(s.seq_len)
        plan.block_tables.append(list(range(-(-s.seq_len // block_size))))
        if s.samples:
            plan.sample_rows.append(plan.query_start[-1] - 1)
    return plan


def run_step(runner: ModelRunner, step: WarmupStep, with_lora: bool) -> None:
    """One forward pass of ``step`` on this rank (and the LM head on its sampled rows)."""
    plan = step_plan(step, runner.config.block_size, runner.model.config.vocab_size)
    if not with_lora:
        # The runner's own pass, as a step runs it; on this rank only: under tensor
        # parallelism every rank warms up by itself (see the module's note).
        runner._forward(plan)
        return
    assert runner.lora is not None
    ids, positions, meta, _ = runner._tensors(plan)
    n = len(plan.token_ids)
    lora = runner.lora
    # Half the tokens in slot 0 (zeros, no adapter is loaded yet: the deltas add zeros), half
    # on the base model, as a step mixing adapters and base rows.
    slots = [0 if i % 2 == 0 else -1 for i in range(n)]
    meta_lora = kernels.LoRAMetadata.build(slots, lora.ranks, lora.scales, runner.device)
    batch = LoRABatch(lora.a, lora.b, meta_lora, frozenset(LORA_MODULES), lora.fused)
    hidden = runner.model.forward(ids, positions, runner.kv_cache, meta, batch)
    if plan.sample_rows:
        runner.model.logits(hidden[torch.tensor(plan.sample_rows, device=runner.device)])


def sample_paths(runner: ModelRunner) -> None:
    """The sampler's paths once each: greedy alone (the fast path), then in one batch greedy,
    temperature with top-k, top-p, min-p, a seed and logprobs, penalties and a logit bias,
    held stop tokens, and a grammar's bitmask. The process's random state is left as it was."""
    v, dev = runner.sampler_width, runner.device
    gen = torch.Generator(device=dev).manual_seed(0)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, logprobs=5, seed=0),
        SamplingParams(top_k=20),
        SamplingParams(top_p=0.5),
        SamplingParams(
            repetition_penalty=1.1,
            frequency_penalty=0.5,
            presence_penalty=0.5,
            logit_bias=((1, 1.0),),
        ),
        SamplingParams(min_tokens=4, max_tokens=8),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    rows = [SamplingRow(p, gen if p.seed is not None else None, [1, 2, 3], [4, 5]) for p in params]
    rows[5] = SamplingRow(params[5], None, [1, 2, 3], [], stop_ids=(0,))
    rows[6] = SamplingRow(params[6], None, [1, 2, 3], [4], guided=True)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        logits = torch.randn((len(rows), v), device=dev, generator=gen)
        bitmask = torch.full((len(rows), -(-v // 32)), -1, dtype=torch.int32, device=dev)
        runner.sampler(logits[:1], rows[:1])
        runner.sampler(logits, rows, bitmask)


def _cache_note() -> str:
    """Triton's cache directory, and whether this process can write there."""
    where = compile_counter.cache_dir()
    if where and not _writable(where):
        log.warning(
            "Triton's cache directory %s is not writable: kernels are compiled again on every "
            "start (set TRITON_CACHE_DIR to a writable, lasting directory)",
            where,
        )
        return f"{where}, not writable"
    return where


def _writable(path: str) -> bool:
    """Whether this process can write into ``path``, or create it in its nearest existing
    parent (a directory)."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return os.path.isdir(path) and os.access(path, os.W_OK)

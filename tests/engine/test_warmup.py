"""The engine's warm-up and the kernel compile counter, on the CPU (no Triton needed): which
steps the warm-up runs for a runner's limits (``engine.warmup_shapes``), the plans it builds,
its passes on a real pool (left as allocated; nothing a request sees), the counter's split at
ready, and ``tandem_kernel_compiles_total`` in a worker's metrics.

With Triton installed, ``tests/engine/test_warmup_record.py`` checks on the CPU that a
served workload
meets no kernel specialisation the warm-up did not; on a GPU, ``tests/gpu/test_warmup_gpu.py``
that nothing compiles after ready."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.core.messages import Snapshot
from engine.llm_engine import EngineStats, LLMEngine
from engine.sampling_params import SamplingParams
from engine.warmup import run_passes, runner_steps, step_plan, warm_up
from engine.warmup_shapes import (
    WarmupLimits,
    WarmupSeq,
    chunk_sizes,
    decode_sizes,
    representatives,
    steps_of,
    warmup_steps,
)
from kernels import KernelChoices, compile_counter
from kernels.compile_counter import CompileCounter, CompileCounts, describe
from services.observability.engine import EngineCollector
from tests.conftest import make_random_model_dir

SKINNY_ROWS = KernelChoices().skinny_rows  # what the engine's model takes on CUDA


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def h200_decode(b: int, kv_heads: int = 3) -> tuple:
    """What ``DecodePlan.make``'s rule gives on an H200 (132 SMs), with batch 8's table plan."""
    if b == 8:
        return ("table", 8, 32)
    return ("rule", min(32, next_pow2(math.ceil(264 / (b * kv_heads)))))


def prefill_plan(q: int) -> int:
    return 16 if q <= 16 else 128  # PrefillPlan.make's BLOCK_M at head_dim <= 128


def make_limits(**kw: int) -> WarmupLimits:
    base = dict(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=2048, block_size=16,
                num_blocks=4096, skinny_rows=SKINNY_ROWS)  # fmt: skip
    return WarmupLimits(**{**base, **kw})


# -- which steps --------------------------------------------------------------------------------


def test_representatives_are_the_ends_of_each_group() -> None:
    assert representatives(range(1, 11), lambda v: v // 4) == [1, 3, 4, 7, 8, 10]
    assert representatives([5], lambda v: 0) == [5]
    assert representatives([], lambda v: 0) == []


def test_decode_sizes_take_every_skinny_row_count_and_each_attention_plan() -> None:
    limits = make_limits()
    sizes = decode_sizes(limits, h200_decode)
    assert set(range(1, SKINNY_ROWS + 1)) <= set(sizes)
    plans = {h200_decode(b) for b in range(1, 65)}
    assert {h200_decode(b) for b in sizes} == plans
    # 16 splits only at batch 6, 7, 9 and 10 (8 has its table plan): no power of two; its ends
    assert {b for b in range(1, 65) if h200_decode(b) == ("rule", 16)} == {6, 7, 9, 10}
    assert {6, 10} <= set(sizes)
    assert max(sizes) == 64 and len(sizes) < 20


def test_chunk_sizes_take_both_prefill_plans_at_their_ends() -> None:
    assert chunk_sizes(make_limits(), prefill_plan) == [2, 16, 17, 512]
    # the chunk is bounded by the context (a prompt leaves room for one token) and the pool
    assert chunk_sizes(make_limits(max_model_len=100), prefill_plan) == [2, 16, 17, 99]
    assert chunk_sizes(make_limits(num_blocks=4), prefill_plan) == [2, 16, 17, 63]
    assert chunk_sizes(make_limits(max_num_batched_tokens=8), prefill_plan) == [2, 8]
    # with fewer sequences than the skinny products' rows, prompts take those token counts
    assert chunk_sizes(make_limits(max_num_seqs=5), prefill_plan) == [2, 6, 7, 8, 16, 17, 512]


def check_steps(limits: WarmupLimits, steps: list[tuple[WarmupSeq, ...]]) -> None:
    """Every step is one the scheduler could make, and the runner's memory plan holds."""
    for step in steps:
        assert 1 <= len(step) <= limits.max_num_seqs
        assert sum(s.num_new for s in step) <= limits.max_num_batched_tokens
        for s in step:
            assert 1 <= s.num_new <= s.seq_len <= limits.max_context
            assert s.seq_len <= limits.max_model_len


@pytest.mark.parametrize(
    "limits",
    [make_limits(), make_limits(max_num_seqs=256, max_num_batched_tokens=8192, num_blocks=300),
     make_limits(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64),
     make_limits(max_num_seqs=1, max_num_batched_tokens=1, max_model_len=8, num_blocks=1)],
)  # fmt: skip
def test_the_steps_cover_every_variant_within_the_limits(limits: WarmupLimits) -> None:
    steps = warmup_steps(limits, h200_decode, prefill_plan)
    check_steps(limits, steps)
    decode = [s for s in steps if all(x.num_new == 1 for x in s)]
    others = [s for s in steps if any(x.num_new > 1 for x in s)]
    top = limits.max_decode_seqs
    assert {h200_decode(len(s)) for s in decode} == {h200_decode(b) for b in range(1, top + 1)}
    want = {prefill_plan(q) for q in range(2, limits.max_chunk + 1)}
    assert {prefill_plan(max(x.num_new for x in s)) for s in others} == want
    tokens = {sum(x.num_new for x in s) for s in steps}
    sampled = {sum(x.samples for x in s) for s in steps}
    small = set(range(1, min(SKINNY_ROWS, max(limits.max_chunk, top)) + 1))
    assert small <= tokens and small & set(range(1, top + 1)) <= sampled
    if max(limits.max_chunk, top) > SKINNY_ROWS:  # and past the skinny products' rows
        assert max(tokens) > SKINNY_ROWS
    if limits.max_chunk > 1 and limits.max_context >= 5:  # a later chunk, sampling nothing
        assert any(s[0].seq_len > s[0].num_new and not s[0].samples for s in others)
        if limits.max_num_seqs > 1 and limits.max_num_batched_tokens > 2:
            assert any(len(s) > 1 and s[0].num_new > 1 for s in others)


def test_step_plan_puts_position_p_in_slot_p_of_blocks_0_to_n() -> None:
    step = (WarmupSeq(3, 40), WarmupSeq(1, 17), WarmupSeq(5, 5, samples=False))
    plan = step_plan(step, block_size=16, vocab_size=30)
    assert plan.positions == [37, 38, 39, 16, 0, 1, 2, 3, 4]
    assert plan.slots == plan.positions
    assert plan.token_ids == [7, 8, 9, 16, 0, 1, 2, 3, 4]
    assert plan.query_start == [0, 3, 4, 9]
    assert plan.seq_lens == [40, 17, 5]
    assert plan.block_tables == [[0, 1, 2], [0, 1], [0]]
    assert plan.sample_rows == [2, 3]
    assert plan.max_query_len == 5


# -- the passes on a CPU engine --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smol_dir) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("warmup"), smol_dir, "qwen2", seed=3)


def tiny_engine(model_dir: Path, **kw) -> LLMEngine:
    opts = dict(device="cpu", max_model_len=96, max_num_seqs=6, max_num_batched_tokens=40,
                num_kv_blocks=64)  # fmt: skip
    return LLMEngine(EngineConfig(model_dir=str(model_dir), **{**opts, **kw}))


def test_the_passes_leave_the_pool_as_allocated_and_outputs_unchanged(tiny_dir) -> None:
    """The warm-up's passes (on the CPU here: the references) write only into blocks no request
    holds yet, and zero them again: a warmed engine answers exactly as a cold one."""
    prompts = [[5 + i for i in range(n)] for n in (3, 30, 70)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def answers(engine: LLMEngine) -> list[list[int]]:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        engine.check_integrity()
        return [done[f"r{i}"] for i in range(len(prompts))]

    cold = answers(tiny_engine(tiny_dir))
    warm = tiny_engine(tiny_dir)
    assert warm.runner.warmup is None  # on the CPU nothing compiles: no warm-up at build
    assert warm_up(warm.runner, warm.max_model_len) is None
    passes = run_passes(warm.runner, warm.max_model_len)
    assert passes == len(runner_steps(warm.runner, warm.max_model_len)) >= 10
    assert not warm.runner.kv_pool.any()
    assert warm.pool.num_used == 0 and warm.pool.num_cached == 0
    assert answers(warm) == cold


def test_with_lora_the_passes_run_again_with_the_deltas(tiny_dir) -> None:
    """Where LoRA is on, every pass runs a second time with a LoRA batch (half its rows in an
    empty slot), through the runner's own input tensors; the pool is left as allocated."""
    engine = tiny_engine(tiny_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    assert engine.runner.lora is not None
    passes = run_passes(engine.runner, engine.max_model_len)
    assert passes == 2 * len(runner_steps(engine.runner, engine.max_model_len))
    assert not engine.runner.kv_pool.any()


def test_engine_stats_carry_the_process_counts(tiny_dir) -> None:
    engine = tiny_engine(tiny_dir)
    assert compile_counter.COUNTER.ready  # the engine marked it at the end of its build
    assert engine.stats().kernel_compiles == compile_counter.COUNTER.counts()


# -- the counter --------------------------------------------------------------------------------


def test_compiles_split_at_ready_and_each_serving_one_is_a_warning(caplog) -> None:
    c = CompileCounter()
    assert c.record("_prefill_kernel", "k1", cached=False) == "warmup"
    assert c.record("_skinny_kernel", "k2", cached=True) == "warmup"
    c.mark_ready()
    c.mark_ready()  # idempotent
    with caplog.at_level(logging.WARNING, logger="kernels.compile_counter"):
        assert c.record("_decode_split_kernel", "(stride_tb:i32:16)", cached=False) == "serving"
    (rec,) = caplog.records
    assert "_decode_split_kernel" in rec.getMessage() and "(stride_tb:i32:16)" in rec.getMessage()
    with c.warming():  # a later engine's warm-up in the same process
        assert c.record("_rms_norm_kernel", "k4", cached=True) == "warmup"
    assert c.record("_rms_norm_kernel", "k5", cached=False) == "serving"
    c.start_build()  # another engine's build: its graphs and warm-up compile
    assert c.record("_skinny_kernel", "k6", cached=False) == "warmup"
    c.mark_ready()
    assert c.counts() == CompileCounts(warmup=4, serving=2, cached=2)
    assert c.counts().total == 6


def test_the_hooks_count_triton_events_and_keep_the_hooks_before_them(monkeypatch) -> None:
    """Triton's listener (cache hit or not) then its post-compile hook, as ``compile`` and
    ``JITFunction._do_compile`` call them, with hooks set before ours still called."""
    counter = CompileCounter()
    monkeypatch.setattr(compile_counter, "COUNTER", counter)
    seen: list[str] = []
    listener = compile_counter._listener(lambda **kw: seen.append(f"listener {kw['cache_hit']}"))
    hook = compile_counter._post_compile(lambda **kw: seen.append(f"hook {kw['key']}"))
    fn = type("Info", (), {"name": "_prefill_kernel"})()
    info = {"signature": {"q_ptr": "*bf16", "n": "i32", "B": "constexpr"},
            "constants": {(2,): 64}, "configs": [{(0,): [["tt.divisibility", 16]]}],
            "num_warps": 8, "num_stages": 3}  # fmt: skip
    for hit in (True, False):
        listener(src=None, metadata=None, metadata_group=None, times=None, cache_hit=hit)
        hook(key=f"key{hit}", repr="", fn=fn, compile=info, is_manual_warmup=False,
             already_compiled=False)  # fmt: skip
    assert seen == ["listener True", "hook keyTrue", "listener False", "hook keyFalse"]
    assert counter.counts() == CompileCounts(warmup=2, serving=0, cached=1)
    assert describe(info) == "[num_warps=8, num_stages=3](q_ptr:*bf16:16, n:i32, B=64)"


# -- the metric ---------------------------------------------------------------------------------


def test_worker_metrics_expose_compiles_by_phase() -> None:
    class Engine:  # what EngineCollector reads of an engine client: its latest snapshot
        counts = CompileCounts(warmup=41, serving=2, cached=40)
        snapshot = Snapshot(EngineStats(0, 0, 10, 0, 0, 0, 0, 0, kernel_compiles=counts), 0)

    reg = CollectorRegistry()
    reg.register(EngineCollector(Engine()))  # type: ignore[arg-type]
    got = {
        s.labels["phase"]: s.value
        for family in reg.collect()
        for s in family.samples
        if s.name == "tandem_kernel_compiles_total"
    }
    assert got == {"warmup": 41.0, "serving": 2.0}


def test_cache_dir_note_says_when_triton_cannot_write(tmp_path, monkeypatch, caplog) -> None:
    from engine import warmup

    where = tmp_path / "home" / ".triton" / "cache"
    monkeypatch.setattr(compile_counter, "cache_dir", lambda: str(where))
    assert warmup._cache_note() == str(where)  # Triton makes it on its first write
    (tmp_path / "home").write_text("a file where the home should be")
    with caplog.at_level(logging.WARNING, logger="engine.warmup"):
        assert warmup._cache_note() == f"{where}, not writable"
    assert "TRITON_CACHE_DIR" in caplog.text


def _agree_on_sizes(rank: int, size: int, store: str, kv_heads: list[int], out: str) -> None:
    """One rank of `test_ranks_with_uneven_shards_agree_on_one_list_of_steps` (gloo)."""
    import json
    import types

    import torch
    import torch.distributed as dist

    from engine.parallel.comm import TPComm
    from engine.warmup import agreed_sizes

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    limits = make_limits(max_num_seqs=256, max_num_batched_tokens=8192)
    mine = decode_sizes(limits, lambda b: h200_decode(b, kv_heads[rank]))
    chunks = chunk_sizes(limits, prefill_plan)
    comm = TPComm(types.SimpleNamespace(rank=rank, size=size))  # type: ignore[arg-type]
    decodes, agreed_chunks = agreed_sizes(comm, limits, mine, chunks, torch.device("cpu"))
    dist.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps([mine, decodes, chunks, agreed_chunks]))


def test_ranks_with_uneven_shards_agree_on_one_list_of_steps(tmp_path: Path) -> None:
    """SmolLM2's 3 KV heads over 2 ranks are 1 + 2: the ranks' decode plans differ, so their
    own decode sizes do; every warm-up pass holds all-reduces, so both must run the same steps
    (on two H200s the ranks waited on each other forever). Two real gloo ranks agree on the
    union."""
    import json

    import torch.multiprocessing as mp

    limits = make_limits(max_num_seqs=256, max_num_batched_tokens=8192)
    own = [decode_sizes(limits, lambda b, k=k: h200_decode(b, k)) for k in (1, 2)]
    assert own[0] != own[1]  # the case this guards against
    mp.start_processes(_agree_on_sizes, args=(2, str(tmp_path / "store"), [1, 2], str(tmp_path)),
                       nprocs=2, start_method="spawn")  # fmt: skip
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert [r[0] for r in ranks] == own
    union = sorted({*own[0], *own[1]})
    assert ranks[0][1] == ranks[1][1] == union
    assert ranks[0][3] == ranks[1][3] == ranks[0][2]  # the prompt lengths were equal already
    steps = steps_of(limits, union, ranks[0][3])
    assert len(steps) == len(union) + len(ranks[0][3]) + 3  # + a later chunk, 2 mixed steps
    check_steps(limits, steps)

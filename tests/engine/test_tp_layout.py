"""How a model and its KV pool split over tensor-parallel ranks (no processes): which heads each
rank holds, which byte range of which source rank's blocks each destination rank copies when a
prefill pool at one TP size hands KV to a decode pool at another, and how a CPU worker's ranks
split its cores."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from engine.config import ModelConfig
from engine.errors import UnsupportedModelError
from engine.parallel.devices import rank_cpu_threads, set_cpu_threads
from engine.parallel.shard import ModelShard, check_tp, uneven
from libkv.kv_layout import KVLayout, SlicePart, kv_heads_of_rank, slice_plan, split

HB = 1000  # head bytes of the layouts below (1 layer x 2 x 5 tokens x 25 dims x 4 bytes)


def layout(kv_heads: int, tp: int, **kw) -> KVLayout:
    geometry = dict(num_layers=1, head_dim=25, block_size=5, dtype="float32", element_size=4)
    return KVLayout(num_kv_heads=kv_heads, tp=tp, **{**geometry, **kw})


def model(heads: int, kv_heads: int, inter: int = 1536, vocab: int = 49152) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": 64 * heads,
            "intermediate_size": inter,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
        }
    )


def test_split_is_contiguous_and_balanced():
    assert [split(9, 2, i) for i in range(2)] == [(0, 4), (4, 9)]
    assert [split(3, 2, i) for i in range(2)] == [(0, 1), (1, 3)]
    assert [split(8, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # More ranks than KV heads: one head each, replicated on consecutive ranks.
    assert [kv_heads_of_rank(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_heads_of_rank(3, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (2, 3)]


def test_shards_of_llama_70b_shape():
    c = model(64, 8, inter=28672, vocab=128256)
    shards = [ModelShard.of(c, 4, r) for r in range(4)]
    assert [s.heads for s in shards] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert [s.kv_heads for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [s.intermediate for s in shards] == [(0, 7168), (7168, 14336), (14336, 21504),
                                                 (21504, 28672)]  # fmt: skip
    assert shards[0].vocab_rows == (32064,) * 4 and uneven(c, 4) is None


def test_smollm2_at_tp2_splits_unevenly_and_says_so():
    c = model(9, 3)
    a, b = ModelShard.of(c, 2, 0), ModelShard.of(c, 2, 1)
    assert (a.kv_heads, a.heads) == ((0, 1), (0, 3))
    assert (b.kv_heads, b.heads) == ((1, 3), (3, 9))
    assert uneven(c, 2) == "9 attention heads over 2 ranks split 3+6"
    assert uneven(c, 3) is None


def test_replicated_kv_heads_split_their_query_group():
    c = model(8, 2)
    shards = [ModelShard.of(c, 4, r) for r in range(4)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.heads for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_sizes_that_leave_a_rank_without_heads_are_refused():
    with pytest.raises(UnsupportedModelError, match="without a query head"):
        check_tp(model(4, 2), 5)
    with pytest.raises(UnsupportedModelError, match="without a query head"):
        check_tp(model(2, 2), 4)  # one query head per KV head, two ranks on each
    with pytest.raises(ValueError, match=">= 1"):
        check_tp(model(4, 2), 0)
    check_tp(model(4, 2), 4)


def test_prefill_tp2_to_decode_tp1_reads_each_half_from_its_rank():
    src, dst = layout(4, 2), layout(4, 1)
    assert slice_plan(src, dst, 0) == [SlicePart(0, 0, 0, 2 * HB), SlicePart(1, 0, 2 * HB, 2 * HB)]


def test_prefill_tp1_to_decode_tp2_reads_each_rank_its_half():
    src, dst = layout(4, 1), layout(4, 2)
    assert slice_plan(src, dst, 0) == [SlicePart(0, 0, 0, 2 * HB)]
    assert slice_plan(src, dst, 1) == [SlicePart(0, 2 * HB, 0, 2 * HB)]


def test_equal_sizes_copy_whole_blocks_rank_to_rank():
    src, dst = layout(8, 4), layout(8, 4)
    assert [slice_plan(src, dst, r) for r in range(4)] == [
        [SlicePart(r, 0, 0, 2 * HB)] for r in range(4)
    ]


def test_sizes_that_do_not_divide_still_map_every_head_once():
    src, dst = layout(6, 2), layout(6, 3)  # ranks of 3 heads to ranks of 2
    assert slice_plan(src, dst, 1) == [SlicePart(0, 2 * HB, 0, HB), SlicePart(1, 0, HB, HB)]
    for s_tp, d_tp in [(1, 4), (4, 1), (2, 4), (4, 2), (3, 2), (2, 3), (4, 3)]:
        src, dst = layout(12, s_tp), layout(12, d_tp)
        for r in range(d_tp):
            lo, hi = dst.heads(r)
            covered = []
            for p in slice_plan(src, dst, r):
                first = src.heads(p.src_rank)[0] + p.src_offset // HB
                covered += range(first, first + p.nbytes // HB)
                assert p.dst_offset == (first - lo) * HB
            assert covered == list(range(lo, hi))


def test_replicated_heads_are_read_from_spread_replicas():
    src, dst = layout(2, 4), layout(2, 2)  # each KV head on two prefill ranks
    assert slice_plan(src, dst, 0) == [SlicePart(0, 0, 0, HB)]
    assert slice_plan(src, dst, 1) == [SlicePart(3, 0, 0, HB)]
    src, dst = layout(2, 1), layout(2, 4)  # decode ranks 0,1 hold head 0; 2,3 head 1
    assert [slice_plan(src, dst, r)[0].src_offset for r in range(4)] == [0, 0, HB, HB]


def test_canonical_block_is_every_head_once_in_order():
    assert layout(2, 4).canonical_parts() == [SlicePart(0, 0, 0, HB), SlicePart(2, 0, HB, HB)]
    assert layout(4, 2).block_bytes == 4 * HB and layout(4, 2).shard_block_bytes(1) == 2 * HB


def test_different_geometry_is_refused_with_the_reason():
    assert layout(4, 1).refusal(layout(4, 2)) is None
    why = layout(4, 1).refusal(layout(4, 2, dtype="bfloat16", element_size=2))
    assert why == "KV geometry differs: dtype float32 vs bfloat16, element_size 4 vs 2"
    assert "versions differ" in (layout(4, 1).refusal(layout(4, 1, version=0)) or "")
    with pytest.raises(ValueError, match="num_kv_heads 4 vs 2"):
        slice_plan(layout(4, 1), layout(2, 1), 0)
    assert KVLayout.from_json(layout(4, 2).to_json()) == layout(4, 2)


@pytest.fixture
def torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_cpu_ranks_split_the_workers_share_of_the_cores(monkeypatch, torch_threads):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    set_cpu_threads(2)  # a lone worker: every core, split
    assert torch.get_num_threads() == 4
    # The launcher gave this worker 6 of the host's cores (or the operator set it): split them.
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    set_cpu_threads(2)
    assert torch.get_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    set_cpu_threads(4)  # more ranks than its cores: one each
    assert torch.get_num_threads() == 1


def test_rank_threads_read_the_first_level_of_omp_and_ignore_a_bad_one(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert rank_cpu_threads(2, {"OMP_NUM_THREADS": "4,2"}) == 2  # nested levels: the outermost
    for bad in ("", "0", "-3", "many"):
        assert rank_cpu_threads(2, {"OMP_NUM_THREADS": bad}) == 4
    assert rank_cpu_threads(1, {}) == 8 and rank_cpu_threads(3, {}) == 2

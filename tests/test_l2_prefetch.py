"""The L2 prefetch of decode steps (issue 19, ``kernels.L2_PREFETCH``) off the GPU: off by
default; the byte patterns of the products' first reads; where the model launches the
prefetches (decode steps only, each right before the small kernel ahead of its product) and
that its outputs do not change; the benchmark's variants in a dry run. On the GPU:
``tests/test_l2_prefetch_gpu.py``."""

from __future__ import annotations

import json

import pytest
import torch

import kernels
from bench import decode_variants
from bench.gpu_llama import BLOCK, LlamaBench
from engine.config import ModelConfig
from engine.shapes import SHAPES
from kernels.l2 import LINE, L2Prefetch, Pattern, product_pattern

TINY = ModelConfig.from_dict({**SHAPES["smollm2-135m"], "num_hidden_layers": 2})


@pytest.fixture(scope="module")
def tiny() -> LlamaBench:
    return LlamaBench(TINY, num_blocks=16, max_len=64, device="cpu")


def decode(bench: LlamaBench, b: int, ctx: int) -> torch.Tensor:
    """One eager decode step of ``b`` sequences holding ``ctx`` tokens each."""
    ids, pos, meta = bench._decode_inputs(b, ctx)
    return bench.model.forward(ids, pos, bench.kv, meta)


def test_off_by_default():
    assert L2Prefetch() == kernels.L2_PREFETCH
    assert not kernels.L2_PREFETCH.launches and not kernels.L2_PREFETCH.kv_evict_first
    assert not L2Prefetch(kv_evict_first=True).launches  # a load hint: nothing launched
    assert L2Prefetch(o_proj=True).launches and L2Prefetch(head=0.125).launches


@pytest.mark.parametrize("bad", [{"head": -0.1}, {"head": 1.5}, {"asm": "prefetch"}])
def test_rejects_what_it_cannot_do(bad):
    with pytest.raises(ValueError):
        L2Prefetch(**bad)


def test_patterns_are_each_programs_first_bytes():
    # the 8B shape's QKV in bf16, no split-K: the first quarter of each 8 KiB row
    assert product_pattern(6144, 4096, 4096, 2, 4096, 0.25) == Pattern(
        rows=6144, row_bytes=8192, row_stride=8192, segs=1, seg_stride=8192, head_bytes=2048
    )
    # down with split-K 2: both programs' ranges of a row start at its first and middle byte
    p = product_pattern(4096, 14336, 14336, 2, 7168, 0.125)
    assert (p.segs, p.seg_stride, p.head_bytes) == (2, 14336, 1792)
    assert p.units(LINE) == 4096 * 2 * 14
    # whole, uneven split-K (the last range is shorter: it ends with the row), a strided view,
    # and FP8 bytes; heads round up to whole lines and never past their range
    p = product_pattern(100, 1000, 1024, 2, 384, 1.0)
    assert (p.segs, p.seg_stride, p.head_bytes, p.row_bytes, p.row_stride) == (
        3, 768, 768, 2000, 2048
    )  # fmt: skip
    assert product_pattern(8, 100, 100, 1, 100, 0.01).head_bytes == 100
    assert product_pattern(8, 4096, 4096, 1, 4096, 0.01).head_bytes == LINE
    with pytest.raises(ValueError):
        product_pattern(8, 64, 64, 2, 128, 0.5)  # a range longer than the row


def test_prefetch_of_cpu_tensors_launches_nothing():
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    kernels.l2_prefetch(x, w, 1.0)
    kernels.l2_prefetch(x, kernels.quantize_fp8_rows(w), 0.25)


def _traced(monkeypatch, bench: LlamaBench) -> list[str]:
    """The kernels the model calls, in order, with each prefetch's weight and share."""
    names = {}
    for i, lw in enumerate(bench.w.layers):
        for part in ("qkv", "o_proj", "gate_up", "down"):
            names[id(getattr(lw, part))] = f"{part}{i}"
    calls: list[str] = []

    def prefetch(x, w, head):
        calls.append(f"prefetch {names[id(w)]} {head}")

    def traced(name, fn):
        def call(*args, **kw):
            calls.append(name)
            return fn(*args, **kw)

        return call

    monkeypatch.setattr(kernels, "l2_prefetch", prefetch)
    for name in ("rms_norm", "rope_write_kv", "paged_attention", "silu_and_mul", "linear"):
        monkeypatch.setattr(kernels, name, traced(name, getattr(kernels, name)))
    return calls


def test_decode_steps_prefetch_right_before_the_kernels_ahead_of_the_products(
    tiny, monkeypatch
):  # fmt: skip
    calls = _traced(monkeypatch, tiny)
    monkeypatch.setattr(kernels, "L2_PREFETCH", L2Prefetch(o_proj=True, head=0.25))
    decode(tiny, 2, 20)
    layer = ["prefetch qkv{i} 0.25", "rms_norm", "linear", "rope_write_kv",
             "prefetch o_proj{i} 1.0", "paged_attention", "linear",
             "prefetch gate_up{i} 0.25", "rms_norm", "linear",
             "prefetch down{i} 0.25", "silu_and_mul", "linear"]  # fmt: skip
    assert calls == [c.format(i=i) for i in range(2) for c in layer] + ["rms_norm"]
    calls.clear()
    monkeypatch.setattr(kernels, "L2_PREFETCH", L2Prefetch(head=0.125))  # o_proj: its head
    decode(tiny, 2, 20)
    assert [c for c in calls if c.startswith("prefetch")][:4] == [
        "prefetch qkv0 0.125", "prefetch o_proj0 0.125", "prefetch gate_up0 0.125",
        "prefetch down0 0.125",
    ]  # fmt: skip
    for p in (L2Prefetch(o_proj=True), L2Prefetch(kv_evict_first=True), L2Prefetch()):
        calls.clear()
        monkeypatch.setattr(kernels, "L2_PREFETCH", p)
        decode(tiny, 2, 20)
        want = ["prefetch o_proj0 1.0", "prefetch o_proj1 1.0"] if p.o_proj else []
        assert [c for c in calls if c.startswith("prefetch")] == want


def test_prefill_steps_prefetch_nothing(tiny, monkeypatch):
    calls = _traced(monkeypatch, tiny)
    monkeypatch.setattr(kernels, "L2_PREFETCH", L2Prefetch(o_proj=True, head=0.25))
    t = 5
    pos = torch.arange(t)
    table = torch.tensor([tiny.tables(1, t)[0]])
    meta = kernels.AttentionMetadata(
        slot_blocks=table[0][pos // BLOCK], slot_offsets=pos % BLOCK, block_tables=table,
        seq_lens=torch.tensor([t]), query_start_loc=torch.tensor([0, t]), max_query_len=t,
        max_seq_len=t, block_size=BLOCK,
    )  # fmt: skip
    tiny.model.forward(torch.arange(t) + 3, pos, tiny.kv, meta)
    assert "paged_attention" in calls and not [c for c in calls if c.startswith("prefetch")]


def test_outputs_are_the_same_with_it_on(tiny, monkeypatch):
    want = decode(tiny, 3, 30)
    monkeypatch.setattr(kernels, "L2_PREFETCH", L2Prefetch(True, 0.25, True, "bulk"))
    assert torch.equal(decode(tiny, 3, 30), want)


def test_the_benchmark_runs_the_l2_variants_dry(tmp_path):
    names = list(decode_variants.L2_VARIANTS)
    decode_variants.main(["--dry-run", "--out", str(tmp_path), "--weights", "bf16", "--batches",
                          "1", "--no-profile", "--variants", *names])  # fmt: skip
    (out,) = tmp_path.glob("decode_variants_*.json")
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["installed", *names]
    assert all("error" not in r and r["same_logits"] for r in rows), rows
    assert L2Prefetch() == kernels.L2_PREFETCH  # put back after each variant

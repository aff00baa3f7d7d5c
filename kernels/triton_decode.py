"""Triton paged decode attention: one query token per sequence, split over the KV length.

FlashDecoding-style: a first kernel gives each (sequence, KV head, split) one contiguous range
of the sequence's KV and computes the attention of all the KV head's query heads (GQA: the K/V
tile is read once for the whole group) over that range, writing an unnormalised partial output
and its log-sum-exp; a second kernel merges the splits. The number of splits depends only on
the batch shape and the GPU (never on sequence lengths), so a captured CUDA graph stays valid
for any lengths: each split takes ``ceil(seq_len / num_splits)`` tokens, rounded to the tile.
Inside `split_floor` the rule takes at least that many splits: what a decode graph for batches
of spread lengths is captured with (``engine.cuda_graphs``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._triton import dot_precision, next_pow2, num_sms, pdl_kwargs
from kernels.triton_cache import PagedLayer
from kernels.triton_rope import rope_mix
from kernels.triton_rope_kv import check_inputs, to_cache

LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """Launch shape of one decode-attention call (a function of the batch shape only).

    ``merge``: the last split of each (sequence, KV head) to finish merges the splits (found
    by an atomic ticket) instead of a second kernel; with one split the output is written
    directly. ``prefetch``: the next tile's K/V loads are issued before this tile is computed
    (a software pipeline in registers; ``num_stages`` is then 1). ``early`` (with ``prefetch``):
    the first tile but the new token is loaded before the PDL wait."""

    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_splits: int
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    merge: bool = False
    prefetch: bool = False
    early: bool = False

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def label(self) -> str:
        stages = ("pfe" if self.early else "pf") if self.prefetch else f"st{self.num_stages}"
        merge = "_m" if self.merge else ""
        return f"s{self.num_splits}_n{self.block_n}_w{self.num_warps}_{stages}{merge}"

    def knobs(self) -> dict[str, object]:
        """The fields that are not the batch shape (what ``install_plans`` takes)."""
        return {k: getattr(self, k) for k in KNOBS}

    @classmethod
    def make(cls, q: torch.Tensor, paged: PagedLayer, max_splits: int = 32) -> DecodePlan:
        b, h, d = q.shape
        return cls.of(b, h, d, paged, q.device.index or 0, max_splits)

    @classmethod
    def of(
        cls, b: int, h: int, d: int, paged: PagedLayer, device_index: int, max_splits: int = 32
    ) -> DecodePlan:
        """`make`'s plan for ``b`` sequences of ``h`` query heads of ``d`` on that device."""
        hkv = paged.num_kv_heads
        if b in _PLANS:
            return cls(b, h, hkv, d, **_PLANS[b])  # type: ignore[arg-type]
        if paged.k.element_size() == 1 and b in FP8_KV_PLANS:
            return cls(b, h, hkv, d, **FP8_KV_PLANS[b])  # type: ignore[arg-type]
        if paged.k.element_size() == 2 and b in KV16_PLANS:
            return cls(b, h, hkv, d, **KV16_PLANS[b])  # type: ignore[arg-type]
        # About two programs per multiprocessor: on an H100 (lab.decode_variants --attention,
        # ctx 1k) that took batch 8 from 20.8 to 19.2 us a layer against four, and batch 1
        # (capped at 32 splits) is the same either way.
        target = 2 * num_sms(device_index)
        splits = next_pow2(max(1, math.ceil(target / max(b * hkv, 1))))
        return cls(b, h, hkv, d, min(max_splits, max(splits, _SPLIT_FLOOR)))


# The least number of splits of the rule's plans (`split_floor`); 0: the rule's own.
_SPLIT_FLOOR = 0


@contextlib.contextmanager
def split_floor(splits: int) -> Iterator[None]:
    """Inside, `DecodePlan.make`'s rule splits every sequence at least ``splits`` ways (plans
    installed for a batch size are kept). With the rule's one or two splits per sequence from
    batch 17 on an H200, a batch whose lengths differ waits on the longest sequences' programs;
    six splits took 0.69-0.95x its time there, but 1.07-1.18x on even short contexts, where the
    extra programs cost even when empty (bench/results/decode_attention_spread_h200/)."""
    global _SPLIT_FLOOR
    saved, _SPLIT_FLOOR = _SPLIT_FLOOR, splits
    try:
        yield
    finally:
        _SPLIT_FLOOR = saved


KNOBS = ("num_splits", "block_n", "num_warps", "num_stages", "merge", "prefetch", "early")
# Batch size -> the plan's knobs, measured on the GPU (``lab.decode_variants
# --only-attention``); batch sizes not here take ``DecodePlan.make``'s rule.
_PLANS: dict[int, dict[str, object]] = {}
# The same for an FP8 KV cache, under any installed plans. Batch 8: the in-kernel merge, the
# next tile in flight and the first tile before the PDL wait. On an H100 (session 7, 8B shape),
# attention took 18.05 against 27.2 us a layer at ctx 1k (0.66x the rule's plan) and 51.3
# against 62.1 at 4k (0.83x). The same plan lost on a bf16 cache (1.09-1.21x), which keeps the
# rule (bench/results/decode_gpu_h100.md).
FP8_KV_PLANS: dict[int, dict[str, object]] = {
    8: {"num_splits": 8, "block_n": 64, "num_warps": 4, "num_stages": 2, "merge": True,
        "prefetch": True, "early": True},
}  # fmt: skip
# The same for a bf16/fp16 cache. Batch 8: 32-token tiles. On an H100 (8B shape, ctx 1k) the
# folded decode step with RoPE inside took 0.993x the rule's plan in two runs (session 15;
# attention alone 0.980x in session 8, and 0.997x at ctx 4k).
KV16_PLANS: dict[int, dict[str, object]] = {8: {"num_splits": 8, "block_n": 32}}


def install_plans(plans: dict[int, dict[str, object]]) -> dict[int, dict[str, object]]:
    """Batch size -> knobs (``DecodePlan.knobs()``) that ``DecodePlan.make`` takes from now on
    (the others keep its rule); returns the plans that were installed before."""
    bad = [k for p in plans.values() for k in p if k not in KNOBS]
    if bad:
        raise ValueError(f"unknown decode plan fields {bad}; known: {list(KNOBS)}")
    saved = dict(_PLANS)
    _PLANS.clear()
    _PLANS.update({int(b): dict(p) for b, p in plans.items()})
    return saved


def candidates(b: int) -> list[dict[str, object]]:
    """Knobs of the plans a benchmark times at batch ``b`` besides ``DecodePlan.make``'s rule
    (labels: ``DecodePlan.label``; tests check each compiles and matches the reference)."""

    def p(splits: int, n: int = 64, w: int = 4, st: int = 2, pf: bool = False, m: bool = True,
          e: bool = False):  # fmt: skip
        return {"num_splits": splits, "block_n": n, "num_warps": w, "num_stages": st,
                "merge": m, "prefetch": pf or e, "early": e}  # fmt: skip

    if b <= 2:
        return [p(32), p(16), p(32, 32), p(16, pf=True), p(16, 32, pf=True), p(8, pf=True, w=8),
                p(16, e=True), p(16, 32, e=True)]  # fmt: skip
    return [
        p(8),  # the default with the merge folded in: what the merge alone costs
        p(8, pf=True), p(8, w=8, pf=True), p(4, pf=True), p(4, w=8, pf=True),
        p(2, w=8, pf=True), p(4, 128, 8, pf=True), p(8, 32, pf=True), p(4, 32, pf=True),
        p(16, 32, pf=True), p(8, e=True), p(4, e=True), p(4, 32, e=True),
        p(8, 128, 8), p(8, st=5), p(4, st=5), p(16),
        # the merge kernel kept (what the rule's plan does), other shapes around it
        p(4, m=False), p(6, m=False), p(16, m=False), p(8, 32, m=False), p(8, w=2, m=False),
        p(8, st=3, m=False), p(8, pf=True, m=False), p(4, pf=True, m=False),
        p(8, e=True, m=False), p(4, e=True, m=False), p(8, 128, 8, m=False),
        # the rule's plans at batch 17-64 on an H200 (one split, two), beside the others on a
        # batch of spread lengths (bench/results/decode_attention_spread_h200/)
        p(1, m=False), p(2, m=False),
        # no split at all (one program per sequence and KV head streams its whole context, the
        # output written directly: no merge kernel), the next tiles in flight
        p(1, pf=True), p(1, w=8, pf=True), p(1, e=True), p(1, w=8, e=True), p(1, 32, e=True),
        p(1, 128, 8, e=True), p(2, e=True), p(2, w=8, e=True),
    ]  # fmt: skip


def _tickets(device: torch.device, n: int) -> torch.Tensor:
    """One counter per (sequence, KV head) for ``merge`` plans (zeroed once; every call
    leaves them zero). Made by the first such call, which must not be inside a CUDA graph
    capture (warm-ups run first)."""
    t = _TICKETS.get(device)
    if t is None or t.numel() < n:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode attention's merge counters must be made before capture")
        t = _TICKETS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return t


_TICKETS: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _kv_rows(table, pos, end, block_size, stride_kb, stride_kt, head_off):
    """Offsets of the K/V rows of tokens ``pos`` (masked past ``end``) in their paged blocks."""
    n_mask = pos < end
    blk = tl.load(table + pos // block_size, mask=n_mask, other=0).to(tl.int64)
    return blk * stride_kb + (pos % block_size).to(tl.int64) * stride_kt + head_off, n_mask


@triton.jit
def _kv_tile(k_ptr, v_ptr, row, n_mask, offs_d, d_mask):
    m = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=m, other=0.0)
    v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=m, other=0.0)
    return k, v


@triton.jit
def _attend(q, k, v, n_mask, m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr):
    """One tile of the online softmax (an FP8 cache's tile is upcast here; its scales are in
    ``scale_log2`` and, at the end, ``v_scale``)."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _rotate(x_ptr, offs_d, mask, c, s, HALF: tl.constexpr):
    """Neox RoPE of the rows at ``x_ptr + offs_d`` (``c``/``s``: the token's cos and sin over
    the head), rounded as ``triton_rope_kv`` rounds."""
    x = tl.load(x_ptr + offs_d, mask=mask, other=0.0)
    partner = tl.load(x_ptr + tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF), mask=mask,
                      other=0.0)  # fmt: skip
    return rope_mix(x, c, tl.where(offs_d < HALF, -partner, partner), s)


@triton.jit
def _new_token(kn_ptr, vn_ptr, k_ptr, v_ptr, slot_block_ptr, slot_offset_ptr, head_off,
               stride_kb, stride_kt, offs_d, d_mask, c, s, k_inv, v_inv, owns,
               HALF: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """The new token of one (sequence, KV head), in the split that ``owns`` it (elsewhere no
    memory is touched): its k rotated, and k and v written into their cache slot (none for a
    negative block: a padding row) as ``triton_rope_kv`` writes them; returns the values the
    cache now holds. Done before the loop, so that its loads are not the program's tail."""
    mask = d_mask & owns
    k = _rotate(kn_ptr, offs_d, mask, c, s, HALF)
    v = tl.load(vn_ptr + offs_d, mask=mask, other=0.0)
    ty = k_ptr.dtype.element_ty
    kc = to_cache(k, k_inv, FP8).to(ty)
    vc = to_cache(v, v_inv, FP8).to(ty)
    blk = tl.load(slot_block_ptr, mask=owns, other=-1).to(tl.int64)
    off = tl.load(slot_offset_ptr, mask=owns, other=0).to(tl.int64)
    slot = blk * stride_kb + off * stride_kt + head_off
    tl.store(k_ptr + slot + offs_d, kc, mask=mask & (blk >= 0))
    tl.store(v_ptr + slot + offs_d, vc, mask=mask & (blk >= 0))
    return kc, vc


@triton.jit
def _rope_inputs(q_rows, kn_ptr, vn_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slot_block_ptr,
                 slot_offset_ptr, head_off, stride_kb, stride_kt, offs_d, d_mask, gd_mask, k_inv,
                 v_inv, owns, HALF: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """With ``ROPE``: the group's q heads (rows at ``q_rows``) rotated, and the new token's k
    and v as the cache now holds them (`_new_token`), from the token's cos and sin."""
    c = tl.load(cos_ptr + offs_d, mask=d_mask, other=0.0)
    s = tl.load(sin_ptr + offs_d, mask=d_mask, other=0.0)
    q = _rotate(q_rows, offs_d[None, :], gd_mask, c[None, :], s[None, :], HALF)
    kc, vc = _new_token(kn_ptr, vn_ptr, k_ptr, v_ptr, slot_block_ptr, slot_offset_ptr, head_off,
                        stride_kb, stride_kt, offs_d, d_mask, c, s, k_inv, v_inv, owns, HALF,
                        FP8)  # fmt: skip
    return q, kc, vc


@triton.jit
def _attend_new(q, kc, vc, m_i, l_i, acc, scale_log2):
    """The online softmax's step for the new token (``_new_token``'s values), as ``_attend``
    on a one-token tile: the products in float32, p rounded to q's dtype."""
    kf = kc.to(q.dtype).to(tl.float32)
    vf = vc.to(q.dtype).to(tl.float32)
    sc = tl.sum(q.to(tl.float32) * kf[None, :], 1) * scale_log2
    m_new = tl.maximum(m_i, sc)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p.to(q.dtype).to(tl.float32)[:, None] * vf[None, :]
    return m_new, l_i, acc


# The block tables' width changes from step to step outside CUDA graphs: not specialised on,
# so one compiled variant per plan serves every batch (``engine.warmup`` compiles each plan).
@triton.jit(do_not_specialize=["stride_tb"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, part_ptr, lse_ptr, out_ptr, tickets_ptr,
    scale_log2, v_scale,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    block_size, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr, MERGE: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_S: tl.constexpr,
    EARLY: tl.constexpr,
    kn_ptr=None, vn_ptr=None, cos_ptr=None, sin_ptr=None, slot_blocks_ptr=None,
    slot_offsets_ptr=None, k_inv=1.0, v_inv=1.0, stride_knb=0, stride_knh=0, stride_vnb=0,
    stride_vnh=0, stride_cos=0, stride_sin=0, ROPE: tl.constexpr = False,
    FP8: tl.constexpr = False,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # The lengths (and block tables, and KV older than the new tokens) are older than the
    # previous kernel: complete once that one passed its own wait and launched this one.
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    if PDL and not EARLY:  # programmatic dependent launch: the previous kernel's results first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(seq_len, start + per_split)
    # ROPE: q, k and v of the new token come unrotated from the QKV product, and the cache
    # does not hold the new token yet: the splits read the cache up to it (``end`` below), and
    # the split whose range holds it rotates its k, writes k and v into the cache and attends
    # to them from registers after its loop (one launch fewer than RoPE's kernel, then this).
    owns = (start <= seq_len - 1) & (seq_len - 1 < end)
    if ROPE:
        end = tl.minimum(end, seq_len - 1)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    gd_mask = (offs_g[:, None] < GROUP) & d_mask[None, :]
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_ptrs = q_rows + offs_d[None, :]
    head_off = kvh * stride_kh
    if not EARLY:
        if ROPE:
            q, kc, vc = _rope_inputs(q_rows, kn_ptr + b * stride_knb + kvh * stride_knh,
                                     vn_ptr + b * stride_vnb + kvh * stride_vnh,
                                     cos_ptr + b * stride_cos, sin_ptr + b * stride_sin, k_ptr,
                                     v_ptr, slot_blocks_ptr + b, slot_offsets_ptr + b, head_off,
                                     stride_kb, stride_kt, offs_d, d_mask, gd_mask, k_inv, v_inv,
                                     owns, HEAD_DIM // 2, FP8)  # fmt: skip
        else:
            q = tl.load(q_ptrs, mask=gd_mask, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = tables_ptr + b * stride_tb
    if PREFETCH:
        # Software pipeline in registers (the launch has num_stages=1): the next tile's K/V
        # loads are in flight while this tile is computed, and the block ids two tiles ahead.
        row0, n_mask = _kv_rows(table, start + offs_n, end, block_size, stride_kb, stride_kt,
                                head_off)  # fmt: skip
        if EARLY:
            # Before the PDL wait: the first tile but the new token (the previous kernel, the
            # KV write, writes it; block tables, lengths and older KV are older than the kernel
            # before it, complete once that one passed its own wait and launched this one).
            last = start + offs_n == seq_len - 1  # (with ROPE past ``end`` already)
            k, v = _kv_tile(k_ptr, v_ptr, row0, n_mask & ~last, offs_d, d_mask)
        else:
            k, v = _kv_tile(k_ptr, v_ptr, row0, n_mask, offs_d, d_mask)
        row, n_mask_next = _kv_rows(table, start + BLOCK_N + offs_n, end, block_size,
                                    stride_kb, stride_kt, head_off)  # fmt: skip
        if EARLY:
            if PDL:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            if ROPE:
                q, kc, vc = _rope_inputs(q_rows, kn_ptr + b * stride_knb + kvh * stride_knh,
                                         vn_ptr + b * stride_vnb + kvh * stride_vnh,
                                         cos_ptr + b * stride_cos, sin_ptr + b * stride_sin,
                                         k_ptr, v_ptr, slot_blocks_ptr + b,
                                         slot_offsets_ptr + b, head_off, stride_kb, stride_kt,
                                         offs_d, d_mask, gd_mask, k_inv, v_inv, owns,
                                         HEAD_DIM // 2, FP8)  # fmt: skip
            else:
                q = tl.load(q_ptrs, mask=gd_mask, other=0.0)
                k_new, v_new = _kv_tile(k_ptr, v_ptr, row0, n_mask & last, offs_d, d_mask)
                k = tl.where(last[:, None], k_new, k)
                v = tl.where(last[:, None], v_new, v)
        for n0 in range(start, end, BLOCK_N):
            k_next, v_next = _kv_tile(k_ptr, v_ptr, row, n_mask_next, offs_d, d_mask)
            row_next, n_mask_after = _kv_rows(table, n0 + 2 * BLOCK_N + offs_n, end, block_size,
                                              stride_kb, stride_kt, head_off)  # fmt: skip
            m_i, l_i, acc = _attend(q, k, v, n_mask, m_i, l_i, acc, scale_log2, DOT_PRECISION)
            k, v, n_mask, row, n_mask_next = k_next, v_next, n_mask_next, row_next, n_mask_after
    else:
        for n0 in range(start, end, BLOCK_N):
            row, n_mask = _kv_rows(table, n0 + offs_n, end, block_size, stride_kb, stride_kt,
                                   head_off)  # fmt: skip
            k, v = _kv_tile(k_ptr, v_ptr, row, n_mask, offs_d, d_mask)
            m_i, l_i, acc = _attend(q, k, v, n_mask, m_i, l_i, acc, scale_log2, DOT_PRECISION)
    if ROPE:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if owns:
            m_i, l_i, acc = _attend_new(q, kc, vc, m_i, l_i, acc, scale_log2)

    nonempty = l_i > 0.0
    out = acc * v_scale / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    if MERGE == 2:  # one split: the output itself
        o_ptr = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        p_off = b * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_ptr + p_off[:, None] + offs_d[None, :], out, mask=gd_mask)
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=offs_g < GROUP)
        if MERGE == 1:
            _merge_last(part_ptr, lse_ptr, out_ptr, tickets_ptr + b * tl.num_programs(1) + kvh,
                        b, kvh, num_splits, stride_pb, stride_ph, stride_ps, stride_lb,
                        stride_lh, stride_ob, stride_oh, GROUP, HEAD_DIM, BLOCK_S,
                        BLOCK_D)  # fmt: skip


@triton.jit
def _merge_last(part_ptr, lse_ptr, out_ptr, ticket, b, kvh, num_splits,
                stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                BLOCK_D: tl.constexpr):  # fmt: skip
    """The last split of a (sequence, KV head) to finish (its ticket, as split-K's in
    ``triton_skinny``) merges the group's heads as the merge kernel does; the ticket is left
    zero for the next call."""
    tl.debug_barrier()  # every thread's stores before the release below
    if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
        for g in tl.static_range(GROUP):
            _merge_head(part_ptr, lse_ptr, out_ptr, b, kvh * GROUP + g, num_splits,
                        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob,
                        stride_oh, HEAD_DIM, BLOCK_S, BLOCK_D, ".cg")  # fmt: skip
        tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_head(part_ptr, lse_ptr, out_ptr, b, h, num_splits,
                stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                CACHE: tl.constexpr):  # fmt: skip
    """Head ``h`` of sequence ``b``: its splits' outputs weighted by their sums (``CACHE``
    ".cg": read from L2, written by other programs of the same launch)."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask,
                  other=-float("inf"), cache_modifier=CACHE)  # fmt: skip
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (a padding row): output 0
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    p_off = b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :]
    part = tl.load(part_ptr + p_off, mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
                   other=0.0, cache_modifier=CACHE)  # fmt: skip
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    o_ptr = out_ptr + b * stride_ob + h * stride_oh + offs_d
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _decode_merge_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # programmatic dependent launch: the previous kernel's results first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _merge_head(
        part_ptr, lse_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64),
        num_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
        HEAD_DIM, BLOCK_S, BLOCK_D, "",
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Rope:
    """The new tokens' unrotated k and v (``[B, Hkv, D]``), cos and sin (``[B, D]``) and cache
    slots, for `decode_attention` to rotate and write them itself."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor

    def check(self, q: torch.Tensor, paged: PagedLayer) -> None:
        check_inputs(q, self.k, self.v, self.cos, self.sin, paged)
        b = q.shape[0]
        if self.slot_blocks.shape[0] < b or self.slot_offsets.shape[0] < b:
            raise ValueError("one cache slot per sequence")

    def kernel_args(self, k_scale: float, v_scale: float, fp8: bool) -> dict[str, object]:
        return dict(
            kn_ptr=self.k, vn_ptr=self.v, cos_ptr=self.cos, sin_ptr=self.sin,
            slot_blocks_ptr=self.slot_blocks, slot_offsets_ptr=self.slot_offsets,
            k_inv=1.0 / k_scale, v_inv=1.0 / v_scale, stride_knb=self.k.stride(0),
            stride_knh=self.k.stride(1), stride_vnb=self.v.stride(0), stride_vnh=self.v.stride(1),
            stride_cos=self.cos.stride(0), stride_sin=self.sin.stride(0), ROPE=True,
            FP8=fp8,
        )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: DecodePlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    rope: Rope | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """Attention of one new token per sequence (``q``: ``[B, H, D]``) over its paged KV (an
    FP8 cache holds ``k / k_scale`` and ``v / v_scale``).

    ``seq_lens[b]`` counts the KV of sequence ``b`` including the new token, already written;
    ``seq_lens[b] == 0`` gives a zero output (padding rows of a captured batch). With
    ``rope``, ``q`` and the new token's k are not rotated yet and its k and v not written:
    the kernel does what ``triton_rope_kv.rope_write_kv`` would have done first. ``pdl``:
    programmatic dependent launch where the GPU has it.
    """
    paged = PagedLayer.of(kv_cache, layer)
    b, h, d = q.shape
    if d != paged.head_dim or h % paged.num_kv_heads or q.stride(-1) != 1:
        raise ValueError(f"q {list(q.shape)} does not fit the cache's heads")
    if block_tables.stride(-1) != 1 or block_tables.shape[0] < b or seq_lens.shape[0] < b:
        raise ValueError("block_tables must be [B, max_blocks] with unit last stride")
    plan = plan or DecodePlan.make(q, paged)
    if plan.early and not plan.prefetch:
        raise ValueError("DecodePlan.early needs prefetch (its tiles are loaded before the loop)")
    if rope is not None:
        rope.check(q, paged)
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    part = torch.empty((b, h, plan.num_splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, h, plan.num_splits), dtype=torch.float32, device=q.device)
    merge = (2 if plan.num_splits == 1 else 1) if plan.merge else 0
    tickets = _tickets(q.device, b * plan.num_kv_heads) if merge == 1 else lse
    block_d = max(next_pow2(d), 16)
    block_s = max(next_pow2(plan.num_splits), 2)
    _decode_split_kernel[(b, plan.num_kv_heads, plan.num_splits)](
        q, paged.k, paged.v, block_tables, seq_lens, part, lse, out, tickets,
        scale * k_scale * LOG2E, v_scale,
        q.stride(0), q.stride(1), paged.stride_block, paged.stride_token, paged.stride_head,
        block_tables.stride(0), part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), paged.block_size,
        plan.num_splits,
        GROUP=plan.group, BLOCK_G=max(next_pow2(plan.group), 16), BLOCK_N=plan.block_n,
        HEAD_DIM=d, BLOCK_D=block_d, DOT_PRECISION=dot_precision(q.dtype), MERGE=merge,
        PREFETCH=plan.prefetch, BLOCK_S=block_s if merge == 1 else 2, EARLY=plan.early,
        num_warps=plan.num_warps,
        num_stages=1 if plan.prefetch else plan.num_stages, **pdl_kwargs(q, pdl),
        **(rope.kernel_args(k_scale, v_scale, paged.k.dtype == torch.float8_e4m3fn)
           if rope is not None else {}),
    )  # fmt: skip
    if merge:
        return out
    _decode_merge_kernel[(b, h)](
        part, lse, out, plan.num_splits,
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4,
        **pdl_kwargs(q, pdl),
    )  # fmt: skip
    return out

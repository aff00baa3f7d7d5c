"""Pure-PyTorch reference implementations of every kernel.

They define the semantics the Triton kernels must match, and they are what the engine runs on
CPU. KV pool layout (shared with libkv's transfer layer)::

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

Block-major: one block of *all* layers (K and V) is a single contiguous range, so moving a
block between workers is one descriptor, and copy-on-write of a block is one copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn  # KV cache and weights in FP8: e4m3, finite (no inf), max 448
FP8_MAX = 448.0


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """A linear weight in FP8 with one float32 scale per output row (per channel), made at
    load time: ``W ~= weight.float() * scale[:, None]``."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N] float32

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


def quantize_fp8_rows(w: torch.Tensor) -> Fp8Weight:
    """Per-row (output channel) FP8 of a ``[N, K]`` weight: each row's largest magnitude maps
    to 448."""
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return Fp8Weight(to_fp8(wf / scale[:, None]), scale)


def to_fp8(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``x / scale`` in e4m3, saturated at +-448 (a plain cast would give NaN past it)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step description of a flattened varlen batch (built once, shared by all layers).

    Tokens of sequence ``i`` occupy rows ``query_start_loc[i]:query_start_loc[i+1]`` of the
    flattened batch; they are the *last* ``q_len`` positions of a sequence whose KV length
    after this step is ``seq_lens[i]`` (so a cached prefix sits before them).
    """

    slot_blocks: torch.Tensor  # [T] block id of each new token's slot
    slot_offsets: torch.Tensor  # [T] offset inside that block
    block_tables: torch.Tensor  # [B, max_blocks] (padded with 0)
    seq_lens: torch.Tensor  # [B] KV length after this step
    query_start_loc: torch.Tensor  # [B+1]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Lazily built helpers of the reference path, shared by all layers of one step.
    scratch: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual) * weight, x + residual)``; computed in float32 like transformers."""
    if residual is not None:
        x = x + residual
    residual_out = x
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    out = weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)
    return out, residual_out


def linear(
    x: torch.Tensor, w: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ w.T + bias``; an FP8 weight is dequantized first (weight-only FP8 semantics)."""
    if isinstance(w, Fp8Weight):
        w = (w.weight.float() * w.scale[:, None]).to(x.dtype)
    return F.linear(x, w, bias)


def linear_fp8_qx(
    x: torch.Tensor, w: Fp8Weight, block: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """W8A8 as the skinny kernel's ``qx`` plans compute it: ``x`` in e4m3 with one scale per
    row and ``block`` columns (each block's largest magnitude maps to 448), times the
    dequantized weight, in float32."""
    m, k = x.shape
    xt = F.pad(x.float(), (0, -k % block)).view(m, -1, block)
    s = xt.abs().amax(-1, keepdim=True).clamp(min=1e-30) / FP8_MAX
    xq = (to_fp8(xt / s).float() * s).view(m, -1)[:, :k]
    return linear(xq, w, None if bias is None else bias.float())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``x = [gate | up]`` along the last dim."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox/HF-style RoPE. q: [T, H, D], k: [T, Hkv, D], cos/sin: [T, D] for each token."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def write_kv(
    kv_cache: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store new K/V rows ([T, Hkv, D]) into their paged slots of ``layer``. An FP8 cache
    stores ``k / k_scale`` and ``v / v_scale`` (saturated)."""
    if kv_cache.dtype == FP8:
        k, v = to_fp8(k, k_scale), to_fp8(v, v_scale)
    layer_kv = kv_cache.select(1, layer)
    layer_kv.select(1, 0)[meta.slot_blocks, meta.slot_offsets] = k.to(kv_cache.dtype)
    layer_kv.select(1, 1)[meta.slot_blocks, meta.slot_offsets] = v.to(kv_cache.dtype)


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """RoPE of q and k, then the write of the rotated k and v into ``layer``; returns q."""
    q, k = rotary_embedding(q, k, cos, sin)
    write_kv(kv_cache, layer, k, v, meta, k_scale, v_scale)
    return q


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of new tokens over their sequences' paged KV (cached prefix included).

    q: [T, H, D] flattened varlen queries; returns [T, H, D]. GQA: H is a multiple of Hkv. An
    FP8 cache is read as ``k * k_scale``, ``v * v_scale``.
    """
    pad_idx, mask = _padding(meta, q.device)
    b, max_q = meta.num_seqs, meta.max_query_len
    t, h, d = q.shape
    qp = q.new_zeros(b * max_q, h, d)
    qp[pad_idx] = q
    qp = qp.view(b, max_q, h, d).transpose(1, 2)  # [B, H, Q, D]
    k, v = _gather_kv(kv_cache, layer, meta)  # [B, Hkv, S, D]
    if kv_cache.dtype == FP8:
        k, v = k.float() * k_scale, v.float() * v_scale
    k, v = k.to(q.dtype), v.to(q.dtype)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(b * max_q, h, d)[pad_idx]


def _gather_kv(
    kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    # One gather per K and V straight into [B*nb, bs, Hkv, D]: it views as [B, S, Hkv, D] and
    # SDPA takes the transposed view, so no second (permute) copy is made. The old gather of
    # both halves at once plus a permute copy was 84% of a batch-16 CPU decode step.
    max_blocks = -(-meta.max_seq_len // meta.block_size)
    tables = meta.block_tables[:, :max_blocks]
    b, nb = tables.shape
    flat = tables.reshape(-1)
    layer_kv = kv_cache.select(1, layer)  # [NB, 2, bs, Hkv, D]
    _, _, bs, hkv, d = layer_kv.shape
    k, v = (
        layer_kv.select(1, j).index_select(0, flat).view(b, nb * bs, hkv, d).transpose(1, 2)
        for j in (0, 1)
    )
    return k, v


def _padding(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index of each token in the padded [B*max_q] layout, and the [B,1,Q,S] causal mask."""
    cached = meta.scratch.get("padding")
    if cached is not None:
        return cached
    b, max_q = meta.num_seqs, meta.max_query_len
    s = -(-meta.max_seq_len // meta.block_size) * meta.block_size
    starts = meta.query_start_loc[:-1]
    q_lens = meta.query_start_loc[1:] - starts
    seq_of_token = torch.repeat_interleave(torch.arange(b, device=device), q_lens)
    local = torch.arange(int(meta.query_start_loc[-1]), device=device) - starts[seq_of_token]
    pad_idx = seq_of_token * max_q + local
    # Query row j of sequence i sits at absolute position seq_len - q_len + j.
    q_pos = (meta.seq_lens - q_lens).unsqueeze(1) + torch.arange(max_q, device=device)
    kv_pos = torch.arange(s, device=device)
    mask = kv_pos.view(1, 1, s) <= q_pos.unsqueeze(2)  # [B, Q, S]
    mask &= kv_pos.view(1, 1, s) < meta.seq_lens.view(b, 1, 1)
    mask[:, :, 0] = True  # padded query rows must see one key (their output is discarded)
    cached = (pad_idx, mask.unsqueeze(1))
    meta.scratch["padding"] = cached
    return cached


def copy_blocks_between(
    dst: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for whole blocks of two pools."""
    dst[dst_idx] = src[src_idx]


def block_wsum64(words: torch.Tensor, block_idx: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """The odd-weighted 64-bit sum of whole blocks (``engine.kv_checksum``'s ``wsum64``):
    ``sum_i (2(i + offset) + 1) * x_i`` modulo 2^64 over the int64 words ``x_i`` of each block
    ``block_idx[b]`` of a ``[num_blocks, words]`` int64 pool; one int64 per block (the bits of
    the unsigned sum). Gathers the blocks and multiplies in a temporary: several passes."""
    weights = (torch.arange(words.shape[1], dtype=torch.int64, device=words.device) + offset) * 2
    return (words.index_select(0, block_idx) * (weights + 1)).sum(dim=1)


def count_mismatches(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many entries of two equal-length int64 vectors differ (a block's checksum as it
    arrived against the sender's), as a 0-dim int64 on their device."""
    return (got != want).sum()


def copy_sum_check_blocks_between(
    dst: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
    sums: torch.Tensor, want: torch.Tensor, tickets: torch.Tensor, state: torch.Tensor,
    out: torch.Tensor, total: int, offset: int = 0,
) -> None:  # fmt: skip
    """The fused copy, sum and compare (``kernels.copy_sum_check_blocks_between``) in torch:
    the same in-out protocol (``sums`` added to; ``state``'s blocks done and mismatches, packed
    in one word, written to ``out`` and cleared after the ``total``-th block; ``tickets`` stay
    zero)."""
    if src_idx.numel() == 0:
        return
    copy_blocks_between(dst, src, src_idx, dst_idx)
    sums += block_wsum64(dst.view(torch.int64), dst_idx, offset)
    seen = int(state) + src_idx.numel() * (1 << 32) + int((sums != want).sum())
    if seen >> 32 == total:
        out.fill_(seen & 0xFFFFFFFF)
        seen = 0
    state.fill_(seen)


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks (all layers, K and V): ``kv_cache[dst[i]] = kv_cache[src[i]]`` (as
    bytes, so any element type, FP8 included, is copied alike)."""
    raw = kv_cache.view(torch.uint8)
    raw[dst] = raw[src]


LORA_TILE_M = 16  # rows of one LoRA tile (the Triton kernel's BLOCK_M)


def lora_tiles(
    token_slots: list[int], tile_m: int = LORA_TILE_M
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The tile form of a batch's slots: ``rows`` (the tokens with an adapter, grouped by slot
    in ascending order, each slot's tokens in order) and one (start, length, slot) per tile of
    at most ``tile_m`` rows of one slot, ``rows[start:start + length]``."""
    by_slot: dict[int, list[int]] = {}
    for t, s in enumerate(token_slots):
        if s >= 0:
            by_slot.setdefault(s, []).append(t)
    rows: list[int] = []
    starts: list[int] = []
    lens: list[int] = []
    slots: list[int] = []
    for s, r in sorted(by_slot.items()):
        for i in range(0, len(r), tile_m):
            starts.append(len(rows) + i)
            lens.append(min(tile_m, len(r) - i))
            slots.append(s)
        rows.extend(r)
    return rows, starts, lens, slots


def max_lora_tiles(num_rows: int, max_slots: int, tile_m: int = LORA_TILE_M) -> int:
    """Tiles enough for any mix of ``num_rows`` tokens over ``max_slots`` slots (each slot's
    last tile may be partly empty; no tile is wholly empty)."""
    return max(1, min(num_rows, -(-num_rows // tile_m) + max_slots))


def lora_tile_table(
    token_slots: list[int], num_rows: int, num_tiles: int, tile_m: int = LORA_TILE_M
) -> list[int]:
    """``lora_tiles`` padded to fixed sizes, as one list: ``rows`` (``num_rows``), then tile
    starts, lengths and slots (``num_tiles`` each). Padding rows are 0 and padding tiles have
    length 0 (the kernels skip them), so a captured CUDA graph serves any mix."""
    rows, starts, lens, slots = lora_tiles(token_slots, tile_m)
    if len(rows) > num_rows or len(starts) > num_tiles:
        raise ValueError(f"{len(rows)} rows in {len(starts)} tiles exceed {num_rows}/{num_tiles}")
    pad_t = [0] * (num_tiles - len(starts))
    return rows + [0] * (num_rows - len(rows)) + starts + pad_t + lens + pad_t + slots + pad_t


@dataclass(slots=True)
class LoRAMetadata:
    """Which LoRA slot each token of a flattened batch uses, built once per step.

    Two forms. The reference path walks ``groups`` (the rows of each slot present). The tile
    form (what the Triton kernel walks) has tiles of at most ``LORA_TILE_M`` tokens of one slot:
    ``rows[tile_start[i]:tile_start[i] + tile_len[i]]`` are the token rows of tile ``i``, all of
    slot ``tile_slot[i]`` (a segmented product with a gather, so a slot's tokens need not be
    contiguous); tiles of length 0 are padding (``lora_tile_table``: the fixed-size tables a
    decode CUDA graph reads). ``ranks[s]`` and ``scales[s]`` are the rank and PEFT scale of the
    adapter in slot ``s`` (``scales_t``: the same on the device).
    """

    ranks: list[int]
    scales: list[float]
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    rows: torch.Tensor | None = None  # [T'] int32, tokens with an adapter, grouped by slot
    tile_start: torch.Tensor | None = None  # [tiles] int32
    tile_len: torch.Tensor | None = None
    tile_slot: torch.Tensor | None = None
    scales_t: torch.Tensor | None = None  # [S] float32

    @classmethod
    def build(
        cls, token_slots: list[int], ranks: list[int], scales: list[float],
        device: torch.device, tile_m: int = LORA_TILE_M,
    ) -> LoRAMetadata:  # fmt: skip
        """The groups form off CUDA, the tile form (unpadded) on CUDA."""
        rows, starts, lens, slots = lora_tiles(token_slots, tile_m)
        if device.type != "cuda":
            return cls(ranks, scales, _groups(rows, starts, lens, slots, device))

        def i32(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int32, device=device)

        return cls(
            ranks, scales, [], i32(rows), i32(starts), i32(lens), i32(slots),
            torch.tensor(scales, dtype=torch.float32, device=device),
        )  # fmt: skip

    @property
    def active(self) -> bool:
        return bool(self.groups) or (self.tile_slot is not None and self.tile_slot.numel() > 0)

    def slot_groups(self) -> list[tuple[int, torch.Tensor]]:
        """``groups``, or (tile form) the same groups read back from the tiles: the rows of a
        slot's tiles in order, padding tiles skipped (host reads; for the reference path)."""
        if self.groups or self.rows is None:
            return self.groups
        assert self.tile_start is not None and self.tile_len is not None
        assert self.tile_slot is not None
        starts, lens, slots = (t.tolist() for t in (self.tile_start, self.tile_len, self.tile_slot))
        return _groups(self.rows.tolist(), starts, lens, slots, self.rows.device)


def _groups(
    rows: list[int], starts: list[int], lens: list[int], slots: list[int], device: torch.device
) -> list[tuple[int, torch.Tensor]]:
    by_slot: dict[int, list[int]] = {}
    for start, n, s in zip(starts, lens, slots, strict=True):
        if n > 0:
            by_slot.setdefault(s, []).extend(rows[start : start + n])
    return [(s, torch.tensor(r, device=device)) for s, r in sorted(by_slot.items())]


def lora_add(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: LoRAMetadata
) -> None:
    """``y[t] += (x[t] @ a[s].T) @ b[s].T * scale[s]`` for each token ``t`` of slot ``s``.

    ``a``: [S, R, in] and ``b``: [S, out, R] hold every slot's matrices zero-padded to rank R;
    ``y`` ([T, out], may be a column slice of a fused projection) is updated in place. Computed
    as PEFT does (``lora_B(lora_A(x)) * scaling``) on the adapter's own rank."""
    for s, rows in meta.slot_groups():
        r = meta.ranks[s]
        delta = F.linear(F.linear(x[rows], a[s, :r]), b[s, :, :r].contiguous()) * meta.scales[s]
        y[rows] += delta


def lora_add_fused(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, widths: list[int],
    meta: LoRAMetadata,
) -> None:  # fmt: skip
    """``lora_add`` for the projections of one input that share a fused output (q/k/v,
    gate/up): ``a`` [S, len(widths) * R, in] holds each projection's A stacked, ``b``
    [S, sum(widths), R] each one's B in the output's column order, ``y`` [T, sum(widths)].
    The same as one ``lora_add`` per projection on its columns of ``y``."""
    r = a.shape[1] // len(widths)
    lo = 0
    for j, w in enumerate(widths):
        lora_add(y[:, lo : lo + w], x, a[:, j * r : (j + 1) * r], b[:, lo : lo + w], meta)
        lo += w

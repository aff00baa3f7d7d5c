"""Triton kernels against the PyTorch references on fresh random inputs (CUDA only).

Attention is compared with the reference in float32 on the upcast bf16 inputs, by
``||out - ref|| / ||ref||``; pointwise kernels round like their references and are compared
in the same dtype. Shapes cover block sizes, GQA ratios (MHA to MQA), head dims that are not
powers of two, lengths that are not multiples of the block, and cached-prefix offsets.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.triton_cache import write_kv  # noqa: E402
from kernels.triton_decode import DecodePlan, decode_attention  # noqa: E402
from kernels.triton_norm import rms_norm, silu_and_mul  # noqa: E402
from kernels.triton_prefill import prefill_attention  # noqa: E402
from kernels.triton_rope import rotary_embedding  # noqa: E402
from tests.kernel_cases import make_paged_batch, reference_attention, rel_err  # noqa: E402

ATTN_TOL = 1e-2  # bf16 operands: expected 1e-3 .. 1e-2

DECODE_CASES = [  # block_size, heads, kv_heads, head_dim, seq_lens
    (16, 32, 8, 128, [1, 17, 1000, 4097]),  # Llama-3.1-8B heads
    (16, 9, 3, 64, [5, 300, 31]),  # SmolLM2 heads
    (8, 4, 4, 64, [33, 2, 8]),  # MHA
    (32, 16, 1, 128, [1023, 65]),  # MQA
    (1, 8, 2, 128, [7, 50]),  # one token per block
    (64, 14, 2, 64, [129, 900, 64]),  # group of 7
    (16, 8, 2, 80, [77, 3]),  # head_dim not a power of two
    (16, 40, 8, 128, [2000]),  # group of 5
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"bs{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}")
def test_decode_attention(case):
    bs, h, hkv, d, lens = case
    q, kv, meta = make_paged_batch(
        lens, [1] * len(lens), block_size=bs, num_heads=h, num_kv_heads=hkv, head_dim=d, seed=3
    )
    out = decode_attention(q, kv, 1, meta.block_tables, meta.seq_lens, d**-0.5)
    assert rel_err(out, reference_attention(q, kv, 1, meta, d**-0.5)) < ATTN_TOL


def test_decode_attention_many_sequences_fp16():
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 3000, (40,), generator=g).tolist()
    q, kv, meta = make_paged_batch(
        lens, [1] * 40, block_size=16, num_heads=8, num_kv_heads=2, head_dim=128,
        dtype=torch.float16, seed=5,
    )  # fmt: skip
    out = decode_attention(q, kv, 0, meta.block_tables, meta.seq_lens, 0.1)
    assert rel_err(out, reference_attention(q, kv, 0, meta, 0.1)) < ATTN_TOL


@pytest.mark.parametrize("splits", [1, 2, 7, 32])
def test_decode_attention_any_split_count(splits):
    lens = [4097, 1, 513, 64]
    q, kv, meta = make_paged_batch(
        lens, [1] * 4, block_size=16, num_heads=32, num_kv_heads=8, head_dim=128, seed=splits
    )
    plan = DecodePlan(4, 32, 8, 128, num_splits=splits)
    out = decode_attention(q, kv, 0, meta.block_tables, meta.seq_lens, 0.08, plan)
    assert rel_err(out, reference_attention(q, kv, 0, meta, 0.08)) < ATTN_TOL


def test_decode_attention_padding_rows_are_zero():
    q, kv, meta = make_paged_batch(
        [40, 9, 100], [1] * 3, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64
    )
    ref = reference_attention(q, kv, 0, meta, 0.125)
    meta.seq_lens[1] = 0
    out = decode_attention(q, kv, 0, meta.block_tables, meta.seq_lens, 0.125)
    assert out[1].abs().max().item() == 0
    assert rel_err(out[[0, 2]], ref[[0, 2]]) < ATTN_TOL


def test_decode_attention_in_cuda_graph_follows_new_lengths():
    """A graph captured once stays right when tables and lengths change (no host lengths)."""
    q, kv, meta = make_paged_batch(
        [300, 20], [1, 1], block_size=16, num_heads=8, num_kv_heads=2, head_dim=128, seed=7
    )
    tables = torch.zeros((2, 64), dtype=torch.int32, device="cuda")
    lens = torch.zeros(2, dtype=torch.long, device="cuda")
    decode_attention(q, kv, 0, tables, lens, 0.1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, kv, 0, tables, lens, 0.1)
    for seq_lens in ([300, 20], [17, 250], [1, 1]):
        meta.seq_lens.copy_(torch.tensor(seq_lens))
        tables.zero_()
        tables[:, : meta.block_tables.shape[1]] = meta.block_tables
        lens.copy_(meta.seq_lens)
        graph.replay()
        assert rel_err(out, reference_attention(q, kv, 0, meta, 0.1)) < ATTN_TOL


PREFILL_CASES = [  # block_size, heads, kv_heads, head_dim, seq_lens, q_lens
    (16, 32, 8, 128, [1000], [1000]),  # no prefix
    (16, 32, 8, 128, [1500, 300], [700, 300]),  # cached prefix of 800
    (16, 9, 3, 64, [100, 37, 260], [1, 37, 200]),  # a decode row inside a prefill batch
    (8, 4, 2, 64, [129, 64], [3, 64]),
    (32, 8, 1, 128, [513], [100]),
    (1, 4, 4, 64, [40, 70], [40, 10]),
    (16, 8, 2, 80, [77, 200], [77, 50]),
    (16, 8, 8, 256, [300], [120]),
    (16, 12, 4, 128, [5, 1, 2], [5, 1, 2]),  # every query shorter than the tile
]


@pytest.mark.parametrize(
    "case", PREFILL_CASES, ids=lambda c: f"bs{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}-q{c[5]}"
)
def test_prefill_attention(case):
    bs, h, hkv, d, lens, q_lens = case
    q, kv, meta = make_paged_batch(
        lens, q_lens, block_size=bs, num_heads=h, num_kv_heads=hkv, head_dim=d, seed=11
    )
    out = prefill_attention(
        q, kv, 1, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        meta.max_query_len, d**-0.5,
    )  # fmt: skip
    assert rel_err(out, reference_attention(q, kv, 1, meta, d**-0.5)) < ATTN_TOL


def test_dispatch_picks_decode_and_prefill_kernels():
    q, kv, meta = make_paged_batch(
        [50, 70], [1, 1], block_size=16, num_heads=8, num_kv_heads=2, head_dim=64
    )
    ref = reference_attention(q, kv, 0, meta, 0.125)
    assert rel_err(kernels.paged_attention(q, kv, 0, meta, 0.125), ref) < ATTN_TOL
    q, kv, meta = make_paged_batch(
        [50, 70], [20, 1], block_size=16, num_heads=8, num_kv_heads=2, head_dim=64
    )
    ref = reference_attention(q, kv, 0, meta, 0.125)
    assert rel_err(kernels.paged_attention(q, kv, 0, meta, 0.125), ref) < ATTN_TOL


@pytest.mark.parametrize("bs,hkv,d", [(16, 8, 128), (8, 3, 64), (1, 1, 80), (32, 2, 256)])
def test_write_kv_matches_reference(bs, hkv, d):
    _, kv, meta = make_paged_batch(
        [37, 5, 64], [30, 5, 1], block_size=bs, num_heads=hkv, num_kv_heads=hkv, head_dim=d
    )
    t = int(meta.query_start_loc[-1])
    qkv = torch.randn(t, 3 * hkv * d, device="cuda").to(torch.bfloat16)  # strided views
    k = qkv[:, hkv * d : 2 * hkv * d].view(t, hkv, d)
    v = qkv[:, 2 * hkv * d :].view(t, hkv, d)
    expected = kv.clone()
    reference.write_kv(expected, 1, k, v, meta)
    write_kv(kv, 1, k, v, meta.slot_blocks, meta.slot_offsets)
    assert torch.equal(kv, expected)


def test_write_kv_skips_padding_rows():
    _, kv, meta = make_paged_batch([20, 9], [1, 1], block_size=16, num_heads=2, num_kv_heads=2,
                                   head_dim=64)  # fmt: skip
    before = kv.clone()
    k = torch.randn(2, 2, 64, device="cuda").to(torch.bfloat16)
    blocks = meta.slot_blocks.clone()
    blocks[1] = -1
    write_kv(kv, 0, k, k, blocks, meta.slot_offsets)
    expected = before.clone()
    expected[meta.slot_blocks[0], 0, :, meta.slot_offsets[0]] = k[0]
    assert torch.equal(kv, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,n", [(1, 576), (7, 4096), (300, 1000), (3, 8192)])
def test_rms_norm_with_and_without_residual(dtype, t, n):
    x = torch.randn(t, n, device="cuda").to(dtype)
    r = torch.randn(t, n, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    out, res = rms_norm(x, w, 1e-5, r)
    ref_out, ref_res = reference.rms_norm(x, w, 1e-5, r)
    assert torch.equal(res, ref_res)
    assert rel_err(out, ref_out) < tol
    out, res = rms_norm(x, w, 1e-6)
    assert res is x and rel_err(out, reference.rms_norm(x, w, 1e-6)[0]) < tol


@pytest.mark.parametrize("t,n", [(1, 1536), (33, 14336), (5, 100)])
def test_silu_and_mul(t, n):
    x = torch.randn(t, 2 * n, device="cuda").to(torch.bfloat16)
    assert rel_err(silu_and_mul(x), reference.silu_and_mul(x)) < 1e-2


@pytest.mark.parametrize("h,hkv,d", [(32, 8, 128), (9, 3, 64), (4, 4, 80)])
def test_rotary_embedding_on_strided_views(h, hkv, d):
    t = 37
    qkv = torch.randn(t, (h + 2 * hkv) * d, device="cuda").to(torch.bfloat16)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    ang = torch.rand(t, d // 2, device="cuda") * 100
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(torch.bfloat16)
    out_q, out_k = rotary_embedding(q, k, cos, sin)
    ref_q, ref_k = reference.rotary_embedding(q, k, cos, sin)
    assert rel_err(out_q, ref_q) < 1e-2 and rel_err(out_k, ref_k) < 1e-2


def test_linear_dispatch():
    w = torch.randn(300, 256, device="cuda").to(torch.bfloat16)
    rows = kernels.KernelChoices().skinny_rows
    for m in (1, rows, 40):  # the skinny Triton kernel up to skinny_rows rows, then cuBLAS
        x = torch.randn(m, 256, device="cuda").to(torch.bfloat16)
        assert rel_err(kernels.linear(x, w), x.float() @ w.float().T) < 1e-2


@pytest.mark.parametrize("block_bytes,n", [(2 * 1024**2, 37), (368_640, 64), (4096, 5)])
def test_copy_blocks_between_pools(block_bytes, n):
    from kernels.triton_copy import copy_blocks_between

    g = torch.Generator(device="cuda").manual_seed(block_bytes + n)
    src = torch.randint(0, 256, (2 * n, block_bytes), dtype=torch.uint8, device="cuda", generator=g)
    dst = torch.full((3 * n, block_bytes), 7, dtype=torch.uint8, device="cuda")  # poisoned
    src_idx = torch.randperm(2 * n, device="cuda", generator=g)[:n]
    dst_idx = torch.randperm(3 * n, device="cuda", generator=g)[:n]
    want = dst.clone()
    reference.copy_blocks_between(want, src, src_idx, dst_idx)
    copy_blocks_between(dst, src, src_idx, dst_idx)
    torch.cuda.synchronize()
    assert torch.equal(dst, want)  # copied blocks exact, the others untouched


@pytest.mark.parametrize(
    ("words", "n", "offset"),
    [(8, 3, 0), (1000, 5, 7), (262144, 17, 0), (262144 // 4, 9, 3 * 262144 // 4), (8197, 4, 2**40)],
)
def test_block_wsum64_equals_the_torch_reference(words, n, offset):
    """The Triton ``wsum64`` equals the torch reference bit for bit (so sums keep their values
    and tensor-parallel parts still add up): 2 MiB blocks of the 8B shape, a rank's quarter at
    its canonical offset, odd sizes, block ids repeated and in any order."""
    from kernels.triton_checksum import block_wsum64

    torch.manual_seed(3)
    pool = torch.randint(-(2**63), 2**63 - 1, (2 * n, words), dtype=torch.int64, device="cuda")
    idx = torch.randperm(2 * n, device="cuda")[:n].to(torch.int32)
    idx[-1] = idx[0]
    want = reference.block_wsum64(pool, idx.long(), offset)
    assert torch.equal(block_wsum64(pool, idx, offset), want)
    assert torch.equal(kernels.block_wsum64(pool, idx.long(), offset), want)


def test_sealed_sums_on_a_gpu_pool_match_a_fresh_checksum():
    """Checked KV on a bf16 GPU pool: sums kept at sealing (on the device) and a partial block
    summed at hand-off give what the sender computed before (``BlockChecksums``)."""
    from engine.kv_checksum import BlockChecksums, SealedSums

    torch.manual_seed(4)
    cache = torch.randn(12, 8, 4, 2, 16, 128, device="cuda").to(torch.bfloat16)
    fn = BlockChecksums(cache)
    assert fn.algorithm == "wsum64"
    sums = SealedSums(fn, 12)
    sums.seal([3, 7, 1])
    ids = [7, 3, 5, 1]
    assert sums.read(ids, [True, True, False, True]) == fn(ids)
    cache[7].zero_()  # written after sealing (never happens in the engine): the kept sum stays
    assert sums.read([7], [True]) != fn([7])


@pytest.mark.parametrize(("block_bytes", "n", "offset"), [(2 * 1024**2, 37, 0), (4096 + 8, 5, 9)])
def test_copy_sum_blocks_between_copies_and_sums_what_it_moved(block_bytes, n, offset):
    """The fused copy moves exactly what the plain one does and returns each block's
    ``wsum64`` equal to the torch reference over the written block."""
    from kernels.triton_copy import copy_sum_blocks_between

    g = torch.Generator(device="cuda").manual_seed(block_bytes + n)
    src = torch.randint(0, 256, (2 * n, block_bytes), dtype=torch.uint8, device="cuda", generator=g)
    dst = torch.full((3 * n, block_bytes), 7, dtype=torch.uint8, device="cuda")
    src_idx = torch.randperm(2 * n, device="cuda", generator=g)[:n]
    dst_idx = torch.randperm(3 * n, device="cuda", generator=g)[:n]
    want = dst.clone()
    reference.copy_blocks_between(want, src, src_idx, dst_idx)
    sums = copy_sum_blocks_between(dst, src, src_idx, dst_idx, offset)
    assert torch.equal(dst, want)
    assert torch.equal(sums, reference.block_wsum64(want.view(torch.int64), dst_idx, offset))


@pytest.mark.parametrize(("block_bytes", "n"), [(2 * 1024**2, 64), (4096 + 8, 300), (64, 1500)])
def test_the_fused_check_counts_exactly_under_concurrent_programs(block_bytes, n):
    """The CUDA IPC check in the copy (``copy_sum_check_blocks_between``): up to 128 programs
    per block race for its ticket and thousands of blocks for the count, 20 calls in a row on
    one workspace, each with other wrong sums: every count exact, every block copied bit for
    bit, the sums the reference's, the workspace zero after each call, the count stored into
    a device scalar and into pinned host memory alike."""
    from kernels.triton_copy_check import copy_sum_check_blocks_between

    g = torch.Generator(device="cuda").manual_seed(n)
    src = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8, device="cuda", generator=g)
    si = torch.randperm(n, device="cuda", generator=g)
    di = torch.randperm(n, device="cuda", generator=g)
    truth = reference.block_wsum64(src.view(torch.int64), si)
    work = torch.zeros(n + 1, dtype=torch.int64, device="cuda")
    host = torch.empty((), dtype=torch.int64, pin_memory=True)
    for call in range(20):
        dst = torch.zeros_like(src)
        wrong = torch.randperm(n, device="cuda", generator=g)[: (call * 7) % (n + 1)]
        want = truth.clone()
        want[wrong] ^= 1 << (call % 63)
        sums = torch.zeros(n, dtype=torch.int64, device="cuda")
        out = host if call % 2 else torch.empty((), dtype=torch.int64, device="cuda")
        host.fill_(-1)
        copy_sum_check_blocks_between(dst, src, si, di, sums, want, work[1:], work[:1], out, n)
        torch.cuda.synchronize()
        assert int(out) == wrong.numel(), call
        assert torch.equal(dst[di], src[si]) and torch.equal(sums, truth)
        assert not work.any()


@pytest.mark.parametrize("n", [0, 1, 63, 1024, 4097])
def test_count_mismatches_equals_the_torch_reference(n):
    """The compare-and-count behind the CUDA IPC copy: the sender's sums as a row of the
    uploaded ``[3, n]`` ids-and-sums tensor (any alignment), top bits and low bits differing."""
    from kernels.triton_checksum import count_mismatches

    g = torch.Generator(device="cuda").manual_seed(n)
    got = torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, device="cuda", generator=g)
    rows = torch.stack([got, got, got])
    rows[2, : n // 3] ^= -(1 << 63)
    rows[2, n // 3 : n // 2] ^= 1
    want = reference.count_mismatches(got, rows[2])
    assert int(want) == n // 2
    for fn in (count_mismatches, kernels.count_mismatches):
        out = fn(got, rows[2])
        assert out.shape == () and out.dtype == torch.int64 and torch.equal(out, want)

"""CUDA only: every decode-attention plan a benchmark times (``triton_decode.candidates``: the last
split merging by ticket, the register prefetch, one to 32 splits, 32- to 128-token tiles)
against the reference, bf16 and FP8 KV, padding rows, the tickets left zero for the next call
and for a CUDA graph's replays, and ``install_plans`` reaching ``DecodePlan.make``."""

from __future__ import annotations

import pytest
import torch

from tests.gpu_report import fp8_capable, require_cuda_triton

pytestmark = pytest.mark.gpu
require_cuda_triton()

from kernels import triton_decode as T  # noqa: E402
from kernels.triton_cache import PagedLayer  # noqa: E402
from kernels.triton_decode import candidates  # noqa: E402
from tests.gpu.test_fp8_spec_gpu import fp8_cache  # noqa: E402
from tests.kernel_cases import make_paged_batch, reference_attention, rel_err  # noqa: E402

KNOBS = {T.DecodePlan(1, 1, 1, 1, **k).label(): k for b in (1, 8) for k in candidates(b)}  # type: ignore[arg-type]
KNOBS["s1_n64_w4_pf_m"] = {"num_splits": 1, "prefetch": True, "merge": True}
KNOBS["s3_n64_w4_st2_m"] = {"num_splits": 3, "merge": True}
# One of each kind (the bench checks every plan's output against the rule's on its own cases)
TESTED = ["s1_n64_w4_pf_m", "s3_n64_w4_st2_m", "s32_n64_w4_st2_m", "s16_n32_w4_pf_m",
          "s8_n64_w4_pf_m", "s2_n64_w8_pf_m", "s4_n128_w8_pf_m", "s8_n128_w8_st2_m",
          "s4_n64_w4_st5_m", "s4_n64_w4_pfe_m", "s16_n32_w4_pfe_m",
          "s8_n64_w4_pfe_m"]  # fmt: skip  # (the last: FP8_KV_PLANS[8])
LENS = [1, 17, 1000, 4097, 64, 129]


def _plan(knobs: dict) -> T.DecodePlan:
    return T.DecodePlan(len(LENS), 32, 8, 128, **knobs)


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def batch(request):
    """(q, kv, meta, k_scale, v_scale, reference) made once per KV dtype; row 4 is padding."""
    if request.param == "fp8" and not fp8_capable():
        pytest.skip("FP8 needs compute capability 8.9+")
    q, kv, meta = make_paged_batch(
        LENS, [1] * len(LENS), block_size=16, num_heads=32, num_kv_heads=8, head_dim=128, seed=2
    )
    ks, vs = (0.5, 2.0) if request.param == "fp8" else (1.0, 1.0)
    if request.param == "fp8":
        kv = fp8_cache(kv.float(), ks, vs)
    ref = reference_attention(q, kv, 1, meta, 0.088, ks, vs)
    meta.seq_lens[4] = 0  # a padding row: zeros
    ref[4] = 0
    return q, kv, meta, ks, vs, ref


@pytest.mark.parametrize("label", TESTED)
def test_plan_matches_reference(label, batch):
    q, kv, meta, ks, vs, ref = batch
    plan = _plan(KNOBS[label])
    for _ in range(2):  # the second call sees the tickets the first one left
        out = T.decode_attention(q, kv, 1, meta.block_tables, meta.seq_lens, 0.088, plan, ks, vs)
        assert out[4].abs().max().item() == 0
        assert rel_err(out, ref) < 1e-2
    if plan.merge and plan.num_splits > 1:
        assert T._TICKETS[q.device].abs().sum().item() == 0


@pytest.mark.parametrize("label", ["s8_n64_w4_pf_m", "s32_n64_w4_st2_m"])
def test_merge_plans_in_cuda_graph_follow_new_lengths(label):
    q, kv, meta = make_paged_batch(
        [300, 20], [1, 1], block_size=16, num_heads=32, num_kv_heads=8, head_dim=128, seed=7
    )
    tables = torch.zeros((2, 64), dtype=torch.int32, device="cuda")
    lens = torch.zeros(2, dtype=torch.long, device="cuda")
    plan = T.DecodePlan(2, 32, 8, 128, **KNOBS[label])  # type: ignore[arg-type]
    T.decode_attention(q, kv, 0, tables, lens, 0.1, plan)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = T.decode_attention(q, kv, 0, tables, lens, 0.1, plan)
    for seq_lens in ([300, 20], [17, 250], [1, 1], [300, 300]):
        meta.seq_lens.copy_(torch.tensor(seq_lens))
        tables.zero_()
        tables[:, : meta.block_tables.shape[1]] = meta.block_tables
        lens.copy_(meta.seq_lens)
        for _ in range(3):
            graph.replay()
        assert rel_err(out, reference_attention(q, kv, 0, meta, 0.1)) < 1e-2


def test_installed_plans_reach_make():
    q = torch.randn(8, 32, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.zeros((4, 1, 2, 16, 8, 128), device="cuda", dtype=torch.bfloat16)
    knobs = KNOBS["s8_n64_w4_pf_m"]
    saved = T.install_plans({8: knobs})
    try:
        assert T.DecodePlan.make(q, PagedLayer.of(kv, 0)).knobs() == knobs
        assert not T.DecodePlan.make(q[:1], PagedLayer.of(kv, 0)).merge  # batch 1: the rule
    finally:
        T.install_plans(saved)
    with pytest.raises(ValueError, match="unknown decode plan fields"):
        T.install_plans({8: {"splits": 4}})


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("label", ["s4_n64_w4_pfe_m", "s16_n32_w4_pfe_m", "s8_n64_w4_pfe_m"])
def test_early_plans_see_the_new_token_written_just_before(label, kv_dtype):
    """``early`` loads KV before the PDL wait: the new token, written by the KV write right
    before (as in a step, with PDL where the GPU has it, in a CUDA graph), must still be read
    after it. New K/V each replay, weighted so that a stale row would show; a bf16 and an FP8
    cache (scaled, as the engine writes it)."""
    import kernels

    if kv_dtype == "fp8" and not fp8_capable():
        pytest.skip("FP8 needs compute capability 8.9+")
    lens = [3, 9, 2, 40]
    q, kv, meta = make_paged_batch(
        lens, [1] * 4, block_size=16, num_heads=32, num_kv_heads=8, head_dim=128, seed=4
    )
    ks, vs = (0.5, 2.0) if kv_dtype == "fp8" else (1.0, 1.0)
    if kv_dtype == "fp8":
        kv = fp8_cache(kv.float(), ks, vs)
    k = torch.zeros(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    ang = torch.zeros(4, 64, device="cuda")
    cos, sin = (torch.cat([f(ang), f(ang)], -1).bfloat16() for f in (torch.cos, torch.sin))
    plan = T.DecodePlan(4, 32, 8, 128, **KNOBS[label])  # type: ignore[arg-type]

    def step():
        qr = kernels.rope_write_kv(q, k, v, cos, sin, kv, 0, meta, ks, vs)
        tables, lengths = meta.block_tables, meta.seq_lens
        return qr, T.decode_attention(qr, kv, 0, tables, lengths, 0.088, plan, ks, vs)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qr, out = step()
    stale = None
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        k.copy_(torch.randn(k.shape, generator=g, device="cuda") * 3)
        v.copy_(torch.randn(v.shape, generator=g, device="cuda") * 3)
        graph.replay()
        ref = reference_attention(qr, kv, 0, meta, 0.088, ks, vs)
        assert rel_err(out, ref) < 1e-2
        if stale is not None:  # the new token moved the output: a stale row would fail above
            assert rel_err(stale, ref) > 5e-2
        stale = out.clone()


def test_make_takes_the_measured_fp8_kv_plan_at_batch_8_and_the_rule_otherwise():
    """``DecodePlan.make``: batch 8 over an FP8 cache takes ``FP8_KV_PLANS[8]``; a bf16 cache
    and other batch sizes keep the rule; installed plans come first."""

    q8 = torch.zeros(8, 32, 128, device="cuda", dtype=torch.bfloat16)
    q4 = q8[:4]
    bf16 = torch.zeros(4, 2, 2, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    fp8 = bf16.to(torch.float8_e4m3fn)
    rule8 = T.DecodePlan.make(q8, PagedLayer.of(bf16, 0))
    assert not (rule8.merge or rule8.prefetch or rule8.early)
    got = T.DecodePlan.make(q8, PagedLayer.of(fp8, 0))
    assert got.knobs() == T.FP8_KV_PLANS[8]
    assert T.DecodePlan.make(q4, PagedLayer.of(fp8, 0)) == T.DecodePlan.make(
        q4, PagedLayer.of(bf16, 0)
    )
    saved = T.install_plans({8: rule8.knobs()})
    try:
        assert T.DecodePlan.make(q8, PagedLayer.of(fp8, 0)) == rule8
    finally:
        T.install_plans(saved)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_rope_inside_matches_rope_write_then_attention(kv_dtype):
    """``KernelChoices.rope_in_attention``'s kernel (the split that holds the new token rotates and
    writes it, and attends to it from registers) against ``rope_write_kv`` then the same plan:
    the 8B shape's heads, the rule's plan and one of each kind, the cache written bit for bit
    the same, a padding row zero."""
    if kv_dtype == "fp8" and not fp8_capable():
        pytest.skip("FP8 needs compute capability 8.9+")
    from tests.kernel_cases import rope_attention_cases

    knobs = [{}] + [KNOBS[label] for label in TESTED]
    lens = (1, 17, 1000, 0, 64, 129, 4097, 8)
    rows = rope_attention_cases("cuda", torch.bfloat16, knobs, fp8=kv_dtype == "fp8",
                                heads=(32, 8, 128), lens=lens)  # fmt: skip
    assert len(rows) == len(knobs)
    bad = [r for r in rows if not (r[1] < 1e-2 and r[2])]
    assert not bad, bad


def test_rope_attention_api_in_a_cuda_graph():
    """``kernels.rope_attention`` on a decode batch of 8 takes the one kernel, replays in a
    CUDA graph with new k and v each time (the cache slot rewritten, the output following),
    and equals its two-kernel path (``KernelChoices.rope_in_attention`` off) within bf16
    rounding."""
    import kernels

    lens = [1000, 1, 300, 17, 64, 129, 2048, 700]
    q0, kv, meta = make_paged_batch(lens, [1] * 8, block_size=16, num_heads=32, num_kv_heads=8,
                                    head_dim=128, seed=6)  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(8, 48 * 128, generator=g, device="cuda").bfloat16()
    q, k, v = (t.view(8, -1, 128) for t in qkv.split([4096, 1024, 1024], -1))
    ang = torch.rand(8, 64, generator=g, device="cuda") * 6
    cos, sin = (torch.cat([f(ang), f(ang)], -1).bfloat16() for f in (torch.cos, torch.sin))

    def step(cache: torch.Tensor, inside: bool = True) -> torch.Tensor:
        c = kernels.KernelChoices(rope_in_attention=inside)
        return kernels.rope_attention(q, k, v, cos, sin, cache, 1, meta, 0.088, choices=c)

    two = kv.clone()
    step(kv)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(kv)
    for seed in range(3):
        qkv.copy_(torch.randn(qkv.shape, generator=g, device="cuda") * (1 + seed))
        graph.replay()
        want = step(two, inside=False)
        assert torch.equal(kv.view(torch.uint8), two.view(torch.uint8))
        assert rel_err(out, want) < 1e-2
        ref = reference_attention(kernels.rope_write_kv(q, k, v, cos, sin, two, 1, meta), two, 1,
                                  meta, 0.088)  # fmt: skip
        assert rel_err(out, ref) < 1e-2

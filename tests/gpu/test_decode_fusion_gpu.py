"""CUDA only (``pytest -m gpu``): the decode fusions of the skinny product against their
references (RMSNorm folded into the QKV and gate/up products, SiLU-and-multiply into the down
product, split-K), and the engine with them on against them off.

Figures go to ``TANDEM_GPU_REPORT`` (``tests.gpu_report``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu_report import (
    agreement,
    assert_replays_in_a_cuda_graph,
    fp8_capable,
    generate,
    report,
    require_cuda_triton,
)

pytestmark = pytest.mark.gpu
require_cuda_triton()

import kernels  # noqa: E402
from kernels import reference, triton_gemv, triton_skinny  # noqa: E402
from kernels.triton_gemv import GemvPlan, linear, norm_linear, silu_mul_linear  # noqa: E402
from kernels.triton_norm import rms_norm, silu_and_mul  # noqa: E402
from tests.kernel_cases import rel_err  # noqa: E402
from tests.smol_shape import SMOL_CONFIG, make_smol_shape_dir, random_prompts  # noqa: E402

FP8_OK = fp8_capable()
TOL = 1e-2  # bf16 operands; the fused norm rounds (x * g) instead of norm(x) * g
# [N, K] of the 8B shape's products, and SmolLM2's (K = 576: not a multiple of BLOCK_K).
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "down": (4096, 14336), "smol": (960, 576)}


def inputs(rows: int, n: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    res = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    norm = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    bias = torch.randn(n, device="cuda", generator=g).bfloat16()
    return x, res, norm, w, bias


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize("shape", ["qkv", "smol"])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_linear_matches_norm_then_linear(rows, shape, with_residual, monkeypatch):
    n, k = SHAPES[shape]
    x, res, norm, w, bias = inputs(rows, n, k, seed=rows)
    r = res if with_residual else None
    out, res_out = norm_linear(x, r, norm, 1e-5, w, bias)
    h, want_res = reference.rms_norm(x, norm, 1e-5, r)
    assert rel_err(out, reference.linear(h.float(), w.float(), bias.float())) < TOL
    assert torch.equal(res_out, want_res)  # x + residual, rounded as the norm kernel rounds
    # The public dispatch takes the fused kernel within GEMV_MAX_ROWS when FUSE_DECODE is on,
    # the pair otherwise; both switch settings are checked.
    h, pair_res = rms_norm(x, norm, 1e-5, r)
    for fuse in (False, True):
        monkeypatch.setattr(kernels, "FUSE_DECODE", fuse)
        got, got_res = kernels.norm_linear(x, r, norm, 1e-5, w, bias)
        assert torch.equal(got_res, pair_res)
        if fuse and rows <= kernels.GEMV_MAX_ROWS:
            # the fused kernel kernels.SKINNY_KERNEL names (not bit for bit the one above)
            assert rel_err(got, reference.linear(h.float(), w.float(), bias.float())) < TOL
        else:
            assert torch.equal(got, kernels.linear(h, w, bias))


@pytest.mark.parametrize("rows", [1, 8, 16])
@pytest.mark.parametrize("shape", ["down", "smol"])
def test_silu_mul_linear_is_the_unfused_pair(rows, shape):
    """The prologue rounds where ``silu_and_mul`` rounds: bit for bit the two kernels."""
    n, k = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(rows)
    y = torch.randn(rows, 2 * k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    got = silu_mul_linear(y, w)
    assert torch.equal(got, linear(silu_and_mul(y), w))
    want = reference.linear(reference.silu_and_mul(y.float()), w.float())
    assert rel_err(got, want) < TOL


@pytest.mark.skipif(not FP8_OK, reason="FP8 needs compute capability 8.9+")
@pytest.mark.parametrize("rows", [1, 8])
def test_fused_prologues_with_fp8_weights(rows):
    n, k = SHAPES["qkv"]
    x, res, norm, w, _ = inputs(rows, n, k, seed=11)
    q = kernels.quantize_fp8_rows(w.float())
    out, _ = kernels.norm_linear(x, res, norm, 1e-5, q)
    h, _ = reference.rms_norm(x, norm, 1e-5, res)
    plan = triton_skinny.plan_for(rows, n, k, q.weight.dtype)
    if not kernels.FUSE_DECODE and plan.qx:  # 2-8 rows on the FP8 tensor cores: W8A8
        want = reference.linear_fp8_qx(h, q, plan.block_k)
    else:
        want = reference.linear(h.float(), q)
    assert rel_err(out, want) < TOL
    y = torch.randn(rows, 2 * k, device="cuda").bfloat16()
    got = kernels.silu_mul_linear(y, q)
    assert torch.equal(got, kernels.linear(silu_and_mul(y), q))


@pytest.mark.parametrize("split", [2, 3, 4, 7])
@pytest.mark.parametrize("shape", ["o_proj", "down", "smol"])
def test_split_k_matches_and_is_deterministic(split, shape):
    n, k = SHAPES[shape]
    x, res, norm, w, bias = inputs(8, n, k, seed=split)
    plan = GemvPlan(split_k=split)
    ref = reference.linear(x.float(), w.float(), bias.float())
    a = linear(x, w, bias, plan)
    assert rel_err(a, ref) < TOL
    assert rel_err(a, linear(x, w, bias)) < 2e-3  # another summation order, that is all
    assert torch.equal(a, linear(x, w, bias, plan))  # the parts are added in a fixed order
    out, res_out = norm_linear(x, res, norm, 1e-5, w, bias, plan)
    h, want_res = reference.rms_norm(x, norm, 1e-5, res)
    assert rel_err(out, reference.linear(h.float(), w.float(), bias.float())) < TOL
    assert torch.equal(res_out, want_res)
    y = torch.randn(8, 2 * k, device="cuda").bfloat16()
    got = silu_mul_linear(y, w, None, plan)
    assert rel_err(got, reference.linear(reference.silu_and_mul(y.float()), w.float())) < TOL
    torch.cuda.synchronize()
    assert int(triton_gemv._locks(x.device).abs().sum()) == 0  # left ready for the next call


def test_split_k_replays_in_a_cuda_graph():
    n, k = SHAPES["o_proj"]
    x, _, _, w, _ = inputs(4, n, k, seed=5)
    plan = GemvPlan(split_k=4)
    eager = linear(x, w, None, plan)
    assert_replays_in_a_cuda_graph(lambda: linear(x, w, None, plan), x, eager)


@pytest.fixture(scope="module")
def smol_shape_dir(tmp_path_factory) -> Path:
    return make_smol_shape_dir(tmp_path_factory.mktemp("smol_shape") / "model", seed=0)


@pytest.mark.xfail(
    strict=False,
    reason="measured on an H100 (2026-11-24): 4 of 8 greedy outputs identical fused, 5 of 8 with "
    "split-K, on random weights where bf16 vs fp32 agrees on 65-75%; fusion is off by default "
    "(kernels.FUSE_DECODE) until an fp32 comparison settles it",
)
def test_engine_with_fusions_agrees_with_the_unfused_engine(smol_shape_dir, monkeypatch):
    """bf16 decode batches of at most 8 (CUDA graphs) with the fusions on and off: the same
    products, rounded a little differently, so greedy tokens mostly agree; split-K too."""
    prompts = random_prompts(8, SMOL_CONFIG["vocab_size"], seed=9, hi=200)
    monkeypatch.setattr(kernels, "FUSE_DECODE", True)
    fused = generate(smol_shape_dir, prompts, max_num_seqs=8)
    monkeypatch.setattr(kernels, "FUSE_DECODE", False)
    plain = generate(smol_shape_dir, prompts, max_num_seqs=8)
    monkeypatch.setattr(kernels, "FUSE_DECODE", True)
    monkeypatch.setattr(triton_gemv, "SPLIT_K_TILES_PER_SM", 1000)  # every product splits
    monkeypatch.setattr(triton_gemv, "SPLIT_K_MIN_K", 0)
    split = generate(smol_shape_dir, prompts, max_num_seqs=8)
    report("fused_vs_unfused_cuda_bf16", match_rate=agreement(fused, plain))
    report("split_k_vs_unfused_cuda_bf16", match_rate=agreement(split, plain))
    # bf16 on CUDA vs float32 on CPU agrees on 75% of such prompts (bench/results/gpu_h100*).
    assert agreement(fused, plain) >= 0.75
    assert agreement(split, plain) >= 0.75


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch: sm 9.0+",
)
def test_engine_with_pdl_gives_the_same_tokens(smol_shape_dir, monkeypatch):
    """``kernels.PDL`` on: the same kernels launched early and waiting in the kernel, in the
    engine's decode graphs and eager prefill: the same greedy tokens as with it off."""
    prompts = random_prompts(8, SMOL_CONFIG["vocab_size"], seed=11, hi=200)
    monkeypatch.setattr(kernels, "PDL", False)
    plain = generate(smol_shape_dir, prompts, max_num_seqs=8)
    monkeypatch.setattr(kernels, "PDL", True)
    pdl = generate(smol_shape_dir, prompts, max_num_seqs=8)
    report("pdl_vs_no_pdl_cuda_bf16", match_rate=agreement(pdl, plain))
    assert pdl == plain

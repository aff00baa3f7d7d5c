"""CUDA only (``pytest -m gpu``): the skinny decode products of ``kernels.triton_skinny``
(bf16/fp16 and FP8 weight-only) against the references, every plan the benchmark measures,
split-K (deterministic, replayed in a CUDA graph), and the dispatch."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from tests.gpu_report import assert_replays_in_a_cuda_graph, fp8_capable, require_cuda_triton

require_cuda_triton()

import kernels  # noqa: E402
from kernels import reference, triton_skinny  # noqa: E402
from kernels.triton_skinny import SkinnyPlan, candidates, linear  # noqa: E402
from tests.skinny_cases import product_cases, rel_err, small_plans  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not fp8_capable(), reason="FP8: sm 8.9+")]
TOL = 1e-2  # bf16 outputs; the FP8 reference dequantizes the same e4m3 weights
QX_TOL = 5e-2  # W8A8 (``qx`` plans) against weight-only FP8: x's e4m3 rounding (about 2.7%)
# [N, K] of the 8B shape's products (small shapes that do not divide the tiles: skinny_cases).
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "down": (4096, 14336)}


def _check(rows: list[tuple[str, float]]) -> None:
    bad = [(n, e) for n, e in rows if not e < TOL]
    assert rows and not bad, bad[:10]


def test_small_shapes_every_path():
    """CUDA cores with one and several rows, prefetch on and off, tensor cores, split-K (also
    uneven), tiles that do not divide N or K, FP8 weights, bias; fp16 too (the folded norm:
    ``tests/gpu/test_fold_gpu.py``)."""
    plans = small_plans()
    _check(product_cases("cuda", torch.bfloat16, plans, rows=(1, 3)))
    _check(product_cases("cuda", torch.float16, plans[-1:], shapes=((40, 96),), rows=(2,)))


@pytest.mark.parametrize("shape", ["qkv", "o_proj", "down"])
@pytest.mark.parametrize("rows", [1, 8])
def test_benchmark_plans_and_default_on_model_shapes(shape, rows):
    """Every plan ``lab.skinny_gpu`` may pick, and the default, on the real shapes."""
    n, k = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    q = reference.quantize_fp8_rows(w)
    for wt, sc, ref in ((w, None, w.float()), (q.weight, q.scale, q)):
        want = reference.linear(x.float(), ref)
        for plan in [triton_skinny.plan_for(rows, n, k, wt.dtype), *candidates(rows, wt.dtype)]:
            got = linear(x, wt, None, sc, plan)
            if plan.qx:  # W8A8: against x quantized as the kernel does; then near weight-only
                assert rel_err(got, reference.linear_fp8_qx(x, q, plan.block_k)) < TOL, plan
                assert rel_err(got, want) < QX_TOL, plan
            else:
                assert rel_err(got, want) < TOL, (plan, wt.dtype)


def test_fp8_tensor_core_plans_quantize_x_per_step():
    """``qx`` plans (x in e4m3 per row and step, FP8 x FP8 on the tensor cores): 1-8 rows,
    split-K, rows and K that do not divide the tiles, bias; zero rows stay zero."""
    g = torch.Generator(device="cuda").manual_seed(7)
    for n, k in ((200, 384), (4096, 4096)):
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
        q = reference.quantize_fp8_rows(w)
        bias = torch.randn(n, device="cuda", generator=g).bfloat16()
        for rows in (1, 3, 8):
            x = torch.randn(rows, k, device="cuda", generator=g).bfloat16() * 4
            x[0] = 0  # a padding row: its scale must not turn it into NaN
            for plan in [p for p in candidates(rows, q.weight.dtype) if p.qx]:
                got = linear(x, q.weight, bias, q.scale, plan)
                want = reference.linear_fp8_qx(x, q, plan.block_k, bias)
                assert torch.isfinite(got).all() and rel_err(got, want) < TOL, (n, rows, plan)
                assert torch.allclose(got[0].float(), bias.float(), atol=1e-2), plan
    with pytest.raises(ValueError, match="qx"):
        linear(x, w, None, None, SkinnyPlan(block_n=64, block_k=256, dot=True, qx=True))


def test_fp8_one_row_in_bf16_pairs():
    """``pairs`` plans (e4m3 to bf16 by bit placement, bf16 pair products, float32 sums):
    within the bf16 tolerance of the weight-only reference for x of any magnitude, weights with
    e4m3 subnormals and zeros, split-K, bias, K not a multiple of the step; other products (2+
    rows, bf16 weights) fall back to the plain path with the same plan."""
    g = torch.Generator(device="cuda").manual_seed(11)
    plans = [p for p in candidates(1, torch.float8_e4m3fn) if p.pairs]
    assert plans
    for n, k in ((4096, 4096), (520, 14336), (96, 1040)):
        w = torch.randn(n, k, device="cuda", generator=g) * 0.02
        w[:, ::7] *= 1e-4  # e4m3 subnormals and zeros in every row
        q = reference.quantize_fp8_rows(w.bfloat16())
        bias = torch.randn(n, device="cuda", generator=g).bfloat16()
        for mag in (1e-3, 1.0, 3e3):
            x = (torch.randn(1, k, device="cuda", generator=g) * mag).bfloat16()
            want = reference.linear(x.float(), q, bias.float())
            for plan in plans:
                got = linear(x, q.weight, bias, q.scale, plan)
                assert rel_err(got, want) < TOL, (n, k, mag, plan)
    x8 = torch.randn(3, 4096, device="cuda").bfloat16()
    w8 = (torch.randn(64, 4096, device="cuda") * 0.02).bfloat16()
    q8 = reference.quantize_fp8_rows(w8)
    got = linear(x8, q8.weight, None, q8.scale, plans[0])
    assert rel_err(got, reference.linear(x8.float(), q8)) < TOL
    assert rel_err(linear(x8, w8, None, None, plans[0]), x8.float() @ w8.float().T) < TOL


@pytest.mark.parametrize("split", [2, 3, 4])
@pytest.mark.parametrize("dot", [False, True])
def test_split_k_deterministic_and_replays_in_a_cuda_graph(split, dot):
    n, k = SHAPES["o_proj"]
    x = torch.randn(8, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    q = reference.quantize_fp8_rows(w)
    plan = SkinnyPlan(block_n=16, block_k=256, split_k=split, dot=dot)
    eager = linear(x, q.weight, None, q.scale, plan)
    assert torch.equal(eager, linear(x, q.weight, None, q.scale, plan))
    assert rel_err(eager, reference.linear(x.float(), q)) < TOL
    assert_replays_in_a_cuda_graph(lambda: linear(x, q.weight, None, q.scale, plan), x, eager)
    torch.cuda.synchronize()
    assert int(triton_skinny._locks(x.device).abs().sum()) == 0


def test_dispatch_takes_the_new_kernel_and_measured_plans():
    n, k = SHAPES["qkv"]
    x = torch.randn(3, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    q = kernels.quantize_fp8_rows(w)
    assert torch.equal(kernels.linear(x, q), linear(x, q.weight, None, q.scale))
    assert torch.equal(kernels.linear(x, w), linear(x, w))
    key = triton_skinny.plan_key(3, n, k, q.weight.dtype)
    plan = SkinnyPlan(block_n=4, block_k=512, split_k=2)
    try:
        triton_skinny.set_plan(key, plan)
        assert triton_skinny.plan_for(3, n, k, q.weight.dtype) == plan
        assert torch.equal(kernels.linear(x, q), linear(x, q.weight, None, q.scale, plan))
        assert [list(key), asdict(plan)] in triton_skinny.plans_json("dev")["dev"]
    finally:
        triton_skinny.set_plan(key, None)


def _pdl_chain(pdl, x, res, g, wq, sq, wg, sg, wd, sd):  # noqa: ANN001, ANN202
    """A decode layer's Triton kernels back to back (norm, products, SiLU, split-K), taking
    part in programmatic dependent launch or not (``KernelChoices.pdl``)."""
    c = kernels.KernelChoices(pdl=pdl)
    h, r = kernels.rms_norm(x, g, 1e-5, res, choices=c)
    a = linear(h, wq, None, sq, pdl=pdl)
    y = linear(h, wg, None, sg, SkinnyPlan(block_n=4, block_k=1024, split_k=2), pdl=pdl)
    return a, r, linear(kernels.silu_and_mul(y, c), wd, None, sd, pdl=pdl)


@pytest.mark.parametrize("rows", [1, 8])
def test_pdl_on_is_pdl_off_bit_for_bit_in_a_cuda_graph(rows):
    """``KernelChoices.pdl`` (programmatic dependent launch, Hopper): the same outputs bit for
    bit, eager and replayed from a CUDA graph, as with it off, FP8 and bf16 weights."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("griddepcontrol needs sm 9.0+")
    k, n = 4096, 2048
    x, res = (torch.randn(rows, k, device="cuda").bfloat16() for _ in range(2))
    g = torch.ones(k, device="cuda").bfloat16()
    ws = [(torch.randn(m, kk, device="cuda") * 0.02).bfloat16()
          for m, kk in ((n, k), (2 * n, k), (k, n))]  # fmt: skip
    for fp8 in (False, True):
        args = []
        for w in ws:
            q = reference.quantize_fp8_rows(w)
            args += [q.weight, q.scale] if fp8 else [w, None]
        want = _pdl_chain(False, x, res, g, *args)
        eager = _pdl_chain(True, x, res, g, *args)
        assert all(torch.equal(a, b) for a, b in zip(eager, want, strict=True))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = _pdl_chain(True, x, res, g, *args)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True)), fp8


def test_the_engine_with_pdl_gives_the_same_tokens(tmp_path):
    """``KernelChoices.pdl`` of an engine (``EngineConfig.kernels``): the same kernels launched
    early and waiting in the kernel, in the engine's decode graphs and eager prefill, give the
    same greedy tokens as with it off."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch: sm 9.0+")
    from tests.gpu_report import agreement, generate, report
    from tests.smol_shape import SMOL_CONFIG, make_smol_shape_dir, random_prompts

    model_dir = make_smol_shape_dir(tmp_path / "model", seed=0)
    prompts = random_prompts(8, SMOL_CONFIG["vocab_size"], seed=11, hi=200)
    plain = generate(model_dir, prompts, max_num_seqs=8, kernels=kernels.KernelChoices(pdl=False))
    pdl = generate(model_dir, prompts, max_num_seqs=8, kernels=kernels.KernelChoices(pdl=True))
    report("pdl_vs_no_pdl_cuda_bf16", match_rate=agreement(pdl, plain))
    assert pdl == plain


def test_fp8_several_rows_on_the_cuda_cores_against_the_reference():
    """FP8 weights, 2-8 rows, the CUDA-core plans (each weight tile converted once for all
    rows) on the 8B shapes: against the reference and equal to the tensor-core result's
    accuracy."""
    for name in ("qkv", "down"):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        q = reference.quantize_fp8_rows(w)
        for rows in (2, 3, 5, 8):
            x = torch.randn(rows, k, device="cuda").bfloat16()
            want = reference.linear(x.float(), q)
            for plan in candidates(rows, q.weight.dtype):
                if not plan.dot:
                    assert rel_err(linear(x, q.weight, None, q.scale, plan), want) < TOL, plan

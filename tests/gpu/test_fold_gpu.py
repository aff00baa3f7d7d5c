"""CUDA only (``pytest -m gpu``): the folded-norm decode kernels (issue 19) against their
references, and the engine that takes them.

``triton_skinny.rms_linear`` (the norm's ``1/rms`` in the epilogue, ``x`` unchanged into the
product; with ``silu`` the SiLU-and-multiply of matching gate and up rows) and
``triton_skinny.linear(add=)`` (the residual stream added in the epilogue), every path of the
small plans and the 8B shape's products with the installed plans; then the engine on CUDA
folds its model by default and keeps its greedy agreement with the CPU's float32."""

from __future__ import annotations

import pytest
import torch

from tests.gpu_report import assert_replays_in_a_cuda_graph, require_cuda_triton

require_cuda_triton()

import kernels  # noqa: E402
from kernels import reference, triton_skinny  # noqa: E402
from kernels.triton_skinny import SkinnyPlan, rms_linear  # noqa: E402
from tests.skinny_cases import rel_err, small_plans  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = 1e-2
EPS = 1e-5
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # fmt: skip


def _cases(n: int, k: int, m: int, dtype: torch.dtype, plans, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to("cuda", dtype)
    norm = (1 + 0.2 * torch.randn(k, generator=g)).to("cuda", dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to("cuda", dtype)
    wf = w.float() * norm.float()  # the folded weight, exactly
    folded = wf.to(dtype)
    bias = torch.randn(n, generator=g).to("cuda", dtype)
    add = torch.randn(m, n, generator=g).to("cuda", dtype)
    h, _ = reference.rms_norm(x.float(), torch.ones(k, device="cuda"), EPS)
    out = []
    for plan in plans:
        tag = f"n{n}_k{k}_m{m}_{str(dtype)[6:]}_{plan.label()}"
        got = rms_linear(x, EPS, folded, None, None, plan)
        out.append((f"rms_{tag}", rel_err(got, h @ wf.T)))
        got = rms_linear(x, EPS, folded, bias, None, plan)
        out.append((f"rms_bias_{tag}", rel_err(got, h @ wf.T + bias.float())))
        half = plan.block_n // 2
        if half >= 1 and (n // 2) % half == 0:
            got = rms_linear(x, EPS, folded, None, None, plan, silu=True)
            want = reference.silu_and_mul(h @ wf.T)
            out.append((f"silu_{tag}", rel_err(got, want)))
        got = triton_skinny.linear(x, w, None, None, plan, add=add)
        out.append((f"add_{tag}", rel_err(got, x.float() @ w.float().T + add.float())))
    return out


def _check(rows: list[tuple[str, float]]) -> None:
    bad = [(n, e) for n, e in rows if not e < TOL]
    assert rows and not bad, bad[:10]


def test_small_shapes_every_path():
    """CUDA cores with one and several rows, tensor cores, split-K (the add), tiles that do
    not divide N or K; bf16 and fp16."""
    plans = small_plans() + [SkinnyPlan(block_n=64, block_k=64, num_stages=4, dot=True)]
    rows = []
    for n, k in ((96, 128), (40, 96), (128, 256)):
        for m in (1, 3, 8):
            rows += _cases(n, k, m, torch.bfloat16, plans)
    rows += _cases(96, 128, 2, torch.float16, plans[:1] + plans[-2:])
    _check(rows)
    silu = [n for n, _ in rows if n.startswith("silu_")]
    assert len(silu) > 20  # the SiLU epilogue ran on most plans


@pytest.mark.parametrize("m", [1, 8])
def test_the_8b_products_with_the_installed_plans(m):
    rows = []
    for name, (n, k) in SHAPES.items():
        plan = triton_skinny.plan_for(m, n, k, torch.bfloat16, 3 if name in ("qkv", "gate_up")
                                      else 0)  # fmt: skip
        rows += [(f"{name}_{r}", e) for r, e in _cases(n, k, m, torch.bfloat16, [plan])]
    _check(rows)
    assert len(rows) >= 8


def test_the_kernels_api_takes_the_skinny_kernels_and_replays_in_a_graph():
    """``kernels.rms_linear``/``linear_add`` at 8 rows on CUDA: on a tensor-core plan without
    the sums from the product before, the norm is `rms_norm` with the unit weight, then the
    skinny product and SiLU; the add in the next product's epilogue; also replayed in a CUDA
    graph with PDL."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 512, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(768, 512, generator=g) * 0.05).to("cuda", torch.bfloat16)
    add = torch.randn(8, 384, generator=g).to("cuda", torch.bfloat16)
    w2 = (torch.randn(384, 384, generator=g) * 0.05).to("cuda", torch.bfloat16)
    ones = torch.ones(512, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        act = kernels.rms_linear(x, ones, EPS, w, silu=True)
        return kernels.linear_add(act, w2, add)

    assert triton_skinny.plan_for(8, 768, 512, torch.bfloat16, 3).dot
    h, _ = kernels.rms_norm(x, ones, EPS)
    act = kernels.silu_and_mul(triton_skinny.linear(h, w))
    assert torch.equal(kernels.rms_linear(x, ones, EPS, w, silu=True), act)
    eager = step()
    assert torch.equal(eager, triton_skinny.linear(act, w2, add=add))
    assert_replays_in_a_cuda_graph(step, x, eager)
    # past 8 rows: the unfused path (rms_norm with the unit weight, cuBLAS, SiLU, add)
    xs = torch.randn(20, 512, generator=g).to("cuda", torch.bfloat16)
    h, _ = reference.rms_norm(xs.float(), ones.float(), EPS)
    want = reference.silu_and_mul(h @ w.float().T)
    assert rel_err(kernels.rms_linear(xs, ones, EPS, w, silu=True), want) < TOL


def test_linear_add_past_the_skinny_rows_adds_in_cublas_and_replays_in_a_graph():
    """``kernels.linear_add`` at 2,048 rows (a mixed step's): cuBLAS's ``addmm`` adds the
    stream in its epilogue, within bf16 rounding of the float32 sum, ``add`` unchanged, and
    the same in a CUDA graph."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2048, 512, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(384, 512, generator=g) * 0.05).to("cuda", torch.bfloat16)
    add = torch.randn(2048, 384, generator=g).to("cuda", torch.bfloat16)
    kept = add.clone()
    eager = kernels.linear_add(x, w, add)
    assert torch.equal(add, kept) and eager.dtype == torch.bfloat16
    assert rel_err(eager, x.float() @ w.float().T + add.float()) < TOL
    assert_replays_in_a_cuda_graph(lambda: kernels.linear_add(x, w, add), x, eager)


def test_the_engine_folds_on_cuda_and_keeps_its_greedy_agreement(tmp_path):
    """bf16 on CUDA: the engine folds (one rank, no LoRA, no FP8) and decodes in CUDA graphs;
    its greedy agreement with the CPU float32 engine is no more than 10 points under the
    unfolded engine's on the same GPU (a random model's bf16 rounding flips some choices)."""
    from engine import LLM, SamplingParams
    from tests.smol_shape import SMOL_CONFIG, make_smol_shape_dir, random_prompts

    model_dir = make_smol_shape_dir(tmp_path / "model", seed=0)
    prompts = random_prompts(16, SMOL_CONFIG["vocab_size"], seed=1, hi=200)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def greedy(**options) -> tuple[list[list[int]], bool]:
        llm = LLM(model_dir, max_num_batched_tokens=256, max_num_seqs=8, num_kv_blocks=1024,
                  **options)  # fmt: skip
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        folded = llm.engine.runner.model.folded
        del llm
        torch.cuda.empty_cache()
        return outs, folded

    cpu, _ = greedy(device="cpu", dtype="float32")
    fold, is_folded = greedy(device="cuda")
    assert is_folded
    eager, _ = greedy(device="cuda", enforce_eager=True)
    plain, plain_folded = greedy(device="cuda", kernels=kernels.KernelChoices(fold_norms=False))
    assert not plain_folded

    def rate(a, b) -> float:
        return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)

    print({"folded_vs_cpu": rate(fold, cpu), "unfolded_vs_cpu": rate(plain, cpu),
           "folded_graphs_vs_eager": rate(fold, eager)})  # fmt: skip
    assert rate(fold, cpu) >= min(0.8, rate(plain, cpu) - 0.1)
    assert rate(fold, eager) >= 0.8


def test_the_sums_of_squares_from_the_product_before():
    """``KernelChoices.fold_sums``: ``linear_sums`` (the residual added in the epilogue) leaves each
    row's sums of squares per row tile, and ``rms_linear(sums=)`` takes them: every plan kind
    on small shapes, bf16 and fp16, against the references."""
    from tests.skinny_cases import fold_sums_cases

    plans = small_plans() + [SkinnyPlan(block_n=64, block_k=64, num_stages=4, dot=True)]
    rows = fold_sums_cases("cuda", torch.bfloat16, plans, rows=(1, 3, 8))
    rows += fold_sums_cases("cuda", torch.float16, plans[:1] + plans[-2:], rows=(2,))
    _check(rows)
    assert sum(n.startswith("sums_total") for n, _ in rows) == 3 * len(plans) + 3


@pytest.mark.parametrize("m", [1, 8])
def test_the_8b_layer_with_the_sums_and_the_installed_plans(m):
    """The folded 8B layer's products as the engine chains them on CUDA (``kernels``' API):
    o_proj's sums feed gate/up, down's feed the next QKV, one launch each, equal to the
    products with the norms made apart (``KernelChoices.fold_sums`` off) within bf16 rounding;
    also in a CUDA graph with PDL. (At one row the engine does not take the sums,
    ``fold_sums_min_rows``; the kernels are checked there too.)"""
    sums_on = kernels.KernelChoices(fold_sums_min_rows=1)
    g = torch.Generator().manual_seed(m)

    def rand(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * s).to("cuda", torch.bfloat16)

    attn, stream = rand(m, 4096), rand(m, 4096)
    w = {name: rand(n, k, s=0.02) for name, (n, k) in SHAPES.items()}
    ones = torch.ones(4096, device="cuda", dtype=torch.bfloat16)

    def layer(c: kernels.KernelChoices = sums_on) -> torch.Tensor:
        s, sums = kernels.linear_add_sums(attn, w["o_proj"], stream, c)
        act = kernels.rms_linear(s, ones, EPS, w["gate_up"], silu=True, sums=sums, choices=c)
        s, sums = kernels.linear_add_sums(act, w["down"], s, c)
        return kernels.rms_linear(s, ones, EPS, w["qkv"], sums=sums, choices=c)

    got = layer()
    assert kernels.linear_add_sums(attn, w["o_proj"], stream, sums_on)[1] is not None
    assert_replays_in_a_cuda_graph(layer, attn, got)
    sums_off = kernels.KernelChoices(fold_sums=False)
    assert kernels.linear_add_sums(attn, w["o_proj"], stream, sums_off)[1] is None
    want = layer(sums_off)  # on the new values the replay check wrote into ``attn``
    assert rel_err(layer(), want) < TOL

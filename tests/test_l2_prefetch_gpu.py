"""CUDA only (``pytest -m gpu``): the L2 prefetch of decode steps (issue 19,
``kernels.L2_PREFETCH``) changes no result. The prefetch kernel leaves memory as it was; put
into a PDL chain between a product and the kernel that reads it, replayed from a CUDA graph, the
chain's results are bit for bit those without it; decode steps replayed from the engine's
graphs give the same logits bit for bit with each of the benchmark's variants, and the engine
the same greedy tokens. CPU side: ``tests/test_l2_prefetch.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu_report import (
    agreement,
    assert_replays_in_a_cuda_graph,
    generate,
    report,
    require_cuda_triton,
)

pytestmark = pytest.mark.gpu
require_cuda_triton()

import kernels  # noqa: E402
from bench.decode_variants import L2_VARIANTS  # noqa: E402
from bench.gpu_common import Ceilings  # noqa: E402
from bench.gpu_llama import LlamaBench  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.shapes import SHAPES  # noqa: E402
from kernels import triton_prefetch  # noqa: E402
from kernels.l2 import ASMS, L2Prefetch, product_pattern  # noqa: E402
from tests.smol_shape import SMOL_CONFIG, make_smol_shape_dir, random_prompts  # noqa: E402

HOPPER = torch.cuda.get_device_capability()[0] >= 9
# (rows, k, row stride, k_split, head): whole; a quarter of each of two split-K ranges; an
# uneven split (the last range shorter); a strided view (k < row stride)
CASES = [(4096, 4096, 4096, 4096, 1.0), (4096, 14336, 14336, 7168, 0.25),
         (100, 1000, 1000, 384, 1.0), (64, 512, 1024, 512, 0.5)]  # fmt: skip


@pytest.mark.parametrize("asm", ASMS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}s{c[2]}k{c[3]}h{c[4]}")
@pytest.mark.parametrize("fp8", [False, True])
def test_prefetch_leaves_memory_unchanged(asm, case, fp8):
    rows, k, stride, k_split, head = case
    base = torch.randn(rows, stride, device="cuda")
    base = base.to(torch.float8_e4m3fn) if fp8 else base.bfloat16()
    before = base.clone()
    w = base[:, :k]
    triton_prefetch.l2_prefetch(w, product_pattern(rows, k, stride, w.element_size(), k_split,
                                                   head), asm)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(base.view(torch.uint8), before.view(torch.uint8))


def _chain(x: torch.Tensor, wg: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    """gate/up product, the prefetch of down (``kernels.L2_PREFETCH``), SiLU-and-multiply
    (reads the gate/up product: launched behind the prefetch), down: the model's order."""
    y = kernels.linear(x, wg)
    if kernels.L2_PREFETCH.launches:
        kernels.l2_prefetch(x, wd, kernels.L2_PREFETCH.head or 1.0)
    return kernels.linear(kernels.silu_and_mul(y), wd)


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch: sm 9.0+")
@pytest.mark.parametrize("asm", ASMS)
def test_a_prefetch_in_a_pdl_chain_keeps_its_order_in_a_cuda_graph(asm, monkeypatch):
    """With PDL the kernel after the prefetch waits only for the prefetch: the prefetch must
    end after the product before it (a long one here, 28672 x 4096), or SiLU-and-multiply
    would read part of its output."""
    x = torch.randn(8, 4096, device="cuda").bfloat16()
    wg = (torch.randn(28672, 4096, device="cuda") * 0.02).bfloat16()
    wd = (torch.randn(4096, 14336, device="cuda") * 0.02).bfloat16()
    monkeypatch.setattr(kernels, "PDL", False)
    want = _chain(x, wg, wd)
    monkeypatch.setattr(kernels, "PDL", True)
    monkeypatch.setattr(kernels, "L2_PREFETCH", L2Prefetch(head=0.25, asm=asm))
    assert torch.equal(_chain(x, wg, wd), want)
    _chain(x, wg, wd)  # compiled before the capture
    assert_replays_in_a_cuda_graph(lambda: _chain(x, wg, wd), x, want)


@pytest.fixture(scope="module")
def smol_bench() -> LlamaBench:
    c = ModelConfig.from_dict(SHAPES["smollm2-135m"])
    return LlamaBench(c, num_blocks=1024, max_len=2048, device="cuda")


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("b", [1, 8])
def test_decode_steps_replayed_give_the_same_logits_with_every_variant(smol_bench, b, pdl,
                                                                       monkeypatch):  # fmt: skip
    """The benchmark's L2 variants, each in the engine's decode graphs (SmolLM2's shape, ctx
    1000: decode attention with several splits): the logits bit for bit those without."""
    monkeypatch.setattr(kernels, "PDL", pdl and HOPPER)
    ceil = Ceilings(1.0, 1.0)
    smol_bench.decode(b, 1000, ceil)
    want = smol_bench.last_logits
    for name, fields in L2_VARIANTS.items():
        monkeypatch.setattr(kernels, "L2_PREFETCH", L2Prefetch(**fields))
        smol_bench.decode(b, 1000, ceil)
        assert torch.equal(smol_bench.last_logits, want), name


@pytest.fixture(scope="module")
def smol_shape_dir(tmp_path_factory) -> Path:
    return make_smol_shape_dir(tmp_path_factory.mktemp("smol_shape") / "model", seed=0)


def test_engine_with_l2_prefetch_gives_the_same_tokens(smol_shape_dir, monkeypatch):
    """The offline engine (decode batches of up to 8 in CUDA graphs, eager prefill) with every
    prefetch and the K/V loads ``evict_first``: the same greedy tokens as without."""
    prompts = random_prompts(8, SMOL_CONFIG["vocab_size"], seed=13, hi=200)
    plain = generate(smol_shape_dir, prompts, max_num_seqs=8)
    monkeypatch.setattr(kernels, "L2_PREFETCH", L2Prefetch(True, 0.25, True))
    on = generate(smol_shape_dir, prompts, max_num_seqs=8)
    report("l2_prefetch_vs_none_cuda_bf16", match_rate=agreement(on, plain))
    assert on == plain

"""FlashAttention 3 (`kernels.flash_attn`) behind `kernels.paged_attention` on a Hopper GPU:
against the PyTorch reference on scattered paged pools (prefill chunks over cached prefixes,
decodes, both in one call), for the Llama-3.1-8B and SmolLM2 head shapes; and the engine with
``attention_backend="fa3"`` against ``"triton"`` (greedy tokens of a bf16 random model).

Needs FA3's extension (``python -m bench.device.prepare --fa3`` packs it for the GPU host);
skips, saying why, where it cannot run.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels import flash_attn  # noqa: E402
from kernels.choices import KernelChoices  # noqa: E402
from tests.kernel_cases import make_paged_batch, reference_attention, rel_err  # noqa: E402

WHY = flash_attn.unavailable_reason(torch.device("cuda"), torch.bfloat16, 128)
if WHY is not None:
    pytest.skip(f"FlashAttention 3 cannot run here: {WHY}", allow_module_level=True)

FA3 = KernelChoices(flash_attention=True, flash_decode=True)
HEADS = {
    "8b": {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128},
    "smol": {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64},
}
CASES = {
    "prefill over a prefix": ([1500 + 700], [700]),
    "two prompts, no prefix": ([333, 64], [333, 64]),
    "decodes": ([4097, 17, 900, 1], [1, 1, 1, 1]),
    "mixed": ([2000, 3000, 129, 50], [512, 1, 1, 50]),
}


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_fa3_matches_the_reference(heads, case):
    seq_lens, q_lens = CASES[case]
    q, kv, meta = make_paged_batch(seq_lens, q_lens, block_size=16, **HEADS[heads], seed=3)
    scale = HEADS[heads]["head_dim"] ** -0.5
    got = kernels.paged_attention(q, kv, 1, meta, scale, choices=FA3)
    want = reference_attention(q, kv, 1, meta, scale)
    assert rel_err(got, want) < 1e-2
    triton = kernels.paged_attention(q, kv, 1, meta, scale, choices=KernelChoices())
    assert rel_err(got, triton) < 1e-2


def test_fp8_pool_keeps_triton():
    seq_lens, q_lens = CASES["mixed"]
    q, kv, meta = make_paged_batch(seq_lens, q_lens, block_size=16, **HEADS["8b"], seed=4)
    kv8 = kv.to(kernels.FP8)
    got = kernels.paged_attention(q, kv8, 1, meta, 128**-0.5, choices=FA3)
    want = kernels.paged_attention(q, kv8, 1, meta, 128**-0.5, choices=KernelChoices())
    assert torch.equal(got, want)


def test_the_engine_with_fa3_agrees_with_triton(tmp_path):
    from engine import LLM, SamplingParams
    from tests.smol_shape import SMOL_CONFIG, make_smol_shape_dir, random_prompts

    model = make_smol_shape_dir(tmp_path / "model", seed=0)
    prompts = random_prompts(16, SMOL_CONFIG["vocab_size"], seed=1, hi=400)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = {}
    for backend in ("fa3", "triton"):
        llm = LLM(model, max_num_batched_tokens=256, max_num_seqs=32, num_kv_blocks=2048,
                  attention_backend=backend)  # fmt: skip
        choices = llm.engine.runner.model.choices
        assert choices.flash_attention == (backend == "fa3")
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(outs["fa3"], outs["triton"], strict=True))
    # bf16 rounding flips some greedy choices of a random model (see test_engine_gpu).
    assert same >= 0.8 * len(prompts), (same, len(prompts))

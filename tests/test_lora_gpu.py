"""The Triton batched LoRA kernel against the PyTorch reference (CUDA only).

Mixed batches: tokens of several slots interleaved with base tokens, ranks below the buffer's
(zero padding), more tokens of one slot than a tile holds, output as a column slice of a fused
projection, float32 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kernels import reference  # noqa: E402
from kernels.triton_lora import lora_add  # noqa: E402

CASES = [  # tokens, in, out, slots, max rank, ranks
    (1, 576, 192, 1, 16, [8]),
    (32, 4096, 1024, 8, 16, [16, 8, 4, 16, 1, 16, 2, 16]),
    (300, 576, 1536, 3, 64, [64, 8, 33]),  # prefill chunks: many tokens of one slot
    (17, 1536, 576, 4, 64, [64, 64, 64, 64]),
]


def _case(t, k, n, s, r, ranks, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, k, device="cuda", generator=g).to(dtype)
    a = torch.randn(s, r, k, device="cuda", generator=g).to(dtype) / k**0.5
    b = torch.randn(s, n, r, device="cuda", generator=g).to(dtype)
    for i, rank in enumerate(ranks):
        a[i, rank:] = 0
        b[i, :, rank:] = 0
    slots = torch.randint(-1, s, (t,), generator=g, device="cuda").tolist()
    if t > 200:  # a long run of one slot, as in a prefill chunk
        slots[:200] = [0] * 200
    scales = [0.5 + i for i in range(s)]
    return x, a, b, slots, ranks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"t{c[0]}-k{c[1]}-n{c[2]}-s{c[3]}-r{c[4]}")
def test_lora_add_matches_reference(case, dtype):
    x, a, b, slots, ranks, scales = _case(*case, dtype=dtype, seed=7)
    t, n = x.shape[0], b.shape[1]
    fused = torch.randn(t, n + 40, device="cuda", dtype=dtype)  # y is a column slice
    want = fused.clone()
    cpu = reference.LoRAMetadata.build(slots, ranks, scales, torch.device("cpu"))
    ref_y = want[:, 8 : 8 + n].float().cpu()
    reference.lora_add(ref_y, x.float().cpu(), a.float().cpu(), b.float().cpu(), cpu)
    meta = reference.LoRAMetadata.build(slots, ranks, scales, x.device)
    lora_add(fused[:, 8 : 8 + n], x, a, b, meta)
    got = fused[:, 8 : 8 + n].float().cpu()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = (got - ref_y).norm() / ref_y.norm()
    assert err < tol
    # Base-only rows and the columns outside the slice are untouched.
    base_rows = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(fused[base_rows, 8 : 8 + n], want[base_rows, 8 : 8 + n])
    assert torch.equal(fused[:, :8], want[:, :8])
    assert torch.equal(fused[:, 8 + n :], want[:, 8 + n :])


def test_engine_lora_on_cuda_matches_cpu(tmp_path):
    """Greedy tokens of a mixed batch (base + two adapters) on CUDA in float32 against the CPU
    engine's (which equals peft, tests/test_lora.py), on a random SmolLM2-shaped model: as in
    tests/test_engine_gpu.py, most sequences match token for token (near-ties of a random
    model may split a few); the adapters change the output."""
    from bench.lora import write_adapter
    from engine import LLM, SamplingParams
    from tests.smol_shape import SMOL_CONFIG, make_smol_shape_dir, random_prompts

    model = make_smol_shape_dir(tmp_path / "model", seed=0)
    prompts = random_prompts(12, SMOL_CONFIG["vocab_size"], seed=1, hi=100)
    mix = [None, "a", "b"] * 4
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(
            model, device=device, dtype="float32", enable_lora=True, max_loras=2,
            max_lora_rank=16, num_kv_blocks=512, max_model_len=1024, enforce_eager=True,
        )  # fmt: skip
        if device == "cpu":
            a, b = ["q_proj", "v_proj", "down_proj"], ["o_proj", "gate_proj", "up_proj"]
            write_adapter(tmp_path / "a", llm.engine, 8, a, seed=1, std=0.1)
            write_adapter(tmp_path / "b", llm.engine, 16, b, seed=2, std=0.1)
        for name in ("a", "b"):
            llm.engine.add_lora(name, str(tmp_path / name))
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        outs[device] = [o.token_ids for o in llm.generate(prompts, params, lora=mix)]
        outs[device + "-base"] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
    same = sum(x == y for x, y in zip(outs["cuda"], outs["cpu"], strict=True))
    assert same >= 0.8 * len(prompts)
    changed = sum(x != y for x, y in zip(outs["cuda"], outs["cuda-base"], strict=True))
    assert changed >= 4  # the 8 adapter rows mostly differ from the base model's

"""The Triton batched LoRA kernel against the PyTorch reference, and decode CUDA graphs with
adapters (CUDA only).

Mixed batches: tokens of several slots interleaved with base tokens, ranks below the buffer's
(zero padding), more tokens of one slot than a tile holds, output as a column slice of a fused
projection, float32 and bfloat16; the fixed-size tile tables of a decode graph give the same
bits as the per-step tiles.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kernels import reference  # noqa: E402

DEVICE = "cuda"
from kernels.triton_lora import lora_add, lora_add_fused  # noqa: E402

CASES = [  # tokens, in, out, slots, max rank, ranks
    (1, 576, 192, 1, 16, [8]),
    (32, 4096, 1024, 8, 16, [16, 8, 4, 16, 1, 16, 2, 16]),
    (300, 576, 1536, 3, 64, [64, 8, 33]),  # prefill chunks: many tokens of one slot
    (17, 1536, 576, 4, 64, [64, 64, 64, 64]),
]


def _case(t, k, n, s, r, ranks, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(t, k, device=DEVICE, generator=g).to(dtype)
    a = torch.randn(s, r, k, device=DEVICE, generator=g).to(dtype) / k**0.5
    b = torch.randn(s, n, r, device=DEVICE, generator=g).to(dtype)
    for i, rank in enumerate(ranks):
        a[i, rank:] = 0
        b[i, :, rank:] = 0
    slots = torch.randint(-1, s, (t,), generator=g, device=DEVICE).tolist()
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
    fixed = fused.clone()
    lora_add(fused[:, 8 : 8 + n], x, a, b, meta)
    # The graph form: tables padded to fixed sizes (empty tiles), the same bits.
    rows, tiles = t + 5, reference.max_lora_tiles(t + 5, len(ranks))
    table = reference.lora_tile_table(slots, rows, tiles)
    tab = torch.tensor(table, dtype=torch.int32, device="cuda")
    parts = [tab[rows + i * tiles : rows + (i + 1) * tiles] for i in range(3)]
    padded = reference.LoRAMetadata(ranks, scales, [], tab[:rows], *parts, meta.scales_t)
    x_pad = torch.cat([x, torch.zeros(5, x.shape[1], device="cuda", dtype=dtype)])
    y_pad = torch.cat([fixed, torch.zeros(5, fixed.shape[1], device="cuda", dtype=dtype)])
    lora_add(y_pad[:, 8 : 8 + n], x_pad, a, b, padded)
    assert torch.equal(y_pad[:t], fused) and not y_pad[t:].any()
    got = fused[:, 8 : 8 + n].float().cpu()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = (got - ref_y).norm() / ref_y.norm()
    assert err < tol
    # Base-only rows and the columns outside the slice are untouched.
    base_rows = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(fused[base_rows, 8 : 8 + n], want[base_rows, 8 : 8 + n])
    assert torch.equal(fused[:, :8], want[:, :8])
    assert torch.equal(fused[:, 8 + n :], want[:, 8 + n :])


FUSED = [  # tokens, in, widths (q/k/v or gate/up, TP slices), slots, max rank
    (32, 4096, [4096, 1024, 1024], 8, 16),
    (32, 4096, [14336, 14336], 8, 16),
    (17, 576, [576, 192, 192], 4, 64),  # 3 x 64 ranks: the shrink's 256-wide block
    (300, 2048, [1000, 200, 200], 3, 8),  # widths not a multiple of the column block
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", FUSED, ids=lambda c: f"t{c[0]}-k{c[1]}-n{len(c[2])}-r{c[4]}")
def test_fused_projections_match_one_at_a_time(case, dtype):
    """q/k/v (gate/up) in one shrink and one expand: against the reference, and against the
    Triton kernel run one projection at a time."""
    t, k, widths, s, r = case
    dev = torch.device(DEVICE)
    ranks = [max(1, r - 3 * i) for i in range(s)]
    x, _, _, slots, ranks, scales = _case(t, k, 1, s, r, ranks, dtype, 9)
    g = torch.Generator(device=dev).manual_seed(10)
    a = torch.randn(s, len(widths), r, k, device=dev, generator=g).to(dtype) / k**0.5
    b = torch.randn(s, sum(widths), r, device=dev, generator=g).to(dtype)
    for i, rank in enumerate(ranks):  # each projection's own A and B zero-padded to r
        a[i, :, rank:] = 0
        b[i, :, rank:] = 0
    a = a.view(s, len(widths) * r, k)
    meta = reference.LoRAMetadata.build(slots, ranks, scales, x.device)
    y0 = torch.randn(t, sum(widths), device=dev, dtype=dtype)
    fused, split = y0.clone(), y0.clone()
    lora_add_fused(fused, x, a, b, widths, meta)
    lo = 0
    for j, w in enumerate(widths):
        lora_add(split[:, lo : lo + w], x, a[:, j * r : (j + 1) * r], b[:, lo : lo + w], meta)
        lo += w
    ref = y0.float().cpu().clone()
    cpu = reference.LoRAMetadata.build(slots, ranks, scales, torch.device("cpu"))
    reference.lora_add_fused(ref, x.float().cpu(), a.float().cpu(), b.float().cpu(), widths, cpu)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for got in (fused, split):
        delta, want = got.float().cpu() - y0.float().cpu(), ref - y0.float().cpu()
        assert (delta - want).norm() / want.norm() < tol
    base_rows = [i for i, sl in enumerate(slots) if sl < 0]
    assert torch.equal(fused[base_rows], y0[base_rows])
    # Deterministic: the same bits on a second run.
    again = y0.clone()
    lora_add_fused(again, x, a, b, widths, meta)
    assert torch.equal(again, fused)


def test_engine_lora_on_cuda_matches_cpu(tmp_path):
    """Greedy tokens of a mixed batch (base + two adapters) on CUDA in float32 against the CPU
    engine's (which equals peft, tests/engine/test_lora.py), on a random SmolLM2-shaped model: as in
    tests/gpu/test_engine_gpu.py, most sequences match token for token (near-ties of a random
    model may split a few); the adapters change the output."""
    from engine import LLM, SamplingParams
    from tests.lora_adapters import write_adapter
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


def test_mixed_adapter_batch_replays_a_graph(tmp_path):
    """Decode steps of a batch of base rows and two adapters' rows replay the LoRA variant of
    the captured graphs: its logits equal the same step's run uncaptured (base rows: the base
    graph's; adapter rows differ from them); greedy tokens match the eager engine's on most
    sequences (float32; padding to the captured size may split a near-tie of a random model,
    as in tests/gpu/test_engine_gpu.py), and the adapters change the output."""
    from engine import LLM, SamplingParams
    from engine.cuda_graphs import DecodeBatch, DecodeGraphs
    from tests.lora_adapters import write_adapter
    from tests.smol_shape import SMOL_CONFIG, make_smol_shape_dir, random_prompts

    model = make_smol_shape_dir(tmp_path / "model", seed=0)
    prompts = random_prompts(12, SMOL_CONFIG["vocab_size"], seed=3, hi=100)
    mix = [None, "a", "b"] * 4
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        llm = LLM(
            model, device="cuda", dtype="float32", enable_lora=True, max_loras=2,
            max_lora_rank=16, num_kv_blocks=512, max_model_len=1024, max_num_seqs=16,
            enforce_eager=eager,
        )  # fmt: skip
        if not eager:
            a, b = ["q_proj", "v_proj", "down_proj"], ["o_proj", "gate_proj", "up_proj"]
            write_adapter(tmp_path / "a", llm.engine, 8, a, seed=1, std=0.1)
            write_adapter(tmp_path / "b", llm.engine, 16, b, seed=2, std=0.1)
        for name in ("a", "b"):
            llm.engine.add_lora(name, str(tmp_path / name))
        outs[eager] = [o.token_ids for o in llm.generate(prompts, params, lora=mix)]
        runner = llm.engine.runner
        if not eager:
            graphs = runner.graphs
            assert graphs is not None and graphs.lora is runner.lora
            assert graphs.lora_runs >= 6  # the decode steps after the last prefill
            runs, lora_runs = graphs.runs, graphs.lora_runs
            outs["base"] = [o.token_ids for o in llm.generate(prompts, params)]
            assert graphs.runs - runs >= 6 and graphs.lora_runs == lora_runs
            # One step of 5 rows: replayed (padded to 8) against the same step uncaptured.
            n = 5
            blocks = list(range(100, 100 + n))
            batch = DecodeBatch(
                token_ids=[p[0] for p in prompts[:n]], positions=[0] * n, slot_blocks=blocks,
                slot_offsets=[0] * n, block_tables=[[blk] for blk in blocks], seq_lens=[1] * n,
            )  # fmt: skip
            slots = runner.lora.token_slots(["a", "", "b", "b", ""], ["a", "b"])
            replayed = graphs.run(batch, slots).clone()
            plain = DecodeGraphs(
                runner.model, runner.kv_cache, graphs.sizes, graphs._tables.shape[1],
                graphs.block_size, runner.lora, capture=False,
            )  # fmt: skip
            torch.testing.assert_close(replayed, plain.run(batch, slots), rtol=1e-4, atol=1e-4)
            base_graph = graphs.run(batch).clone()  # the base variant: no deltas
            torch.testing.assert_close(replayed[[1, 4]], base_graph[[1, 4]], rtol=1e-4, atol=1e-4)
            assert (replayed[[0, 2, 3]] - base_graph[[0, 2, 3]]).abs().amax(dim=1).min() > 1e-2
        del llm, runner
        torch.cuda.empty_cache()
    same = sum(x == y for x, y in zip(outs[False], outs[True], strict=True))
    assert same >= 0.8 * len(prompts)
    changed = sum(x != y for x, y in zip(outs[False], outs["base"], strict=True))
    assert changed >= 4  # the 8 adapter rows mostly differ from the base model's

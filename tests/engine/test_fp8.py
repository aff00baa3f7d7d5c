"""FP8 on CPU (reference kernels): the e4m3 helpers, the KV cache in FP8 (half the bytes,
scales honoured, close to the unquantized model), weights in FP8, and the FP8 KV moved
through the disaggregated path token-exact against FP8 colocated."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import UnsupportedConfigError
from kernels import reference
from kernels.reference import FP8, quantize_fp8_rows, to_fp8
from tests.handoff_cases import check_handoff_matches_colocated
from tests.kernel_cases import make_paged_batch, rel_err


# -- reference kernels -------------------------------------------------------------------------
def test_fp8_helpers_round_and_saturate():
    x = torch.tensor([0.0, 1.0, -3.3, 1e4, -1e4, 448.0])
    y = to_fp8(x).float()
    assert not torch.isnan(y).any() and y[3] == 448 and y[4] == -448
    assert abs(y[2] + 3.3) <= 3.3 / 16  # 3 mantissa bits: within half a step of 2**-3
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64).unsqueeze(1)  # rows of every scale
    fw = quantize_fp8_rows(w)
    assert fw.weight.dtype == FP8 and fw.scale.shape == (64,)
    deq = fw.weight.float() * fw.scale[:, None]
    assert ((deq - w).abs() <= w.abs() / 16 + fw.scale[:, None] * 2**-9).all()
    x = torch.randn(5, 96)
    assert rel_err(reference.linear(x, fw), x @ w.T) < 0.05


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 4.0)])
def test_fp8_cache_write_and_attention_follow_the_scales(scales):
    k_scale, v_scale = scales
    q, kv, meta = make_paged_batch(
        [40, 70], [40, 5], block_size=16, num_heads=8, num_kv_heads=2, head_dim=64,
        dtype=torch.float32, device="cpu", seed=3,
    )  # fmt: skip
    kv *= torch.tensor([k_scale, v_scale]).view(1, 1, 2, 1, 1, 1)  # K and V of those sizes
    ref = reference.paged_attention(q, kv, 1, meta, 0.125)
    cache = torch.zeros(kv.shape, dtype=FP8)
    rows = meta.slot_blocks.shape[0]
    full = make_paged_batch(
        [40, 70], [40, 70], block_size=16, num_heads=8, num_kv_heads=2, head_dim=64,
        dtype=torch.float32, device="cpu", seed=3,
    )[2]  # fmt: skip
    layer = kv[:, 1]
    k = layer[full.slot_blocks, 0, full.slot_offsets]
    v = layer[full.slot_blocks, 1, full.slot_offsets]
    reference.write_kv(cache, 1, k, v, full, k_scale, v_scale)
    assert rows < k.shape[0]
    out = reference.paged_attention(q, cache, 1, meta, 0.125, k_scale, v_scale)
    assert rel_err(out, ref) < 0.05
    # Read with the wrong scales, the output is far off: the scales are really applied.
    assert rel_err(reference.paged_attention(q, cache, 1, meta, 0.125), ref) > 0.1 or scales == (
        1.0,
        1.0,
    )
    # Copy-on-write copies FP8 blocks byte for byte.
    src, dst = torch.tensor([0, 1]), torch.tensor([2, 3])
    reference.copy_blocks(cache, src, dst)
    assert torch.equal(cache[dst].view(torch.uint8), cache[src].view(torch.uint8))


# -- engine ------------------------------------------------------------------------------------
def make(model_dir, **kw) -> LLMEngine:
    opts = dict(kv_cache_bytes=32 * 1024**2, max_num_batched_tokens=64)
    opts.update(kw)
    return LLMEngine(EngineConfig(model_dir=str(model_dir), **opts))


def greedy(engine: LLMEngine, prompts, max_tokens=16) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0))
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
    engine.check_integrity()
    return [finals[f"g{i}"] for i in range(len(prompts))]


def test_config_refuses_unknown_fp8_options(smol_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model_dir=str(smol_dir), kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model_dir=str(smol_dir), quantization="awq")


def test_fp8_needs_fp8_hardware_on_cuda(monkeypatch):
    from engine import fp8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    with pytest.raises(UnsupportedConfigError, match="compute capability 8.9.*A100 has 8.0"):
        fp8.kv_dtype("fp8", torch.bfloat16, torch.device("cuda", 0))
    assert fp8.kv_dtype("auto", torch.bfloat16, torch.device("cuda", 0)) == torch.bfloat16
    assert fp8.kv_dtype("fp8", torch.float32, torch.device("cpu")) == FP8


@pytest.fixture(scope="module")
def smol_prompts(smol_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(smol_dir)
    texts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "1, 2, 3, 4,"]
    return [tok.encode(t) for t in texts] + [
        tok.encode_chat([{"role": "user", "content": "Name three rivers in Europe."}])
    ]


def close(a: LLMEngine, b: LLMEngine, prompts) -> float:
    """Share of prompt positions where both engines' next-token argmax agree; asserts the mean
    logprob change of ``a``'s choice is small."""
    la = torch.cat([a.score(p) for p in prompts])
    lb = torch.cat([b.score(p) for p in prompts])
    chosen = la.argmax(-1, keepdim=True)
    delta = torch.log_softmax(la, -1).gather(1, chosen) - torch.log_softmax(lb, -1).gather(
        1, chosen
    )
    assert delta.abs().mean() < 0.5
    return float((la.argmax(-1) == lb.argmax(-1)).float().mean())


def test_fp8_kv_cache_halves_blocks_and_stays_close(smol_dir, smol_prompts):
    bf16 = make(smol_dir, dtype="bfloat16")
    fp8 = make(smol_dir, dtype="bfloat16", kv_cache_dtype="fp8")
    assert fp8.runner.kv_cache.dtype == FP8
    assert fp8.runner.block_bytes * 2 == bf16.runner.block_bytes
    assert fp8.pool.num_blocks == 2 * bf16.pool.num_blocks  # same bytes, twice the tokens
    # The prompts' logits through an FP8 cache: close to bf16's, mostly the same argmax.
    assert close(bf16, fp8, smol_prompts) >= 0.75
    outs = greedy(fp8, smol_prompts)
    assert all(len(o) == 16 for o in outs)


def test_fp8_weights_on_cpu_stay_close(smol_dir, smol_prompts):
    base = make(smol_dir)
    w8 = make(smol_dir, quantization="fp8")
    lw = w8.runner.model.w.layers[0]
    assert lw.qkv.weight.dtype == FP8 and lw.down.scale.dtype == torch.float32
    agree = close(base, w8, smol_prompts)
    assert agree >= 0.75


def test_fp8_kv_handoff_is_token_exact_against_fp8_colocated(smol_dir, smol_prompts):
    """Prefill and decode engines with FP8 caches: the held blocks move as raw bytes (half of
    bf16's) and the decode engine continues exactly like one FP8 engine doing both."""
    prompts = [smol_prompts[1], smol_prompts[-1]]
    moved = check_handoff_matches_colocated(
        lambda: make(smol_dir, dtype="bfloat16", kv_cache_dtype="fp8"), prompts
    )
    bf16 = make(smol_dir, dtype="bfloat16", num_kv_blocks=8)
    blocks = [-(-len(p) // bf16.config.block_size) for p in prompts]
    assert moved == [n * bf16.runner.block_bytes // 2 for n in blocks]  # half of bf16's bytes


@pytest.mark.slow
def test_fp8_kv_through_the_stack_is_token_exact_with_fp8_blocks(smol_dir, tmp_path):
    """A disaggregated request through the real stack (router, prefill and decode workers, the
    KV transport) with ``--kv-cache-dtype fp8`` on both workers: the text equals an offline FP8
    engine's, and every block moved is an FP8 block (a quarter of float32's bytes)."""
    import httpx

    from services.launcher.etcd import free_port
    from services.launcher.stack import Stack, StackConfig
    from tests.stack_probe import metrics_of

    text = "List the steps again. " + " ".join(f"step {i}: mix {i * 7} grams." for i in range(40))
    offline = make(smol_dir, kv_cache_dtype="fp8", max_num_batched_tokens=256)  # the workers'
    prompt = offline.tokenizer.encode(text)
    assert len(prompt) > 256  # the router prefills it on the prefill worker
    ref = offline.tokenizer.decode(greedy(offline, [prompt], max_tokens=24)[0])
    config = StackConfig(model_dir=str(smol_dir), run_dir=str(tmp_path), port=free_port(),
                         num_prefill=1, num_decode=1,
                         worker_args=("--kv-cache-dtype", "fp8"))  # fmt: skip
    with Stack(config) as stack:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": text, "max_tokens": 24,
                "temperature": 0}  # fmt: skip
        r = httpx.post(stack.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref
        decode = metrics_of(stack.scrape_targets()["decode-0"])
    blocks = decode["tandem_kv_transfer_blocks_total"]
    assert blocks >= len(prompt) // offline.config.block_size
    assert decode["tandem_kv_transfer_bytes_total"] == blocks * offline.runner.block_bytes
    assert offline.runner.block_bytes * 4 == make(smol_dir, num_kv_blocks=4).runner.block_bytes


@pytest.mark.parametrize("algorithm", ["wsum64", "xxh3-64-heads", "crc32"])
def test_block_checksums_of_an_fp8_pool(algorithm):
    """Checked hand-offs sum a pool's blocks as bytes: an FP8 pool like any other."""
    from engine.kv_checksum import BlockChecksums

    pool = to_fp8(torch.randn(6, 2, 4, 2, 16, 8))
    pool[3] = pool[1]
    sums = BlockChecksums(pool, algorithm)([0, 1, 3])
    assert sums[1] == sums[2] != sums[0]

"""Multi-LoRA in the engine against transformers + peft (fp32 CPU), slots, salts, bad adapters.

Adapters are made by peft itself on SmolLM2 with random A and B (tests/lora_adapters.py): one
of rank 8 on all seven projections (alpha/r scaling), one of rank 16 with rsLoRA on q/v/down.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import AdapterNotFoundError, InvalidAdapterError
from engine.lora import LoRAManager
from engine.lora_config import read_spec
from kernels import reference
from tests.conftest import hf_greedy, load_hf
from tests.lora_adapters import ALL_TARGETS, make_adapter

MAX_NEW = 12
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time,",
    "1, 2, 3, 4, 5,",
    "Water boils at",
    "The quick brown fox",
]
MIX = [None, "a", "b", "a", None, "b"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, smol_dir):
    base = tmp_path_factory.mktemp("adapters")
    a = make_adapter(smol_dir, base / "a", r=8, alpha=16, targets=ALL_TARGETS, seed=1)
    b = make_adapter(
        smol_dir, base / "b", r=16, alpha=8, targets=["q_proj", "v_proj", "down_proj"],
        seed=2, rslora=True,
    )  # fmt: skip
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def peft_reference(smol_dir, adapters):
    """Greedy continuations by transformers + peft, per (prompt, adapter)."""
    from peft import PeftModel

    from engine.tokenizer import Tokenizer

    tok = Tokenizer(smol_dir)
    model = PeftModel.from_pretrained(load_hf(smol_dir), str(adapters["a"]), adapter_name="a")
    model.load_adapter(str(adapters["b"]), adapter_name="b")
    model.eval()
    out = {}
    for text in PROMPTS:
        ids = tok.encode(text)
        with model.disable_adapter():
            out[(text, None)] = hf_greedy(model, ids, MAX_NEW)
        for name in ("a", "b"):
            model.set_adapter(name)
            out[(text, name)] = hf_greedy(model, ids, MAX_NEW)
    return out


def make_llm(smol_dir, adapters, **options) -> LLM:
    opts = dict(enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=256)
    llm = LLM(smol_dir, **{**opts, **options})
    for name, path in adapters.items():
        llm.engine.add_lora(name, str(path))
    return llm


@pytest.mark.parametrize(
    "max_loras", [2, pytest.param(1, marks=pytest.mark.slow)], ids=["two-slots", "one-slot"]
)
def test_mixed_batch_matches_peft(smol_dir, adapters, peft_reference, max_loras):
    """Base and two adapters in one batch, token for token as peft; with one slot the
    scheduler runs one adapter per step and the slots are evicted and refilled."""
    llm = make_llm(smol_dir, adapters, max_loras=max_loras)
    tok = llm.tokenizer
    outs = llm.generate(
        [tok.encode(t) for t in PROMPTS], SamplingParams(max_tokens=MAX_NEW, temperature=0),
        lora=MIX,
    )  # fmt: skip
    for text, name, out in zip(PROMPTS, MIX, outs, strict=True):
        assert out.token_ids == peft_reference[(text, name)], (text, name)
    # The adapters matter: each changes the continuation of some prompt.
    for name in ("a", "b"):
        assert any(peft_reference[(t, name)] != peft_reference[(t, None)] for t in PROMPTS)
    llm.engine.check_integrity()


def test_prefix_cache_is_salted_by_adapter(smol_dir, adapters):
    llm = make_llm(smol_dir, adapters, block_size=4)
    prompt = llm.tokenizer.encode("A long enough prompt to fill several blocks of four tokens.")
    params = SamplingParams(max_tokens=1, temperature=0)
    first = llm.generate([prompt], params, lora="a")[0]
    assert first.num_cached_tokens == 0
    assert llm.generate([prompt], params)[0].num_cached_tokens == 0  # base: no hit on a's KV
    assert llm.generate([prompt], params, lora="b")[0].num_cached_tokens == 0
    assert llm.generate([prompt], params, lora="a")[0].num_cached_tokens >= 8  # a's own hit


def test_unknown_adapter_and_unload_after_finish(smol_dir, adapters):
    llm = make_llm(smol_dir, adapters)
    engine = llm.engine
    with pytest.raises(AdapterNotFoundError, match="`zzz` is not loaded"):
        engine.add_request("x", [1, 2, 3], lora="zzz")
    engine.add_request("r1", llm.tokenizer.encode("Hello"), SamplingParams(max_tokens=4), lora="a")
    engine.step()
    engine.remove_lora("a")  # r1 still runs with it
    assert engine.list_loras() == ["b"]
    with pytest.raises(AdapterNotFoundError):
        engine.add_request("r2", [1, 2, 3], lora="a")
    assert "a" in engine.runner.lora.specs  # kept for r1
    while engine.has_unfinished():
        engine.step()
    assert "a" not in engine.runner.lora.specs  # freed once r1 finished
    with pytest.raises(AdapterNotFoundError):
        engine.remove_lora("a")
    engine.add_lora("a", str(adapters["a"]))  # loads again under the same name
    assert engine.list_loras() == ["a", "b"]
    with pytest.raises(InvalidAdapterError, match="already loaded"):
        engine.add_lora("a", str(adapters["a"]))


def test_slots_are_evicted_least_recently_used(smol_dir, adapters, tmp_path):
    c = make_adapter(smol_dir, tmp_path / "c", r=4, alpha=4, targets=["o_proj"], seed=3)
    from engine.config import ModelConfig

    m = LoRAManager(ModelConfig.from_dir(smol_dir), 2, 16, torch.device("cpu"), torch.float32)
    for name, path in {**adapters, "c": c}.items():
        m.add(name, str(path))
    assert m.prepare({"a"}) == {"a": 0}
    assert m.prepare({"b"}) == {"b": 1}
    m.prepare({"a"})  # a is now the most recent
    assert m.prepare({"c"}) == {"c": 1}  # b (least recently used) gave its slot
    assert m.resident() == ["a", "c"]
    assert m.prepare({"b", "c"}) == {"b": 0, "c": 1}  # a evicted; c kept (needed)
    # The slot holds c's matrices, zero elsewhere (b's rank-16 leftovers cleared).
    assert m.ranks[1] == 4
    assert torch.count_nonzero(m.a["q_proj"][:, 1]) == 0
    assert torch.count_nonzero(m.a["o_proj"][:, 1, 4:]) == 0
    with pytest.raises(ValueError, match="limit is 2"):
        m.prepare({"a", "b", "c"})


def test_lora_reference_kernel_against_dense():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 32, generator=g)
    a = torch.randn(3, 8, 32, generator=g)
    b = torch.randn(3, 20, 8, generator=g)
    a[1, 4:] = 0  # slot 1 has rank 4
    b[1, :, 4:] = 0
    slots = [0, -1, 1, 0, 2, -1, 1]
    meta = reference.LoRAMetadata.build(slots, [8, 4, 8], [0.5, 2.0, 1.0], torch.device("cpu"))
    y = torch.zeros(7, 20)
    reference.lora_add(y, x, a, b, meta)
    for t, s in enumerate(slots):
        want = torch.zeros(20) if s < 0 else (b[s] @ (a[s] @ x[t])) * [0.5, 2.0, 1.0][s]
        torch.testing.assert_close(y[t], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "max_loras", [2, pytest.param(1, marks=pytest.mark.slow)], ids=["two-slots", "one-slot"]
)
def test_decode_graph_inputs_match_peft(smol_dir, adapters, peft_reference, max_loras):
    """Decode steps through the CUDA-graph path (``DecodeGraphs``, run without capture on CPU):
    static buffers, fixed-size LoRA tile tables (laid out for the largest size) and the slots'
    scales read at run time. Mixed batches of base and adapter rows take the LoRA
    variant, base-only batches the base one; token for token as peft."""
    from engine.cuda_graphs import DecodeGraphs

    llm = make_llm(smol_dir, adapters, max_loras=max_loras)
    runner = llm.engine.runner
    bs = runner.config.block_size
    width = -(-runner.model.cos.shape[0] // bs)
    graphs = DecodeGraphs(runner.model, runner.kv_cache, [1, 2, 4, 8], width, bs, runner.lora)
    graphs.capture()
    runner.graphs = graphs
    tok = llm.tokenizer
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    ids = [tok.encode(t) for t in PROMPTS]
    outs = llm.generate(ids, params, lora=MIX)
    for text, name, out in zip(PROMPTS, MIX, outs, strict=True):
        assert out.token_ids == peft_reference[(text, name)], (text, name)
    assert graphs.lora_runs >= MAX_NEW - 2  # the decode steps (6 rows)
    base = llm.generate(ids[:1], params)[0]
    assert base.token_ids == peft_reference[(PROMPTS[0], None)]
    assert graphs.runs - graphs.lora_runs >= MAX_NEW - 2
    llm.engine.check_integrity()


def test_lora_tile_tables_match_groups():
    """The fixed-size tile tables a decode graph reads give the reference kernel the same
    result as the per-step groups, bit for bit: any mix, padding rows and empty tiles; the
    tables' bounds hold for every mix of n rows over the slots."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 48, generator=g)
    a = torch.randn(4, 8, 48, generator=g)
    b = torch.randn(4, 24, 8, generator=g)
    ranks, scales = [8, 3, 8, 5], [0.5, 2.0, 1.0, 0.25]
    for slots in ([-1] * 40, [2] * 40, [s % 5 - 1 for s in range(33)], [0, -1, 3, 3, 1]):
        t = len(slots)
        want = torch.zeros(t, 24)
        cpu = torch.device("cpu")
        reference.lora_add(
            want, x[:t], a, b, reference.LoRAMetadata.build(slots, ranks, scales, cpu)
        )
        rows, tiles = t + 3, reference.max_lora_tiles(t + 3, 4)
        table = torch.tensor(reference.lora_tile_table(slots, rows, tiles), dtype=torch.int32)
        parts = [table[rows + i * tiles : rows + (i + 1) * tiles] for i in range(3)]
        meta = reference.LoRAMetadata(ranks, scales, [], table[:rows], *parts)
        got = torch.zeros(t, 24)
        reference.lora_add(got, x[:t], a, b, meta)
        assert torch.equal(got, want)
        assert parts[1].sum().item() == sum(s >= 0 for s in slots)  # every adapted row, once
    for n in range(1, 70):  # the worst mixes: as many slots as possible, each just over a tile
        for used in range(1, 5):
            mix = [i % used for i in range(n)]
            assert len(reference.lora_tiles(mix)[1]) <= reference.max_lora_tiles(n, 4)
    with pytest.raises(ValueError, match="exceed"):
        reference.lora_tile_table([0] * 20, 20, 1)


_INTERPRETED = """
import torch
from kernels import reference, triton_lora

g = torch.Generator().manual_seed(3)
x = torch.randn(37, 2100, generator=g)
a = torch.randn(5, 16, 2100, generator=g) / 2100**0.5
b = torch.randn(5, 300, 16, generator=g)
ranks, scales = [16, 8, 4, 16, 1], [0.5, 1.5, 2.5, 3.5, 4.5]
for i, r in enumerate(ranks):
    a[i, r:] = 0
    b[i, :, r:] = 0
slots = [(t * 7) % 6 - 1 for t in range(32)] + [2] * 5
y = torch.randn(37, 310, generator=g)
want = y.clone()
cpu = torch.device("cpu")
reference.lora_add(want[:, 3:303], x, a, b, reference.LoRAMetadata.build(slots, ranks, scales, cpu))
rows = 40
tiles = reference.max_lora_tiles(rows, 5)
tab = torch.tensor(reference.lora_tile_table(slots, rows, tiles), dtype=torch.int32)
parts = [tab[rows + i * tiles : rows + (i + 1) * tiles] for i in range(3)]
meta = reference.LoRAMetadata(ranks, scales, [], tab[:rows], *parts, torch.tensor(scales))
got = torch.cat([y, torch.zeros(3, 310)])
triton_lora.lora_add(got[:, 3:303], torch.cat([x, torch.zeros(3, 2100)]), a, b, meta)
torch.testing.assert_close(got[:37], want, rtol=1e-4, atol=1e-4)
assert not got[37:].any()

# q/k/v fused: A stacked [S, 3R, in], B [S, q + k + v, R]; widths not multiples of BLOCK_N.
widths = [200, 72, 72]
af = torch.randn(5, 3 * 16, 2100, generator=g) / 2100**0.5
bf = torch.randn(5, sum(widths), 16, generator=g)
for i, r in enumerate(ranks):
    for j in range(3):
        af[i, j * 16 + r : (j + 1) * 16] = 0
    bf[i, :, r:] = 0
yf = torch.randn(37, sum(widths), generator=g)
want = yf.clone()
gm = reference.LoRAMetadata.build(slots, ranks, scales, cpu)
lo = 0
for j, w in enumerate(widths):  # one projection at a time
    aj = af[:, j * 16 : (j + 1) * 16]
    reference.lora_add(want[:, lo : lo + w], x, aj, bf[:, lo : lo + w], gm)
    lo += w
fused = yf.clone()
reference.lora_add_fused(fused, x, af, bf, widths, gm)
assert torch.equal(fused, want)
got = torch.cat([yf, torch.zeros(3, sum(widths))])
triton_lora.lora_add_fused(got, torch.cat([x, torch.zeros(3, 2100)]), af, bf, widths, meta)
torch.testing.assert_close(got[:37], want, rtol=1e-4, atol=1e-4)
assert not got[37:].any()

print("interpreted ok")
"""


def test_triton_kernel_reads_padded_tables_interpreted():
    """The Triton kernel (split K, empty tiles) on a decode graph's padded tables against the
    reference, run by Triton's interpreter on CPU; skipped where Triton does not import (run it
    with triton==3.6.0 on PYTHONPATH)."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "interpreted ok" in out.stdout, out.stderr[-3000:]


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_lora as L

def compile(fn, ptrs, consts):
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

idx = {n: "*i32" for n in ("rows_ptr", "start_ptr", "len_ptr", "slot_ptr")}
for dt, prec in (("*bf16", "tf32"), ("*fp32", "ieee")):
    shrink = {**idx, "x_ptr": dt, "a_ptr": dt, "part_ptr": "*fp32"}
    for block_r, block_k in ((16, L.BLOCK_K), (64, L.BLOCK_K), (256, L.BLOCK_K // 2)):
        consts = dict(BLOCK_M=16, BLOCK_R=block_r, BLOCK_K=block_k, K_SPLIT=L.K_SPLIT, PREC=prec,
                      PDL=False)
        assert "cubin" in compile(L._shrink_kernel, shrink, consts).asm
    for splits in (1, 14):
        ptrs = {**idx, "part_ptr": "*fp32", "b_ptr": dt, "y_ptr": dt, "scale_ptr": "*fp32"}
        consts = dict(BLOCK_M=16, BLOCK_R=16, BLOCK_N=L.BLOCK_N, SPLITS=splits, PREC=prec,
                      PDL=False)
        assert "cubin" in compile(L._expand_kernel, ptrs, consts).asm
print("compiled ok")
"""


def test_triton_kernels_compile_for_hopper():
    """Shrink and expand (early return on padding tiles, split partials) compile for sm_90 off
    the GPU (Triton's compiler and ptxas need no device); skipped without Triton."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    if out.returncode and "ptxas" in out.stderr.lower() and "not found" in out.stderr.lower():
        pytest.skip("no ptxas in this Triton install")
    assert out.returncode == 0 and "compiled ok" in out.stdout, out.stderr[-3000:]


# -- bad adapters ------------------------------------------------------------------------------


def test_bad_adapters_are_refused_with_the_reason(smol_dir, adapters, tmp_path, qwen2_dir):
    from engine.config import ModelConfig

    model = ModelConfig.from_dir(smol_dir)
    with pytest.raises(InvalidAdapterError, match="not a directory"):
        read_spec("x", tmp_path / "missing", model, 64)
    with pytest.raises(InvalidAdapterError, match="rank 16 is over the limit of 8"):
        read_spec("b", adapters["b"], model, 8)
    other = ModelConfig.from_dir(qwen2_dir)  # another base model (hidden 128, 3 layers)
    with pytest.raises(InvalidAdapterError, match="another base model"):
        read_spec("a", adapters["a"], other, 64)
    head = make_adapter(smol_dir, tmp_path / "head", r=4, alpha=4, targets=["lm_head"], seed=4)
    with pytest.raises(InvalidAdapterError, match="unsupported target"):
        read_spec("h", head, model, 64)
    dora = tmp_path / "dora"
    shutil.copytree(adapters["a"], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(InvalidAdapterError, match="use_dora"):
        read_spec("d", dora, model, 64)
    (dora / "adapter_model.safetensors").unlink()
    with pytest.raises(InvalidAdapterError, match="adapter_model.safetensors not found"):
        read_spec("d", dora, model, 64)


def test_tensor_parallel_mixed_batch_matches_peft(smol_dir, adapters, peft_reference):
    """TP=2 on CPU (gloo): base and two adapters in one batch, token for token as TP=1 and as
    peft. SmolLM2's 9 heads and 3 KV heads split 3+6 and 1+2, so each rank's slices of B (q/k/v,
    gate/up rows) and of A (o, down columns) are uneven. One slot forces evictions, so both
    ranks must make the same slot choices; an unload and a reload reach every rank."""
    texts = PROMPTS[:4]
    mix = MIX[:4]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    with make_llm(smol_dir, adapters, tensor_parallel_size=2, max_loras=1) as llm:
        ids = [llm.tokenizer.encode(t) for t in texts]
        outs = [o.token_ids for o in llm.generate(ids, params, lora=mix)]
        shard = llm.engine.runner.lora.shard
        assert (shard.size, shard.num_heads) == (2, 3)
        assert llm.engine.runner.lora.b["q_proj"].shape[2] == 3 * 64  # rank 0's rows of B
        assert llm.engine.runner.lora.a["down_proj"].shape[3] == 1536 // 2  # its columns of A
        llm.engine.remove_lora("a")
        llm.engine.add_lora("a", str(adapters["a"]))
        again = llm.generate(ids[:2], params, lora=["a", "a"])
        llm.engine.check_integrity()
    for text, name, out in zip(texts, mix, outs, strict=True):
        assert out == peft_reference[(text, name)], (text, name)
    assert [o.token_ids for o in again] == [peft_reference[(t, "a")] for t in texts[:2]]
    with make_llm(smol_dir, adapters, max_loras=1) as one:
        ref = [o.token_ids for o in one.generate(ids, params, lora=mix)]
    assert outs == ref

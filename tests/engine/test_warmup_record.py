"""The warm-up covers what serving meets, checked on the CPU with Triton's own specialisation
rules (``tests/kernel_record.py``: every launch's compile key recorded, nothing run): an engine
serves a mixed workload (prompts up to the context limit, chunked prefill, decode batches of
every size as requests come and go, n > 1, greedy and sampled, logprobs; n-gram speculation
and an FP8 KV cache in the second case), and every kernel specialisation it launches must be
one its warm-up launched. The folded decode products are taken as on CUDA (``fold``); decode
CUDA graphs are not (there are none off CUDA), so every decode step is an eager one here: a
stricter test than the GPU's, whose graph replays compile nothing.

Skipped unless Triton imports (CI has none):

    pip install --target /tmp/triton-3.6 triton==3.6.0 'numpy<2.3'
    PYTHONPATH=/tmp/triton-3.6 .venv/bin/python -m pytest -q tests/engine/test_warmup_record.py
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="Triton is not installed (see the docstring)")

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.warmup import run_passes  # noqa: E402
from tests.conftest import make_random_model_dir  # noqa: E402
from tests.kernel_record import Recorder, recording, storages  # noqa: E402
from tests.warmup_cases import serve_mixed  # noqa: E402

CASES = {
    "llama": ("llama", {}),
    "qwen2-fp8kv-ngram": (
        "qwen2",
        {
            "kv_cache_dtype": "fp8",
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
        },
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_serving_meets_no_specialisation_the_warm_up_did_not(case, tmp_path, smol_dir, monkeypatch):
    arch, options = CASES[case]
    model = make_random_model_dir(
        tmp_path, smol_dir, arch, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=512, num_hidden_layers=2,
    )  # fmt: skip
    # Blocks of 4 tokens: block tables up to 32 wide (a width divisible by 16 and others).
    config = EngineConfig(
        model_dir=str(model), device="cpu", dtype="bfloat16", max_model_len=128, max_num_seqs=40,
        max_num_batched_tokens=48, block_size=4, num_kv_blocks=2048, **options,
    )  # fmt: skip
    engine = LLMEngine(config)
    engine.runner.model.fold()  # as on CUDA (KernelChoices.fold_norms)
    keep = storages(engine.runner.model.w, engine.runner.kv_pool)
    with recording(monkeypatch, keep) as rec:
        run_passes(engine.runner, engine.max_model_len)
        warm = set(rec.keys)
        assert {"_prefill_kernel", "_decode_split_kernel", "_skinny_kernel", "_rms_norm_kernel",
                "_rope_write_kernel"} <= rec.names()  # fmt: skip
        before = rec.launches
        steps = serve_mixed(engine, seed=len(case))
        assert steps > 50 and rec.launches > before
    missed = sorted(rec.keys - warm)
    assert not missed, f"{len(missed)} specialisations after the warm-up: {missed[:3]}"
    assert len(warm) < 40  # a few variants per kernel, not one per shape


def binder_key(rec: Recorder, fn, *args, **kwargs) -> str:  # noqa: ANN001
    """The specialisation Triton would compile ``fn`` for, for these arguments."""
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(fn.signature, fn.params, rec.backend)
    return str(binder(*args, **kwargs)[1])


def test_attention_is_not_specialised_on_table_widths_or_tile_counts(monkeypatch):
    """The arguments that change from step to step (the block tables' width, the number of
    query tiles) are not specialised on: 1, 16 and 17 give one key."""
    import torch

    from kernels import triton_decode, triton_prefill

    rec = Recorder(set())
    t = torch.zeros(64, dtype=torch.bfloat16)
    keys = set()
    for width in (1, 16, 17):
        args = {p.name: (t if p.name.endswith("_ptr") else 32) for p in
                triton_prefill._prefill_kernel.params if not p.is_constexpr}  # fmt: skip
        args.update(stride_tb=width, num_m_tiles=width, scale_log2=1.0, v_scale=1.0)
        keys.add(binder_key(rec, triton_prefill._prefill_kernel, **args, GROUP=2, BLOCK_M=16,
                            BLOCK_N=64, HEAD_DIM=64, BLOCK_D=64, DOT_PRECISION="tf32"))  # fmt: skip
    assert len(keys) == 1
    keys = set()
    fn = triton_decode._decode_split_kernel
    for width in (1, 16, 17):
        args = {p.name: (t if p.name.endswith("_ptr") else 32) for p in fn.params
                if not p.is_constexpr and not p.has_default}  # fmt: skip
        args.update(stride_tb=width, scale_log2=1.0, v_scale=1.0)
        keys.add(binder_key(rec, fn, **args, GROUP=2, BLOCK_G=16, BLOCK_N=64, HEAD_DIM=64,
                            BLOCK_D=64, DOT_PRECISION="tf32", PDL=True, MERGE=0, PREFETCH=False,
                            BLOCK_S=2, EARLY=False))  # fmt: skip
    assert len(keys) == 1


def test_the_counter_reads_tritons_own_hook_calls(monkeypatch, caplog):
    """``install``'s hooks take the calls Triton 3.6 makes (``JITFunction._call_hook`` with the
    packed arguments of a real launch, after ``compile``'s listener): a load from the cache
    during the warm-up, then a compile after ready, logged with the kernel and its key."""
    import logging

    import torch
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature

    from kernels import compile_counter, triton_prefill

    counter = compile_counter.CompileCounter()
    monkeypatch.setattr(compile_counter, "COUNTER", counter)
    monkeypatch.setattr(compile_counter, "_installed", False)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(knobs.compilation, "listener", None)
    assert compile_counter.install()
    fn, rec = triton_prefill._prefill_kernel, Recorder(set())
    t = torch.zeros(64, dtype=torch.bfloat16)
    args = {p.name: (t if p.name.endswith("_ptr") else 32) for p in fn.params
            if not p.is_constexpr}  # fmt: skip
    args.update(stride_tb=1, scale_log2=1.0, v_scale=1.0)
    kw = dict(GROUP=2, BLOCK_M=16, BLOCK_N=64, HEAD_DIM=64, BLOCK_D=64, DOT_PRECISION="tf32",
              num_warps=4, num_stages=2, debug=False)  # fmt: skip
    binder = create_function_from_signature(fn.signature, fn.params, rec.backend)
    bound, spec, options = binder(**args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(rec.backend, kw, bound, spec, options)

    def compiled(cache_hit: bool) -> None:
        knobs.compilation.listener(src=None, metadata=None, metadata_group=None, times=None,
                                   cache_hit=cache_hit)  # fmt: skip
        fn._call_hook(knobs.runtime.jit_post_compile_hook, "key", signature, 0, constexprs,
                      options, [attrs], False)  # fmt: skip

    compiled(cache_hit=True)
    counter.mark_ready()
    with caplog.at_level(logging.WARNING, logger="kernels.compile_counter"):
        compiled(cache_hit=False)
    assert counter.counts() == compile_counter.CompileCounts(warmup=1, serving=1, cached=1)
    (msg,) = [r.getMessage() for r in caplog.records]
    assert msg.startswith("kernel _prefill_kernel compiled after ready")
    assert "[num_warps=4, num_stages=2](q_ptr:*bf16:16," in msg
    assert "stride_tb:i32, " in msg and "BLOCK_M=16" in msg  # a runtime width, never 1 or 16

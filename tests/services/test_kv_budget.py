"""A CPU stack's KV pools hold the context every process of it serves (`kv_budget`): the
sizes, what each process is told, and a request that leaves out max_tokens on the real stack
(test_e2e_stack)."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.config import ModelConfig
from services.launcher.kv_budget import (
    BLOCK_SIZE,
    CPU_KV_CACHE_MAX_BYTES,
    CPU_KV_CACHE_MIN_BYTES,
    draft_dir,
    fit_cpu_pools,
    token_bytes,
)
from services.launcher.stack import StackConfig
from tests.services.test_gpu_config import RecordingStack

MIB = 1024**2


def smol_token_bytes(smol_dir) -> int:
    c = ModelConfig.from_dir(smol_dir)
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # float32 K and V


def test_a_cpu_stack_with_no_pool_given_holds_the_whole_context(smol_dir, tmp_path):
    """SmolLM2: 8,192 tokens, 46,080 bytes a token in float32: 361 MiB, where the old fixed
    128 MiB held 2,912 tokens and a request that left out max_tokens was refused."""
    tb = smol_token_bytes(smol_dir)
    assert token_bytes(str(smol_dir), "") == tb == 46_080
    fitted, note = fit_cpu_pools(StackConfig(str(smol_dir), str(tmp_path)))
    assert fitted.max_model_len is None  # the model's own context, 8192
    assert fitted.kv_cache_bytes == (8192 // BLOCK_SIZE + 1) * BLOCK_SIZE * tb
    assert fitted.kv_cache_bytes // (BLOCK_SIZE * tb) * BLOCK_SIZE >= 8192 + BLOCK_SIZE
    assert "361 MiB" in note and "capped" not in note
    # 16-bit weights and KV: half the bytes; a short context: the 128 MiB floor.
    half, _ = fit_cpu_pools(StackConfig(str(smol_dir), str(tmp_path), dtype="bfloat16"))
    assert half.kv_cache_bytes == fitted.kv_cache_bytes // 2
    short, _ = fit_cpu_pools(StackConfig(str(smol_dir), str(tmp_path), max_model_len=1024))
    assert (short.kv_cache_bytes, short.max_model_len) == (CPU_KV_CACHE_MIN_BYTES, 1024)


def test_a_pool_that_cannot_hold_the_context_caps_it_for_every_process(smol_dir, tmp_path):
    cfg = StackConfig(str(smol_dir), str(tmp_path), kv_cache_bytes=128 * MIB)
    stack = RecordingStack(cfg)
    # 128 MiB holds 182 blocks; one is kept spare, as a GPU worker's pool keeps one.
    assert stack.config.max_model_len == (128 * MIB // (BLOCK_SIZE * 46_080) - 1) * 16 == 2896
    assert stack.config.kv_cache_bytes == 128 * MIB  # what was given stays
    assert "context capped to 2896 tokens" in stack.kv_note
    stack._spawn_workers(deadline=float("inf"))
    for name in ("prefill-0", "decode-0"):
        argv = stack.children[name].argv
        assert argv[argv.index("--max-model-len") + 1] == "2896"
        assert argv[argv.index("--kv-cache-bytes") + 1] == str(128 * MIB)
    # Blocks given: the same rule.
    blocks, note = fit_cpu_pools(StackConfig(str(smol_dir), str(tmp_path), num_kv_blocks=100))
    assert (blocks.max_model_len, blocks.kv_cache_bytes) == (99 * 16, None)
    with pytest.raises(SystemExit, match="larger pool"):
        fit_cpu_pools(StackConfig(str(smol_dir), str(tmp_path), num_kv_blocks=1))


def test_the_default_pool_stops_at_its_bound_and_caps_a_long_context(smol_dir, tmp_path):
    """A model of 1M tokens of context would need 44 GiB a worker: the pool stops at 2 GiB,
    and the context is capped to what that holds."""
    long = tmp_path / "long"
    shutil.copytree(smol_dir, long)
    cfg = json.loads((long / "config.json").read_text())
    cfg["max_position_embeddings"] = 1 << 20
    (long / "config.json").write_text(json.dumps(cfg))
    fitted, note = fit_cpu_pools(StackConfig(str(long), str(tmp_path)))
    assert fitted.kv_cache_bytes == CPU_KV_CACHE_MAX_BYTES
    assert fitted.max_model_len == (CPU_KV_CACHE_MAX_BYTES // (16 * 46_080) - 1) * 16
    assert "capped" in note and "long (1048576 tokens)" in note


def test_a_draft_models_kv_counts_too(smol_dir, tmp_path):
    spec = json.dumps({"model": str(smol_dir), "num_speculative_tokens": 3})
    assert draft_dir(("--speculative-config", spec)) == str(smol_dir)
    assert draft_dir((f"--speculative-config={spec}",)) == str(smol_dir)
    assert draft_dir(("--speculative-config", '{"method": "ngram"}')) is None
    with_draft = StackConfig(
        str(smol_dir), str(tmp_path), worker_args=("--speculative-config", spec)
    )
    fitted, _ = fit_cpu_pools(with_draft)
    plain, _ = fit_cpu_pools(StackConfig(str(smol_dir), str(tmp_path)))
    assert fitted.kv_cache_bytes == 2 * plain.kv_cache_bytes  # the same shape drafts


def test_a_folder_that_cannot_be_read_is_left_to_its_workers(tmp_path):
    """Its workers refuse it with the reason; the launcher does not fail first."""
    fitted, note = fit_cpu_pools(StackConfig(str(tmp_path / "missing"), str(tmp_path)))
    assert (fitted.kv_cache_bytes, fitted.max_model_len) == (CPU_KV_CACHE_MIN_BYTES, None)
    assert "128 MiB" in note


def test_gpu_stacks_are_left_as_they_are(smol_dir, tmp_path):
    cfg = StackConfig(str(smol_dir), str(tmp_path), gpus=("0",))
    assert fit_cpu_pools(cfg) == (cfg, "")

"""No Triton kernel compiles after the engine is ready, on a GPU: SmolLM2's shape with seeded
random weights (``tests/smol_shape.py``: the GPU host has no bundled model) built with a small
shape (context 512, 32 sequences, 256-token budget), then a mixed workload
(``tests/warmup_cases.py``: prompts up to the context limit, chunked prefill, decode batches
of many sizes, n > 1, greedy and sampled) with CUDA graphs, eagerly, with LoRA adapters, and
with FP8 weights and KV and n-gram speculation; ``tandem_kernel_compiles_total``'s serving
count must not move. And a restarted worker loads every kernel from Triton's on-disk cache.

    pytest -m gpu -q tests/gpu/test_warmup_gpu.py

(``TANDEM_GPU_REPORT=file`` collects the warm-up's passes, seconds and compiles as JSON.)
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from tests.gpu_report import fp8_capable, report  # noqa: E402
from tests.lora_adapters import ALL_TARGETS, make_adapter  # noqa: E402
from tests.smol_shape import make_smol_shape_dir  # noqa: E402
from tests.warmup_cases import serve_mixed  # noqa: E402

SHAPE = dict(max_model_len=512, max_num_seqs=32, max_num_batched_tokens=256, num_kv_blocks=2048)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
CASES = {
    "graphs": {},
    "eager": {"enforce_eager": True},
    "lora": {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16},
    "fp8-ngram": {"quantization": "fp8", "kv_cache_dtype": "fp8", "speculative_config": NGRAM},
}


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory) -> Path:
    return make_smol_shape_dir(tmp_path_factory.mktemp("smol_shape") / "model", seed=0)


@pytest.mark.parametrize("case", list(CASES))
def test_nothing_compiles_after_ready(case, smol_dir, tmp_path, caplog):
    if case.startswith("fp8") and not fp8_capable():
        pytest.skip("FP8 needs compute capability 8.9+")
    engine = LLMEngine(EngineConfig(model_dir=str(smol_dir), **SHAPE, **CASES[case]))
    warmup = engine.runner.warmup
    assert warmup is not None and warmup.passes > 10
    report("warmup", case=case, passes=warmup.passes, seconds=round(warmup.seconds, 2),
           compiles=warmup.compiles, cached=warmup.cached)  # fmt: skip
    loras: list[str] = []
    if case == "lora":
        for i, r in enumerate((8, 16)):
            path = make_adapter(smol_dir, tmp_path / f"a{i}", r=r, alpha=2 * r,
                                targets=ALL_TARGETS, seed=i)  # fmt: skip
            engine.add_lora(f"a{i}", str(path))
            loras.append(f"a{i}")
    before = engine.stats().kernel_compiles
    with caplog.at_level(logging.WARNING, logger="kernels.compile_counter"):
        steps = serve_mixed(engine, seed=1, requests=60, max_tokens=32, loras=loras)
    after = engine.stats().kernel_compiles
    report(
        "warmup_serving", case=case, steps=steps, serving_compiles=after.serving - before.serving
    )
    assert steps > 50
    missed = [r.getMessage() for r in caplog.records if "after ready" in r.getMessage()]
    assert after.serving == before.serving, missed[:5]
    del engine
    torch.cuda.empty_cache()


BUILD = """
import json, sys
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
engine = LLMEngine(EngineConfig(model_dir=sys.argv[1], **json.loads(sys.argv[2])))
w, c = engine.runner.warmup, engine.stats().kernel_compiles
print(json.dumps({"passes": w.passes, "seconds": w.seconds, "compiles": w.compiles,
                  "cached": w.cached, "before_ready": c.warmup, "before_ready_cached": c.cached}))
"""


def test_a_restarted_worker_loads_its_kernels_from_tritons_cache(smol_dir, tmp_path):
    """Two processes build the same engine with one ``TRITON_CACHE_DIR``: the first compiles
    what the second then only loads (every specialisation, graphs' and warm-up's)."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", BUILD, str(smol_dir), json.dumps(SHAPE)], env=env,
            capture_output=True, text=True, timeout=900, cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    report("warmup_restart", cold=cold, warm=warm)
    assert cold["before_ready"] > 0 and cold["before_ready_cached"] < cold["before_ready"]
    assert warm["before_ready"] == cold["before_ready"]
    assert warm["before_ready_cached"] == warm["before_ready"]  # nothing compiled again

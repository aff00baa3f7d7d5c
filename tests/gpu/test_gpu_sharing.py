"""Two workers sharing one GPU at their default shares of its memory, under load, and a
worker whose share cannot hold the model (``pytest -m gpu``). Apart from test_serving_gpu,
whose module-wide stack holds part of the device."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from openai import AsyncOpenAI  # noqa: E402

from services.launcher.stack import Stack  # noqa: E402
from tests.gpu.test_serving_gpu import MODEL, config, metrics, prompt, sample, shape_dir  # noqa: E402


def test_two_workers_share_one_gpu_at_045_under_load(tmp_path_factory):
    model = shape_dir(tmp_path_factory, "llama-3.2-3b")
    run = tmp_path_factory.mktemp("shared")
    cfg = config(model, run, max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=32)
    assert {p.utilization for p in cfg.placements().values()} == {0.45}

    async def load(stack: Stack) -> list[int]:
        client = AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)

        async def one(i: int) -> int:
            r = await client.completions.create(
                model=MODEL, prompt=prompt(i, 1200), max_tokens=32, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return r.usage.completion_tokens

        return await asyncio.gather(*(one(i) for i in range(48)))

    # What this process (earlier GPU tests of the session) already holds is not the stack's.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    before = total - free
    with Stack(cfg) as stack:
        assert asyncio.run(load(stack)) == [32] * 48
        for name in ("prefill-0", "decode-0"):
            assert stack.children[name].proc.poll() is None
            assert "OutOfMemory" not in stack.children[name].log_path.read_text()
        m = metrics(stack, "decode-0")
        assert sample(m, "tandem_kv_transfers_total", transport="cuda-ipc") > 0
        assert sample(m, "tandem_kv_handoff_recomputed_total") == 0
        free, total = torch.cuda.mem_get_info()
        assert total - free - before < 0.95 * total  # two shares of 0.45, with some slack

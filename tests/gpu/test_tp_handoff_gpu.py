"""The KV hand-off between workers of different tensor-parallel sizes on two GPUs of one host
(skipped with fewer): P tp=2 -> D tp=1 and P tp=1 -> D tp=2 over CUDA IPC rank by rank
(`libkv.transfer.rank_ipc`: every rank exports its shard, each decode rank copies its heads
from the prefill ranks that hold them), and P tp=2 -> D tp=1 over per-rank NIXL agents on GPU
memory where NIXL moves it device-direct. Greedy text through the hand-off equals the TP=1
in-process engine's (float32, the seeded random SmolLM2 shape whose 3 KV heads split 1 + 2:
`tests/gpu/test_tensor_parallel_gpu.py` shows TP=2 matches TP=1 there), and the decode worker
counted the hand-offs on that path with nothing recomputed.

``bash bench/device/run.sh tests tests/gpu/test_tp_handoff_gpu.py`` on a host with two GPUs."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices", allow_module_level=True)

from openai import OpenAI  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from libkv.cluster.registry import MemberWatcher  # noqa: E402
from libkv.kv_layout import KVLayout  # noqa: E402
from libkv.transfer.nixl_agent import nixl_available, ucx_cuda_problem  # noqa: E402
from libkv.transfer.rank_ipc import rank_pools  # noqa: E402
from services.launcher.etcd import free_port  # noqa: E402
from services.launcher.stack import Stack, StackConfig  # noqa: E402
from tests.smol_shape import make_smol_shape_dir  # noqa: E402

ENGINE = dict(max_num_batched_tokens=512, max_model_len=2048, max_num_seqs=16)
WORDS = "the quick brown fox jumps over a lazy dog while seven bold wizards quietly hex"
PROMPTS = [
    " ".join(WORDS.split()[(i * 7 + j * 3) % 15] for j in range(150 + 61 * i)) for i in range(3)
]
MAX_TOKENS = 16

CASES = [
    pytest.param((2, 1, "cuda-ipc"), id="p2-d1-cuda-ipc"),
    pytest.param((1, 2, "cuda-ipc"), id="p1-d2-cuda-ipc"),
]
if nixl_available() and ucx_cuda_problem() is None:
    CASES.append(pytest.param((2, 1, "nixl"), id="p2-d1-nixl"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_smol_shape_dir(tmp_path_factory.mktemp("tp_handoff") / "model", seed=0)


@pytest.fixture(scope="module")
def reference(model_dir) -> list[str]:
    """Greedy text of the TP=1 engine in this process."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with LLM(model_dir, dtype="float32", gpu_memory_utilization=0.15, **ENGINE) as llm:
        out = [llm.generate(p, params)[0].text for p in PROMPTS]
    torch.cuda.empty_cache()
    return out


def stack_config(model_dir: Path, run_dir: Path, prefill_tp: int, decode_tp: int, path: str):
    return StackConfig(
        model_dir=str(model_dir),
        run_dir=str(run_dir),
        port=free_port(),
        gpus=("0", "1"),
        dtype="float32",
        gpu_memory_utilization=0.15,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        decode_only_threshold=16,
        disagg_mode="length",  # every long prompt to the prefill worker: its hand-off
        start_timeout=400.0,
        kv_transport="nixl" if path == "nixl" else "",
        worker_args=("--no-cuda-ipc",) if path == "nixl" else (),
        **ENGINE,
    )


def transfers(stack: Stack, name: str) -> dict[str, float]:
    """The decode worker's counters: hand-offs by path, failures, recomputed prompts."""
    port = stack.children[name].metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        value = line.split()[-1] if line and not line.startswith("#") else "0"
        if line.startswith("tandem_kv_transfers_total{"):
            path = line.split('transport="')[1].split('"')[0].removesuffix("-read")
            out[path] = out.get(path, 0) + float(value)
        for key in ("tandem_kv_transfer_failures_total", "tandem_kv_handoff_recomputed_total"):
            if line.startswith(key):
                out[key] = out.get(key, 0) + float(value)
    return out


def records(stack: Stack) -> dict[str, dict[str, str]]:
    async def read() -> dict[str, dict[str, str]]:
        watcher = await MemberWatcher.start([stack.etcd.endpoint])
        try:
            return {m.worker_id: dict(m.extra) for m in watcher.members.values()}
        finally:
            await watcher.stop()

    return asyncio.run(read())


@pytest.mark.parametrize("case", CASES)
def test_handoff_between_tp_sizes_on_gpus_matches_tp1(case, model_dir, reference, tmp_path):
    prefill_tp, decode_tp, path = case
    with Stack(stack_config(model_dir, tmp_path, prefill_tp, decode_tp, path)) as stack:
        extra = records(stack)
        for worker, tp in (("prefill-0", prefill_tp), ("decode-0", decode_tp)):
            layout = KVLayout.from_extra(extra[worker])
            assert layout is not None and layout.tp == tp
            if path == "cuda-ipc":  # every rank's shard exported, with its heads' bytes
                pools = rank_pools(extra[worker])
                assert [p.block_bytes for p in pools] == [
                    layout.shard_block_bytes(r) for r in range(tp)
                ]
        client = OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        got = []
        for p in PROMPTS:  # one at a time: the same batch shapes as the reference
            r = client.completions.create(
                model="model", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            got.append(r.choices[0].text)
        counted = transfers(stack, "decode-0")
        log = stack.children["decode-0"].log_path.read_text()
    assert got == reference
    assert counted.get(path, 0) == len(PROMPTS), counted  # every prompt moved on that path
    assert counted.get("tandem_kv_transfer_failures_total", 0) == 0, counted
    assert counted.get("tandem_kv_handoff_recomputed_total", 0) == 0, counted
    assert "did not arrive" not in log
